"""`kvtui bench`: a suite of side-by-side measurements, each part selectable.

Parts: overhead (kvtui decode step vs a bare transformers forward), batch (the batch curve), knobs
(bucketing, slot reuse, layouts), peers (kvtui vs vLLM, transformers and llama.cpp on a Poisson workload and at saturation),
bf16 (float32 vs bfloat16), detectors (the in-engine detectors' cost), profile (where a decode step's time
goes), transcribe (Whisper tiny.en transcription throughput against transformers and ctranslate2), images
(DINOv2-small per image, batched vs one at a time, the encoder cache's hits and savings), loadgen (the
`--target` client against `vllm bench serve` on a mock OpenAI server: docs/loadgen.md). Every
part writes its figures to the JSON and a Markdown table; `--quick` uses fewer repeats and shapes (under 10 minutes on 2 cores).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvtui.bench import (
    curve,
    detectors,
    faults,
    images,
    knobs,
    loadgen,
    overhead,
    peers,
    penalties,
    profile,
    transcribe,
)
from kvtui.bench.common import machine, peak_rss_bytes

PARTS = {
    "overhead": (overhead.run, overhead.markdown, "engine overhead: kvtui decode step vs a bare transformers forward"),
    "batch": (curve.run, curve.markdown, "batch curve: decode tokens/s by batch size"),
    "knobs": (knobs.run, knobs.markdown, "bucketing, slot reuse and layouts on a wide length spread"),
    "peers": (peers.run, peers.markdown, "peers on a Poisson workload (arrivals on the wall clock) and at saturation (all at once)"),
    "bf16": (peers.run_bf16, peers.markdown_bf16, "float32 vs bfloat16 on the same workload"),
    "detectors": (detectors.run, detectors.markdown, "in-engine detectors' cost"),
    "profile": (profile.run, profile.markdown, "where a decode step's time goes (phases and operators)"),
    "penalties": (penalties.run, penalties.markdown, "per-request penalties, bias and bans: cost per decode step"),
    "faults": (faults.run, faults.markdown, "the newer isolation faults on held-out random scenarios, on and off"),
    "transcribe": (transcribe.run, transcribe.markdown,
                   "Whisper tiny.en transcription: batched vs one at a time vs generate vs ctranslate2"),
    "images": (images.run, images.markdown,
               "the image encoder: per image, batched vs one at a time, and the encoder cache's hits and savings"),
    "loadgen": (loadgen.run, loadgen.markdown,
                "the --target client against vllm bench serve on a mock server: rates kept, lag, client-added TTFT"),
}
MODEL_FREE = {"loadgen"}  # parts that load no model (`kvtui bench --part loadgen` starts in seconds)


def run_suite(loaded, *, name: str, parts: list[str], quick: bool, output: Path, console,
              part_options: dict[str, dict] | None = None) -> dict:
    """Run `parts` (keys of PARTS) in order; write `output` (JSON) and `output` with .md (Markdown);
    returns the figures. Each part records its wall time and the process's peak RSS after it.

    Args:
        loaded: the model (kvtui.models.load_model), None when every part is in MODEL_FREE.
        part_options: more keyword arguments for a part's run, by part (e.g. loadgen's rates).
    """
    figures = {"model": loaded.model_id if loaded is not None else "(no model)",
               "dtype": str(loaded.dtype).replace("torch.", "") if loaded is not None else "-", "quick": quick,
               "machine": machine(), "parts": {}}
    m = figures["machine"]
    console.print(f"CPU: {m['processor']} ({m['cores']} cores, {m['machine']}); flags: "
                  f"{' '.join(m['cpu_flags']) or 'unknown'}; torch {m['torch']} with {m['torch_threads']} threads",
                  markup=False, highlight=False)
    for part in parts:
        run, _, title = PARTS[part]
        console.print(f"[bold]{part}[/]: {title}")
        t0 = time.perf_counter()
        result = run(loaded, name=name, quick=quick, console=console, **(part_options or {}).get(part, {}))
        result["seconds"] = time.perf_counter() - t0
        result["peak_rss_bytes"] = peak_rss_bytes()
        figures["parts"][part] = result
        console.print("\n".join(PARTS[part][1](result)), markup=False, highlight=False)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(figures, indent=2))
    output.with_suffix(".md").write_text(markdown(figures))
    return figures


def markdown(figures: dict) -> str:
    """The whole suite as Markdown: a line on the machine, then one table per part."""
    m = figures["machine"]
    lines = [f"{figures['model']} ({figures['dtype']}), {m['cores']} cores ({m['machine']}, {m['processor']}; "
             f"flags: {' '.join(m.get('cpu_flags') or ['?'])}), torch {m['torch']} with {m['torch_threads']} threads, "
             f"transformers {m['transformers']}" + (", --quick" if figures["quick"] else ""), ""]
    for part, result in figures["parts"].items():
        lines += [f"### {part}: {PARTS[part][2]}", "", *PARTS[part][1](result),
                  "", f"({result['seconds']:.0f} s; peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB)", ""]
    return "\n".join(lines)
