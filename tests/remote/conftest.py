"""Fixtures only the remote room's tests use (tests/remote/: runs against servers); the shared fixtures
are in tests/conftest.py, shared helpers in tests/helpers.py."""

import pytest


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory):
    """One real vLLM CPU server (tests/helpers.py vllm_server) for every vllm-marked module of a worker:
    tests/remote/test_vllm.py, tests/remote/test_vllm_prompt_embeds.py and tests/remote/test_conformance_servers.py
    share it (one xdist group), so it starts once however the worker interleaves their tests (module-scoped
    servers started 4 times in one run).
    Its flags, VLLM_ARGS, are what the prompt-embeds probe needs; the other audits read the block size
    from the server."""
    from helpers import VLLM_ARGS, vllm_server

    yield from vllm_server(tmp_path_factory, VLLM_ARGS)
