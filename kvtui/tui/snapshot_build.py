"""Freeze a DashboardState into a Snapshot (kept apart from state.py to keep both small)."""

from __future__ import annotations

from kvtui.metrics import percentile
from kvtui.tui.kv_map import map_view
from kvtui.tui.lanes import lane_views
from kvtui.tui.snapshot import (
    BlockView,
    EncoderView,
    Latency,
    PagedView,
    RequestView,
    SlotView,
    Snapshot,
    StateSlotView,
)
from kvtui.tui.state import MAX_TABLE_ROWS, REUSE_MARK_STEPS, TAIL_CHARS, DashboardState, _Request

FLAGGED_ROWS = 16  # finished rows with a leak or a detector report kept in the table ahead of others
FOCUS_BEFORE = 24  # characters of text kept before the passphrase a row's text_focus shows


def _one_line(text: str) -> str:
    return text.replace("\r", "").replace("\n", "⏎")


def text_focus(text: str, phrases) -> str:
    """The part of `text` that matters: TAIL_CHARS characters from FOCUS_BEFORE before the earliest of
    `phrases` it holds, "…" where text was left out; "" when it holds none of them."""
    upper = text.upper()  # found as the canary finds them: ignoring case
    found = [i for i in (upper.find(p.upper()) for p in phrases if p) if i >= 0]
    if not found:
        return ""
    start = max(min(found) - FOCUS_BEFORE, 0)
    end = start + TAIL_CHARS
    return ("…" if start else "") + _one_line(text[start:end]) + ("…" if end < len(text) else "")


def _request_view(state: DashboardState, r: _Request) -> RequestView:
    tail = _one_line(r.text[-TAIL_CHARS:])
    focus = text_focus(r.text, tuple(r.matched)) or text_focus(r.text, (r.passphrase,))
    return RequestView(
        id=r.id, status=r.status, slot=r.slot, cache_len=r.cache_len, capacity=state.capacity,
        prompt_tokens=r.prompt_tokens, generated_tokens=r.generated, max_new_tokens=r.max_new_tokens,
        ttft_s=r.ttft_s, text_tail=tail, passphrase=r.passphrase, leaked=tuple(r.leaked),
        leak_sources=tuple(s for s in r.leaked.values() if s), echoed=bool(r.echoed),
        contamination=tuple(r.contamination), attention_mass=r.attention_mass, color=r.color, tenant=r.tenant,
        blocks=r.blocks, text_focus=focus, matched=tuple(r.matched), sampling=_tags(r),
    )


def table_ids(state: DashboardState) -> list[str]:
    """Row order: running (by slot), flagged finished (newest first), waiting (arrival order), other
    finished (newest first); at most MAX_TABLE_ROWS."""
    requests = state.requests
    ids = sorted(state.active, key=lambda i: (requests[i].slot is None, requests[i].slot or 0, i))
    seen = set(ids)
    flagged = [i for i in reversed(state.flagged) if i not in seen][:FLAGGED_ROWS]
    ids += flagged
    seen.update(flagged)
    for group in (state.waiting, state.recent_finished):
        for i in group:
            if len(ids) >= MAX_TABLE_ROWS:
                return ids
            if i not in seen:
                ids.append(i)
                seen.add(i)
    return ids[:MAX_TABLE_ROWS]


def _slots(state: DashboardState) -> tuple[SlotView, ...]:
    views = []
    for index in range(state.num_slots):
        owner = state.slot_owner.get(index)
        reused_at = state.slot_reused_step.get(index)
        views.append(SlotView(
            index=index, owner=owner, cache_len=state.slot_cache.get(index, 0) if owner else 0,
            capacity=state.capacity, color=state.requests[owner].color if owner in state.requests else -1,
            just_reused=owner is not None and reused_at is not None and state.step - reused_at < REUSE_MARK_STEPS,
            previous_owner=state.slot_prev.get(index),
            audio=state.requests[owner].audio if owner in state.requests else None,
            image=state.requests[owner].image if owner in state.requests else None,
        ))
    return tuple(views)


def _blocks(state: DashboardState) -> tuple[BlockView, ...]:
    """The block map: each block's reference count (from the step's block state), whether it is cached,
    and its owner (the first running request listing it), coloured by owner or by the owner's tenant."""
    owners: dict[int, str] = {}
    for rid, blocks in state.block_tables.items():
        for b in blocks:
            owners.setdefault(b, rid)
    views = []
    for index, char in enumerate(state.block_state):
        if char == "_":
            continue
        owner = owners.get(index)
        r = state.requests.get(owner) if owner else None
        if r is None:
            color = -1
        else:
            color = state.tenants.get(r.tenant, r.color) if state.tenants else r.color
        refs = 0 if char in ".c" else 10 if char == "+" else int(char)
        views.append(BlockView(index, refs, char == "c", owner, color))
    return tuple(views)


