"""Per-request state: everything that must stay private to one request.

A request's prompt, generated tokens, KV slot, cache length, sampling generator and timestamps live
here and nowhere else; the scheduler and runner read them, only the engine changes them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtui.engine.inputs import RequestInput
from kvtui.engine.stops import StopScan


class RequestStatus(str, enum.Enum):
    """Lifecycle: WAITING -> RUNNING -> FINISHED, or ABORTED from either of the first two."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(str, enum.Enum):
    """Why a request stopped: `stop` (EOS or a stop string), `length` (max_new_tokens or the slot's
    max_len), `abort` (cancelled by the caller), `rejected` (could not be admitted: too long, queue full,
    a token id outside the vocabulary), `error` (its own sampling or stop check raised; it alone ended,
    the rest of the batch went on). A rejected or failed request also carries a FinishCode."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    REJECTED = "rejected"
    ERROR = "error"


class FinishCode(str, enum.Enum):
    """Machine-readable cause of a rejection or an error (RequestState.finish_code), so a server maps it
    to a status without reading the prose of `finish_detail`; each cause has its own code:
    `empty` (no prompt tokens), `too_long` (prompt, or prompt + max_new_tokens, above max_len or the
    paged pool), `out_of_vocabulary` (a prompt token id outside [0, vocab size)), `queue_full` (the
    waiting queue is at config.max_waiting), `internal_error` (the request's own sampling, log-probability
    or stop-string step raised), `invalid_logit_bias` (a logit_bias token id outside the vocabulary),
    `invalid_bad_words` (a bad_words token id outside the vocabulary), `invalid_structured_output` (its
    grammar did not compile), `unsupported_input` (an input this model cannot take: audio to a
    decoder-only model, none to a speech model, images without an image encoder, prompt_embeds rows of
    another width), `adapter_unsupported` (a LoRA adapter this engine cannot run: its model family, or
    --enforce-eager / the batch-invariant mode)."""

    EMPTY = "empty"
    TOO_LONG = "too_long"
    OUT_OF_VOCABULARY = "out_of_vocabulary"
    QUEUE_FULL = "queue_full"
    INTERNAL_ERROR = "internal_error"
    INVALID_LOGIT_BIAS = "invalid_logit_bias"
    INVALID_BAD_WORDS = "invalid_bad_words"
    INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"  # its grammar (schema, regex, choices) did not compile
    UNSUPPORTED_INPUT = "unsupported_input"
    ADAPTER_UNSUPPORTED = "adapter_unsupported"


MAX_N = 16  # sequences one request may fork into (parallel sampling)


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on a request's output, named as vLLM's StructuredOutputsParams: exactly one of
    `json` (a JSON schema, as JSON text), `regex`, `choice` (the output is one of these strings),
    `grammar` (EBNF in xgrammar's GBNF dialect) or `json_object` (any JSON object). Enforced token by
    token with a grammar matcher and a bitmask on the request's logits (kvtui/engine/grammar.py).

    Raises:
        ValueError: none or more than one of them set, or an empty choice list.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.choice is not None and not self.choice:
            raise ValueError("structured outputs: choice must list at least one string")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its next token.

    temperature == 0 means greedy (argmax). Otherwise logits are divided by `temperature`, cut to the
    `top_k` most likely tokens (0 = all) and to the smallest set whose probability reaches `top_p`,
    and one token is drawn with a generator seeded by `seed`, owned by the request alone, so the draw
    does not depend on the request's slot or its neighbours in the batch.

    A request stops at EOS (unless ignore_eos), at max_new_tokens, or when a token completes one of
    `stop` in its text; as in the OpenAI API and vLLM, the returned text then ends before the stop
    string (with it when include_stop_str_in_output), while the token ids keep the token that
    completed it. Stop strings are searched as vLLM searches them (engine/stops.py): only in text
    decoded after the first `min_tokens` tokens (plus a stop string's length - 1 before it), so one
    that occurs earlier neither ends the request nor cuts its text.

    `logprobs` asks for log-probabilities (natural log, from log_softmax of the float32 logits, before
    penalties, bias, temperature, top-k or top-p, as vLLM's default raw logprobs): None = off (nothing
    computed), 0 = the sampled token's only, k = also the k most likely tokens at each step (OpenAI's
    `top_logprobs`).

    Penalties, bias and bans (the OpenAI API's and vLLM's names and semantics; applied by the
    request's own row state, kvtui/engine/row_state.py, before temperature, top-k and top-p):
    `frequency_penalty` and `presence_penalty` in [-2, 2] subtract count x frequency and
    (count > 0) x presence from each token's logit, counted over the request's own output tokens;
    `repetition_penalty` > 0 (1 = off) divides a positive logit and multiplies a negative one of every
    token in its prompt or output (HF / vLLM); `logit_bias` adds a bias in [-100, 100] to a token id's
    logit ((id, bias) pairs); `min_tokens` masks EOS (unless ignore_eos) until that many tokens were
    generated and keeps stop strings from being searched in their text; `bad_words` are strings never
    to generate, `bad_words_ids` their token sequences (sampling.resolve_bad_words fills them from a
    tokenizer): the last token of a sequence is banned when the output ends with the sequence's other
    tokens.

    Parallel sampling (`n`, vLLM's and OpenAI's name): the engine runs `n` sequences of the prompt,
    prefilled once and forked (see Engine.submit); sequence i draws with its own generator seeded
    `seed + i` (vLLM's rule for a seeded request), so each equals a solo run of its own seed.

    `structured` (StructuredOutputs) constrains the output to a JSON schema, a regex, a choice list or a
    grammar: each step the request's logits outside what its grammar allows next are masked to -inf,
    and it stops (reason "stop") once its grammar is complete.

    Raises:
        ValueError: temperature < 0, top_k < 0, top_p outside (0, 1], logprobs < 0, or n outside 1..MAX_N;
            a penalty, bias or min_tokens out of range (the message names the field).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 32
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # -- parallel sampling ----------------------------------------------------------------------
    n: int = 1
    # -- structured output (kvtui/engine/grammar.py) ----------------------------------------------
    structured: StructuredOutputs | None = None
    # -- penalties, bias and bans (row_state.py) --
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature = }")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k = }")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p = }")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens = }")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs = }")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in 1..{MAX_N}, got {self.n = }")
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0 or self.repetition_penalty == float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        bad = next(((t, b) for t, b in self.logit_bias if not -100.0 <= b <= 100.0 or t < 0), None)
        if bad is not None:
            raise ValueError(f"logit_bias must map token ids >= 0 to biases in [-100, 100], got {bad[0]}: {bad[1]}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}")
        if any(not ids for ids in self.bad_words_ids):
            raise ValueError("bad_words_ids must not hold an empty sequence")

    @property
    def state_tags(self) -> tuple[str, ...]:
        """Short names of the per-row state it carries, for the dashboard: pen (a penalty), bias
        (logit_bias), ban (bad_words), min (min_tokens), and the structured-output kind (json, regex,
        choice, grammar, json_object)."""
        pen = self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
        tags = tuple(tag for tag, on in (("pen", pen), ("bias", self.logit_bias), ("ban", self.bad_words_ids or
                                         self.bad_words), ("min", self.min_tokens)) if on)
        return tags + ((self.structured.kind,) if self.structured is not None else ())

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty, bias, ban or min_tokens changes this request's logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.bad_words_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RequestState:
    """One request as the engine tracks it.

    Attributes:
        request_id: unique name chosen by the caller.
        prompt_ids: prompt token ids (list of int, tokens).
        sampling: SamplingParams (greedy by default).
        generated_ids: tokens produced so far.
        slot: index of the KV slot it owns while RUNNING, else None.
        cache_len: tokens of this request currently held in its slot (tokens).
        prefill_done: prompt tokens already fed (chunked prefill feeds a long prompt over several steps).
        status, finish_reason: lifecycle, see RequestStatus and FinishReason.
        finish_detail: one line on why it ended (rejections, errors, a capped max_new_tokens);
            finish_code: a FinishCode value for a rejection or an error, else "".
        arrival_s, scheduled_s, first_token_s, finish_s: timestamps in seconds on the engine's clock
            (None until reached). token_times_s: time of every generated token, for ITL.
        top2_gaps: top-1 minus top-2 logit at each generated token (for labelling numeric divergence).
        draws: sampling requests: the Draw of each generated token (kvtui/engine/sampling.py); empty
            when greedy.
        stop_str: the stop string that ended it, if one did.
        text_end: characters of the decoded output to return (it ends before, or with, the stop
            string), or None for the whole text. stop_scan: its stop-string search so far
            (engine/stops.py; None until its first check).
        faults_seen: the isolation faults active in any step it took part in.
        tenant: who sent it (None: the only tenant); cache_salt: its tenant's prefix-cache salt, part
            of its first block's key, so tenants never share cached blocks (None: no salt).
        recompute_tokens: paged KV: generated tokens fed again as part of the prefill after a
            preemption by recompute (its KV was given back); 0 otherwise.
        num_preemptions: times it was preempted; prefix_hit_tokens: tokens its last admission took
            from the prefix cache.
        input: what the request feeds the model (kvtui/engine/inputs.py: token ids, supplied embedding
            rows, images, audio); its prompt_ids equal `prompt_ids`.
        parent_id: parallel sampling (n > 1): the id the caller submitted; this sequence is its child
            `index` (request_id `f"{index}_{parent_id}"`, as vLLM names them). None for n = 1.
        forced: teacher forcing (the reference detector's continuation past a numeric flip): the tokens
            to emit, one per position, whatever the model picks; the request stops after the last one.
            None: it emits its own choices. chosen_ids: with `forced`, the model's own choice at each
            position (greedy argmax, or its draw with its own generator; its top2_gaps and draws are of
            that choice's logits).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generated_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    cache_len: int = 0
    prefill_done: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    finish_detail: str = ""
    finish_code: str = ""
    arrival_s: float | None = None
    scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    top2_gaps: list[float] = field(default_factory=list)
    draws: list = field(default_factory=list)
    stop_str: str | None = None
    text_end: int | None = None
    stop_scan: StopScan | None = None
    faults_seen: frozenset = frozenset()
    tenant: str | None = None
    cache_salt: str | None = None
    recompute_tokens: int = 0
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    parent_id: str | None = None
    index: int = 0
    input: RequestInput | None = None
    forced: tuple[int, ...] | None = None
    chosen_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.input is None:
            self.input = RequestInput(tuple(self.prompt_ids))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """Tokens fed as prefill: the prompt, plus the generated tokens recomputed after a preemption."""
        if not self.recompute_tokens:
            return self.prompt_ids
        return self.prompt_ids + self.generated_ids[: self.recompute_tokens]

    @property
    def prefill_len(self) -> int:
        return self.prompt_len + self.recompute_tokens

    @property
    def in_prefill(self) -> bool:
        """True while prefill tokens (the prompt, or what a preemption made recompute) remain to be fed."""
        return self.prefill_done < self.prefill_len

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.generated_ids

    def cache_keys(self, num_tokens: int, faults: frozenset = frozenset()) -> list:
        """Prefix-cache key items of positions 0 .. num_tokens - 1 (RequestInput.position_keys for the
        prompt, the token ids after it); faults=frozenset() gives the true keys."""
        spliced = self.input.embeds is not None or self.input.images
        keys = self.input.position_keys(faults) if spliced else list(self.prompt_ids)
        return (keys + self.generated_ids)[:num_tokens]

    @property
    def is_done(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (seconds): arrival -> first generated token."""
        if self.first_token_s is None or self.arrival_s is None:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token (seconds), excluding the first: (finish - first token) / (n - 1)."""
        n = len(self.token_times_s)
        if n < 2:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1)

    @property
    def e2e_s(self) -> float | None:
        if self.finish_s is None or self.arrival_s is None:
            return None
        return self.finish_s - self.arrival_s

    @property
    def queue_s(self) -> float | None:
        if self.scheduled_s is None or self.arrival_s is None:
            return None
        return self.scheduled_s - self.arrival_s
