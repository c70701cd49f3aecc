"""The newer isolation faults on held-out random scenarios: for each fault, N scenarios (8; `--quick` 3)
drawn from a small template of its family with seeded random knobs (layout, slots or paged as the
fault's `kv` modes allow, request counts, output lengths, arrival rates, and the sampling mix that makes
the fault act), seeds 9000 and up, which no test uses. Each scenario runs twice on the virtual clock,
with the fault on and with it removed. Figures per fault: the runs in which a counted report
(`Contamination.counts`) came, the runs each detector reported in, the runs with a report naming both a
victim and a source among the run's requests, the step of each run's first counted report (median, min,
max), the counted reports with the fault off (false alarms), and apart from the misses (runs with no
counted report where the fault acted: kvtui.events.FaultActed) the inert runs, where the scenario gave the
fault nothing to act on. Text and prompt-embeddings faults run on
tiny-llama, the cross-attention faults on tiny-whisper, the image faults on tiny-vision, the recurrent-state
faults on tiny-qwen35moe (random weights: the canary, which needs a model that says its passphrase, stays
silent there); `loaded`, the suite's model, is not used."""

from __future__ import annotations

import random
from pathlib import Path

from kvtui.bench.common import Spread
from kvtui.faults import FAULTS

SEED0 = 9000  # the held-out seed range: tests use seeds below 9000
AUDIO = Path(__file__).resolve().parents[2] / "scenarios" / "audio"
TEXT = ("row_state_misalign", "shared_rng", "penalty_shared_history", "cow_missing", "stale_bitmask")
SPEECH = ("stale_cross_kv", "cross_row_misalign", "encoder_cache_unkeyed", "cross_kv_prefix_cached")
EMBEDS = ("embeds_unkeyed", "embeds_mask_unkeyed")
IMAGES = ("mm_hash_missing", "mm_uuid_trusted", "stale_image_embedding")
STATE = ("state_slot_not_reset", "state_published_before_write", "tier_drops_recurrent_state", "state_index_units")
FAULT_LIST = TEXT + SPEECH + EMBEDS + IMAGES + STATE
MODELS = {**dict.fromkeys(SPEECH, "tiny-whisper"), **dict.fromkeys(IMAGES, "tiny-vision"),
          **dict.fromkeys(STATE, "tiny-qwen35moe")}  # else tiny-llama
RETRY_PROMPTS = Path(__file__).resolve().parents[2] / "scenarios" / "faults" / "state_retry_prompts.txt"
# every other token id banned with a -100 logit bias: a row that samples with this state emits none of them
BANS = "{" + ", ".join(f'"{i}": -100' for i in range(0, 256, 2)) + "}"


def _pool(rng: random.Random, fault: str, slots: tuple[int, int], blocks: int) -> str:
    """The KV pool line: slots or paged as the fault's catalogue entry allows."""
    if rng.choice(FAULTS[fault].kv) == "paged":
        return f"kv: paged, block_size: 16, num_blocks: {blocks}"
    return f"slots: {rng.randint(*slots)}"


def _sampling_rows(rng: random.Random, fault: str, layout: str, faults: str) -> str:
    """row_state_misalign, shared_rng, penalty_shared_history: sampled rows, rows banning half the
    vocabulary and greedy penalized rows, with output lengths that differ, so rows leave mid-batch."""
    return f"""max_requests: {rng.randint(8, 14)}
model: tiny-llama
engine: {{{_pool(rng, fault, (3, 5), rng.randint(18, 30))}, max_len: 128, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: {rng.choice(["constant", "poisson"])}, rate_per_s: {rng.choice([20.0, 50.0, 100.0])}}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: {rng.randint(2, 6)}, max: {rng.randint(20, 40)}}}}}
output_tokens: {{dist: uniform, min: 2, max: {rng.randint(10, 20)}}}
sampling: {{temperature: 1.0, ignore_eos: true, mix: [{{fraction: {rng.choice([0.3, 0.4])}, logit_bias: {BANS}}},
           {{fraction: {rng.choice([0.3, 0.4])}, temperature: 0, repetition_penalty: {rng.choice([1.5, 2.0])},
             presence_penalty: {rng.choice([1.0, 2.0])}}}]}}"""


def _forks(rng: random.Random, fault: str, layout: str, faults: str) -> str:
    """cow_missing: sampled requests with n > 1 forking from one prefill on paged KV."""
    return f"""max_requests: {rng.randint(2, 4)}
model: tiny-llama
engine: {{kv: paged, block_size: 16, max_len: 128, prefix_caching: {rng.choice(["true", "false"])}, layout: {layout},
          faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: {rng.choice([4.0, 10.0])}}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: 17, max: 60}}}}
output_tokens: {{dist: uniform, min: 8, max: 16}}
sampling: {{temperature: 1.0, ignore_eos: true, n: {rng.randint(2, 4)}}}"""