def _paged(state: DashboardState) -> PagedView | None:
    m = state.metrics
    if state.kv != "paged":
        return None
    last = m.last
    offload = None
    if last is not None and last.kv_offload_capacity is not None:
        offload = (m.offload_hits, m.offload_stores, last.kv_offload_blocks, last.kv_offload_capacity)
    return PagedView(state.block_size, m.prefix_queries, m.prefix_hits, m.cross_tenant_hits, m.num_preemptions,
                     bool(state.tenants), offload)


def _latency(state: DashboardState, name: str) -> Latency:
    """p50/p95 of TTFT (from first-token events, so it shows before requests finish) or of
    Metrics.tpot (per finished request); recomputed only when a value was added."""
    values = state.ttft_live if name == "ttft" else getattr(state.metrics, name)
    cached = state.latency_cache.get(name)
    if cached is None or cached[0] != len(values):
        cached = (len(values), Latency(percentile(values, 50), percentile(values, 95)))
        state.latency_cache[name] = cached
    return cached[1]


def build_snapshot(state: DashboardState) -> Snapshot:
    """The immutable view of `state` (see Snapshot for the fields)."""
    header = state.header
    m = state.metrics
    last = state.last_step
    return Snapshot(
        seq=state.seq,
        scenario=header.scenario.get("name", "?") if header else "?",
        model=header.model.id if header else "?", model_kind=header.model.kind if header else None,
        dtype=header.model.dtype if header else "?",
        clock=header.clock if header else "?",
        layout=last.layout if last else (header.engine.get("layout", "?") if header else "?")
        if not (header and header.target) else f"{header.engine.get('api', '?')} API",
        step=state.step, t=state.t,
        active_faults=state.active_faults, isolation_faults=state.isolation_faults,
        slots=_slots(state),
        requests=tuple(_request_view(state, state.requests[i]) for i in table_ids(state)),
        arrived=len(state.requests), running=len(state.active), waiting=len(state.waiting),
        finished=state.finished, rejected=state.rejected,
        prefill_rate=m.prefill_1s.rate(), decode_rate=m.decode_1s.rate(),
        prefill_history=tuple(state.prefill_history), decode_history=tuple(state.decode_history),
        padding_ratio=last.padding_ratio if last else 0.0, key_padding_ratio=last.key_padding_ratio if last else 0.0,
        padding_history=tuple(state.padding_history),
        kv_usage=last.kv_usage if last else 0.0, occupancy=last.occupancy if last else 0.0,
        kv_history=tuple(state.kv_history),
        ttft=_latency(state, "ttft"), tpot=_latency(state, "tpot"),
        contamination=tuple(state.contamination),
        by_detector=tuple(sorted(state.by_detector.items())), by_kind=tuple(sorted(state.by_kind.items())),
        log=tuple(state.log),
        done=state.summary is not None, summary=state.summary,
        findings=tuple(sorted(m.findings.by_kind().items())),
        reference=(m.reference.checked, m.reference.skipped, m.reference.pending) if m.reference else None,
        kv=state.kv, blocks=_blocks(state) if state.kv == "paged" else (), paged=_paged(state),
        server=state.server.view({rid: r.color for rid, r in state.requests.items()}) if state.server else None,
        pace=state.pace, encoder=_encoder(last),
        prefix_caching=bool(header.engine.get("prefix_caching")) if header else False,
        state_slots=_state_slots(state, last), kv_map=map_view(state.kv_map, state, last),
        lanes=lane_views(state.lanes, {rid: r.color for rid, r in state.requests.items()}, MAX_TABLE_ROWS),
    )


def _state_slots(state: DashboardState, last) -> tuple[StateSlotView, ...]:
    """A hybrid's recurrent-state slots after the last step (StepEvent.state_slot_map), coloured by owner; ()
    for other models."""
    if last is None or not getattr(last, "state_slot_map", ()):
        return ()
    return tuple(StateSlotView(slot, owner, checkpoint,
                               state.requests[owner].color if owner in state.requests else -1)
                 for slot, owner, checkpoint in last.state_slot_map)


def _encoder(last) -> EncoderView | None:
    """The encoder cache's figures of the last step (a speech model's run), else None."""
    if last is None or getattr(last, "encoder_entries", None) is None:
        return None
    return EncoderView(last.encoder_entries, last.encoder_capacity or 0, last.encoder_referenced or 0,
                       last.encoder_hits or 0, last.encoder_misses or 0, last.encoder_bytes or 0)


def _tags(r) -> str:
    """A request row's tags: its LoRA adapter (lora:<name>), its pictures (img:<name>) and its per-row
    sampling state ("pen bias")."""
    tags = [f"lora:{r.lora}"] if r.lora else []
    tags += [f"img:{name.removesuffix('.png')}" for name in (r.image or "").split(",") if name]
    return " ".join([*tags, r.sampling] if r.sampling else tags)
