"""The one shape of a request before it reaches an engine or a server: `PlannedRequest`.

Scenarios (kvtui/scenario/plan.py), `kvtui serve` (kvtui/serve/) and `--target` runs (kvtui/remote/) all
build and read this one frozen dataclass. What a request feeds the model is its `input`, one of the
InputSpec dataclasses below; kvtui/run/intake.py is the one place an InputSpec becomes the engine's
RequestInput (kvtui/engine/inputs.py). What the run layer knows of a request beyond its input (its
canary, its text, facts for reports) lives in typed fields here: the engine never carries any of it,
and the run (Session, TargetSession, serve) keeps each request's PlannedRequest by request id.

A changed request is a new one: `dataclasses.replace(planned, arrival_s=...)`.

Its own room (kvtui/request.py, ranked between the engine and the scenario: tests/architecture/test_imports.py), since
the scenario builds these and the run layer ranks above the scenario. Nothing here imports torch or the
engine: RequestInput, ImagePart and SamplingParams are named for type checkers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from kvtui.engine.inputs import ImagePart, RequestInput
    from kvtui.engine.request import SamplingParams


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt of token ids only (text prompts, synthetic ones).

    Attributes:
        ids: the prompt's token ids, one per position.
    """

    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(int(t) for t in self.ids))


@dataclass(frozen=True)
class EmbedsPrompt:
    """A prompt sent (in part or whole) as embedding rows (`prompts.embeds`): the rows are the model's own
    input embeddings of token ids, made from the engine's embedding table at submit (run/intake.py).

    Attributes:
        ids: the prompt's token ids (T of them).
        mask: [T] True where the position stays a token id, False where the model's own embedding row of
            `ids[i]` (or `rows_of[i]`) is supplied instead (vLLM's `prompt_is_token_ids`).
        rows_of: the ids whose embedding rows fill the tensor, when they are not `ids` (`mask_pairs`' second
            request carries its first's tensor: its `ids` hold the placeholder where the first's rows
            were); None: `ids`.

    Raises:
        ValueError: a mask or rows_of whose length is not len(ids).
    """

    ids: tuple[int, ...]
    mask: tuple[bool, ...]
    rows_of: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(int(t) for t in self.ids))
        object.__setattr__(self, "mask", tuple(bool(m) for m in self.mask))
        if self.rows_of is not None:
            object.__setattr__(self, "rows_of", tuple(int(t) for t in self.rows_of))
        for name, value in (("mask", self.mask), ("rows_of", self.rows_of)):
            if value is not None and len(value) != len(self.ids):
                raise ValueError(f"{name} has {len(value)} entries for a prompt of {len(self.ids)} ids")

    @property
    def whole(self) -> bool:
        """Every position is a supplied row (no token id left)."""
        return not any(self.mask)


