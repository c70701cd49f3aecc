"""The paged KV bookkeeping on its own (no model): keys, reference counts, LRU eviction, admission,
prefix hits, and what each paged fault changes in it. Tables of cases, expected values worked out by
hand from vLLM's rules (not computed by the code under test)."""

import hashlib
import json

import pytest

from kvtui.engine.block_manager import NONE_KEY, BlockManager, BlockPool, block_key, chain_keys


def sha(parent: bytes, tokens, extra=()) -> bytes:
    """The documented key: sha256 of the compact JSON [parent hex, token ids, extra keys]."""
    return hashlib.sha256(json.dumps([parent.hex(), list(tokens), list(extra)], separators=(",", ":")).encode()).digest()


def test_block_key_is_sha256_of_the_documented_encoding():
    assert NONE_KEY == hashlib.sha256(b"kvtui:prefix-cache:none").digest()
    first = block_key(None, [1, 2, 3], ("salt-a",))
    assert first == sha(NONE_KEY, [1, 2, 3], ["salt-a"])
    assert block_key(first, [4, 5, 6]) == sha(first, [4, 5, 6])


@pytest.mark.parametrize("a,b,same", [
    (dict(tokens=[1, 2, 3, 4], salt=None), dict(tokens=[1, 2, 3, 4], salt=None), True),
    (dict(tokens=[1, 2, 3, 4], salt="t0"), dict(tokens=[1, 2, 3, 4], salt="t1"), False),  # salted apart
    (dict(tokens=[1, 2, 3, 4], salt="t0"), dict(tokens=[1, 2, 3, 4], salt=None), False),
    (dict(tokens=[1, 2, 3, 4], salt=None), dict(tokens=[1, 2, 3, 5], salt=None), False),
])
def test_chain_keys_equal_exactly_for_equal_tokens_and_salt(a, b, same):
    ka, kb = chain_keys(a["tokens"], 2, a["salt"]), chain_keys(b["tokens"], 2, b["salt"])
    assert len(ka) == len(kb) == 2
    assert (ka == kb) is same


def test_the_salt_sits_in_the_first_block_and_the_chain_carries_it():
    keys = chain_keys([1, 2, 3, 4], 2, "s")
    assert keys[0] == sha(NONE_KEY, [1, 2], ["s"])
    assert keys[1] == sha(keys[0], [3, 4])  # no salt of its own: inherited through the parent


def test_same_block_at_another_prefix_gets_another_key_unless_the_parent_is_left_out():
    a, b = chain_keys([1, 2, 7, 7], 2, None), chain_keys([3, 4, 7, 7], 2, None)
    assert a[1] != b[1]
    a, b = chain_keys([1, 2, 7, 7], 2, None, parent=False), chain_keys([3, 4, 7, 7], 2, None, parent=False)
    assert a[1] == b[1] == sha(NONE_KEY, [7, 7])


# -- the pool: reference counts and the LRU free queue -------------------------------------------------
@pytest.mark.parametrize("ops,expected_free_order", [
    ([], [1, 2, 3, 4, 5]),  # block 0 is the null block, never free
    ([("alloc", 2)], [3, 4, 5]),  # head first
    ([("alloc", 2), ("free", [1, 2])], [3, 4, 5, 2, 1]),  # back to the tail, last block first
    ([("alloc", 3), ("free", [1]), ("free", [3, 2])], [4, 5, 1, 2, 3]),
    ([("alloc", 2), ("touch", [1]), ("free", [1])], [3, 4, 5]),  # held twice: one free keeps it in use
    ([("alloc", 2), ("free", [1, 2]), ("touch", [2])], [3, 4, 5, 1]),  # a hit takes it out of the queue
])
def test_free_queue_order(ops, expected_free_order):
    pool = BlockPool(6)
    for op, arg in ops:
        getattr(pool, {"alloc": "allocate", "free": "free", "touch": "touch"}[op])(arg)
    assert list(pool.free_queue) == expected_free_order


