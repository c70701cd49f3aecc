"""Black-box targets: real inference servers that kvtui drives and checks only over HTTP.

kvtui's own engine is a white box (its KV pool, masks and slots are visible to the detectors). A target
here is an external OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp's llama-server, `kvtui
serve`) whose internals are not visible: what can be checked is what its HTTP endpoints return.

- `session.TargetSession`: `kvtui run SCENARIO --target URL`: the scenario's arrivals as concurrent
  streamed requests, the same typed events as a local run (kvtui.events), plus `ServerSample`.
- `openai`: one streamed request, timed as vLLM's `bench serve` times it.
- `server_probe`: polls `/metrics` (Prometheus) and llama.cpp's `/slots`.
- `solo_check`, `audit`: the black-box reference check and noninterference audit.
- `options`: TargetOptions, how to reach and drive a server.
- `reach`: the first contact (GET /v1/models) every command makes, and the one wording for an answer
  that is not JSON (TargetError, BadAnswer).
- `llama_server`, `vllm_cpu`: start llama.cpp's server or vLLM for tests and findings.
The dashboard on a target lives in kvtui/tui/ (target_source, server_track, server_panels), the
`--target` commands in kvtui/cli/target.py.
"""
