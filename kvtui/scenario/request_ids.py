"""Request ids chosen by the clients: the `request_ids` section of a scenario (`kvtui run --target` only).

YAML `request_ids: {send_as: [header], groups: [{ids: unique, size: 2}, {ids: duplicate, size: 2}], probes: 2}`.
Each request carries an id of its client's choosing, where a server takes one: the `x-request-id` header
(`header`), the body's `user` (OpenAI's end-user id), `request_id` (vLLM's field) or `rid` (SGLang's), or
the W3C `traceparent` header (`traceparent`: `00-<32 hex trace id>-<16 hex span id>-01`; the requests of
a group share the trace id, each has a span id of its own, as the calls of one traced job do: a gateway
that takes the trace id as the request id, as Dynamo did for SGLang, makes them collide). A server that keys its
own state by such an id (a map from id to the client waiting for the answer, a scheduler queue) mixes up
two requests that share one: an answer reaches the wrong client, a request is never answered, or the
server stops. vLLM once did (vLLM #27987 now adds a random suffix to the client's id); transformers
#48918 reports it for `transformers serve --continuous-batching`.

The requests, in arrival order, are dealt to `groups` in turn (the list repeats until the requests run
out): a `unique` group gives each of its requests an id of its own, a `duplicate` group gives all of
its requests one id, and a `near_duplicate` group gives its first request an id and each next one a
variant of it (`case`: upper case, `whitespace`: a trailing space, `suffix`: `-1` appended). A group's
requests must arrive together to overlap: put each group in one round of `process: rounds` (or one
burst). Ids are fixed by the seed: `kvtui-<6 hex>-<group>`.

After the load the audit sends `probes` requests with fresh ids, one at a time, and GET /health:
a server that answered before the duplicates and stops answering after them stopped serving others.
Every request waits at most `wait_s` seconds for its whole answer (and `--timeout`, if lower).
kvtui/remote/request_ids.py runs the audit.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal, Union

import pydantic
from pydantic import Field

from kvtui.request import ClientId as ClientId  # re-exported: it lives with the request it is sent with
from kvtui.scenario.base import MAX_SECONDS, Strict
from kvtui.scenario.errors import Problem

SEND_AS = ("header", "user", "request_id", "traceparent", "rid")
HEADER = "x-request-id"  # the header the `header` place sends (vLLM, transformers serve, SGLang read it)
TRACEPARENT = "traceparent"  # the W3C trace-context header the `traceparent` place sends
HEADER_PLACES = ("header", "traceparent")  # the places that are headers; the others are body fields
VARIANTS = ("case", "whitespace", "suffix")
MAX_GROUP = 64  # requests one group may hold


class UniqueIds(Strict):
    """`size` requests, each with an id no other request of the run carries: the clients that share the
    server with the colliding ones, and the baseline that shows the server answers at all."""

    ids: Literal["unique"]
    size: Annotated[int, Field(ge=1, le=MAX_GROUP)] = Field(1, description="requests in the group")


class DuplicateIds(Strict):
    """`size` requests that all carry the same id: two clients that chose one id, or a client that
    retries with the id it used (overlapping duplicates when they arrive together)."""

    ids: Literal["duplicate"]
    size: Annotated[int, Field(ge=2, le=MAX_GROUP)] = Field(2, description="requests sharing the one id")


class NearDuplicateIds(Strict):
    """A request with an id, then one request per variant of it: `case` (the id in upper case),
    `whitespace` (a trailing space; HTTP drops it from a header value, so in `x-request-id` it arrives as
    the same id: a duplicate there) and `suffix` (`-1` appended). A server that treats ids as opaque
    strings keeps them apart; one that normalizes or truncates them mixes the requests up."""

    ids: Literal["near_duplicate"]
    variants: Annotated[list[Literal[VARIANTS]], Field(min_length=1, max_length=len(VARIANTS))] = Field(
        list(VARIANTS), description="the variants sent beside the id, one request each")

    @pydantic.model_validator(mode="after")
    def _distinct(self):
        if len(set(self.variants)) != len(self.variants):
            raise Problem("a variant is listed twice", "list each of case, whitespace, suffix once", ("variants",))
        return self

    @property
    def size(self) -> int:
        """Requests in the group: the id's own and one per variant."""
        return 1 + len(self.variants)


IdGroup = Annotated[Union[UniqueIds, DuplicateIds, NearDuplicateIds], Field(discriminator="ids")]


