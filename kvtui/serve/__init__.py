"""kvtui serve: the real engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)."""

# the largest request body `kvtui serve` takes by default (bytes): 1 MiB holds about 250k tokens of text,
# far past any context kvtui serves on a CPU, and tokenizing it takes seconds (5.4 s for 1 MB with
# SmolLM2's tokenizer on a loaded 2-core machine; 23 s for 3.9 MB, only to be refused as too long).
# Past it: 413 before the body is parsed or tokenized (kvtui/serve/guard.py). Kept here, light to
# import, for the command line's help.
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
API_KEY_ENV = "KVTUI_API_KEY"  # the environment variable `--api-key` falls back to (vLLM's is VLLM_API_KEY)
