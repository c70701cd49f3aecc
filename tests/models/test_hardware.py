"""The native-bfloat16 check and the note a bfloat16 run gets on a CPU without it."""

from kvtui.models.hardware import bf16_note, cpu_bf16_flags

SAPPHIRE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


def test_the_flags_are_read_from_cpuinfo(tmp_path):
    (tmp_path / "amx").write_text(SAPPHIRE)
    (tmp_path / "none").write_text(ZEN2)
    assert cpu_bf16_flags(tmp_path / "amx") == ("amx_bf16", "avx512_bf16")
    assert cpu_bf16_flags(tmp_path / "none") == ()
    assert cpu_bf16_flags(tmp_path / "missing") == ()


def test_only_a_bfloat16_cpu_run_without_the_flags_gets_a_note(tmp_path):
    (tmp_path / "amx").write_text(SAPPHIRE)
    (tmp_path / "none").write_text(ZEN2)
    assert "emulated" in bf16_note("bfloat16", "cpu", tmp_path / "none")
    assert bf16_note("bfloat16", "cpu", tmp_path / "amx") is None
    assert bf16_note("float32", "cpu", tmp_path / "none") is None
    assert bf16_note("bfloat16", "cuda", tmp_path / "none") is None
    assert "emulated" in bf16_note("torch.bfloat16", "cpu", tmp_path / "none")
