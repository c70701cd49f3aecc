"""canary: prompts carry unique passphrases; an output holding another request's passphrase, or a
distinctive fragment of it (two of its three parts, e.g. "VELVET-ORCHID" or "ORCHID-42"), is a leak
naming its source. Checked on the text so far at every step, and on the final text; a request whose text
is seen only at its end (a `--target` run's streamed answer, kvtui/remote/session.py) is checked once,
then, against every passphrase it could have met while it ran (see CanaryDetector).

A spoken passphrase (a speech model's clip, `spoken=True`) comes back as words in a transcript
("... silver rabbit 19."): it is matched with kvtui.detect.spoken.match_spoken, and two of its three
parts in another request's transcript (the number in digits or words, parts the victim's own
passphrase shares not counted) are the leak."""

from __future__ import annotations

from collections import OrderedDict

from kvtui.detect.observer import Arrival, Finished, Quiet, StepSeen
from kvtui.detect.spoken import match_spoken
from kvtui.events import CanaryEvidence, Contamination


def fragments(passphrase: str) -> list[str]:
    """The passphrase and its two-part fragments (WORD-WORD, WORD-NN) for a WORD-WORD-NN passphrase."""
    parts = passphrase.split("-")
    out = [passphrase]
    if len(parts) >= 3:
        out += ["-".join(parts[i:i + 2]) for i in range(len(parts) - 1)]
    return out


class CanaryDetector:
    """Watches every request's text for passphrases of other requests of the run; reports each
    (victim, source) pair once, at the first step its text holds the source's passphrase.

    A request whose text comes only at its end (`on_finish` without `on_piece` before it: a `--target`
    run checks each answer once, whole) is checked against the passphrases known now and those forgotten
    (past `memory`) since it arrived, which a check at each chunk would still have held when the chunk
    came; its report's evidence text ends where the matched fragment first ends, as a report at that
    chunk's step would.
    """

    def __init__(self, memory: int = 512) -> None:
        # request id -> passphrase, the `memory` most recent arrivals: a long run's text is checked
        # against the requests whose KV could still be around, at a cost that does not grow
        self.passphrases: OrderedDict[str, str] = OrderedDict()
        self.memory = memory
        self._arrivals = 0  # arrivals so far
        self._open: dict[str, int] = {}  # request id -> its arrival's number, until its finish
        # passphrases forgotten while a request that arrived before was still open: source -> (passphrase,
        # the arrival number that pushed it out); at most `memory`, the oldest dropped first
        self._forgotten: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self.text: dict[str, str] = {}
        self._seen: set[tuple[str, str]] = set()
        self.spoken: set[str] = set()  # requests whose passphrase is spoken (matched in a transcript)
        self.inputs: dict[str, str] = {}  # request id -> its input's content key (a speech request's audio hash)
        self.turns: OrderedDict[str, str] = OrderedDict()  # a session's later turn -> its first request

    def on_arrive(self, request_id: str, passphrase: str | None, spoken: bool = False,
                  input_key: str | None = None, same_as: str | None = None) -> None:
        """Note a request's passphrase (None: it has none) and, for speech, its audio's content hash:
        two requests with the same audio say the same words, so neither's text is evidence against the
        other (the same clip uploaded under another name is no leak). A session's later turn (`same_as`: its
        first request) carries that request's passphrase as its own and is no source of its own: a leak of
        the session's passphrase names the first request once."""
        self._arrivals += 1
        self._open[request_id] = self._arrivals
        if same_as is not None:
            self.turns[request_id] = same_as
            while len(self.turns) > self.memory:
                self.turns.popitem(last=False)
            return
        if input_key:
            self.inputs[request_id] = input_key
            while len(self.inputs) > self.memory:
                self.inputs.pop(next(iter(self.inputs)))
        if passphrase:
            self.passphrases[request_id] = passphrase
            if spoken:
                self.spoken.add(request_id)
            while len(self.passphrases) > self.memory:
                old, phrase = self.passphrases.popitem(last=False)
                self._seen = {pair for pair in self._seen if old not in pair}
                self._forget(old, phrase)

    def _forget(self, source: str, phrase: str) -> None:
        """`source` left the memory: kept for the open requests that arrived before now (their whole-answer
        check), until none is left or `memory` newer ones are kept."""
        self._forgotten[source] = (phrase, self._arrivals)
        oldest_open = next(iter(self._open.values()), self._arrivals)
        while self._forgotten:
            first, (_, at) = next(iter(self._forgotten.items()))
            if at > oldest_open and len(self._forgotten) <= self.memory:
                break
            self._forgotten.popitem(last=False)
            if first not in self.passphrases:
                self.spoken.discard(first)

    def _check(self, victim: str, text: str, t: float, step: int, whole: bool = False) -> list[Contamination]:
        """Reports for `victim`'s `text`. `whole`: the request's only check (its answer seen at its end): the
        passphrases forgotten since it arrived count too, and the evidence ends at the match."""
        events = []
        first = self.turns.get(victim)
        own = self.passphrases.get(victim, "") or (self.passphrases.get(first, "") if first else "")
        upper = text.upper()
        key = self.inputs.get(victim)
        sources = self.passphrases.items()
        if whole and self._forgotten:
            since = self._open.get(victim, self._arrivals)
            sources = [*sources, *((source, phrase) for source, (phrase, at) in self._forgotten.items()
                                   if at > since and source not in self.passphrases)]
        for source, phrase in sources:
            if source == victim or source == first or (victim, source) in self._seen or (key and self.inputs.get(source) == key):
                continue
            if source in self.spoken:
                matched = _spoken_leak(phrase, own, text)
                if matched:
                    self._seen.add((victim, source))
                    events.append(Contamination(
                        t=t, step=step, detector="canary", kind="cross_request", victim=victim, source=source,
                        evidence=CanaryEvidence(leaked=phrase, matched=matched, text=text[-160:])))
                continue
            for fragment in fragments(phrase):
                if fragment in own:  # shared with the victim's own passphrase: not evidence
                    continue
                if fragment.upper() in upper:
                    self._seen.add((victim, source))
                    shown = _up_to(text, upper, fragment.upper()) if whole else text
                    events.append(Contamination(
                        t=t, step=step, detector="canary", kind="cross_request", victim=victim, source=source,
                        evidence=CanaryEvidence(leaked=phrase, matched=fragment, text=shown[-160:])))
                    break
        return events

    def on_piece(self, request_id: str, piece: str, t: float, step: int) -> list[Contamination]:
        """A new token's text for `request_id` at `step`; returns new leak reports."""
        self.text[request_id] = self.text.get(request_id, "") + piece
        return self._check(request_id, self.text[request_id], t, step)

    def on_finish(self, request_id: str, text: str, t: float, step: int) -> list[Contamination]:
        """The request's final text; returns new leak reports. Forgets the request's running text."""
        whole = self.text.pop(request_id, None) is None  # no piece seen before: the answer's one check
        events = self._check(request_id, text, t, step, whole=whole)
        self.forget(request_id)
        return events

    def forget(self, request_id: str) -> None:
        """The request ended (or never ran): no check of its text is to come."""
        self._open.pop(request_id, None)


