"""kvtui serve: the real engine behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)."""
