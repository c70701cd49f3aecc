"""What a target server shows of itself: Prometheus `/metrics` and llama.cpp's `/slots`, as
`ServerSample` events (kvtui.events).

`/metrics` is parsed with prometheus_client's own parser; gauges and counters whose names start with a
known server's prefix are kept: under the bare name the sum over all labels (one model, every engine),
and, where a family's samples differ in other labels than vLLM's `model_name` and `engine`, one value
per label set too, keyed `name{label="value",...}` (e.g. `vllm:request_success_total{finished_reason=
"stop"}`). Info families (`*_info`, value 1, the facts in their labels, e.g. vLLM's
`vllm:cache_config_info` with `block_size` and `enable_prefix_caching`) are read by `parse_info`.
Histograms are left out (large, and kvtui times requests itself). Names:

| figure | vLLM | llama.cpp | SGLang | TGI |
|---|---|---|---|---|
| requests running | `vllm:num_requests_running` | `llamacpp:requests_processing` | `sglang:num_running_reqs` | `tgi_batch_current_size` |
| requests waiting | `vllm:num_requests_waiting` | `llamacpp:requests_deferred` | `sglang:num_queue_reqs` | `tgi_queue_size` |
| KV cache usage (0-1) | `vllm:kv_cache_usage_perc` (older: `vllm:gpu_cache_usage_perc`) | - | `sglang:token_usage` | - |
| prefix cache (tokens queried / hit) | `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` | - | - | - |

llama.cpp's `/slots` (served with `--slots`) lists each slot's `id`, `n_ctx` and `is_processing`; with
`LLAMA_SERVER_SLOTS_DEBUG=1` a busy slot also shows `n_prompt_tokens`, `next_token[0].n_decoded` and its
`prompt` text, which gives the slot's context length and, matched against the run's prompts, its request.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtui.events import ServerSample, SlotState

PREFIXES = ("vllm:", "llamacpp:", "sglang:", "tgi_")
RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing", "sglang:num_running_reqs",
           "tgi_batch_current_size")
WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred", "sglang:num_queue_reqs", "tgi_queue_size")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


IDENTITY_LABELS = ("model_name", "engine")  # what every sample of a vLLM server carries


def parse_metrics(text: str) -> dict[str, float]:
    """Gauge and counter values of the known servers' metrics in Prometheus text: sample name -> value
    summed over labels, plus `name{label="value",...}` -> value per label set where a family's samples
    differ in labels other than IDENTITY_LABELS (counters keep their `_total` name; `_created` samples
    and `*_info` families are dropped).

    Raises:
        ValueError: text prometheus_client cannot parse.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in ("gauge", "counter") or not family.name.startswith(PREFIXES) \
                or family.name.endswith("_info"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
            labels = {k: v for k, v in sample.labels.items() if k not in IDENTITY_LABELS}
            if labels:
                key = sample.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def parse_info(text: str) -> dict[str, dict[str, str]]:
    """The labels of each info family (`*_info`, e.g. vLLM's `vllm:cache_config_info`) in Prometheus
    text: family name -> {label: value} (the first sample's). Raises ValueError for unparseable text."""
    out: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_info") and family.samples and family.name not in out:
            out[family.name] = dict(family.samples[0].labels)
    return out


def first_of(metrics: dict[str, float], names: tuple[str, ...]) -> float | None:
    """The value of the first of `names` the server has, or None."""
    return next((metrics[n] for n in names if n in metrics), None)


def parse_slots(data, prompts: dict[str, str] | None = None) -> tuple[SlotState, ...] | None:
    """llama.cpp's `/slots` JSON as SlotStates; None when it is not a list of slots.

    Args:
        prompts: request id -> a text unique to that request (its passphrase, its prompt); a busy slot
            whose `prompt` contains one is attributed to that request.
    """
    if not isinstance(data, list) or not all(isinstance(s, dict) and isinstance(s.get("id"), int) for s in data):
        return None
    return tuple(_slot(s, prompts or {}) for s in data)


def _slot(s: dict, prompts: dict[str, str]) -> SlotState:
    busy = bool(s.get("is_processing"))
    context = None
    if busy and isinstance(s.get("n_prompt_tokens"), int):
        decoded = [t.get("n_decoded", 0) for t in s.get("next_token") or () if isinstance(t, dict)]
        context = s["n_prompt_tokens"] + (decoded[0] if decoded else 0)
    request_id = None
    text = s.get("prompt") if busy else None
    if isinstance(text, str):
        request_id = next((rid for rid, mark in prompts.items() if mark and mark in text), None)
    n_ctx = s.get("n_ctx")
    return SlotState(id=s["id"], n_ctx=n_ctx if isinstance(n_ctx, int) else None, busy=busy,
                     context_tokens=context, request_id=request_id)


class ServerProbe:
    """Polls a server's `/metrics` and `/slots`. An endpoint that answers anything but parseable data
    once (404, HTML, a connection error) is not asked again, so a server with neither gives nothing.

    Args:
        client: an AsyncClient whose base_url is the server.
        prompts: request id -> unique text, for attributing llama.cpp slots (see parse_slots).
    """

    def __init__(self, client: httpx.AsyncClient, prompts: dict[str, str] | None = None) -> None:
        self.client = client
        self.prompts = prompts if prompts is not None else {}
        self.has_metrics = self.has_slots = True
        self._seen_metrics = self._seen_slots = False

    async def sample(self, t: float) -> ServerSample | None:
        """One sample at time `t` (seconds on the run's clock), or None when the server shows nothing."""
        metrics = await self._metrics() if self.has_metrics else None
        slots = await self._slots() if self.has_slots else None
        if metrics is None and slots is None:
            return None
        metrics = metrics or {}
        return ServerSample(t=t, metrics=metrics, running=first_of(metrics, RUNNING),
                            waiting=first_of(metrics, WAITING), kv_usage=first_of(metrics, KV_USAGE), slots=slots)

    async def _metrics(self) -> dict[str, float] | None:
        try:
            response = await self.client.get("/metrics", timeout=5.0)
            metrics = parse_metrics(response.text) if response.status_code == 200 else None
        except httpx.HTTPError:  # a network hiccup: ask again next time if it answered before
            self.has_metrics = self._seen_metrics
            return None
        except ValueError:
            metrics = None
        self._seen_metrics = self.has_metrics = bool(metrics)
        return metrics or None

    async def _slots(self) -> tuple[SlotState, ...] | None:
        try:
            response = await self.client.get("/slots", timeout=5.0)
            slots = parse_slots(response.json(), self.prompts) if response.status_code == 200 else None
        except httpx.HTTPError:
            self.has_slots = self._seen_slots
            return None
        except ValueError:
            slots = None
        self._seen_slots = self.has_slots = slots is not None
        return slots