class CanaryObserver(Quiet):
    """`canary` as a run's observer (kvtui/run/observers.py): each arrival's passphrase, each new token's
    (or streamed chunk's) text, and each final answer but a rejected request's (it never ran).

    Attributes:
        detector: the CanaryDetector (its `passphrases` by request id, its running texts).
    """

    name = "canary"

    def __init__(self) -> None:
        self.detector = CanaryDetector()

    def on_arrive(self, arrival: Arrival) -> list[Contamination]:
        self.detector.on_arrive(arrival.request_id, arrival.passphrase, spoken=arrival.spoken,
                                input_key=arrival.input_key, same_as=arrival.same_as)
        return []

    def on_step(self, step: StepSeen) -> list[Contamination]:
        events = []
        for request_id, piece in step.pieces:
            events += self.detector.on_piece(request_id, piece, step.t, step.step)
        return events

    def on_finish(self, finished: Finished) -> list[Contamination]:
        if finished.finish_reason == "rejected":
            self.detector.forget(finished.request_id)
            return []
        return self.detector.on_finish(finished.request_id, finished.text, finished.t, finished.step)


def _up_to(text: str, upper: str, fragment: str) -> str:
    """`text` up to the end of the first place its upper-cased form holds `fragment` (all of it where
    upper-casing changed its length)."""
    if len(upper) != len(text):
        return text
    return text[:upper.index(fragment) + len(fragment)]


def _spoken_leak(phrase: str, own: str, transcript: str) -> str:
    """The parts of spoken passphrase `phrase` that `transcript` holds, joined with "-" (e.g. "RABBIT-19"),
    when at least two of its parts not shared with `own` came back; "" otherwise."""
    match = match_spoken(phrase, transcript)
    parts = phrase.split("-")
    found = [*match.words, match.number] if parts[-1].isdigit() else list(match.words)
    mine = set(own.split("-"))
    heard = [p for p, hit in zip(parts, found) if hit and p not in mine]
    return "-".join(heard) if len(heard) >= 2 else ""