def test_reference_counts_and_an_outright_free():
    pool = BlockPool(4)
    a = pool.allocate(1)
    pool.touch(a)  # a second holder
    pool.free(a)
    assert pool.blocks[a[0]].ref_cnt == 1 and a[0] not in pool.free_queue
    pool.free(a, outright=True)  # the block_refcount fault: freed while still held
    assert pool.blocks[a[0]].ref_cnt == 0 and a[0] in pool.free_queue


def test_allocating_a_cached_free_block_evicts_it_least_recently_used_first():
    m = BlockManager(5, 2, caching=True)  # 4 usable blocks
    assert m.admit("a", [1, 2, 3, 4, 9]).hit_tokens == 0  # 3 blocks: 1, 2, 3
    m.commit("a", [1, 2, 3, 4, 9], 5, prompt_len=5)  # blocks 1 and 2 full -> cached
    m.free("a")
    assert list(m.pool.free_queue) == [4, 3, 2, 1]
    assert len(m.pool.cached) == 2
    m.admit("b", [7, 7, 7])  # 2 blocks: 4, then 3 (never cached)
    assert m.pool.evictions == 0 and m.table("b") == (4, 3)
    m.admit("c", [8, 8, 8])  # 2 blocks: 2 (cached: evicted), 1
    assert m.pool.evictions == 2 and m.table("c") == (2, 1) and m.pool.cached == {}


# -- admission and prefix hits ----------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len,block_size,cached_prefix,hit", [
    (9, 4, 8, 8),  # two full blocks cached, the 9th token computed
    (8, 4, 8, 4),  # a hit never covers the last prompt token: the second block is recomputed
    (5, 4, 8, 4),
    (4, 4, 8, 0),
    (17, 16, 16, 16),
    (16, 16, 16, 0),
    (3, 1, 3, 2),
])
def test_hits_are_whole_blocks_short_of_the_last_prompt_token(prompt_len, block_size, cached_prefix, hit):
    m = BlockManager(40, block_size, caching=True)
    tokens = list(range(100, 100 + 40))
    m.admit("w", tokens[:cached_prefix] + [1])
    m.commit("w", tokens[:cached_prefix] + [1], cached_prefix, prompt_len=cached_prefix + 1)
    m.free("w")
    admission = m.admit("r", tokens[:prompt_len])
    assert admission.hit_tokens == hit
    assert m.queries == cached_prefix + 1 + prompt_len and m.hits == hit
    assert all(r.verified for r in admission.reused)


def test_admission_keeps_the_watermark_free():
    m = BlockManager(11, 4, watermark=0.2)  # 10 usable, 2 kept free
    assert m.watermark_blocks == 2
    assert m.admit("a", [1] * 24) is not None  # 6 blocks, 4 left
    assert m.admit("b", [1] * 12) is None  # 3 more would leave 1 < 2
    assert m.admit("b", [1] * 8) is not None  # 2 more leave 2
    assert m.fits(32) and not m.fits(33)  # 8 blocks = 10 usable - 2


def test_ensure_grows_the_table_or_says_none():
    m = BlockManager(4, 2)  # 3 usable
    m.admit("a", [1, 2, 3])
    assert m.ensure("a", 4) == (1, 2)
    assert m.ensure("a", 5) == (1, 2, 3)
    assert m.ensure("a", 7) is None and m.table("a") == (1, 2, 3)


def test_state_string():
    m = BlockManager(6, 2, caching=True)
    m.admit("a", [1, 2, 3])
    m.commit("a", [1, 2, 3], 3, prompt_len=3)
    m.admit("b", [1, 2, 9])  # hits block 1
    m.free("a")
    assert m.state() == "_1.1.."  # block 1 held by b, block 2 (a's partial) free, b's block 3
    m.free("b")
    assert m.state() == "_c...."  # block 1 still cached, free; the others free


