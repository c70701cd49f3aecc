"""The request-id audit of a target server (a scenario's `request_ids`, kvtui/scenario/request_ids.py).

Each planned request carries the id its client chose (PlannedRequest.client_id) in the `x-request-id`
header, the W3C `traceparent` header (the group's trace id, a span id of its own) and/or the body's
`user` / `request_id` / `rid`; TargetSession sends them, each request bounded by
`request_ids.wait_s`. After the load this module sends `probes` requests with fresh ids, one at a time,
and GET /health, then turns what the clients saw into findings (Contamination events, detector
`request_id`, each naming victim and source):

- an answer delivered to the wrong client is the canary's `cross_request` report (the victim's answer
  holds another request's passphrase); this module only counts it in the summary line;
- `hung`: no whole answer within the wait (the client gave up: no headers, or a stream that stalled);
- `lost`: the server dropped the request: a 5xx, an error event in the stream, a stream that ended
  without a finish, a connection cut. A 4xx is a refusal (the server said no to the id or a field): it
  is counted in the line, not a finding;
- `stopped_serving`: a probe with a fresh id got no whole answer, or /health answered other than 200,
  while the server had answered load requests before.

Sources. A group of colliding requests is a cause when it came to grief (a member hung, was lost, or sent
or got a wrong answer) and was sent before any request of the run was lost (the server still served when
it took them). A request of a cause group that hung or was lost names the requests of its group the
canary saw it mixed up with (the one that got its answer), else the other requests of its group;
any other request that hung or was lost (one with an id of its own, or of a group sent after the server
began to fail) names the cause groups' requests. With no cause group, a request that failed is a plain
failed request, no finding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from kvtui.events import Contamination, RequestIdEvidence
from kvtui.remote.openai import StreamResult
from kvtui.scenario.request_ids import HEADER, HEADER_PLACES, TRACEPARENT, ClientId, RequestIds, probe_id, traceparent

COMPLETED = ("stop", "length")
DETECTOR = "request_id"
SHOWN = 3  # victims named per kind in the summary line


def id_headers(client_id: ClientId | None, send_as: Sequence[str], span: str = "") -> dict[str, str]:
    """The request headers that carry `client_id`: `x-request-id` (place `header`) and/or `traceparent`
    (its span id made from `span`, the request's name in the run); {} without an id or a header place."""
    if client_id is None:
        return {}
    headers = {HEADER: client_id.sent("header")} if "header" in send_as else {}
    if TRACEPARENT in send_as:
        headers[TRACEPARENT] = traceparent(client_id, span).strip()  # HTTP drops surrounding whitespace
    return headers


def id_fields(client_id: ClientId | None, send_as: Sequence[str]) -> dict[str, str]:
    """The body fields that carry `client_id`: `user`, `request_id` and/or `rid` as send_as says."""
    if client_id is None:
        return {}
    return {place: client_id.sent(place) for place in send_as if place not in HEADER_PLACES}


@dataclass
class Outcome:
    """What one request's client saw, classified: kind None (answered), "hung", "lost" or "refused"."""

    kind: str | None
    text: str
    waited_s: float | None
    status: int | None


def classify(result: StreamResult, wait_s: float) -> Outcome:
    """hung (timed out), refused (a 4xx), lost (any other failure) or answered (kind None); `waited_s` is
    the wait for a hung one (the caller knows the others' times)."""
    if result.finish_reason in COMPLETED or result.finish_reason not in ("error", "abort"):
        return Outcome(None, "answered", None, result.status)
    if result.finish_reason == "abort":
        return Outcome(None, "stopped by the run", None, result.status)
    if result.timed_out:
        n = len(result.chunk_times_s)
        came = (f"{n} chunk{'s' if n != 1 else ''} came, then nothing" if n else
                f"HTTP {result.status}, no chunk" if result.status is not None else "not even the response headers")
        return Outcome("hung", f"no whole answer within {wait_s:g} s ({came})", wait_s, result.status)
    kind = "refused" if result.status is not None and 400 <= result.status < 500 else "lost"
    return Outcome(kind, (result.error or "failed")[:300], None, result.status)


class RequestIdAudit:
    """The audit of one target run: the ids of the plan, the probes' results, the findings.

    Args:
        spec: the scenario's `request_ids`; seed: the scenario seed (the probes' ids).
        planned: the run's planned requests (their client_id set by the plan).
    """

    def __init__(self, spec: RequestIds, seed: int, planned: Sequence) -> None:
        self.spec, self.seed = spec, seed
        self.client_of: dict[str, ClientId] = {p.request_id: p.client_id for p in planned if p.client_id is not None}
        self.groups: dict[int, list[str]] = {}
        for rid, cid in self.client_of.items():
            self.groups.setdefault(cid.group, []).append(rid)
        self.prompts = list(planned)[: spec.probes]  # the probes send these prompts again
        self.probes: list[tuple[str, str, StreamResult]] = []  # (probe name, its id, what came)
        self.health_status: int | None = None
        self.health_text = ""
        self.health_before: int | None = None  # GET /health's status before the load (None: no answer)
        self.outcomes: dict[str, Outcome] = {}
        self.spans: dict[str, tuple[float, float]] = {}
        self.misrouted: list[tuple[str, str]] = []  # (victim, source) of the canary's reports

    @property
    def wait_s(self) -> float:
        return self.spec.wait_s

    def colliders(self, rid: str) -> tuple[str, ...]:
        """The other requests whose id equals or nears `rid`'s (its group), in plan order."""
        cid = self.client_of.get(rid)
        if cid is None:
            return ()
        return tuple(r for r in self.groups[cid.group] if r != rid)

    # -- before and after the load -----------------------------------------------------------------------
    async def health(self, client: httpx.AsyncClient) -> tuple[int | None, str]:
        """GET /health: its status (None when no answer came) and text (or the error), bounded."""
        try:
            response = await client.get("/health", timeout=min(self.wait_s, 10.0))
            return response.status_code, response.text.strip()[:200]
        except httpx.HTTPError as e:
            return None, f"{type(e).__name__}: {e}"[:200]

    async def before_load(self, client: httpx.AsyncClient) -> None:
        """GET /health before the first request: a server without a /health that answers 200 is not judged
        by it after the load."""
        if self.spec.health:
            self.health_before, _ = await self.health(client)

    async def probe(self, client: httpx.AsyncClient, send: Callable) -> None:
        """The probes, one at a time, then GET /health. `send(planned, headers, fields, timeout_s)` sends
        one request as the run sends its load and returns its StreamResult."""
        for k, planned in enumerate(self.prompts):
            value = probe_id(self.seed, k)
            cid = ClientId(value, -1, "probe")
            result = await send(planned, id_headers(cid, self.spec.send_as, f"probe{k}"), id_fields(cid, self.spec.send_as),
                                self.wait_s)
            self.probes.append((f"probe{k}", value, result))
        if self.spec.health:
            self.health_status, self.health_text = await self.health(client)

    @property
    def probes_answered(self) -> int:
        return sum(r.finish_reason in COMPLETED for _, _, r in self.probes)

    @property
    def health_failed(self) -> bool:
        """/health answered 200 before the load and otherwise (or not at all) after it."""
        return self.spec.health and self.health_before == 200 and self.health_status != 200

    def probe_failed(self, result: StreamResult) -> bool:
        """A probe that hung or was lost (a 4xx is a refusal of the request, not of the server)."""
        return classify(result, self.wait_s).kind in ("hung", "lost")

    @property
    def stopped_serving(self) -> bool:
        """A probe hung or was lost, or /health stopped answering 200."""
        return any(self.probe_failed(r) for _, _, r in self.probes) or self.health_failed

    # -- findings --------------------------------------------------------------------------------------
    def findings(self, results: dict[str, StreamResult], spans: dict[str, tuple[float, float]],
                 canary: Sequence[Contamination], t: float) -> list[Contamination]:
        """The hung, lost and stopped_serving reports of the run (after the load and the probes).

        Args:
            results: request id -> what its client saw (every planned request sent).
            spans: request id -> (sent, ended) on the run's clock: from the send to the last chunk, the
                error, or giving up.
            canary: the run's canary reports (answers that hold another request's passphrase).
            t: the time to stamp the reports with.
        """
        self.spans = spans
        self.misrouted = [(e.victim, e.source or "?") for e in canary if e.counts]
        self.outcomes = {rid: classify(r, self.wait_s) for rid, r in results.items()}
        causes = self._cause_groups()
        events = []
        for rid, outcome in sorted(self.outcomes.items()):
            if outcome.kind not in ("hung", "lost"):
                continue
            cid = self.client_of.get(rid)
            own = cid is not None and cid.group in causes
            sources = self._own_sources(rid) if own else tuple(r for g in causes for r in self.groups[g] if r != rid)
            if not sources:
                continue  # failed with no collision that came first: a plain failed request
            events.append(self._report(rid, outcome, sources, t))
        if self.stopped_serving and any(o.kind is None and o.text == "answered" for o in self.outcomes.values()):
            events += self._stopped(causes, t)
        return events

    def _own_sources(self, rid: str) -> tuple[str, ...]:
        """The requests of `rid`'s group that took its answer or gave it theirs (the canary's pairs), else
        every other request of its group (which of them the server mixed it up with is not visible)."""
        mixed = {s if v == rid else v for v, s in self.misrouted if rid in (v, s)}
        return tuple(r for r in self.colliders(rid) if r in mixed) or self.colliders(rid)

    def overlapped(self, rid: str) -> bool:
        """Whether one of the requests sharing `rid`'s id was in flight while it was."""
        if rid not in self.spans:
            return False
        a0, a1 = self.spans[rid]
        return any(a0 < self.spans[s][1] and self.spans[s][0] < a1 for s in self.colliders(rid) if s in self.spans)

    def _cause_groups(self) -> list[int]:
        """Groups of colliding requests (two or more) that came to grief while the server still served: a
        member hung, was lost, or sent or got a wrong answer, and no request had been lost (a server error)
        before the group was sent."""
        bad = {rid for rid, o in self.outcomes.items() if o.kind in ("hung", "lost")}
        bad |= {r for pair in self.misrouted for r in pair}
        lost_ends = [self.spans[r][1] for r, o in self.outcomes.items() if o.kind == "lost" and r in self.spans]
        down_since = min(lost_ends, default=float("inf"))
        causes = []
        for g, members in sorted(self.groups.items()):
            sent = [self.spans[r][0] for r in members if r in self.spans]
            if len(members) > 1 and bad & set(members) and sent and min(sent) < down_since:
                causes.append(g)
        return causes

    def _report(self, rid: str, outcome: Outcome, sources: tuple[str, ...], t: float) -> Contamination:
        cid = self.client_of.get(rid)
        return Contamination(
            t=t, step=-1, detector=DETECTOR, kind=outcome.kind, victim=rid, source=",".join(sources),
            evidence=RequestIdEvidence(
                client_id=cid.value if cid else "", sent_as=tuple(self.spec.send_as),
                group=cid.label if cid else "", shares_id_with=self.colliders(rid),
                overlapped=self.overlapped(rid),
                outcome=outcome.text, waited_s=outcome.waited_s if outcome.kind == "hung" else _waited(self.spans, rid),
                status=outcome.status))

    def _stopped(self, causes: list[int], t: float) -> list[Contamination]:
        """One stopped_serving report per failed probe, and one for /health when it did not answer 200."""
        suspects = [r for g in causes for r in self.groups[g]] or [
            r for members in self.groups.values() if len(members) > 1 for r in members]
        common = dict(sent_as=tuple(self.spec.send_as), shares_id_with=(), overlapped=False,
                      probes_sent=len(self.probes), probes_answered=self.probes_answered,
                      health_status=self.health_status)
        events = []
        for name, value, result in self.probes:
            if not self.probe_failed(result):
                continue
            outcome = classify(result, self.wait_s)
            waited = outcome.waited_s if outcome.kind == "hung" else (
                result.end_s - result.sent_s if result.end_s is not None else None)
            events.append(Contamination(
                t=t, step=-1, detector=DETECTOR, kind="stopped_serving", victim=name, source=",".join(suspects) or None,
                evidence=RequestIdEvidence(client_id=value, group="probe", outcome=outcome.text,
                                           waited_s=waited, status=outcome.status, **common)))
        if self.health_failed:
            said = f"HTTP {self.health_status}: {self.health_text}" if self.health_status is not None else self.health_text
            events.append(Contamination(
                t=t, step=-1, detector=DETECTOR, kind="stopped_serving", victim="GET /health",
                source=",".join(suspects) or None,
                evidence=RequestIdEvidence(client_id="", group="health", outcome=said[:300], status=self.health_status,
                                           **common)))
        return events

    # -- the line ----------------------------------------------------------------------------------------
    def line(self, results: dict[str, StreamResult]) -> str:
        """One line for an upstream report: what collided, what went wrong, whether the server still served."""
        where = "+".join(HEADER if p == "header" else p if p in HEADER_PLACES else f"body {p}" for p in self.spec.send_as)
        kinds = Counter(self.client_of[r].kind for members in self.groups.values() if len(members) > 1 for r in members[:1])
        shared = sum(len(m) for m in self.groups.values() if len(m) > 1)
        overlapping = sum(1 for rid in self.client_of if self.overlapped(rid))
        groups = ", ".join(_count(n, f"{k.replace('_', '-')} group") for k, n in sorted(kinds.items()))
        parts = [f"request-id audit ({where}): {shared} of {len(results)} requests shared an id with another "
                 f"({groups}; {overlapping} overlapped one in flight)"]
        wrong = ", ".join(f"{v} got {s}'s" for v, s in self.misrouted[:SHOWN]) + (" ..." if len(self.misrouted) > SHOWN else "")
        parts.append(_count(len(self.misrouted), "answer") + " to the wrong client" + (f" ({wrong})" if wrong else ""))
        for kind in ("hung", "lost", "refused"):
            named = sorted(r for r, o in self.outcomes.items() if o.kind == kind)
            if named or kind != "refused":
                parts.append(f"{len(named)} {kind}" + (f" ({_names(named, self.outcomes)})" if named else ""))
        if self.probes or self.spec.health:
            parts.append(self._after())
        return "; ".join(parts)

    def _after(self) -> str:
        probes = f"{self.probes_answered} of {_count(len(self.probes), 'later request')} with fresh ids answered"
        failed = next((r for _, _, r in self.probes if r.finish_reason not in COMPLETED), None)
        if failed is not None:
            probes += f" (first: {classify(failed, self.wait_s).text[:160]})"
        health = ""
        if self.spec.health:
            health = f", GET /health {self.health_status}" if self.health_status is not None else \
                f", GET /health no answer ({self.health_text[:80]})"
            if self.health_status not in (None, 200) and self.health_text:
                health += f" {self.health_text[:80]}"
            if self.health_before != 200:
                health += f" (before the load: {self.health_before or 'no answer'}, so not judged)"
        verdict = "then the server stopped serving other clients: " if self.stopped_serving else "afterwards "
        return verdict + probes + health


def _waited(spans: dict[str, tuple[float, float]], rid: str) -> float | None:
    """Seconds from `rid`'s send to its end (its error), when known."""
    return spans[rid][1] - spans[rid][0] if rid in spans else None


def _count(n: int, noun: str) -> str:
    """'1 answer', '2 answers'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _names(rids: list[str], outcomes: dict[str, Outcome]) -> str:
    """'r003, r007 ...: HTTP 503: ...' (the first few, and the first one's outcome)."""
    shown = ", ".join(rids[:SHOWN]) + (" ..." if len(rids) > SHOWN else "")
    return f"{shown}: {outcomes[rids[0]].text[:120]}"
