"""`kvtui audit SCENARIO --timing --target URL`: the prefix-cache timing side channel of a real server.

The experiment of the local timing audit (kvtui/audit_timing.py), over HTTP: a victim tenant sends
prompts made of a public prefix (one block, the same for everyone), a secret (one block of random
token ids) and a question; an attacker tenant sends one warm-up (the public block cached under its own
namespace too), then matching probes (public + a victim's secret + a new question) and non-matching
ones (public + a random secret of the same length), one at a time, one token each, in a random order.
A cache hit skips prefill, so TTFT is the attacker's score; ROC AUC = P(a matching probe's TTFT < a
non-matching one's), 1.0 telling every guess apart, 0.5 chance.

Probes are sized to the server's KV block (prefix caches reuse whole blocks): vLLM publishes it in
the labels of `vllm:cache_config_info` (`block_size`, with `enable_prefix_caching`), as `kvtui serve`
does; for a server that does not (llama.cpp, whose prompt cache reuses any prefix), `--block-size`,
else DEFAULT_TARGET_BLOCK_SIZE tokens. Prompts are sent as token ids to the completions API, so the blocks
fall where they are meant to.

Three configurations, each with fresh prompts (nothing one leaves in the cache helps another):

- `different`: each tenant its own fresh random `cache_salt` (vLLM's per-request cache namespace);
- `same`: both tenants the victim's salt: the paired control. Salting splits the cache, it does not
  switch it off, so here the matching probes must reuse the victim's blocks; when they do not, caching
  looks off (or its effect is invisible) and the audit cannot judge a clean `different` row;
- `none`: no salt on either side, as clients of a deployment that should separate tenants by other
  means (a gateway that adds salts, caching off) send them.

Ground truth where the server reports it (`usage.prompt_tokens_details.cached_tokens`, llama.cpp's
`timings.cache_n`): a matching probe that got more cached tokens than the public block the attacker
cached itself read the victim's blocks. The verdict is on the tenants' row (`different`, or `none`
with `--cache-salt none`): one tenant can tell another's prefix when some probe read another tenant's
blocks, or when TTFT separates the classes with AUC >= AUC_LIMIT whatever the server reports. Chance
AUC with 16 probes a class has a standard deviation of about 0.10 (Mann-Whitney), so 0.9 is about
four of them; measured on vLLM CPU here: unsalted 1.00 (hits 56-65 ms against 778-821 ms), per-tenant
salts 0.50-0.66.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import statistics
from dataclasses import dataclass

import httpx

from kvtui.audit_timing import DEFAULT_PROBES, DEFAULT_TARGET_BLOCK_SIZE, make_probes, roc_auc
from kvtui.remote.openai import COMPLETIONS_PATH, stream_request
from kvtui.remote.reach import TargetError, first_model
from kvtui.remote.server_probe import parse_info

AUC_LIMIT = 0.9
CONFIGS = ("different", "same", "none")
CONFIG_TEXT = {"different": "different salts", "same": "same salt (control)", "none": "no salt"}


@dataclass(frozen=True)
class ServerCache:
    """What the server says of its prefix cache: `block_size` (tokens) and `prefix_caching` (None when
    it does not say), and where the block size came from."""

    block_size: int
    source: str
    prefix_caching: bool | None = None


@dataclass(frozen=True)
class TargetTimingRow:
    """One configuration's result.

    Attributes:
        config: "different", "same" or "none" (see the module docstring).
        matching, non_matching: probes of each class.
        ttft_matching_s, ttft_non_matching_s: median TTFT of each class (seconds, client-measured).
        auc: ROC AUC of TTFT as a test for "this prefix is cached by another tenant".
        reported: every probe's response said how many prompt tokens came from the server's cache.
        hit_probes: matching probes that read more cached tokens than their own tenant's public block
            (None when not reported); hit_tokens: those extra tokens, summed.
    """

    config: str
    matching: int
    non_matching: int
    ttft_matching_s: float
    ttft_non_matching_s: float
    auc: float
    reported: bool
    hit_probes: int | None
    hit_tokens: int | None

    @property
    def reuse(self) -> bool:
        """The attacker could tell the victim's prefix: a probe read its blocks, or TTFT separates."""
        return bool(self.hit_probes) or self.auc >= AUC_LIMIT


@dataclass(frozen=True)
class TimingVerdict:
    """The audit's conclusion: `leak` (exit 1), `judged` (the row the verdict is on), `inconclusive`
    (no leak, but the control shows no reuse either: caching looks off, nothing can be judged)."""

    leak: bool
    judged: str
    inconclusive: bool


def verdict(rows: list[TargetTimingRow], cache_salt: str) -> TimingVerdict:
    """The verdict on the tenants' row: `different` with per-tenant salts, `none` without."""
    by = {r.config: r for r in rows}
    judged = "none" if cache_salt == "none" else "different"
    leak = by[judged].reuse
    return TimingVerdict(leak=leak, judged=judged, inconclusive=not leak and not by["same"].reuse)


async def server_cache(client: httpx.AsyncClient, block_size: int | None) -> ServerCache:
    """The block size to size probes to: `block_size` when given, else vLLM's `vllm:cache_config_info`
    labels on /metrics, else DEFAULT_TARGET_BLOCK_SIZE."""
    info: dict[str, str] = {}
    try:
        response = await client.get("/metrics", timeout=10.0)
        if response.status_code == 200:
            info = next((labels for name, labels in parse_info(response.text).items()
                         if name.endswith("cache_config_info")), {})
    except (httpx.HTTPError, ValueError):
        pass
    caching = {"True": True, "False": False}.get(info.get("enable_prefix_caching", ""))
    if block_size is not None:
        return ServerCache(block_size, "--block-size", caching)
    published = info.get("block_size", "")
    if published.isdigit() and int(published) > 0:
        return ServerCache(int(published), "vllm:cache_config_info", caching)
    return ServerCache(DEFAULT_TARGET_BLOCK_SIZE, "default: the server publishes none", caching)


