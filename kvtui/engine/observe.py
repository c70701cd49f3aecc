"""What a step actually read: slot-taint and attention-flow measurements over the KV pool's writer tags.

The pool tags every cache position with the serial of the request that last wrote it (UNWRITTEN for
a position never written, PAD_WRITTEN for a pad cached by the fp16_cache fault). For each query of a
step, these functions compare the tags of the keys it could see (slot_taint) or actually weighted
(attention_flow) with the query's own request. With isolation intact both are exactly zero.
"""

from __future__ import annotations

import torch

from kvtui.engine.batching import PAD_OWNER, BatchTensors
from kvtui.events import FlowEntry, NonfiniteEntry, TaintEntry

UNWRITTEN = -1
PAD_WRITTEN = -2


def nonfinite_reads(batch: BatchTensors, pool, writers: torch.Tensor, chunks: list[int], names: dict[int, str],
                    request_ids: list[str]) -> list[NonfiniteEntry]:
    """For each chunk index in `chunks` (those whose logits were not finite): the keys its queries were
    allowed to read whose K or V holds NaN or inf in any layer, and who wrote them.

    Args:
        pool: the KVPool (keys/values per layer [S, Hkv, L, D]); writers: [R, K] from key_writers.
    """
    reports = []
    q_owner = batch.query_owner.cpu()
    for index in chunks:
        rows, cols = (q_owner == index).nonzero(as_tuple=True)
        row = int(rows[0])
        seen = batch.allowed[row, cols].cpu().any(dim=0).nonzero(as_tuple=True)[0]  # key columns it may read
        slots, positions = batch.key_slot[row, seen], batch.key_pos[row, seen]
        bad = torch.zeros(len(seen), dtype=torch.bool)
        for keys, values in zip(pool.keys, pool.values):
            bad |= (~torch.isfinite(keys[slots, :, positions]) | ~torch.isfinite(values[slots, :, positions])).flatten(1).any(1).cpu()
        if not bad.any():
            continue
        serials = writers[row, seen[bad]]
        counts = torch.unique(serials, return_counts=True)
        order = torch.argsort(counts[1], descending=True, stable=True)
        sources = tuple(_name(int(counts[0][i]), names) for i in order)
        examples = tuple((int(slots[bad][j]), int(positions[bad][j]), _name(int(serials[j]), names))
                         for j in range(min(5, int(bad.sum()))))
        reports.append(NonfiniteEntry(request_id=request_ids[index], sources=sources, positions=int(bad.sum()),
                                      examples=examples))
    return reports


def _name(serial: int, names: dict[int, str]) -> str:
    if serial == UNWRITTEN:
        return "<unwritten>"
    if serial == PAD_WRITTEN:
        return "<pad>"
    return names.get(serial, f"#{serial}")


OTHER = -99  # an expected-writer cell no query compares with (another request's key column)


def expected_writers(batch: BatchTensors, own: list[int], borrowed: list[list[int]]) -> torch.Tensor:
    """[R, K] the writer serial each request's own key columns may hold (for slot_taint and
    attention_flow): `borrowed[i]` for the first positions of chunk i (KV it did not compute itself: a
    prefix-cache hit, or the prompt of a forked sequence), its own serial `own[i]` after them."""
    expected = torch.full(batch.key_owner.shape, OTHER, dtype=torch.long)
    for index, seg in enumerate(batch.segments):
        expected[seg.row, seg.key_start : seg.key_start + seg.end_pos] = own[index]
        taken = borrowed[index][: seg.end_pos]
        if taken:
            expected[seg.row, seg.key_start : seg.key_start + len(taken)] = torch.tensor(taken)
    return expected


def key_writers(writer: torch.Tensor, batch: BatchTensors) -> torch.Tensor:
    """[R, K] serial of the request that wrote each gathered key (pool tags [S, L] -> batch keys)."""
    return writer[batch.key_slot.cpu(), batch.key_pos.cpu()]


