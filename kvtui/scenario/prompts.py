"""Prompt generators: what each request says.

YAML `prompts:` takes one of
  - `{kind: passphrase}`: a chat prompt asking the model to remember and repeat a unique generated
    passphrase WORD-WORD-NN (e.g. VELVET-ORCHID-42); the passphrase is the request's canary
    (what the canary detector looks for), its PlannedRequest.canary. Optional `template` with `{passphrase}` in it,
    and `openings`: texts for an `{opening}` in the template, one per request in turn.
  - `{kind: synthetic, prompt_tokens: <length dist>, shared_prefix_tokens: N}`: random token ids
    (special tokens avoided), N of them common to all requests first (total = N + prompt_tokens, as
    vLLM's random dataset adds its prefix length to the input length).
  - `{kind: file, path, chat}`: one prompt per line, or JSON Lines (`.jsonl`: a string, or an object
    with `prompt` text or chat `messages`); used in order, cycling.
  - `{kind: system_prompt, count, system_tokens, instruction_tokens, user_tokens}`: one of N shared
    system prompts (random ids), a common instruction block, then the request's own random ids.
  - `{kind: multi_turn, sessions, turns, system_tokens, user_tokens, reply_tokens}`: chat sessions;
    each turn's prompt is the previous turn's plus a reply and a new user message.
  - `{kind: spoken_passphrase, clips}` (speech models: whisper-tiny.en, tiny-whisper): each request is
    one spoken clip "The passphrase is WORD WORD NN." from a folder of WAV files named after their
    passphrase (word-word-nn.wav; scenarios/audio/ ships 8); the passphrase is its canary.
  - `{kind: audio, path}` (speech models): WAV files (one file, or every .wav in a folder), in turn.
  - `{kind: trace_passphrase, template, prompt_tokens}`: a trace's lengths and (Mooncake hash ids) shared
    prefixes as blocks of canary text, ending with the request's passphrase (kvtui/scenario/trace_prompts.py).

A tokenizer here is anything with `apply_chat_template`, `encode`, `vocab_size` and
`all_special_ids` (a transformers tokenizer).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal, Union

import pydantic
from pydantic import Field

from kvtui.scenario.base import MAX_PLANNED, MAX_PROMPT_CHARS, Strict
from kvtui.scenario.errors import Problem
from kvtui.scenario.lengths import Fixed, LengthDist
from kvtui.scenario.trace import resolve

# Short common words SmolLM2-135M-Instruct copies exactly. Chosen by measurement (greedy, 24 tokens, one
# request at a time): words it garbled were dropped (FOREST, COMET, COBALT, PLANET, BRONZE, LION, COPPER,
# BAMBOO, MAPLE, GRANITE); seed 0's first 40 passphrases all echo. Changing the list changes every plan.
WORDS = (
    "AMBER", "ANCHOR", "APPLE", "ARROW", "BANJO", "BASKET", "BEACON", "BISCUIT", "CABIN", "CACTUS",
    "CANDLE", "CANYON", "CARROT", "CASTLE", "CEDAR", "CHERRY", "CLOVER", "CORAL", "COTTON", "CRYSTAL",
    "DAISY", "DESERT", "DOLPHIN", "DRAGON", "EAGLE", "EMBER", "FALCON", "FEATHER", "GARDEN", "GINGER",
    "GLACIER", "HARBOR", "HONEY", "ISLAND", "JASMINE", "JUNGLE", "LANTERN", "LEMON", "MARBLE", "MEADOW",
    "MANGO", "ORANGE", "ORCHID", "PEPPER", "PUMPKIN", "RABBIT", "RIVER", "ROCKET", "SILVER", "SPARROW",
    "TIGER", "TULIP", "VELVET", "WALNUT",
)
DEFAULT_TEMPLATE = "The passphrase is {passphrase}. Reply with only the passphrase."
MAX_PROMPT_FILE_BYTES = 16 * 1024 * 1024  # a prompt file's size (bytes)


class PassphrasePrompts(Strict):
    """A chat prompt asking the model to remember and repeat a unique generated passphrase
    WORD-WORD-NN (two different words from a fixed list of short common words, NN in 10..99, e.g.
    VELVET-ORCHID-42). The passphrase is the request's canary: another request's output holding it
    (or two of its three parts) is a leak that names its source."""

    kind: Literal["passphrase"]
    template: Annotated[str, Field(min_length=1, max_length=10_000)] = Field(
        DEFAULT_TEMPLATE, description="the user message; must contain `{passphrase}`, replaced by the passphrase, "
                                      "and `{opening}` when `openings` are given")
    openings: Annotated[list[Annotated[str, Field(min_length=1, max_length=10_000)]],
                        Field(max_length=1000)] = Field(
        [], description="texts for the template's `{opening}`, request i taking openings[i mod n]: groups of "
                        "conversations that share an opening (a prompt prefix) and differ in their passphrase")
    embeds: Literal["none", "all", "passphrase", "mask_pairs"] = Field(
        "none", description="send the prompt as embedding rows (vLLM's prompt_embeds) instead of token ids: `all` "
                            "of it, or only the `passphrase`'s tokens, mixed with token ids under a mask. The "
                            "rows are the model's own input embeddings of those tokens, so the answer and the "
                            "canary read the passphrase as if it were text. `mask_pairs`: requests in pairs with "
                            "equal ids and equal tensor and different masks (vLLM #56655's trigger): the first "
                            "sends its passphrase as rows, the second the same ids and tensor with every "
                            "position marked a token id (the passphrase's positions hold the placeholder id)")

    @pydantic.field_validator("template")
    @classmethod
    def _has_slot(cls, v: str) -> str:
        if "{passphrase}" not in v:
            raise Problem("template has no {passphrase}", 'put {passphrase} where the passphrase goes')
        return v

    @pydantic.model_validator(mode="after")
    def _openings_fit(self):
        if self.openings and "{opening}" not in self.template:
            raise Problem("openings are given but the template has no {opening}",
                          "put {opening} where the opening goes, or drop openings", ("template",))
        if not self.openings and "{opening}" in self.template:
            raise Problem("the template has {opening} but no openings are given",
                          "add `openings: [text, ...]` or remove {opening}", ("openings",))
        return self

    def text(self, index: int, passphrase: str) -> str:
        """Request `index`'s user message with `passphrase` (and its opening) filled in."""
        text = self.template
        if self.openings:
            text = text.replace("{opening}", self.openings[index % len(self.openings)])
        return text.replace("{passphrase}", passphrase)