class _Prober:
    """Sends one-token completions one at a time and times their first token."""

    def __init__(self, client: httpx.AsyncClient, model: str | None, timeout_s: float) -> None:
        self.client, self.model, self.timeout_s = client, model, timeout_s

    async def send(self, prompt: list[int], salt: str | None) -> tuple[float, int | None]:
        """(TTFT in seconds, cached prompt tokens the server reported or None).

        Raises:
            TargetError: the request failed (the audit cannot go on without its probes).
        """
        body: dict = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if salt is not None:
            body["cache_salt"] = salt
        r = await stream_request(self.client, COMPLETIONS_PATH, body, timeout_s=self.timeout_s)
        if r.finish_reason == "error" or r.first_s is None:
            raise TargetError(f"a timing probe failed: {r.error or 'no token came back'}")
        return r.first_s - r.sent_s, r.cached_tokens


async def measure(prober: _Prober, tokenizer, config: str, *, count: int, block_size: int,
                  seed: int) -> TargetTimingRow:
    """One configuration with fresh prompts drawn from `seed` (see the module docstring)."""
    probes = make_probes(tokenizer, seed, count=count, block_size=block_size, public_blocks=1, secret_blocks=1)
    victim_salt = secrets.token_hex(16) if config != "none" else None
    attacker_salt = {"different": secrets.token_hex(16), "same": victim_salt, "none": None}[config]
    for prompt in probes.victims:
        await prober.send(prompt, victim_salt)
    await prober.send(probes.warmup, attacker_salt)
    ttft: dict[bool, list[float]] = {True: [], False: []}
    cached: list[int | None] = []
    for matching, prompt in probes.probes:
        t, c = await prober.send(prompt, attacker_salt)
        ttft[matching].append(t)
        if matching:
            cached.append(c)
    reported = all(c is not None for c in cached)
    extra = [max((c or 0) - block_size, 0) for c in cached] if reported else None
    return TargetTimingRow(config, len(ttft[True]), len(ttft[False]), statistics.median(ttft[True]),
                           statistics.median(ttft[False]), roc_auc(ttft[True], ttft[False]), reported,
                           sum(1 for e in extra if e) if extra is not None else None,
                           sum(extra) if extra is not None else None)


async def _audit(options, tokenizer, *, probes: int, block_size: int | None, say) -> tuple[ServerCache, list]:
    async with httpx.AsyncClient(base_url=options.url.rstrip("/"), transport=options.transport,
                                 timeout=httpx.Timeout(options.timeout_s)) as client:
        first = await first_model(client, options.url, options.served_model)
        model = options.served_model or first.get("id")
        cache = await server_cache(client, block_size)
        say(f"audit --timing: probes of {cache.block_size} tokens a block ({cache.source})")
        prober = _Prober(client, model, options.timeout_s)
        rng = random.Random(secrets.randbits(64))  # fresh prompts on every run: the server's cache outlives runs
        rows = []
        for config in CONFIGS:
            say(f"audit --timing: {probes} victims, {2 * probes} probes, {CONFIG_TEXT[config]}")
            rows.append(await measure(prober, tokenizer, config, count=probes, block_size=cache.block_size,
                                      seed=rng.randrange(1 << 62)))
        return cache, rows


def run_target_timing(options, tokenizer, *, probes: int = DEFAULT_PROBES, block_size: int | None = None,
                      console=None) -> tuple[ServerCache, list[TargetTimingRow]]:
    """The three configurations against the server in `options` (a TargetOptions: url, served_model,
    timeout_s, transport); returns what the server said of its cache and one row per configuration.

    Raises:
        TargetError: the server cannot be reached, or a probe failed.
    """
    def say(text: str) -> None:
        if console is not None:
            console.print(text, markup=False, highlight=False)

    return asyncio.run(_audit(options, tokenizer, probes=probes, block_size=block_size, say=say))


def print_target_timing(cache: ServerCache, rows: list[TargetTimingRow], console) -> None:
    """The result table: per configuration, probes, median TTFTs, ROC AUC and the ground truth."""
    from rich.table import Table

    table = Table(title="prefix-cache timing side channel against the server: TTFT as a test for another "
                        f"tenant's cached prefix (blocks of {cache.block_size} tokens)", title_justify="left")
    for column in ("tenants", "probes (matching / not)", "TTFT median matching / not", "ROC AUC",
                   "matching probes that read the victim's blocks"):
        table.add_column(column)
    for r in rows:
        truth = "not reported by the server" if r.hit_probes is None else \
            f"{r.hit_probes} of {r.matching} ({r.hit_tokens} cached tokens)"
        table.add_row(CONFIG_TEXT[r.config], f"{r.matching} / {r.non_matching}",
                      f"{r.ttft_matching_s * 1000:.1f} / {r.ttft_non_matching_s * 1000:.1f} ms", f"{r.auc:.3f}", truth)
    table.caption = (f"AUC 1.0: TTFT tells a matching guess apart every time; 0.5: chance. Ground truth: the "
                     "server's cached-token counts (usage.prompt_tokens_details.cached_tokens, llama.cpp timings."
                     f"cache_n). Leak: a probe read another tenant's blocks, or AUC >= {AUC_LIMIT}")
    console.print(table)
