"""The tenant-salt check: `kvtui audit --timing --target`'s experiment (kvtui/remote/timing.py) with
fewer probes, judged on the server's cached-token counts when it reports them (the ground truth), else
on TTFT's ROC AUC."""

from __future__ import annotations

from kvtui.conformance.base import CheckResult, Server, not_applicable
from kvtui.remote.timing import AUC_LIMIT, CONFIG_TEXT, run_target_timing

SALTS = "tenant_salts"
TITLE = "tenant salts (prefix cache)"


def _row_text(row) -> str:
    hits = "hits not reported" if row.hit_probes is None else f"{row.hit_probes}/{row.matching} probes hit"
    return f"{CONFIG_TEXT[row.config]}: {hits}, AUC {row.auc:.2f}"


def tenant_salts(server: Server) -> CheckResult:
    """A victim tenant caches secret prefixes; an attacker with another cache_salt probes them one token at
    a time. Fail: a probe read the victim's cached blocks (or, unreported, TTFT tells them apart: AUC >=
    AUC_LIMIT). n/a when even the same salt (the control) shows no reuse: prefix caching looks off."""
    probes = 6 if server.quick else 12
    sent = (f"3 configurations (different salts, same salt, no salt), each {probes} victim prompts then "
            f"{2 * probes} one-token probes, one at a time")
    server.say(f"tenant salts: {sent}")
    refused = server.salt_refusal()
    if refused:
        return not_applicable(SALTS, TITLE, sent, f"{refused}: tenants cannot be given cache namespaces of their own")
    cache, rows = run_target_timing(server.options(), server.tokenizer, probes=probes, console=None)
    by = {r.config: r for r in rows}
    figures = f"blocks of {cache.block_size} tokens ({cache.source}); " + "; ".join(_row_text(r) for r in rows)

    def reuse(row) -> bool:
        return bool(row.hit_probes) if row.reported else row.auc >= AUC_LIMIT

    tenants, control = by["different"], by["same"]
    if reuse(tenants):
        seen = (f"{tenants.hit_probes} of {tenants.matching} matching probes read {tenants.hit_tokens} tokens of the "
                "victim's cached blocks" if tenants.reported else
                f"TTFT tells matching probes apart: AUC {tenants.auc:.2f} >= {AUC_LIMIT}")
        return CheckResult(SALTS, TITLE, "fail", sent, figures,
                           f"with different cache_salts {seen} (median TTFT {tenants.ttft_matching_s * 1000:.0f} vs "
                           f"{tenants.ttft_non_matching_s * 1000:.0f} ms)")
    if not reuse(control):
        off = " (the server says enable_prefix_caching=False)" if cache.prefix_caching is False else ""
        return not_applicable(SALTS, TITLE, sent, "even with the same salt no probe reused the victim's blocks: "
                              f"prefix caching looks off{off}, so salts cannot be judged", figures)
    return CheckResult(SALTS, TITLE, "pass", sent, figures)