def _structured(rng: random.Random, fault: str, layout: str, faults: str) -> str:
    """stale_bitmask: about half the requests constrained to digits, plain ones sampling beside them."""
    return f"""max_requests: {rng.randint(6, 10)}
model: tiny-llama
engine: {{{_pool(rng, fault, (3, 4), rng.randint(20, 30))}, max_len: 128, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: {rng.choice(["constant", "poisson"])}, rate_per_s: {rng.choice([20.0, 50.0])}}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: 3, max: 30}}}}
output_tokens: {{dist: uniform, min: 4, max: {rng.randint(10, 16)}}}
sampling: {{ignore_eos: true, structured: {{regex: "[0-9]{{1,30}}", fraction: {rng.choice([0.4, 0.5, 0.6])}}}}}"""


# speech: slots reused (stale_cross_kv), rows leaving at different times (cross_row_misalign), several
# requests with one decoder prompt (encoder_cache_unkeyed), a shared initial prompt longer than a few
# blocks under prefix caching (cross_kv_prefix_cached)
SPEECH_POOLS = {"stale_cross_kv": "slots: 2", "cross_row_misalign": "slots: 3", "encoder_cache_unkeyed": "slots: 3",
                "cross_kv_prefix_cached": "block_size: 4, prefix_caching: true"}


def _speech(rng: random.Random, fault: str, layout: str, faults: str) -> str:
    """The cross-attention faults on tiny-whisper, one spoken passphrase clip per request."""
    kv = rng.choice(FAULTS[fault].kv)
    pool = SPEECH_POOLS[fault] if kv == "slots" or fault == "cross_kv_prefix_cached" else "block_size: 16"
    prompt = "Passphrases are read here." if fault == "cross_kv_prefix_cached" else ""
    return f"""max_requests: {rng.randint(5, 8)}
model: tiny-whisper
engine: {{{pool}, kv: {kv}, max_len: 64, max_batch_size: {rng.randint(2, 3)}, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: {rng.choice(["constant", "poisson"])}, rate_per_s: {rng.choice([4.0, 8.0, 16.0])}}}
prompts: {{kind: spoken_passphrase, clips: {AUDIO}, initial_prompt: "{prompt}"}}
output_tokens: {{dist: uniform, min: 3, max: {rng.randint(10, 16)}}}
sampling: {{ignore_eos: true}}"""


def _embeds(rng: random.Random, fault: str, layout: str, faults: str) -> str:
    """embeds_unkeyed: passphrase prompts sent whole as embedding rows; embeds_mask_unkeyed: in pairs of
    equal ids and tensor with different masks; paged KV with prefix caching, a random block size."""
    mode = "all" if fault == "embeds_unkeyed" else "mask_pairs"
    return f"""max_requests: {rng.randint(4, 8)}
model: tiny-llama
engine: {{kv: paged, block_size: {rng.choice([4, 8, 16])}, max_len: 256, max_batch_size: {rng.randint(1, 3)},
          prefix_caching: true, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: {rng.choice(["constant", "poisson"])}, rate_per_s: {rng.choice([1.0, 2.0, 4.0])}}}
prompts: {{kind: passphrase, embeds: {mode}}}
output_tokens: {{dist: uniform, min: 4, max: {rng.randint(8, 16)}}}
sampling: {{ignore_eos: true}}"""


def _images(rng: random.Random, fault: str, layout: str, faults: str) -> str:
    """The image faults on tiny-vision, one canary picture per request: mm_hash_missing under prefix
    caching; the encoder-cache faults with slots or paged KV without prefix caching (a prefix hit would
    skip the picture's position, which is where they act)."""
    if fault == "mm_hash_missing":
        pool = f"kv: paged, block_size: {rng.choice([4, 8])}, prefix_caching: true"
    elif rng.random() < 0.5:
        pool = f"kv: paged, block_size: 8, max_batch_size: {rng.randint(2, 3)}"
    else:
        pool = f"slots: {rng.randint(2, 3)}"
    uuids = "reused" if fault == "mm_uuid_trusted" else "none"
    return f"""max_requests: {rng.randint(5, 9)}
model: tiny-vision
engine: {{{pool}, max_len: 128, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: {rng.choice(["constant", "poisson"])}, rate_per_s: {rng.choice([1.0, 2.0, 4.0])}}}
prompts: {{kind: image_passphrase, pictures: {rng.randint(2, 6)}, uuids: {uuids}}}
output_tokens: {{dist: uniform, min: 3, max: {rng.randint(8, 12)}}}
sampling: {{ignore_eos: true}}"""