# -- faults ---------------------------------------------------------------------------------------------
def _writer_then_reader(faults, writer, reader, block_size=2):
    m = BlockManager(20, block_size, caching=True)
    m.faults = frozenset(faults)
    wtokens, wsalt = writer
    m.admit("w", wtokens, salt=wsalt, tenant="tw")
    m.commit("w", wtokens, len(wtokens), prompt_len=len(wtokens))
    rtokens, rsalt = reader
    return m, m.admit("r", rtokens, salt=rsalt, tenant="tr")


@pytest.mark.parametrize("faults,hit,verified", [
    ((), 0, None),  # salted apart: no hit
    (("unsalted_prefix",), 4, False),  # the other tenant's blocks, reused
])
def test_unsalted_prefix_shares_blocks_across_salts(faults, hit, verified):
    _, a = _writer_then_reader(faults, ([1, 2, 3, 4, 5], "salt-a"), ([1, 2, 3, 4, 6], "salt-b"))
    assert a.hit_tokens == hit
    if verified is not None:
        assert {r.verified for r in a.reused} == {verified}
        assert {r.origin.writer for r in a.reused} == {"w"} and {r.origin.tenant for r in a.reused} == {"tw"}


@pytest.mark.parametrize("faults,hit", [((), 0), (("prefix_key_no_parent",), 2)])
def test_prefix_key_no_parent_matches_a_block_seen_under_another_prefix(faults, hit):
    # the reader's first block [7, 8] was the writer's second block (after [1, 2])
    _, a = _writer_then_reader(faults, ([1, 2, 7, 8, 9], None), ([7, 8, 5], None))
    assert a.hit_tokens == hit
    assert all(not r.verified for r in a.reused)


@pytest.mark.parametrize("reader_salt,hit", [("salt-a", 2), ("salt-b", 0)])
def test_prefix_key_no_parent_keeps_the_salt_in_every_block(reader_salt, hit):
    """Without its parent, a block's key still holds the partition: the block [7, 8] a tenant cached after
    [1, 2] is matched by the same tenant after [5, 6], never by another tenant that cached its own [5, 6]."""
    m, _ = _writer_then_reader(("prefix_key_no_parent",), ([1, 2, 7, 8, 9], "salt-a"), ([5, 6, 3], reader_salt))
    m.commit("r", [5, 6, 3], 3, prompt_len=3)
    m.free("r")
    probe = m.admit("p", [5, 6, 7, 8, 4], salt=reader_salt, tenant="tp")
    assert probe.hit_tokens == 2 + hit
    assert [r.origin.writer for r in probe.reused] == ["r"] + ["w"] * (hit // 2)


@pytest.mark.parametrize("faults,hit,partial", [((), 4, False), (("shared_partial_block",), 6, True)])
def test_shared_partial_block_hands_out_the_partial_last_block(faults, hit, partial):
    prompt = [1, 2, 3, 4, 5, 6, 7]  # block size 4: one full block, a partial one of 3 tokens
    m, a = _writer_then_reader(faults, (prompt, None), (prompt, None), block_size=4)
    assert a.hit_tokens == hit  # the partial block gives 2 of its 3 tokens (the last is computed)
    assert (m.table("w")[1] == m.table("r")[1]) is partial  # the writer's partial block, in both tables


def test_block_refcount_frees_a_block_another_request_still_holds():
    for faults, reused_free in (((), False), (("block_refcount",), True)):
        m, a = _writer_then_reader(faults, ([1, 2, 3, 4, 5], None), ([1, 2, 3, 4, 6], None))
        assert a.hit_tokens == 4
        m.free("w")
        shared = m.table("r")[:2]
        assert all(b in m.pool.free_queue for b in shared) is reused_free
        assert all(m.pool.blocks[b].ref_cnt == (0 if reused_free else 1) for b in shared)