def _expected(batch: BatchTensors, q_owner: torch.Tensor, query_serial: torch.Tensor,
              expected: torch.Tensor | None) -> torch.Tensor:
    """[R, Q, K] (or [R, Q, 1]) the writer each query may find at each key: its own request's serial,
    or, for its own request's key columns, `expected` [R, K] (paged KV with prefix caching: a block
    reused from the cache was written by the request that computed it)."""
    if expected is None:
        return query_serial[:, :, None]
    mine = batch.key_owner.cpu()[:, None, :] == q_owner[:, :, None]
    return torch.where(mine, expected[:, None, :], query_serial[:, :, None])


def slot_taint(batch: BatchTensors, writers: torch.Tensor, own: list[int], names: dict[int, str],
               request_ids: list[str], expected: torch.Tensor | None = None) -> list[TaintEntry]:
    """Requests whose allowed (unmasked) keys include positions written by someone else.

    Args:
        batch: the step's tables; writers: [R, K] from key_writers; own: serial of each chunk;
        names: serial -> request id; request_ids: request id of each chunk.
        expected: [R, K] writer serial each of a request's own key columns may hold (paged KV: the
            writers of the cached blocks it reused, its own serial elsewhere); None: its own serial.
    """
    q_owner = batch.query_owner.cpu()
    own_t = torch.tensor(own, dtype=torch.long)
    query_serial = torch.where(q_owner == PAD_OWNER, torch.full_like(q_owner, -99), own_t[q_owner.clamp(min=0)])
    allowed_writer = _expected(batch, q_owner, query_serial, expected)
    bad = batch.allowed.cpu() & (writers[:, None, :] != allowed_writer) & (q_owner != PAD_OWNER)[:, :, None]
    reports = []
    if not bad.any():
        return reports
    for chunk_index, request_id in enumerate(request_ids):
        cells = bad & (q_owner == chunk_index)[:, :, None]
        count = int(cells.sum())
        if not count:
            continue
        r, _, k = cells.nonzero(as_tuple=True)
        serials = writers[r, k]
        values, counts = torch.unique(serials, return_counts=True)
        order = torch.argsort(counts, descending=True, stable=True)
        sources = tuple(_name(int(values[i]), names) for i in order)
        seen, examples = set(), []
        for rr, kk in zip(r.tolist(), k.tolist()):
            key = (int(batch.key_slot[rr, kk]), int(batch.key_pos[rr, kk]))
            if key not in seen:
                seen.add(key)
                examples.append((*key, _name(int(writers[rr, kk]), names)))
            if len(examples) == 5:
                break
        reports.append(TaintEntry(request_id=request_id, sources=sources, positions=count, examples=tuple(examples)))
    return reports


def attention_flow(batch: BatchTensors, attn_sum: torch.Tensor, terms: int, writers: torch.Tensor, own: list[int],
                   names: dict[int, str], request_ids: list[str],
                   expected: torch.Tensor | None = None) -> list[FlowEntry]:
    """Per request, the attention mass on keys written by others (see kvtui.events.FlowEntry).

    Args:
        attn_sum: [R, Q, K] attention probabilities summed over `terms` (layers x heads).
        expected: as in slot_taint (paged KV: the writers of reused cached blocks are not "others").
    """
    probs = attn_sum.cpu() / max(terms, 1)
    q_owner = batch.query_owner.cpu()
    key_owner = batch.key_owner.cpu()
    reports = []
    for chunk_index, request_id in enumerate(request_ids):
        rows, cols = (q_owner == chunk_index).nonzero(as_tuple=True)
        p = probs[rows, cols]  # [n, K]
        w = writers[rows]  # [n, K]
        allowed_writer = own[chunk_index]
        if expected is not None:
            allowed_writer = torch.where(key_owner[rows] == chunk_index, expected[rows], own[chunk_index])
        foreign = (w != allowed_writer) & (w >= 0)
        padlike = w < 0
        foreign_mass = (p * foreign).sum(dim=1)
        pad_mass = (p * padlike).sum(dim=1)
        top = None
        if float(foreign_mass.max()) > 0:  # False for NaN: the non-finite report names the source then
            by_writer: dict[int, float] = {}
            for serial in torch.unique(w[foreign]).tolist():
                by_writer[serial] = float((p * (w == serial)).sum())
            top = _name(max(by_writer, key=by_writer.get), names)
        reports.append(FlowEntry(request_id=request_id, foreign_mass=float(foreign_mass.max()),
                                 pad_mass=float(pad_mass.max()), top_source=top))
    return reports
