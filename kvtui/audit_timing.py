"""The prefix-cache timing side channel (`kvtui audit --timing`).

A prefix-cache hit skips the prefill of the cached blocks, so the time to first token (TTFT) of a
request whose prompt starts like someone else's cached prompt is shorter. An attacker who can send
requests to the same server can test a guess of another user's prompt by timing it (CVE-2025-46570,
vLLM before 0.9.0: reported near-perfect separation, ROC AUC about 0.99 at prefixes of 8 tokens).
Per-tenant cache salts close it: a tenant's requests only hit blocks its own tenant computed.

The experiment, on the scenario's model and engine (forced to paged KV with prefix caching, a pool
large enough that nothing is evicted):

1. The victim tenant sends `probes` prompts: a public system prompt (`public_blocks` blocks, the same
   for everyone), a secret (`secret_blocks` blocks of random token ids) and a question.
2. The attacker tenant sends one warm-up request (public prompt + a random secret: the public part is
   then cached under the attacker's own salt too), then 2 x `probes` probes in a seeded random order:
   *matching* probes (public prompt + a victim's secret + a new question) and *non-matching* ones
   (public prompt + a random secret of the same length + a new question). Every probe asks for one
   token and runs alone, so its TTFT is only its own prefill.
3. The score is TTFT; ROC AUC = P(a matching probe's TTFT < a non-matching one's) (ties count half):
   1.0 separates perfectly, 0.5 is chance.

Measured on both clocks from one run: the virtual clock (modeled: the step cost model charges the
prefill positions a hit skips) and the wall clock (perf_counter from submit to first token). Done
with per-tenant salts and without salts (`cache_salt: none`); the scenario's faults (e.g.
unsalted_prefix) act in both.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtui.config import EngineConfig

# The engine (torch) and the scenario package are imported where an experiment runs: the command line
# imports this module at start-up for the defaults below, and stays quick.
if TYPE_CHECKING:
    from kvtui.engine import Engine
    from kvtui.scenario.tenants import TenantPlan

DEFAULT_PROBES = 16  # probes of each class (matching / not), `kvtui audit --timing --probes`
# tokens per probe block against a server that publishes no block size (llama.cpp reuses any prefix),
# `kvtui audit --timing --target --block-size`
DEFAULT_TARGET_BLOCK_SIZE = 64


def roc_auc(positives: list[float], negatives: list[float]) -> float:
    """Area under the ROC curve of the score `-x` (smaller x = more likely positive): the probability
    that a random positive is below a random negative, ties counted half (the Mann-Whitney U
    statistic divided by len(positives) x len(negatives)). Raises ValueError on an empty list."""
    if not positives or not negatives:
        raise ValueError("ROC AUC needs at least one positive and one negative")
    wins = sum(1.0 if p < n else 0.5 if p == n else 0.0 for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


@dataclass(frozen=True)
class TimingRow:
    """One configuration's result.

    Attributes:
        salts: "per_tenant" or "none"; clock: "virtual" (modeled) or "wall" (measured).
        matching, non_matching: probes of each class.
        ttft_matching_s, ttft_non_matching_s: median TTFT of each class (seconds).
        auc: ROC AUC of TTFT as a test for "this prefix is cached by another tenant".
        cross_tenant_hit_tokens: prompt tokens the attacker's probes took from the victim's blocks.
    """

    salts: str
    clock: str
    matching: int
    non_matching: int
    ttft_matching_s: float
    ttft_non_matching_s: float
    auc: float
    cross_tenant_hit_tokens: int


@dataclass(frozen=True)
class Probes:
    """The experiment's prompts (token ids): the victim's, the attacker's warm-up, and the probes in the
    order they are sent, each with whether its prefix matches a victim's secret."""

    victims: list[list[int]]
    warmup: list[int]
    probes: list[tuple[bool, list[int]]]  # (matching, prompt), in the order they are sent


def make_probes(tokenizer, seed: int, *, count: int, block_size: int, public_blocks: int = 2,
                secret_blocks: int = 2, question_tokens: int = 7) -> Probes:
    """The victims' prompts and the attacker's probes (see the module docstring), fixed by `seed`."""
    from kvtui.scenario.plan import derive_seed
    from kvtui.scenario.prompts import random_ids

    rng = random.Random(derive_seed(seed, "timing_audit"))
    public = random_ids(rng, public_blocks * block_size, tokenizer)
    secrets = [random_ids(rng, secret_blocks * block_size, tokenizer) for _ in range(count)]

    def question() -> list[int]:
        return random_ids(rng, question_tokens, tokenizer)

    victims = [public + s + question() for s in secrets]
    warmup = public + random_ids(rng, secret_blocks * block_size, tokenizer) + question()
    probes = [(True, public + s + question()) for s in secrets]
    probes += [(False, public + random_ids(rng, secret_blocks * block_size, tokenizer) + question())
               for _ in range(count)]
    rng.shuffle(probes)
    return Probes(victims, warmup, probes)