def _hybrid(rng: random.Random, fault: str, layout: str, faults: str) -> str:
    """The recurrent-state faults on tiny-qwen35moe: state slots taken in turn (state_slot_not_reset, slots or
    paged KV); a request cancelled right after its prefill and retried (state_published_before_write, one at a
    time in a pool its predecessor filled; a prefill in one chunk or in two whose last reaches the retry's last
    cached boundary, as a cancel mid-prefill needs); system prompts whose blocks go through a small pool
    into the offload tier (tier_drops_recurrent_state); one-block system prompts before long user parts, so a
    hit is one block (state_index_units)."""
    if fault == "state_slot_not_reset":
        pool = (f"slots: {rng.randint(2, 3)}" if rng.random() < 0.5 else
                f"kv: paged, block_size: 16, num_blocks: 24, max_batch_size: {rng.randint(2, 3)}, "
                f"prefix_caching: {rng.choice(['true', 'false'])}")
        return f"""max_requests: {rng.randint(5, 8)}
model: tiny-qwen35moe
engine: {{{pool}, max_len: 128, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: {rng.choice(["constant", "poisson"])}, rate_per_s: {rng.choice([20.0, 50.0, 100.0])}}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: {rng.randint(3, 8)}, max: {rng.randint(20, 40)}}}}}
output_tokens: {{dist: uniform, min: 4, max: {rng.randint(8, 12)}}}
sampling: {{ignore_eos: true}}"""
    if fault == "state_published_before_write":
        block = rng.choice([8, 16])
        return f"""max_requests: 3
model: tiny-qwen35moe
engine: {{kv: paged, block_size: {block}, num_blocks: {64 // block + 1}, max_len: 64, prefix_caching: true,
          max_tokens_per_step: {rng.choice([24, 256])}, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: rounds, rounds: [{{size: 1}}, {{size: 1, cancel: 1, cancel_after: 1}}, {{size: 1}}]}}
prompts: {{kind: file, path: {RETRY_PROMPTS}, chat: false}}
output_tokens: {{dist: uniform, min: 4, max: {rng.randint(6, 10)}}}
sampling: {{ignore_eos: true}}"""
    if fault == "tier_drops_recurrent_state":
        return f"""max_requests: {rng.randint(10, 14)}
model: tiny-qwen35moe
engine: {{kv: paged, block_size: 16, max_len: 64, num_blocks: 7, max_batch_size: 2,
          prefix_caching: true, kv_offload_blocks: 32, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: {rng.choice([2.0, 4.0])}}}
prompts: {{kind: system_prompt, count: {rng.randint(3, 4)}, system_tokens: 32, user_tokens: {{dist: uniform, min: 2, max: 8}},
           choice: round_robin}}
output_tokens: {{dist: uniform, min: 4, max: {rng.randint(6, 10)}}}
sampling: {{ignore_eos: true}}"""
    return f"""max_requests: {rng.randint(6, 10)}
model: tiny-qwen35moe
engine: {{kv: paged, block_size: 16, max_len: 96, num_blocks: {rng.randint(10, 14)}, max_batch_size: {rng.randint(1, 2)},
          prefix_caching: true, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: {rng.choice([1.0, 2.0, 4.0])}}}
prompts: {{kind: system_prompt, count: {rng.randint(2, 3)}, system_tokens: 16, user_tokens: {{dist: uniform, min: 40, max: 56}}}}
output_tokens: {{dist: uniform, min: 4, max: {rng.randint(6, 10)}}}
sampling: {{ignore_eos: true}}"""


FAMILIES = {"row_state_misalign": _sampling_rows, "shared_rng": _sampling_rows, "penalty_shared_history": _sampling_rows,
            "cow_missing": _forks, "stale_bitmask": _structured, **dict.fromkeys(SPEECH, _speech),
            **dict.fromkeys(EMBEDS, _embeds), **dict.fromkeys(IMAGES, _images), **dict.fromkeys(STATE, _hybrid)}


def scenario_text(fault: str, seed: int, on: bool = True) -> str:
    """The held-out scenario `seed` of `fault`'s family as YAML; on=False: the same scenario, fault removed.
    The knobs are drawn from random.Random(seed), so both texts differ only in `faults`."""
    rng = random.Random(seed)
    layout = rng.choice(FAULTS[fault].layouts)
    body = FAMILIES[fault](rng, fault, layout, fault if on else "")
    return f"name: held-out-{fault}-{seed}\nseed: {seed}\n{body}\n"


def run_one(loaded, fault: str, seed: int, on: bool) -> tuple[list, int]:
    """The counted reports of one held-out run (virtual clock), and the steps the fault acted in (0 with it
    off, or when the scenario gave it nothing to act on: an inert run, no detector miss)."""
    from kvtui.scenario import parse_scenario
    from kvtui.session import Session

    session = Session(parse_scenario(scenario_text(fault, seed, on), f"held-out {fault} {seed}"), loaded,
                      clock="virtual")
    session.run()
    return [e for e in session.contamination if e.counts], (session.summary.fault_acts or {}).get(fault, 0)


