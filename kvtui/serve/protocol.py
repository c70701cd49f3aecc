"""The OpenAI request bodies `kvtui serve` accepts, their checks, and OpenAI-shaped errors.

Parameters follow the OpenAI API and vLLM's extensions (`top_k`, `ignore_eos`,
`include_stop_str_in_output`, `cache_salt`: a per-request prefix-cache namespace). Unknown fields are
accepted and ignored, and `ignored_fields` names them for the log line vLLM writes ("The following fields
were present in the request but ignored: {...}"); known parameters the engine cannot honour (suffix,
tools, echo with logprobs) are refused with 400 rather than silently ignored. Integer parameters take
JSON integers only, as OpenAI's API does: `max_tokens: 3.0`, `"3"` or `true` is a 400 naming the field. `n` (1 to 16) asks for n choices, sampled as n sequences of one
prefill (parallel sampling; choice i samples with seed + i, as vLLM seeds a request's children). Ranges
as OpenAI's API reference states them: `temperature` a finite number in [0, 2], `top_p` in (0, 1],
`presence_penalty` and `frequency_penalty` in [-2, 2], `logit_bias` token-id strings -> [-100, 100];
vLLM's `repetition_penalty` > 0, `min_tokens` from 0 to the max tokens, `bad_words` a list of strings.
A string anywhere in the body that holds a lone UTF-16
surrogate (JSON `"\ud800"` with no pair) is refused with 400: it is not Unicode text, and no
tokenizer or JSON encoder takes it.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

MAX_LOGPROBS = 20  # as OpenAI's top_logprobs and vLLM's default max_logprobs
MAX_PROMPTS = 1024  # prompts in one /v1/completions request (vLLM's VLLM_MAX_COMPLETION_PROMPTS default)
_SURROGATE = re.compile("[\ud800-\udfff]")


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`.

    Args:
        status: HTTP status (400 bad parameters, 404 unknown model, 429 queue full, 503 loading).
        message: one line for the user.
        param: the request field at fault, or None.
        code: a machine-readable code such as "context_length_exceeded", or vLLM's HTTP status number
            (its own errors: unknown model, LoRA loading), or None.
        kind: the body's `type` (vLLM's NotFoundError, InvalidUserInput, ...); None: OpenAI's type by status.
    """

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        kind = self.kind or self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class LoneSurrogate(ValueError):
    """A string of the request body holds a lone UTF-16 surrogate; `path` is where (field names and
    list indexes from the body's root)."""

    def __init__(self, path: tuple) -> None:
        self.path = tuple(_printable(p) for p in path)  # a key may be the surrogate itself: escape it
        where = ".".join(self.path) or "body"
        super().__init__(f"{where}: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                         "which is not Unicode text; send the character itself in UTF-8, or both halves of its pair")


def _printable(part) -> str:
    return str(part).encode("utf-8", "backslashreplace").decode("utf-8")


def lone_surrogate_path(data: Any) -> tuple | None:
    """Where the first string (a value or a key) holding a lone surrogate is in decoded JSON `data`, or
    None. Iterative, so a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                if isinstance(key, str) and _SURROGATE.search(key):
                    return (*path, key)
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in reversed(list(enumerate(value))))
    return None


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The fields the body held that no model declares (dotted paths into nested parts, e.g.
        `messages[0].name`): kept by pydantic, read by nothing."""
        found = [prefix + key for key in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, _Open):
                    where = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                    found += item.ignored_fields(where)
        return found


class StreamOptions(_Open):
    include_usage: bool = False


class TextPart(_Open):
    type: str
    text: str | None = None
    data: Any = None  # a prompt_embeds part's base64 (kvtui/serve/embeds.py)
    image_url: Any = None  # an image_url part's {"url": ...} (kvtui/serve/images.py)
    uuid: Any = None  # vLLM's client id for an image part


class ChatMessage(_Open):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The message's text; a list of parts must hold text parts only.

        Raises:
            ApiError: a non-text part (images, audio).
        """
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content part of type {part.type!r} is not supported: send text",
                               param="messages")
        return "".join(part.text for part in self.content)


class SamplingFields(_Open):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    user: str | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # -- penalties, bias and bans (the engine's per-row state: kvtui/engine/row_state.py) --
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    # -- structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* ------
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        """Refuse the body when a string in it holds a lone surrogate (LoneSurrogate names where)."""
        path = lone_surrogate_path(data)
        if path is not None:
            raise LoneSurrogate(path)
        return data

    def check_common(self) -> None:
        """Raises ApiError (400) for parameters the engine cannot honour."""
        self.check_n()
        for name in self.UNSUPPORTED:
            value = getattr(self, name)
            if value:  # 0, None and {} mean "off"
                raise ApiError(400, f"{name} is not supported by kvtui serve; leave it unset", param=name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        if any(s == "" for s in self.stop_list()):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        self.logit_bias_pairs()

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs. Raises ApiError (400) for a key that is no token id."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise ApiError(400, f"Invalid key in 'logit_bias': {key!r}. You should only be submitting "
                               "non-negative integers (token ids as strings).", param="logit_bias")
            pairs.append((int(key), bias))
        return tuple(sorted(pairs))

    # -- parallel sampling ----------------------------------------------------------------------
    def check_n(self) -> None:
        """Raises ApiError (400) for an `n` outside 1..MAX_N (the choices one request may ask for)."""
        from kvtui.engine.request import MAX_N

        if not 1 <= self.n <= MAX_N:
            raise ApiError(400, f"n={self.n}: n must be between 1 and {MAX_N} (choices per request)", param="n")

    # -- structured output ----------------------------------------------------------------------
    GUIDED: ClassVar[tuple[str, ...]] = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")

    def structured_param(self) -> str | None:
        """The field the request's constraint came in (for errors), or None without one."""
        given = [n for n in ("response_format", "structured_outputs", *self.GUIDED) if _constrains(n, getattr(self, n))]
        return given[0] if given else None

    def structured(self):
        """The request's StructuredOutputs (kvtui.engine.request), or None: from OpenAI's `response_format`
        (`json_schema` with `json_schema.schema`, or `json_object`; `text` is no constraint), vLLM's
        `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) or its older `guided_json`,
        `guided_regex`, `guided_choice`, `guided_grammar`.

        Raises:
            ApiError: 400 for more than one constraint, an unknown response_format type, or a malformed one.
        """
        from kvtui.engine.request import StructuredOutputs

        param = self.structured_param()
        if param is None:
            return None
        others = [n for n in ("response_format", "structured_outputs", *self.GUIDED)
                  if n != param and _constrains(n, getattr(self, n))]
        if others:
            raise ApiError(400, f"{param} and {others[0]} both constrain the output: send one", param=others[0])
        fields = _structured_fields(param, getattr(self, param))
        try:
            return StructuredOutputs(**fields)
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is text or token ids, or a list of up to MAX_PROMPTS of either
    (each its own engine request; choice `index` = prompt index x n + sequence, as vLLM numbers them);
    `echo` puts each prompt's text before its choices' text. With --enable-prompt-embeds,
    `prompt_embeds` (base64 torch.save bytes, kvtui/serve/embeds.py) may stand in for one prompt."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] | None = None
    prompt_embeds: str | list[str] | None = None
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = SamplingFields.UNSUPPORTED + ("suffix",)

    def check(self) -> None:
        self.check_common()
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of={self.best_of}: only 1 is supported", param="best_of")
        if self.echo and self.logprobs is not None:
            raise ApiError(400, "echo with logprobs asks for the prompt's log-probabilities, which kvtui serve does "
                           "not compute: drop logprobs or echo", param="echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (one for a plain string or id list).

        Raises:
            ApiError: 400 naming `prompt` when it is missing, an empty list, longer than MAX_PROMPTS, or one
                of its prompts is empty.
        """
        prompt = self.prompt
        if prompt is None:
            raise ApiError(400, "prompt: Field required", param="prompt")
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        prompts = list(prompt) if batch else [prompt]
        if len(prompts) > MAX_PROMPTS:
            raise ApiError(400, f"prompt list length {len(prompts)} exceeds the maximum allowed count of {MAX_PROMPTS}",
                           param="prompt")
        for i, one in enumerate(prompts):
            if not one:
                raise ApiError(400, f"prompt[{i}] is empty" if batch else "the prompt is empty", param="prompt")
        return prompts


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = SamplingFields.UNSUPPORTED + ("tools",)

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    def chat(self) -> list[dict]:
        """Messages as the chat template takes them: [{"role", "content"}]."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


Endpoint = Literal["completion", "chat"]


def sampling_params(body: SamplingFields, *, prompt_len: int, max_len: int, endpoint: Endpoint, tokenizer=None):
    """The engine's SamplingParams for a request, with the OpenAI defaults: temperature 1, top_p 1,
    max_tokens 16 for completions and "up to the context" for chat; a random seed when sampling
    without one; no penalty, bias or ban. `tokenizer` tokenizes bad_words (vLLM's way).

    Raises:
        ApiError: 400 context_length_exceeded when prompt + max tokens exceed `max_len` (tokens); 400
            naming min_tokens when it exceeds the max tokens.
    """
    from kvtui.engine import SamplingParams

    limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if limit is None:
        limit = 16 if endpoint == "completion" else max(max_len - prompt_len, 1)
    if prompt_len + limit > max_len:
        raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                       f"{prompt_len + limit} tokens ({prompt_len} in the prompt, {limit} for the completion). "
                       "Please reduce the prompt or max_tokens.", param="max_tokens", code="context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    seed = body.seed if body.seed is not None else secrets.randbits(63)
    return SamplingParams(
        temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0), seed=seed % 2**63, max_new_tokens=limit, stop=body.stop_list(),
        ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=_logprobs(body), n=body.n, structured=body.structured(),
        **_penalty_fields(body, limit, tokenizer))


def _penalty_fields(body: SamplingFields, limit: int, tokenizer) -> dict:
    """The SamplingParams penalty, bias and ban fields of a request (None in the body: off)."""
    from kvtui.engine.sampling import bad_words_token_ids

    min_tokens = body.min_tokens or 0
    if min_tokens > limit:
        raise ApiError(400, f"min_tokens={min_tokens} must be less than or equal to max_tokens={limit}",
                       param="min_tokens")
    words = tuple(body.bad_words or ())
    return dict(frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=body.logit_bias_pairs(), min_tokens=min_tokens, bad_words=words,
                bad_words_ids=bad_words_token_ids(tokenizer, words) if words and tokenizer is not None else ())


def _logprobs(body: SamplingFields) -> int | None:
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


# -- structured output ------------------------------------------------------------------------------
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _constrains(name: str, value) -> bool:
    """Whether field `name` holding `value` asks for a constraint (a `text` response_format does not)."""
    if value is None:
        return False
    if name == "response_format":
        return not (isinstance(value, dict) and value.get("type", "text") == "text")
    return True


def _structured_fields(param: str, value) -> dict:
    """StructuredOutputs' fields from the request field `param`. Raises ApiError 400 for a malformed one."""
    if param == "response_format":
        return _response_format(value)
    if param == "structured_outputs":
        unknown = sorted(set(value) - set(STRUCTURED_KEYS) - {"disable_any_whitespace", "disable_fallback"})
        if unknown:
            raise ApiError(400, f"structured_outputs.{unknown[0]} is not supported; use one of "
                           f"{', '.join(STRUCTURED_KEYS)}", param="structured_outputs")
        value = {k: v for k, v in value.items() if k in STRUCTURED_KEYS and v not in (None, False)}
        if len(value) != 1:
            raise ApiError(400, f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KEYS)}",
                           param="structured_outputs")
        (key, spec), = value.items()
        return _one(key, spec, f"structured_outputs.{key}")
    return _one(param.removeprefix("guided_"), value, param)


def _one(key: str, spec, param: str) -> dict:
    if key == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                raise ApiError(400, f"{param} must be a JSON schema (an object, or its JSON text)", param=param) from None
        if not isinstance(spec, dict):
            raise ApiError(400, f"{param} must be a JSON schema (an object)", param=param)
        return {"json": json.dumps(spec, sort_keys=True)}
    if key == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise ApiError(400, f"{param} must be a list of non-empty strings", param=param)
        return {"choice": tuple(spec)}
    if key == "json_object":
        return {"json_object": True}
    if not isinstance(spec, str) or not spec:
        raise ApiError(400, f"{param} must be a non-empty string", param=param)
    return {key: spec}


def _response_format(value) -> dict:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (value.get("json_schema") or {}).get("schema") if isinstance(value.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                           param="response_format")
        return {"json": json.dumps(schema, sort_keys=True)}
    raise ApiError(400, f"response_format {kind!r} is not supported; use text, json_object or json_schema",
                   param="response_format")