@dataclass(frozen=True)
class AudioClip:
    """A speech request: a 16 kHz WAV clip and the decoder prompt read with it (Whisper's
    [<|startoftranscript|>, <|notimestamps|>]). The clip is read when the request is submitted.

    Attributes:
        path: the clip's file path.
        ids: the decoder prompt's token ids.
    """

    path: str
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", str(self.path))
        object.__setattr__(self, "ids", tuple(int(t) for t in self.ids))


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with pictures at placeholder positions (`prompts.kind: image_passphrase`).

    Attributes:
        ids: the prompt's token ids (the placeholder id at each image position).
        images: kvtui.engine.inputs.ImagePart per picture (start, tokens, content hash, pixels, label).
    """

    ids: tuple[int, ...]
    images: tuple[ImagePart, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(int(t) for t in self.ids))
        object.__setattr__(self, "images", tuple(self.images))


@dataclass(frozen=True)
class GivenInput:
    """A request input made whole elsewhere (kvtui serve's uploads: prompt embeddings, images, decoded
    audio features): the engine's RequestInput as it is.

    Attributes:
        request_input: a kvtui.engine.inputs.RequestInput.
    """

    request_input: RequestInput

    @property
    def ids(self) -> tuple[int, ...]:
        """Its prompt token ids (PLACEHOLDER_ID where a supplied row or an image fills the position)."""
        return tuple(self.request_input.prompt_ids)


InputSpec = Union[TokenPrompt, EmbedsPrompt, AudioClip, ImagePrompt, GivenInput]
INPUT_SPECS = (TokenPrompt, EmbedsPrompt, AudioClip, ImagePrompt, GivenInput)


@dataclass(frozen=True)
class Canary:
    """What makes a request a canary: a passphrase only it was told, which no other request's answer may
    say (kvtui/detect/canary.py).

    Attributes:
        passphrase: e.g. "AMBER-LANTERN-23" (an image's word, "COPPER").
        spoken: the passphrase is spoken in the request's audio (its answer is a transcript, matched word
            by word: kvtui.detect.spoken.match_spoken); False: it is in the prompt's text or picture.
    """

    passphrase: str
    spoken: bool = False


@dataclass(frozen=True)
class PromptFacts:
    """What the plan knows of a prompt, for reports and tests (the engine and the detectors never read it).

    Attributes:
        opening: passphrase prompts with `openings`: the index of its opening sentence.
        prompt_tokens, shared_prefix_tokens: synthetic prompts: its length and its shared prefix's (tokens).
        trace_prompt_tokens: a trace row's (or scripted arrival's) prompt length, when it gave one.
        system_prompt: system_prompt prompts: which system prompt it starts with.
        session, turn: multi_turn prompts: its conversation and its turn in it (from 0).
        prompt_index: file prompts: its entry in the scenario's prompt list.
        hash_ids: a Mooncake trace row's block hash ids (trace_passphrase prompts), when it gave them.
    """

    opening: int | None = None
    prompt_tokens: int | None = None
    shared_prefix_tokens: int | None = None
    trace_prompt_tokens: int | None = None
    system_prompt: int | None = None
    session: int | None = None
    turn: int | None = None
    prompt_index: int | None = None
    hash_ids: tuple[int, ...] | None = None


NO_FACTS = PromptFacts()


@dataclass(frozen=True)
class ClientId:
    """The id one request's client sends.

    Attributes:
        value: the id itself (a near duplicate's variant included).
        group: the number of its group in the run (0, 1, ...; each dealing of `groups` counts on).
        kind: the group's `ids` (unique, duplicate, near_duplicate).
        variant: a near duplicate's variant (case, whitespace, suffix); None for the group's own id.
    """

    value: str
    group: int
    kind: str
    variant: str | None = None

    def sent(self, place: str) -> str:
        """The id as it travels in `place`: a header value without surrounding whitespace (HTTP drops it,
        RFC 9110 section 5.5, and httpx refuses to send it), a body field as it is."""
        return self.value.strip() if place == "header" else self.value

    @property
    def label(self) -> str:
        """e.g. 'duplicate group 3', 'near_duplicate group 4 (case)'."""
        return f"{self.kind} group {self.group}" + (f" ({self.variant})" if self.variant else "")


@dataclass(frozen=True)
class SessionTurn:
    """One turn of a multi-turn session (a scenario's `sessions`, sent with the server's real answers).

    Attributes:
        session: the request id of the session's first turn.
        turn: its turn, from 0.
        turns: the session's turns in all.
        think_s: seconds after the previous turn's answer ended before this turn is sent (0 for the first).
    """

    session: str
    turn: int
    turns: int
    think_s: float = 0.0


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a run, before it reaches the engine (or a server).

    Attributes:
        request_id: "r000", "r001", ... in arrival order (a served request: kvtui serve's own id).
        arrival_s: seconds from the run's start (the engine clock).
        input: what it feeds the model (an InputSpec: TokenPrompt, EmbedsPrompt, AudioClip, ImagePrompt
            or GivenInput).
        sampling: SamplingParams; max_new_tokens is the request's output length (tokens) and seed its
            own sampling seed (derive_seed(scenario seed, "sampling:<index>")).
        text: the prompt's text, when it has one (what a server is sent; a speech request's
            "[audio <clip>]"); None: token ids only.
        canary: its passphrase canary, or None.
        facts: what the plan knows of the prompt, for reports (PromptFacts).
        tenant: who sends it (None: the only tenant); cache_salt: its tenant's salt (see tenants.py).
        adapter: the LoRA adapter it runs under (scenario/lora.py; a name the session or server loaded), or
            None: the base model.
        client_id: the request id its client sends (the scenario's `request_ids`, kvtui/scenario/request_ids.py);
            None: the client sends none (the server picks its own).
        round: `process: rounds` only: its round (0, 1, ...). It is sent once every request of an earlier
            round has finished, and its arrival_s (0 in the plan) becomes that moment.
        cancel_after: `process: rounds` with `cancel`: the client cancels the request once it has this
            many generated tokens (it finishes `abort`); None: it runs to its end.
        min_tokens_asked: the min_tokens its sampling section or mix entry asks; sampling.min_tokens is that
            capped at its output length (kvtui.scenario.fit.min_tokens_lines says when a cap happened).
        turn: a session's turn (SessionTurn), None outside sessions. A later turn's `text` is its follow-up
            user message; its `messages` and `input` are set when it is sent, from the answers before it.
        messages: the chat sent (role/content dicts, the earlier turns' real answers included), when it is
            not one user message with `text`; None: that one message.

    Raises:
        TypeError: `input` is not an InputSpec.
    """

    request_id: str
    arrival_s: float
    input: InputSpec
    sampling: SamplingParams
    text: str | None = None
    canary: Canary | None = None
    facts: PromptFacts = field(default=NO_FACTS)
    tenant: str | None = None
    cache_salt: str | None = None
    adapter: str | None = None
    client_id: ClientId | None = None
    round: int | None = None
    cancel_after: int | None = None
    min_tokens_asked: int = 0
    turn: SessionTurn | None = None
    messages: tuple[dict, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.input, INPUT_SPECS):
            raise TypeError(f"PlannedRequest.input must be one of {', '.join(c.__name__ for c in INPUT_SPECS)}, "
                            f"got {type(self.input).__name__}")

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (a new list each call)."""
        return list(self.input.ids)

    @property
    def passphrase(self) -> str | None:
        """Its canary's passphrase, or None."""
        return self.canary.passphrase if self.canary is not None else None

    @property
    def spoken(self) -> bool:
        """Its canary's passphrase is spoken in its audio."""
        return self.canary is not None and self.canary.spoken

    @property
    def images(self) -> tuple:
        """Its pictures (ImagePart), () without."""
        if isinstance(self.input, ImagePrompt):
            return self.input.images
        if isinstance(self.input, GivenInput):
            return tuple(self.input.request_input.images)
        return ()

    @property
    def image_label(self) -> str | None:
        """The names of the request's pictures (comma-separated), or None without images."""
        return ",".join(i.label or i.content_hash[:12] for i in self.images) or None

    @property
    def audio_label(self) -> str | None:
        """The name of the request's audio (the clip's file name, or the upload's), or None for text."""
        if isinstance(self.input, AudioClip):
            return Path(self.input.path).name
        if isinstance(self.input, GivenInput) and self.input.request_input.audio is not None:
            return self.input.request_input.audio.label
        return None