class SyntheticPrompts(Strict):
    """Random token ids drawn uniformly from the vocabulary (special tokens left out), no chat template.
    A prompt is `shared_prefix_tokens` ids common to every request followed by `prompt_tokens` ids of
    its own, so its length is their sum (as vLLM's random dataset adds its prefix length to the input
    length). A trace row's prompt_tokens replaces the drawn length."""

    kind: Literal["synthetic"]
    prompt_tokens: LengthDist = Field(Fixed(value=128), description="length after the shared prefix (tokens)")
    shared_prefix_tokens: Annotated[int, Field(ge=0, le=100_000)] = Field(
        0, description="tokens common to all requests, before each request's own")


class FilePrompts(Strict):
    """Prompts from a file, used in order and cycled when there are more requests than prompts. A text
    file has one prompt per non-empty line. A `.jsonl` file has one JSON value per line: a string, an
    object with `prompt` text, or an object with chat `messages` (`[{role, content}, ...]`, always
    wrapped in the chat template)."""

    kind: Literal["file"]
    path: Annotated[str, Field(min_length=1, max_length=4096)] = Field(
        description=f"relative to the scenario file; at most {MAX_PROMPT_FILE_BYTES >> 20} MiB, 1 to "
                    f"{MAX_PLANNED} prompts of at most {MAX_PROMPT_CHARS} characters each")
    chat: bool = Field(True, description="wrap text prompts in the model's chat template")
    _prompts: list = pydantic.PrivateAttr(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _read(self, info: pydantic.ValidationInfo):
        self._prompts = _read_path(read_prompt_file, self.path, info)
        return self

    @property
    def prompts(self) -> list:
        """Each a str (text) or a list of chat messages."""
        return list(self._prompts)


class SystemPromptPrompts(Strict):
    """The load prefix caching is for: every prompt starts with one of `count` shared system prompts
    (`system_tokens` random token ids each, fixed by the seed), then `instruction_tokens` ids common to
    every prompt (e.g. tool instructions after a persona), then the request's own `user_tokens` random
    ids. Which system prompt: drawn by the seed (`choice: random`) or in turn."""

    kind: Literal["system_prompt"]
    count: Annotated[int, Field(ge=1, le=1000)] = Field(4, description="number of shared system prompts")
    system_tokens: Annotated[int, Field(ge=1, le=100_000)] = Field(256, description="length of each system prompt")
    instruction_tokens: Annotated[int, Field(ge=0, le=100_000)] = Field(
        0, description="tokens common to every prompt, after its system prompt")
    user_tokens: LengthDist = Field(Fixed(value=32), description="length of each request's own part (tokens)")
    choice: Literal["random", "round_robin"] = Field("random", description="how a request picks its system prompt")


class MultiTurnPrompts(Strict):
    """Chat sessions: `sessions` conversations side by side, each request the next turn of one of them,
    in turn. A turn's prompt is the previous turn's prompt, then a stand-in for the previous answer
    (`reply_tokens` random ids: the real answer is not known when the run is planned), then a new
    user message (`user_tokens` random ids); the first turn starts with `system_tokens` ids shared by
    every session. After `turns` turns a session ends and a new one takes its place. A session belongs
    to one tenant."""

    kind: Literal["multi_turn"]
    sessions: Annotated[int, Field(ge=1, le=10_000)] = Field(4, description="conversations at once")
    turns: Annotated[int, Field(ge=1, le=1000)] = Field(4, description="turns per conversation")
    system_tokens: Annotated[int, Field(ge=0, le=100_000)] = Field(
        0, description="a system prompt every session starts with (tokens)")
    user_tokens: LengthDist = Field(Fixed(value=24), description="length of each new user message (tokens)")
    reply_tokens: LengthDist = Field(Fixed(value=24), description="length of each previous answer's stand-in (tokens)")


class TracePassphrasePrompts(Strict):
    """Canaried prompts of a trace's shapes: each prompt is `prompt_tokens` long (a trace row's prompt length
    replaces the drawn one) and ends with `template`, its own passphrase in it (the canary). Before that comes
    canary text: with Mooncake hash ids, each hash id is a block of `hash_block_size` tokens of made-up words
    fixed by the seed and the hash id, so two requests whose hash_ids start alike share exactly that prompt
    prefix (the passphrase's tokens take the place of the last ones); without hash ids the text is the
    request's own (no shared prefix). Sent as token ids, no chat template (the completions API against a
    --target; `sessions` send it as a chat's first user message). A prompt shorter than its template is the
    template alone."""

    kind: Literal["trace_passphrase"]
    template: Annotated[str, Field(min_length=1, max_length=10_000)] = Field(
        " The passphrase is {passphrase}. Reply with only the passphrase.",
        description="the prompt's end; must contain `{passphrase}`")
    prompt_tokens: LengthDist = Field(Fixed(value=128), description="prompt length when the arrival gives none "
                                                                    "(tokens)")

    @pydantic.field_validator("template")
    @classmethod
    def _has_slot(cls, v: str) -> str:
        if "{passphrase}" not in v:
            raise Problem("template has no {passphrase}", "put {passphrase} where the passphrase goes")
        return v


SAMPLE_RATE = 16000  # Hz, 16-bit mono: what Whisper's feature extractor takes
MAX_AUDIO_SECONDS = 30.0  # one Whisper window
PASSPHRASE_CLIP = re.compile(r"[a-z]+-[a-z]+-[0-9]+")


def check_wav(path: Path) -> float:
    """The duration (seconds) of a 16 kHz mono 16-bit WAV file of at most 30 s.

    Raises:
        Problem: unreadable, another format (naming the sox command that converts it), or too long.
    """
    import wave

    try:
        with wave.open(str(path), "rb") as wav:
            rate, channels, width, frames = wav.getframerate(), wav.getnchannels(), wav.getsampwidth(), wav.getnframes()
    except (OSError, EOFError, wave.Error) as e:
        raise Problem(f"audio file {path} cannot be read as WAV ({type(e).__name__})",
                      "give a 16 kHz mono 16-bit WAV file") from None
    if (rate, channels, width) != (SAMPLE_RATE, 1, 2):
        raise Problem(f"audio file {path} is {rate} Hz, {channels} channel(s), {8 * width}-bit",
                      "convert it to 16 kHz mono 16-bit: sox IN -r 16000 -c 1 -b 16 OUT.wav")
    if frames > MAX_AUDIO_SECONDS * SAMPLE_RATE:
        raise Problem(f"audio file {path} lasts {frames / SAMPLE_RATE:.1f} s", "cut it to at most 30 s")
    return frames / SAMPLE_RATE


def wav_files(path: str, base_dir: Path | None) -> list[Path]:
    """The WAV file `path`, or the .wav files of folder `path` (sorted by name), each checked (check_wav).

    Raises:
        Problem: not found, a folder without .wav files, or a bad file.
    """
    full = resolve(path, base_dir)
    if full.is_dir():
        files = sorted(f for f in full.iterdir() if f.suffix.lower() == ".wav" and f.is_file())
        if not files:
            raise Problem(f"audio folder {path} holds no .wav file (looked at {full})", "add 16 kHz mono WAV files")
    elif full.is_file():
        files = [full]
    else:
        raise Problem(f"audio path {path} not found (looked at {full})",
                      "give a WAV file or a folder of them, relative to the scenario file")
    if len(files) > MAX_PLANNED:
        raise Problem(f"audio folder {path} holds {len(files)} files", f"use at most {MAX_PLANNED}")
    for f in files:
        check_wav(f)
    return files


class SpokenPassphrasePrompts(Strict):
    """Speech models only (whisper-tiny.en, tiny-whisper): each request transcribes one spoken clip,
    "The passphrase is WORD WORD NN.", taken in turn from `clips`, a folder of 16 kHz mono WAV files
    each named after the passphrase it says (`silver-rabbit-19.wav` says SILVER-RABBIT-19). The
    passphrase is the request's canary: another request's transcript holding two of its three parts
    (as words; the number in digits or words) is a leak naming its source. scenarios/audio/ holds 8
    clips made with espeak-ng (scripts/make-speech-clips.sh makes more)."""

    kind: Literal["spoken_passphrase"]
    clips: Annotated[str, Field(min_length=1, max_length=4096)] = Field(
        "audio", description="folder of word-word-nn.wav clips, relative to the scenario file")
    initial_prompt: Annotated[str, Field(max_length=2000)] = Field(
        "", description="text the decoder is prompted with before the transcript (Whisper's previous-text "
                        "prompt, faster-whisper's initial_prompt); with paged KV and prefix caching, requests "
                        "with the same audio and prompt share its blocks")
    _files: list = pydantic.PrivateAttr(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _read(self, info: pydantic.ValidationInfo):
        try:
            files = wav_files(self.clips, (info.context or {}).get("base_dir"))
        except Problem as e:
            raise Problem(e.problem, e.fix, ("clips",)) from None
        bad = [f.name for f in files if not PASSPHRASE_CLIP.fullmatch(f.stem)]
        if bad:
            raise Problem(f"clip {bad[0]} is not named after a passphrase", "name each clip word-word-nn.wav "
                          "after what it says (e.g. silver-rabbit-19.wav)", ("clips",))
        self._files = files
        return self

    @property
    def files(self) -> list[Path]:
        return list(self._files)


class AudioPrompts(Strict):
    """Speech models only: each request transcribes one WAV file (16 kHz mono 16-bit, at most 30 s),
    `path` itself or the .wav files of folder `path` in name order, in turn."""

    kind: Literal["audio"]
    path: Annotated[str, Field(min_length=1, max_length=4096)] = Field(
        description="a WAV file or a folder of them, relative to the scenario file")
    initial_prompt: Annotated[str, Field(max_length=2000)] = Field(
        "", description="text the decoder is prompted with before the transcript (Whisper's previous-text "
                        "prompt, faster-whisper's initial_prompt); with paged KV and prefix caching, requests "
                        "with the same audio and prompt share its blocks")
    _files: list = pydantic.PrivateAttr(default_factory=list)

    @pydantic.model_validator(mode="after")
    def _read(self, info: pydantic.ValidationInfo):
        self._files = _read_path(wav_files, self.path, info)
        return self

    @property
    def files(self) -> list[Path]:
        return list(self._files)


class ImagePassphrasePrompts(Strict):
    """Image models only (dinov2-smollm2, tiny-vision): each request shows one canary picture, a generated
    picture of a word (kvtui/models/projector.py), and asks for the word; the word is the request's
    canary. With dinov2-smollm2 the picture enters SmolLM2 as the word's own embedding row (kvtui's
    closed-form projector, fitted on these pictures), so the answer repeats it; another request's
    answer holding it is a leak naming its source. Requests showing the same picture share its encoder
    output (an encoder-cache hit)."""

    kind: Literal["image_passphrase"]
    template: Annotated[str, Field(min_length=1, max_length=10_000)] = Field(
        "Repeat the word in the picture: <image>", description="the user message; `<image>` marks where the "
                                                              "picture goes (exactly once)")
    pictures: Annotated[int, Field(ge=2, le=8)] = Field(
        8, description="distinct canary pictures, request i showing picture i mod pictures (fewer pictures: "
                       "more encoder-cache hits)")
    uuids: Literal["none", "reused"] = Field(
        "none", description="the uuid a client sends with each picture (vLLM's multi_modal_uuids): `none`, or "
                            "`reused`: every request labels its picture image-0, as a client numbering pictures "
                            "per conversation would (harmless while the cache is keyed by content)")

    @pydantic.field_validator("template")
    @classmethod
    def _has_image(cls, v: str) -> str:
        if v.count("<image>") != 1:
            raise Problem("template must hold <image> exactly once", "put <image> where the picture goes")
        return v


def _read_path(reader, path: str, info: pydantic.ValidationInfo):
    """reader(path, the scenario file's folder), its Problem placed at the section's `path` field."""
    try:
        return reader(path, (info.context or {}).get("base_dir"))
    except Problem as e:
        raise Problem(e.problem, e.fix, ("path",)) from None


PromptSpec = Annotated[Union[PassphrasePrompts, SyntheticPrompts, FilePrompts, SystemPromptPrompts,
                             MultiTurnPrompts, SpokenPassphrasePrompts, AudioPrompts, ImagePassphrasePrompts,
                             TracePassphrasePrompts],
                       Field(discriminator="kind")]
PROMPT_KINDS = ("passphrase", "synthetic", "file", "system_prompt", "multi_turn", "spoken_passphrase", "audio",
                "image_passphrase", "trace_passphrase")
AUDIO_KINDS = ("spoken_passphrase", "audio")
IMAGE_KINDS = ("image_passphrase",)


def read_prompt_file(path: str, base_dir: Path | None) -> list:
    """Prompts from a text file (one per non-empty line) or JSON Lines file. Raises Problem."""
    full = resolve(path, base_dir)
    try:
        size = full.stat().st_size
        if size > MAX_PROMPT_FILE_BYTES:
            raise Problem(f"prompt file {path} is {size} bytes, over the {MAX_PROMPT_FILE_BYTES} byte "
                          f"({MAX_PROMPT_FILE_BYTES >> 20} MiB) limit", "use a smaller file")
        lines = full.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError, UnicodeError) as e:
        if isinstance(e, Problem):
            raise
        why = "not found" if isinstance(e, FileNotFoundError) else f"cannot be read ({type(e).__name__})"
        raise Problem(f"prompt file {path} {why} (looked at {full})",
                      "give a path relative to the scenario file") from None
    out: list = []
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            prompt = _jsonl_prompt(path, lineno, line) if full.suffix == ".jsonl" else line
            chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
            if chars > MAX_PROMPT_CHARS:
                raise Problem(f"{path} line {lineno}: prompt of {chars} characters, over the {MAX_PROMPT_CHARS} "
                              "character limit", "shorten or split it (for long inputs of a given length "
                              "use `kind: synthetic` with prompt_tokens)")
            out.append(prompt)
    if not out or len(out) > MAX_PLANNED:
        raise Problem(f"prompt file {path} has {len(out)} prompts", f"give 1 to {MAX_PLANNED} prompts")
    return out


def _jsonl_prompt(path: str, lineno: int, line: str) -> str | list:
    fix = 'write "text", {"prompt": "text"} or {"messages": [{"role": "user", "content": "text"}]}'
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):
        raise Problem(f"{path} line {lineno}: not JSON", fix) from None
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        item = item["prompt"]
    elif isinstance(item, dict) and isinstance(item.get("messages"), list):
        item = item["messages"]
        if not item or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in item):
            raise Problem(f"{path} line {lineno}: bad messages", fix)
    if not isinstance(item, (str, list)) or not item:
        raise Problem(f"{path} line {lineno}: no prompt", fix)
    return item


