"""What the CPU offers the model's arithmetic: native bfloat16 instructions or not."""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of x86 CPUs that multiply bfloat16 natively


def cpu_bf16_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[str, ...]:
    """The native-bfloat16 flags this CPU lists (Intel AMX, AVX-512 BF16), () when none or no
    /proc/cpuinfo. Without them torch emulates bfloat16 matrix multiplies in float32, which is slower
    than float32 itself; with them (oneDNN) a bfloat16 decode step is about 1.5x float32's on SmolLM2
    (docs/performance.md)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return ()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(line.split(":", 1)[-1].split())
    return tuple(f for f in BF16_FLAGS if f in flags)


def bf16_note(dtype: str, device: str, cpuinfo: str | Path = "/proc/cpuinfo") -> str | None:
    """A note for a bfloat16 run on a CPU without native bfloat16 (None otherwise)."""
    if str(dtype).replace("torch.", "") != "bfloat16" or not str(device).startswith("cpu") or cpu_bf16_flags(cpuinfo):
        return None
    return ("this CPU lists no native bfloat16 (amx_bf16 or avx512_bf16 in /proc/cpuinfo): bfloat16 runs "
            "emulated and is likely slower than float32; answers differ from float32 at near ties either way "
            "(the reference detector labels those numeric)")