class _Prober:
    """Sends requests one at a time to one engine and times their first token."""

    def __init__(self, engine: Engine, salts: TenantPlan) -> None:
        self.engine, self.salts, self.count = engine, salts, 0

    def send(self, tenant: str, prompt: list[int]) -> tuple[float, float, int]:
        """(virtual TTFT s, wall TTFT s, cross-tenant hit tokens) of one request run alone."""
        from kvtui.engine import SamplingParams

        self.count += 1
        start = time.perf_counter()
        state = self.engine.submit(f"{tenant}{self.count:04d}", prompt, SamplingParams(max_new_tokens=1),
                                   tenant=tenant, cache_salt=self.salts.salt(tenant))
        cross = 0
        while state.first_token_s is None and self.engine.has_unfinished():
            cross += self.engine.step().prefix_cache_cross_tenant_hits
        wall = time.perf_counter() - start
        while self.engine.has_unfinished():
            self.engine.step()
        if state.first_token_s is None:
            raise ValueError(f"probe {state.request_id} was not served: {state.finish_detail}")
        # the modeled duration, rounded to the nanosecond: the virtual clock's float sums would otherwise break
        # exact ties at random (an absolute time of 10 s carries about 1e-15 s of rounding)
        return round(state.first_token_s - state.arrival_s, 9), wall, cross


def _engine(spec, loaded, probes: Probes, faults, block_size: int) -> Engine:
    """The scenario's engine as paged KV with prefix caching, big enough that no cached block is evicted."""
    from kvtui.engine import Engine

    prompts = probes.victims + [probes.warmup] + [p for _, p in probes.probes]
    blocks = sum(-(-(len(p) + 1) // block_size) for p in prompts) + 2 * -(-spec.engine.max_len // block_size) + 1
    config = spec.engine_config(kv="paged", prefix_caching=True, num_blocks=blocks, kv_budget_bytes=None,
                                block_size=block_size, max_len=max(spec.engine.max_len, max(map(len, prompts)) + 2),
                                faults=frozenset(spec.engine.faults) | frozenset(faults), watermark=0.0)
    return Engine.from_loaded(loaded, config, eos_token_ids=(), tokenizer=None, image_encoder=None, clock="virtual")


def measure(spec, loaded, probes: Probes, *, salts: str, faults=(),
            block_size: int = EngineConfig.block_size) -> list[TimingRow]:
    """Run the experiment once with `salts` ("per_tenant" or "none"); a row per clock."""
    from kvtui.scenario.plan import derive_seed
    from kvtui.scenario.tenants import TenantPlan, Tenants

    prober = _Prober(_engine(spec, loaded, probes, faults, block_size),
                     TenantPlan(Tenants(count=2, cache_salt=salts), spec.seed, derive_seed))
    for prompt in probes.victims:
        prober.send("victim", prompt)
    prober.send("attacker", probes.warmup)
    results = {True: [], False: []}
    cross = 0
    for matching, prompt in probes.probes:
        virtual, wall, hit = prober.send("attacker", prompt)
        results[matching].append((virtual, wall))
        cross += hit
    rows = []
    for clock, k in (("virtual", 0), ("wall", 1)):
        match, miss = [r[k] for r in results[True]], [r[k] for r in results[False]]
        rows.append(TimingRow(salts, clock, len(match), len(miss), _median(match), _median(miss),
                              roc_auc(match, miss), cross))
    return rows


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def run_timing_audit(spec, loaded, *, faults=(), probes: int = DEFAULT_PROBES, console=None) -> list[TimingRow]:
    """The experiment with per-tenant salts and without salts (see the module docstring)."""
    block_size = spec.engine.block_size
    probe_set = make_probes(loaded.tokenizer, spec.seed, count=probes, block_size=block_size)
    rows = []
    for salts in ("per_tenant", "none"):
        if console is not None:
            console.print(f"audit --timing: {2 * probes} probes, {'per-tenant salts' if salts != 'none' else 'no salt'}")
        rows += measure(spec, loaded, probe_set, salts=salts, faults=faults, block_size=block_size)
    return rows


def print_timing(rows: list[TimingRow], console) -> None:
    """The result table: per salt mode and clock, probes, median TTFTs, ROC AUC, cross-tenant hits."""
    from rich.table import Table

    table = Table(title="prefix-cache timing side channel: TTFT as a test for another tenant's cached prefix",
                  title_justify="left")
    for column in ("salts", "clock", "probes (matching / not)", "TTFT median matching / not", "ROC AUC",
                   "cross-tenant hit tokens"):
        table.add_column(column)
    for r in rows:
        clock = "virtual (modeled)" if r.clock == "virtual" else "wall (measured)"
        table.add_row(r.salts, clock, f"{r.matching} / {r.non_matching}",
                      f"{r.ttft_matching_s * 1000:.1f} / {r.ttft_non_matching_s * 1000:.1f} ms", f"{r.auc:.3f}",
                      str(r.cross_tenant_hit_tokens))
    table.caption = "AUC 1.0: TTFT tells a matching guess apart every time; 0.5: chance"
    console.print(table)