def passphrases(rng: random.Random) -> Iterator[str]:
    """Endless unique passphrases WORD-WORD-NN (two different words, NN in 10..99)."""
    seen: set[str] = set()
    while len(seen) < len(WORDS) * (len(WORDS) - 1) * 90:
        a, b = rng.sample(WORDS, 2)
        phrase = f"{a}-{b}-{rng.randint(10, 99)}"
        if phrase not in seen:
            seen.add(phrase)
            yield phrase


def to_id_list(out: object) -> list[int]:
    """Token ids from whatever a tokenizer returned: list, BatchEncoding/dict, tensor, batch of one."""
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):
        out = list(out[0])
    return [int(x) for x in out]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids of a chat, with the assistant turn opened (a tokenizer without a chat template
    gets 'role: content' lines and 'assistant:')."""
    if getattr(tokenizer, "chat_template", None):
        return to_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return encode_text(tokenizer, text)


def encode_text(tokenizer, text: str) -> list[int]:
    return to_id_list(tokenizer.encode(text))


def user_chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def random_ids(rng: random.Random, n: int, tokenizer) -> list[int]:
    """`n` token ids drawn uniformly from the vocabulary, special tokens excluded."""
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    vocab = int(tokenizer.vocab_size)
    out: list[int] = []
    while len(out) < n:
        i = rng.randrange(vocab)
        if i not in special:
            out.append(i)
    return out
