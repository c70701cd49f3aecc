"""OpenAI response bodies: completions and chat completions, whole or as stream chunks, with
log-probabilities in each endpoint's shape.

- chat: `logprobs.content` = one `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`
  per generated token;
- completions: `logprobs` = `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`,
  where each top_logprobs dict holds the k most likely tokens and the sampled one (as vLLM).

Token strings are each token decoded alone, special tokens kept (as vLLM); `bytes` is that string's
UTF-8 encoding. Every logprob is a natural log; -inf (probability 0) is written -9999.0, as vLLM
writes it. With `n > 1` a response holds n choices, `index` 0 .. n - 1 (each stream chunk carries its
choice's index), and `usage.completion_tokens` sums them all.
"""

from __future__ import annotations

import math
import time

from kvtui.serve.jsonsafe import dumps

Entry = tuple[tuple[int, float], ...]  # (token id, logprob): the sampled token first, then the top k
MIN_LOGPROB = -9999.0  # a logprob of -inf (probability 0) as vLLM writes it: JSON has no infinity


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line (`data: [DONE]` for the string).

    Raises:
        jsonsafe.NonFiniteNumber: the payload holds NaN or an infinity (the stream then ends with an error).
    """
    data = payload if isinstance(payload, str) else dumps(payload)
    return f"data: {data}\n\n"


def logprob_value(logprob: float) -> float:
    """A logprob as a response carries it: -inf (a token of probability 0) is vLLM's -9999.0; NaN stays
    NaN, which the JSON writer refuses (jsonsafe: the request gets an error, never a bare NaN)."""
    return MIN_LOGPROB if logprob == -math.inf else logprob


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's `usage`; with `cached_tokens` (paged KV with prefix caching: prompt tokens taken from the
    prefix cache) also `prompt_tokens_details.cached_tokens`, as vLLM with --enable-prompt-tokens-details."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


class Formatter:
    """Builds one request's response bodies.

    Args:
        chat: chat completion (True) or text completion (False).
        request_id, model: the response's `id` and `model`.
        tokenizer: to spell tokens in log-probabilities.
        top_k: log-probability alternatives per token, or None when log-probabilities are off.
    """

    def __init__(self, *, chat: bool, request_id: str, model: str, tokenizer, top_k: int | None) -> None:
        self.chat, self.id, self.model, self.tokenizer, self.top_k = chat, request_id, model, tokenizer, top_k
        self.created = int(time.time())
        self._offset: dict[int, int] = {}  # completions' text_offset per choice: characters of token text so far

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, entries: list[Entry], index: int = 0) -> dict | None:
        """The `logprobs` object for `entries` of choice `index` (None when log-probabilities are off)."""
        if self.top_k is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for (token_id, logprob), *top in entries:
            text = self._token(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob_value(logprob))
            out["top_logprobs"].append({self._token(t): logprob_value(lp) for t, lp in [*top, (token_id, logprob)]})
            out["text_offset"].append(self._offset.get(index, 0))
            self._offset[index] = self._offset.get(index, 0) + len(text)
        return out

    def _chat_entry(self, entry: Entry) -> dict:
        (token_id, logprob), *top = entry

        def spelled(t: int, lp: float) -> dict:
            text = self._token(t)
            return {"token": text, "logprob": logprob_value(lp), "bytes": list(text.encode("utf-8"))}

        return {**spelled(token_id, logprob), "top_logprobs": [spelled(t, lp) for t, lp in top]}

    def _choice(self, text: str, entries: list[Entry], finish_reason: str | None, *, chunk: bool,
                index: int = 0) -> dict:
        choice: dict = {"index": index}
        if self.chat:
            choice["delta" if chunk else "message"] = {"content": text} if chunk else {"role": "assistant",
                                                                                     "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(entries, index)
        choice["finish_reason"] = finish_reason
        return choice

    def chunk(self, text: str, entries: list[Entry], finish_reason: str | None = None, index: int = 0) -> dict:
        """A stream chunk of choice `index` carrying `text` (the new text), its tokens' log-probabilities
        and, on the choice's last chunk, the finish reason."""
        return {**self._head(True), "choices": [self._choice(text, entries, finish_reason, chunk=True, index=index)]}

    def role_chunk(self, index: int = 0) -> dict:
        """A chat stream's first chunk of choice `index`: the assistant role, empty content."""
        return {**self._head(True), "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
        """The stream's last chunk with `stream_options.include_usage`: no choices, the usage."""
        return {**self._head(True), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def whole(self, choices: list[tuple[str, list[Entry], str]], prompt_tokens: int, completion_tokens: int,
              cached_tokens: int | None = None) -> dict:
        """A non-streamed response: `choices` holds (text, log-probability entries, finish reason) per
        choice, in index order; `completion_tokens` is all choices' tokens together."""
        return {**self._head(False),
                "choices": [self._choice(text, entries, reason, chunk=False, index=i)
                            for i, (text, entries, reason) in enumerate(choices)],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
