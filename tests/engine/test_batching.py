"""Mask, position-id and KV-map tables for both layouts, written out as strings ("1100")."""

import torch

from kvtui.engine.batching import PAD_OWNER, build_batch
from kvtui.engine.request import RequestState
from kvtui.engine.scheduler import ScheduledChunk, StepPlan


def chunk(rid, slot, start, tokens, samples=True):
    request = RequestState(request_id=rid, prompt_ids=list(tokens))
    phase = "decode" if start > 0 and len(tokens) == 1 else "prefill"
    return ScheduledChunk(request, slot, start, tuple(tokens), samples, phase)


def rows(allowed_2d):
    return ["".join("1" if v else "0" for v in row) for row in allowed_2d.tolist()]


# Row A decodes with 3 cached tokens (end 4); row B prefills 2 tokens into a fresh slot (end 2):
# B's cache is shorter than the longest in the batch, so its key columns 2-3 are cache padding.
PLAN = StepPlan((chunk("A", 1, 3, [11]), chunk("B", 0, 0, [21, 22])))


def test_padded_right_mask_positions_and_maps():
    b = build_batch(PLAN, layout="padded", padding_side="right", pad_token_id=0)
    assert b.input_ids.tolist() == [[11, 0], [21, 22]]
    assert b.position_ids.tolist() == [[3, 0], [0, 1]]
    assert rows(b.allowed[0]) == ["1111", "0000"]  # A: sees its 4 keys; pad query sees nothing
    assert rows(b.allowed[1]) == ["1000", "1100"]  # B: causal, cache padding (cols 2-3) hidden
    assert b.key_slot.tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]
    assert b.key_pos.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]  # B's columns 2-3: its slot's unused region
    assert b.key_owner.tolist() == [[0, 0, 0, 0], [1, 1, PAD_OWNER, PAD_OWNER]]
    assert list(zip(b.write_slot.tolist(), b.write_pos.tolist())) == [(1, 3), (0, 0), (0, 1)]
    assert list(zip(b.sample_row.tolist(), b.sample_col.tolist())) == [(0, 0), (1, 1)]
    assert b.padded_positions == 1  # one pad query position out of 4
    assert b.key_padded_positions == 2 * 2  # B's 2 queries x 2 padded key columns


def test_padded_left_mask_and_positions():
    b = build_batch(PLAN, layout="padded", padding_side="left", pad_token_id=0)
    assert b.input_ids.tolist() == [[0, 11], [21, 22]]
    assert b.position_ids.tolist() == [[0, 3], [0, 1]]
    assert rows(b.allowed[0]) == ["0000", "1111"]
    assert rows(b.allowed[1]) == ["1000", "1100"]
    assert list(zip(b.sample_row.tolist(), b.sample_col.tolist())) == [(0, 1), (1, 1)]


def test_packed_block_diagonal_mask():
    b = build_batch(PLAN, layout="packed")
    assert b.input_ids.tolist() == [[11, 21, 22]]
    assert b.position_ids.tolist() == [[3, 0, 1]]
    assert rows(b.allowed[0]) == ["111100", "000010", "000011"]
    assert b.key_slot.tolist() == [[1, 1, 1, 1, 0, 0]]
    assert b.key_pos.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert b.query_owner.tolist() == [[0, 1, 1]]
    assert b.sample_col.tolist() == [0, 2]
    assert b.padded_positions == 0
    assert b.key_padded_positions == 1 * 2 + 2 * 4  # A ignores B's 2 keys, B ignores A's 4


def test_additive_mask_uses_finite_minimum():
    b = build_batch(PLAN, layout="padded")
    mask = b.additive_mask(torch.float32)
    assert mask.shape == (2, 1, 2, 4)
    assert mask[1, 0, 0].tolist() == [0.0, torch.finfo(torch.float32).min, torch.finfo(torch.float32).min,
                                      torch.finfo(torch.float32).min]
    assert torch.isfinite(mask).all()


def test_freshly_reused_slot_starts_at_position_zero():
    # slot 2 held a 5-token request before; the new owner starts at 0 and must not see positions 2..4
    plan = StepPlan((chunk("old-neighbour", 0, 4, [5]), chunk("new", 2, 0, [7, 8])))
    b = build_batch(plan, layout="padded", padding_side="right")
    assert b.position_ids[1].tolist() == [0, 1]
    assert rows(b.allowed[1]) == ["10000", "11000"]
    assert b.key_slot[1].tolist() == [2] * 5
    assert b.key_pos[1, :2].tolist() == [0, 1]
    p = build_batch(plan, layout="packed")
    assert rows(p.allowed[0])[1:] == ["0000010", "0000011"]
    assert p.key_pos.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
