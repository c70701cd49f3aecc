"""Incremental detokenization for streaming: each token's new text, never a partial character, never
text a stop string may still cut.

Rules (as vLLM's incremental detokenizer):
- text whose decoding ends in U+FFFD (the bytes of a character split across tokens) is held until the
  character completes;
- with stop strings (and include_stop_str_in_output off) the last `max(len(stop)) - 1` characters are
  held, since the engine cuts the returned text before a stop string that the next tokens may complete;
- the token that completes a stop string ends the text where the engine ends it (before the stop
  string, or after it with include_stop_str_in_output): the same search as the engine's
  (kvtui/engine/stops.py, vLLM's: only the text each token adds plus the overlap, nothing in the first
  min_tokens tokens' text), so a stop string the engine passes over never holds the stream back;
- when the request finishes, the rest of the engine's returned text (stop string cut) is sent, so the
  concatenated stream equals the non-streamed text.

Cost per token: two decodes of a window of a few tokens (vLLM's prefix and read offsets), not of the
whole output: the window starts one whole piece back, so a decoder that drops the leading space of the
first token it sees (SentencePiece) still yields the text the whole output decodes to.
"""

from __future__ import annotations

from kvtui.engine.stops import REPLACEMENT, StopScan


class TextStream:
    """One request's streamed text.

    Args:
        tokenizer: the model's tokenizer (decode with skip_special_tokens, as the engine's text).
        stop: the request's stop strings; include_stop: SamplingParams.include_stop_str_in_output;
        min_tokens: SamplingParams.min_tokens (no stop string is searched in its tokens' text).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop, self.include_stop = tuple(stop), include_stop
        self._scan = StopScan(self.stop, min_tokens, include_stop)
        self.hold = max((len(s) for s in stop), default=1) - 1 if stop and not include_stop else 0
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # tokens whose text is in self._text
        self._text = ""  # the text of self._ids[:self._read]
        self.sent = ""  # text sent so far

    def add(self, token_id: int) -> str:
        """Take one generated token; return the text that may be sent now ("" if none)."""
        self._ids.append(int(token_id))
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix:self._read], skip_special_tokens=True)
        window = decode(self._ids[self._prefix:], skip_special_tokens=True)
        new = window[len(before):]
        if window.endswith(REPLACEMENT) or len(window) <= len(before):
            visible = self._text + new.rstrip(REPLACEMENT)
        else:  # whole again: the window moves on (a token of context kept, as some decoders drop a
            self._text += new  # leading space of the first token they see)
            self._prefix, self._read = self._read, len(self._ids)
            visible = self._text
        end = self._stop_end(visible)
        if end <= len(self.sent):
            return ""
        delta = visible[len(self.sent):end]
        self.sent += delta
        return delta

    def _stop_end(self, visible: str) -> int:
        """How much of `visible` may be sent: up to a stop string that this token completes (the
        request ends at it), else all but the held characters."""
        found = self._scan.update(visible, len(self._ids))
        return len(visible) - self.hold if found is None else found[1]

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the engine's returned text) after what was sent."""
        rest = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent += rest
        return rest