class RequestIds(Strict):
    """Clients choose their own request ids (a `kvtui run --target` audit; a local run ignores the
    section). The requests, in arrival order, are dealt to `groups` in turn; a group's requests must
    arrive together (one round of `process: rounds`, or one burst) to overlap. Each request keeps its own
    passphrase, so the canary names a client that got another's answer; a request with no whole answer
    within `wait_s` is reported `hung`, one the server dropped (a 5xx, an error in the stream, a stream cut
    short) `lost`; a 4xx is a refusal, counted but no finding. After the load, `probes` requests with
    fresh ids go one at a time, then GET /health: failures there are `stopped_serving`."""

    send_as: Annotated[list[Literal[SEND_AS]], Field(min_length=1, max_length=len(SEND_AS))] = Field(
        ["header"], description="where each request carries its id: `header` (x-request-id), `user` (the body's "
                                "`user`), `request_id` (the body's `request_id`, vLLM's field), `rid` (the "
                                "body's `rid`, SGLang's field), `traceparent` (the W3C header: the group's "
                                "requests share its trace id, each has a span id of its own)")
    groups: Annotated[list[IdGroup], Field(min_length=1, max_length=1000)] = Field(
        [DuplicateIds(ids="duplicate", size=2)], description="the id groups the requests are dealt to, in "
                                                             "arrival order, repeated: see unique, duplicate, "
                                                             "near_duplicate")
    probes: Annotated[int, Field(ge=0, le=64)] = Field(
        2, description="requests with fresh ids sent one at a time after the load (the prompts of the first "
                       "requests), to see whether the server still serves")
    health: bool = Field(True, description="GET /health after the load (and the probes)")
    wait_s: Annotated[float, Field(gt=0, le=MAX_SECONDS)] = Field(
        30.0, description="the longest a request (or probe) may take, send to last chunk, before it counts as "
                          "hung; --timeout lowers it")

    @pydantic.model_validator(mode="after")
    def _distinct(self):
        if len(set(self.send_as)) != len(self.send_as):
            raise Problem("a place is listed twice", f"list each of {', '.join(SEND_AS)} once", ("send_as",))
        if all(isinstance(g, UniqueIds) for g in self.groups):
            raise Problem("every group is unique, so no two requests share an id and the audit tests nothing",
                          "add a group `{ids: duplicate, size: 2}` or `{ids: near_duplicate}`", ("groups",))
        return self


def base_id(seed: int, group: int) -> str:
    """The id of group `group` under the scenario seed: `kvtui-<6 hex of sha256(seed)>-<group, 3 digits>`."""
    digest = hashlib.sha256(f"kvtui:request_ids:{seed}".encode()).hexdigest()[:6]
    return f"kvtui-{digest}-{group:03d}"


def variant(value: str, name: str | None) -> str:
    """`value` as a near duplicate: upper case, a trailing space, `-1` appended; itself for None."""
    if name == "case":
        return value.upper()
    if name == "whitespace":
        return value + " "
    if name == "suffix":
        return value + "-1"
    return value


def traceparent(client_id: ClientId, span: str) -> str:
    """The W3C `traceparent` header value that carries `client_id`: `00-<trace id>-<span id>-01`.

    The trace id (32 lower-case hex) is a hash of the group's own id, so every request of a group shares
    it; a near duplicate's variant changes it as the variant changes an id: `case` upper-cases its hex
    (W3C asks for lower case: a server normalizes it, refuses it, or keeps it apart), `whitespace` adds a
    trailing space (HTTP drops it: the same trace id), `suffix` changes its last hex digit. The span id
    (16 hex) is a hash of `span` (the request's name in the run, e.g. `r004` or `probe0`), so each request
    has its own, as the spans of one trace do.
    """
    base = client_id.value
    if client_id.variant == "case":
        base = base.lower()
    elif client_id.variant == "whitespace":
        base = base[:-1]
    elif client_id.variant == "suffix":
        base = base[: -len("-1")]
    trace = hashlib.sha256(f"kvtui:trace:{base}".encode()).hexdigest()[:32]
    if client_id.variant == "case":
        trace = trace.upper()
    elif client_id.variant == "suffix":
        trace = trace[:-1] + format((int(trace[-1], 16) + 1) % 16, "x")
    span_id = hashlib.sha256(f"kvtui:span:{span}".encode()).hexdigest()[:16]
    return f"00-{trace}-{span_id}-01" + (" " if client_id.variant == "whitespace" else "")


def probe_id(seed: int, k: int) -> str:
    """A probe's fresh id, unlike any load request's: `kvtui-<6 hex>-probe-<k>`."""
    return base_id(seed, 0).rsplit("-", 1)[0] + f"-probe-{k}"


def assign_ids(spec: RequestIds, seed: int, count: int) -> list[ClientId]:
    """The client ids of `count` requests in arrival order: dealt to the groups in turn, the last group
    cut short when the requests run out (a duplicate group of one is then no duplicate)."""
    out: list[ClientId] = []
    group = 0
    while len(out) < count:
        for g in spec.groups:
            if len(out) >= count:
                break
            if isinstance(g, UniqueIds):
                for _ in range(g.size):
                    if len(out) < count:
                        out.append(ClientId(base_id(seed, group), group, "unique"))
                        group += 1
                continue
            names = [None, *g.variants] if isinstance(g, NearDuplicateIds) else [None] * g.size
            base = base_id(seed, group)
            for name in names[: count - len(out)]:
                out.append(ClientId(variant(base, name), group, g.ids, name))
            group += 1
    return out
