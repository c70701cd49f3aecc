"""kvtui serve: the real engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)."""

# the largest request body `kvtui serve` takes by default (bytes): room for a long chat, and a 10 MB
# prompt is refused with 413 before it is parsed or tokenized (kvtui/serve/guard.py); kept here, light
# to import, for the command line's help
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
API_KEY_ENV = "KVTUI_API_KEY"  # the environment variable `--api-key` falls back to (vLLM's is VLLM_API_KEY)
