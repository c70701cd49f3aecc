"""kvtui's C++ decode-attention kernel (kvtui/engine/cpu_kernels.py): against transformers' own eager
attention, the same row alone and in any batch, the engine on it and on SDPA, and the fallback where no
compiler builds it."""

import pytest
import torch
from helpers import make_engine
from test_masked_keys import GREEDY, reference_tokens
from transformers.models.llama.modeling_llama import eager_attention_forward

from kvtui.engine import cpu_kernels
from kvtui.models import build_tiny

needs_kernel = pytest.mark.skipif(cpu_kernels.problem() is not None,
                                  reason=f"kvtui's decode kernel cannot run here: {cpu_kernels.problem()}")


@pytest.fixture(scope="module")
def oracle():
    """A separate tiny-llama instance (same seed, same weights) on transformers' eager attention."""
    model, _ = build_tiny("tiny-llama")
    model.set_attn_implementation("eager")
    return model.eval()


class Groups(torch.nn.Module):
    """What transformers' eager_attention_forward reads off its module: the grouped-query factor."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def pools(slots=6, kv_heads=3, length=80, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn((slots, kv_heads, length, head_dim), generator=gen),
            torch.randn((slots, kv_heads, length, head_dim), generator=gen))


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 16), (6, 1, 48)])
def test_each_row_equals_transformers_eager_attention_over_its_own_keys(heads, kv_heads, head_dim):
    """Rows reading slots in any order (one slot twice), ends from 1 to the pool's length: each row's output
    is transformers' eager attention of its query over pool[slot, :, :end], within 2e-6."""
    k_pool, v_pool = pools(kv_heads=kv_heads, head_dim=head_dim)
    slots, ends = torch.tensor([4, 0, 2, 2, 5]), torch.tensor([17, 1, 80, 33, 64])
    query = torch.randn((5, 1, heads, head_dim), generator=torch.Generator().manual_seed(1)).transpose(1, 2)
    out = cpu_kernels.decode_attention(query, k_pool, v_pool, slots, ends, head_dim ** -0.5)
    assert out.shape == (5, 1, heads, head_dim)
    for r, (slot, end) in enumerate(zip(slots.tolist(), ends.tolist())):
        expected, _ = eager_attention_forward(Groups(heads // kv_heads), query[r : r + 1], k_pool[slot : slot + 1, :, :end],
                                              v_pool[slot : slot + 1, :, :end], None, head_dim ** -0.5)
        torch.testing.assert_close(out[r : r + 1], expected, rtol=0, atol=2e-6)


@needs_kernel
def test_the_flow_sums_are_transformers_probabilities_summed_over_heads_and_added():
    """attention_flow's sums: each row's probabilities (transformers' eager weights) summed over the 9 heads
    and added to what the buffer held, within 2e-6; positions past a row's end keep exactly what they held."""
    k_pool, v_pool = pools(length=96)  # pool length, flow width and longest row all differ
    query = torch.randn((3, 9, 1, 64), generator=torch.Generator().manual_seed(4))
    slots, ends = torch.tensor([2, 0, 5]), torch.tensor([12, 80, 45])
    flow = torch.full((3, 88), 0.5)
    cpu_kernels.decode_attention(query, k_pool, v_pool, slots, ends, 0.125, flow=flow)
    for r, (slot, end) in enumerate(zip(slots.tolist(), ends.tolist())):
        _, weights = eager_attention_forward(Groups(3), query[r : r + 1], k_pool[slot : slot + 1, :, :end],
                                             v_pool[slot : slot + 1, :, :end], None, 0.125)  # [1, 9, 1, end]
        torch.testing.assert_close(flow[r, :end], 0.5 + weights[0, :, 0].sum(dim=0), rtol=0, atol=2e-6)
        assert torch.equal(flow[r, end:], torch.full((88 - end,), 0.5))


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    """Batch invariance by construction: a row's output does not depend on which rows share the call, their
    order, or how many threads split them."""
    k_pool, v_pool = pools()
    query = torch.randn((4, 9, 1, 64), generator=torch.Generator().manual_seed(2))
    slots, ends = torch.tensor([1, 3, 0, 5]), torch.tensor([40, 7, 80, 61])
    together = cpu_kernels.decode_attention(query, k_pool, v_pool, slots, ends, 0.125)
    for r in range(4):
        alone = cpu_kernels.decode_attention(query[r : r + 1], k_pool, v_pool, slots[r : r + 1], ends[r : r + 1], 0.125)
        assert torch.equal(alone[0], together[r])
    reordered = cpu_kernels.decode_attention(query.flip(0), k_pool, v_pool, slots.flip(0), ends.flip(0), 0.125)
    assert torch.equal(reordered.flip(0), together)
    threads = torch.get_num_threads()
    try:  # rows split over OpenMP threads: each row on one thread, the same bits at any thread count
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(cpu_kernels.decode_attention(query, k_pool, v_pool, slots, ends, 0.125), together)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("slot,end,why", [(6, 10, "slot 6"), (-1, 10, "slot -1"), (2, 81, "position 81"),
                                          (2, 0, "position 0")])
def test_a_row_outside_the_pool_raises_before_any_work(slot, end, why):
    """A slot past the pool (6 slots), a negative one, or an end past its 80 positions or below 1: IndexError
    naming the row, instead of reading memory outside the pool."""
    k_pool, v_pool = pools()
    query = torch.randn((2, 9, 1, 64), generator=torch.Generator().manual_seed(6))
    with pytest.raises(IndexError, match=f"row 1 reads {why}|row 1 reads slot {slot} up to {why}"):
        cpu_kernels.decode_attention(query, k_pool, v_pool, torch.tensor([0, slot]), torch.tensor([5, end]), 0.125)


@needs_kernel
def test_the_wrappers_refuse_what_the_kernels_would_read_past():
    """Shapes the C code would read past (a flow narrower than the longest row, a broadcast cos table, ends of
    the wrong dtype, a query with two positions): ValueError before the call."""
    k_pool, v_pool = pools()
    query = torch.randn((2, 9, 1, 64))
    slots, ends = torch.tensor([0, 1]), torch.tensor([10, 40])
    with pytest.raises(ValueError, match="flow must be float32"):
        cpu_kernels.decode_attention(query, k_pool, v_pool, slots, ends, 0.125, flow=torch.zeros((2, 39)))
    with pytest.raises(ValueError, match="slots and ends must be int64"):
        cpu_kernels.decode_attention(query, k_pool, v_pool, slots, ends.int(), 0.125)
    with pytest.raises(ValueError, match=r"query \[R, Hq, 1, D\]"):
        cpu_kernels.decode_attention(torch.randn((2, 9, 2, 64)), k_pool, v_pool, slots, ends, 0.125)
    with pytest.raises(ValueError, match="cos and sin must be float32"):
        cpu_kernels.rotate_(torch.zeros((2, 3, 64)), 2, 32, torch.zeros((1, 3, 1, 32)), torch.zeros((1, 3, 1, 32)))


@needs_kernel
def test_keys_past_a_rows_end_are_never_read():
    """NaN past each row's end (what an earlier owner or stray memory may leave) changes no bit."""
    k_pool, v_pool = pools()
    query = torch.randn((3, 9, 1, 64), generator=torch.Generator().manual_seed(3))
    slots, ends = torch.tensor([0, 1, 2]), torch.tensor([5, 30, 79])
    clean = cpu_kernels.decode_attention(query, k_pool, v_pool, slots, ends, 0.125)
    for slot, end in zip(slots.tolist(), ends.tolist()):
        k_pool[slot, :, end:] = float("nan")
        v_pool[slot, :, end:] = float("inf")
    assert torch.equal(cpu_kernels.decode_attention(query, k_pool, v_pool, slots, ends, 0.125), clean)


@pytest.mark.parametrize("path", ["kernel", "sdpa"])
def test_the_engine_gives_transformers_tokens_on_either_decode_attention(tiny, oracle, monkeypatch, path):
    """Three requests of different lengths, batched, greedy: on kvtui's kernel and on SDPA (the fallback) the
    tokens equal transformers' generate on a separate instance, and the runner's note names the path."""
    if path == "kernel" and cpu_kernels.problem() is not None:
        pytest.skip(f"kvtui's decode kernel cannot run here: {cpu_kernels.problem()}")
    monkeypatch.setenv(cpu_kernels.ENV, path)
    prompts = [[5, 6, 7], list(range(20, 45)), list(range(50, 62))]
    engine = make_engine(tiny["tiny-llama"].model, num_slots=3, max_len=64)
    assert engine.runner.decode_kernel is (path == "kernel")
    assert engine.runner.attention_note == ("kvtui's C++ kernel" if path == "kernel" else "SDPA") + \
        " (forced by $KVTUI_DECODE_ATTENTION)"
    states = [engine.submit(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    engine.run_until_done()
    assert [s.generated_ids for s in states] == [reference_tokens(oracle, p, 8) for p in prompts]


def test_without_a_compiler_decode_attention_falls_back_to_sdpa(tiny, oracle, monkeypatch, tmp_path):
    """No C++ compiler on PATH (and none built yet): the kernel reports why, the engine runs SDPA with a note
    saying so, and its tokens still equal transformers'."""
    monkeypatch.setattr(cpu_kernels, "_LIB", {})
    monkeypatch.setattr(cpu_kernels, "library_path", lambda: tmp_path / "not-built.so")
    monkeypatch.setattr(cpu_kernels, "compiler_path", lambda: None)
    assert cpu_kernels.problem() == "no C++ compiler found"
    engine = make_engine(tiny["tiny-llama"].model, num_slots=2, max_len=64)
    assert engine.runner.decode_kernel is False
    assert engine.runner.attention_note == "SDPA (kvtui's kernel cannot run here: no C++ compiler found)"
    states = [engine.submit(f"r{i}", p, GREEDY) for i, p in enumerate([[5, 6, 7], list(range(20, 40))])]
    engine.run_until_done()
    assert [s.generated_ids for s in states] == [reference_tokens(oracle, p, 8) for p in ([5, 6, 7], list(range(20, 40)))]


def test_a_bad_forced_choice_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "flash")
    with pytest.raises(ValueError, match=r"\$KVTUI_DECODE_ATTENTION='flash': choose one of sdpa, kernel"):
        cpu_kernels.use_kernel(64, 3, 9)


def test_half_precision_pools_keep_sdpa(tiny):
    """The kernel takes float32 only: a bfloat16 pool runs SDPA and the note says why."""
    use, note = cpu_kernels.choose_for(tiny["tiny-llama"].model, torch.bfloat16, torch.device("cpu"))
    assert use is False and note == "SDPA (kvtui's kernel runs float32 on the CPU; this pool is bfloat16 on cpu)"


@needs_kernel
def test_the_element_wise_kernels_equal_transformers_layers():
    """The fused forward's element-wise parts on the kernels against transformers' own code: LlamaRMSNorm
    (within 1 ulp-scale 2e-6: the sum of squares is summed in another order), the residual add (exact),
    SiLU x up (within 2e-6 relative: a polynomial exp), and apply_rotary_pos_emb (bit for bit)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(5)
    hidden, delta = torch.randn((3, 5, 96), generator=gen) * 3, torch.randn((3, 5, 96), generator=gen)
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(cpu_kernels.rms_norm(hidden, norm.weight, 1e-5), norm(hidden), rtol=2e-6, atol=2e-6)
        summed = hidden + delta
        normed = cpu_kernels.add_rms_norm(hidden, delta, norm.weight, 1e-5)
        assert torch.equal(hidden, summed)
        torch.testing.assert_close(normed, norm(summed), rtol=2e-6, atol=2e-6)
    gate_up = torch.randn((4, 2 * 40), generator=gen) * 6
    expected = torch.nn.functional.silu(gate_up[:, :40]) * gate_up[:, 40:]
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up, 40), expected, rtol=2e-6, atol=1e-7)
    rows, q_len, heads, kv_heads, d = 2, 3, 4, 2, 16
    qkv = torch.randn((rows, q_len, (heads + 2 * kv_heads) * d), generator=gen)
    angles = torch.randn((rows, q_len, d // 2), generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [R, Q, D]
    q = qkv[..., : heads * d].view(rows, q_len, heads, d).transpose(1, 2)
    k = qkv[..., heads * d : (heads + kv_heads) * d].view(rows, q_len, kv_heads, d).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)  # unsqueeze_dim=1: [R, 1, Q, D] over the heads
    v_before = qkv[..., (heads + kv_heads) * d :].clone()
    cpu_kernels.rotate_(qkv, heads + kv_heads, d, cos.unsqueeze(2).contiguous(), sin.unsqueeze(2).contiguous())
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)  # q, k: views of qkv, rotated in place
    assert torch.equal(qkv[..., (heads + kv_heads) * d :], v_before)  # the values untouched
