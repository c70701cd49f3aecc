"""Black-box targets: real inference servers that kvtui starts and talks to only over HTTP.

kvtui's own engine is a white box (its KV pool, masks and slots are visible to the detectors). A target
here is an external OpenAI-compatible server whose internals are not visible: what can be checked is
what its HTTP endpoints return (`/v1/chat/completions`, `/slots`, `/metrics`, ...).

    from kvtui.target.llama_server import LlamaServer, find_llama_server
"""
