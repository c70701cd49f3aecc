"""Structured output: each constrained request's grammar, as one per-row stage on the step's logits.

A request with `SamplingParams.structured` (a JSON schema, JSON object, regex, choice list or EBNF
grammar) gets its own xgrammar `GrammarMatcher` (the library vLLM and SGLang use). Each step the stage
fills one row of a persistent token bitmask per sampling row (`[rows, ceil(V / 32)]` int32, one bit
per token: 1 allowed) from that row's matcher, and, whenever a row of the step is constrained, applies
the bitmask to the step's logits: a token its grammar does not allow next gets -inf. A plain row's
bitmask row is reset to all ones first, so it is left as it was. The matcher advances by every token
the request accepts, and the request finishes (reason "stop") once its matcher has terminated.

The buffer is reused step after step, as vLLM's and SGLang's are, so the reset of a plain row is an
isolation boundary: the `stale_bitmask` fault skips it, and a plain request sampling in a row a
constrained request used before is restricted by that request's grammar (SGLang #23653, xgrammar #460).

xgrammar is imported on first use: runs without structured output never load it.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass

import torch

from kvtui.engine.request import StructuredOutputs
from kvtui.faults import FaultName

INSTALL = "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2"  # --no-deps: no triton (CPU)


def _xgr():
    """xgrammar, imported on first use. Raises ValueError naming the install command when it is missing."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(f"structured output needs xgrammar, which is not installed: {INSTALL}") from None
    return xgrammar


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose only sentences are `choices` (as vLLM's xgrammar backend builds one)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True)
class StaleRow:
    """stale_bitmask: `victim` sampled through a bitmask row `source` (a constrained request) left."""

    victim: str
    source: str | None
    row: int


class GrammarStage:
    """The engine's structured-output state: the compiler (built on first use), one matcher per
    constrained request, the persistent bitmask buffer and who last filled each of its rows.

    Args:
        tokenizer: the model's Hugging Face tokenizer (None: a constrained request is rejected).
        vocab_size: logits width V (tokens).
    A completed grammar ends with the tokenizer's own end-of-sequence token (xgrammar reads it from the
    tokenizer), whatever EOS ids the engine stops at, so a reference engine built without EOS ids
    enforces the same grammar.
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()  # compile() may run in a server's worker thread beside the engine's
        self._compiler = None
        self._compiled: dict[StructuredOutputs, object] = {}
        self.matchers: dict[str, object] = {}
        self.bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown as needed
        self.row_owner: list[str | None] = []  # the request that last filled each bitmask row
        self.stale: deque[StaleRow] = deque(maxlen=256)  # stale_bitmask: rows used stale, the latest kept
        self.rejected_tokens = 0  # tokens a matcher refused (only a fault can make one)

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar of `spec`, cached (any thread: a server compiles a new grammar in a worker
        thread before submitting, so the engine's step never waits for it; SmolLM2's vocabulary takes
        about a second a JSON schema on 2 cores). Raises ValueError with the library's reason."""
        if spec in self._compiled:
            return self._compiled[spec]
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; this engine has none")
        xgr = _xgr()
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        try:
            compiled = self._compile_kind(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{spec.kind} does not compile: {_reason(e)}") from None
        self._compiled[spec] = compiled
        return compiled

    def _compile_kind(self, spec: StructuredOutputs):
        c = self._compiler
        if spec.json is not None:
            return c.compile_json_schema(spec.json)
        if spec.json_object:  # OpenAI's json_object is an object (vLLM compiles the same schema), not any JSON value
            return c.compile_json_schema('{"type": "object"}')
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar(choice_grammar(spec.choice))
        return c.compile_grammar(spec.grammar)

    def add(self, request_id: str, spec: StructuredOutputs) -> None:
        """Give a constrained request its own matcher. Raises ValueError when its grammar does not compile."""
        self.matchers[request_id] = _xgr().GrammarMatcher(self.compile(spec))

    def drop(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def accept(self, request_id: str, token: int) -> None:
        """Advance the request's matcher by its sampled `token` (a refused token is counted; the matcher
        then stays where it was, as vLLM's does)."""
        matcher = self.matchers.get(request_id)
        if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(int(token)):
            self.rejected_tokens += 1

    def terminated(self, request_id: str) -> bool:
        """Whether the request's grammar is complete (its matcher accepted the stop token)."""
        matcher = self.matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    def apply(self, rows: list[tuple[int, str]], logits: dict, faults: frozenset) -> None:
        """Mask this step's logits in place of `logits` (chunk index -> [V]) for the sampling rows
        `rows` (chunk index, request id) in row order, when any of them is constrained."""
        if not any(rid in self.matchers for _, rid in rows):
            return
        self._grow(len(rows))
        stale = FaultName.STALE_BITMASK in faults
        for r, (_, rid) in enumerate(rows):
            matcher = self.matchers.get(rid)
            if matcher is not None:
                matcher.fill_next_token_bitmask(self.bitmask, r)
                self.row_owner[r] = rid
            elif not stale:
                self.bitmask[r] = -1  # every token allowed: a plain row is left as it is
                self.row_owner[r] = None
            elif self.row_owner[r] is not None and self.row_owner[r] != rid:
                self.stale.append(StaleRow(rid, self.row_owner[r], r))
        stacked = torch.stack([logits[i].float() for i, _ in rows])
        _xgr().apply_token_bitmask_inplace(stacked, self.bitmask[: len(rows)].to(stacked.device))
        for r, (index, _) in enumerate(rows):
            logits[index] = stacked[r]

    def _grow(self, rows: int) -> None:
        if self.bitmask is None or self.bitmask.shape[0] < rows:
            grown = _xgr().allocate_token_bitmask(max(rows, 8), self.vocab_size)
            if self.bitmask is not None:
                grown[: self.bitmask.shape[0]] = self.bitmask  # old rows stay what they were (the buffer is reused)
            self.bitmask = grown
            self.row_owner += [None] * (grown.shape[0] - len(self.row_owner))

    def take_stale(self) -> list[StaleRow]:
        """The stale rows used since the last call (stale_bitmask)."""
        out = list(self.stale)
        self.stale.clear()
        return out


def _reason(error: Exception) -> str:
    """The library's first line without its log prefix ("[18:06:08] /project/cpp/regex_converter.cc:83: ")."""
    import re

    line = (str(error).strip().splitlines() or [""])[0]
    return re.sub(r"^\[[\d:]+\]\s*\S+:\d+:\s*", "", line)[:200]