def tally(fault: str, on_runs: list[list], off_runs: list[list], ran: list[set[str]], acts: list[int]) -> dict:
    """The table row of `fault` from each run's counted reports (fault on, fault off), request ids and the
    steps the fault acted in (fault on): a run with no report is a miss only where the fault acted; one
    where it acted 0 times is inert, counted apart."""
    caught = [r for r in on_runs if r]
    detectors = {d: sum(any(e.detector == d for e in r) for r in on_runs)
                 for d in dict.fromkeys([*FAULTS[fault].caught_by, *sorted({e.detector for r in on_runs for e in r})])}
    named = sum(any(e.victim in ids and e.source in ids and e.source != e.victim for e in r)
                for r, ids in zip(on_runs, ran))
    first = Spread.of([min(e.step for e in r) for r in caught]).as_dict() if caught else None
    return {"runs": len(on_runs), "caught": len(caught), "detectors": detectors, "named": named,
            "acted": sum(1 for n in acts if n), "missed": sum(1 for r, n in zip(on_runs, acts) if n and not r),
            "inert": sum(1 for r, n in zip(on_runs, acts) if not n and not r),
            "first_step": first, "false_alarms": sum(map(len, off_runs)),
            "false_alarm_runs": sum(1 for r in off_runs if r)}


def run(loaded, *, name: str, quick: bool, console, faults: tuple[str, ...] = FAULT_LIST) -> dict:
    """Each fault in `faults` on N held-out scenarios (N = 3 with quick, else 8), on and off."""
    from kvtui.models import load_model

    models: dict[str, object] = {}
    n = 3 if quick else 8
    rows = {}
    for fault in faults:
        model = MODELS.get(fault, "tiny-llama")
        if missing := _missing(fault):
            console.print(f"  faults: {fault} skipped: {missing}")
            rows[fault] = {"model": model, "skipped": missing}
            continue
        loaded_fault = models.get(model) or models.setdefault(model, load_model(model, progress=False))
        on_runs, off_runs, ran, acts = [], [], [], []
        for i in range(n):
            seed = SEED0 + i
            console.print(f"  faults: {fault} seed {seed}")
            reports, acted = run_one(loaded_fault, fault, seed, True)
            on_runs.append(reports)
            acts.append(acted)
            off_runs.append(run_one(loaded_fault, fault, seed, False)[0])
            ran.append(_request_ids(fault, seed))
        rows[fault] = {"model": model, "seeds": [SEED0, SEED0 + n - 1], **tally(fault, on_runs, off_runs, ran, acts)}
    return {"faults": rows}


def _missing(fault: str) -> str:
    """What a fault's held-out runs need and this install lacks ("" when nothing is missing)."""
    import importlib.util

    if fault == "stale_bitmask" and importlib.util.find_spec("xgrammar") is None:
        from kvtui.engine.grammar import INSTALL

        return f"structured output needs xgrammar: {INSTALL}"
    if fault in SPEECH and not AUDIO.is_dir():
        return f"the spoken passphrase clips are not at {AUDIO} (they ship with the source checkout)"
    return ""


def _request_ids(fault: str, seed: int) -> set[str]:
    """The ids of the requests and forked sequences a held-out scenario runs (`r003`, `1_r003`)."""
    from kvtui.scenario import parse_scenario

    spec = parse_scenario(scenario_text(fault, seed))
    ids = {f"r{i:03d}" for i in range(spec.max_requests)}
    n = spec.sampling.n if fault == "cow_missing" else 1
    return ids | {f"{k}_{r}" for r in ids for k in range(n)} if n > 1 else ids


def markdown(result: dict) -> list[str]:
    lines = ["| fault | runs | caught in | missed where it acted | inert (acted 0 times) | detectors that reported "
             "(runs) | victim and source named (runs) | first counted report, step: median (min-max) | false alarms "
             "with the fault off |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fault, r in result["faults"].items():
        if "skipped" in r:
            lines.append(f"| {fault} ({r['model']}) | 0 | skipped: {r['skipped']} | | | | | | |")
            continue
        detectors = ", ".join(f"{d} {k}" for d, k in r["detectors"].items())
        s = r["first_step"]
        first = f"{s['median']:g} ({s['min']:g}-{s['max']:g})" if s else "-"
        alarms = f"{r['false_alarms']} ({r['false_alarm_runs']} of {r['runs']} runs)"
        lines.append(f"| {fault} ({r['model']}) | {r['runs']} | {r['caught']} | {r['missed']} | {r['inert']} | "
                     f"{detectors} | {r['named']} | {first} | {alarms} |")
    return lines
