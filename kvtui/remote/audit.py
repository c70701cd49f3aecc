"""`kvtui audit SCENARIO --target URL`: the noninterference audit (kvtui/run/noninterference.py) against a server.

Three runs of the scenario's load: as planned, then with the prompts of the even requests replaced by
different prompts a few tokens longer, then the odd ones. A request whose prompt stayed must get the
same answer in every run. On the wall clock the batches differ from run to run anyway, so a changed
answer is compared as the reference check compares: the first differing token's top-2 logprob gap
within the tolerance is `numeric`; beyond it the answer moved with its neighbours' content:
`cross_request`, naming the replaced neighbours that were in flight with it in the first run; without
logprobs, `unknown`.

Every request of the three runs goes past the server's prefix cache (a fresh `cache_salt` each, or
`cache_prompt: false` to llama.cpp): a run that reused the KV an earlier run wrote for the same prompt
would copy that run's answer instead of computing its own. A request whose server still reports cached
prompt tokens in either run is not compared, and counted (`TargetAudit.cached`).
"""

from __future__ import annotations

from dataclasses import replace

from kvtui.remote.openai import StreamResult
from kvtui.remote.options import TargetOptions
from kvtui.remote.session import TargetSession
from kvtui.remote.solo_check import first_divergence
from kvtui.run.noninterference import AuditRun, Change, NoninterferenceAudit, run_noninterference

TargetAudit = NoninterferenceAudit  # what run_target_audit returns (events, compared, cached)
REPLACEMENT_ROOM = 8  # tokens a replacement prompt may grow by (a server's max_len is not known here)


class TargetSubject:
    """The audit's runs against a server (kvtui.run.noninterference.AuditSubject): an answer is the
    streamed result; who could reach a request, the requests in flight with it; answers compared with
    the reference check's logprob tolerance (kvtui.remote.solo_check.first_divergence)."""

    def __init__(self, spec, tokenizer, options: TargetOptions) -> None:
        # clients send no ids of their own here: a server that mixes up duplicated ids (the request-id audit
        # of `kvtui run --target`) would make the three runs' answers differ for that reason alone
        self.spec = spec.model_copy(update={"request_ids": None}) if spec.request_ids is not None else spec
        self.tokenizer = tokenizer
        self.options = replace(options, uncached_load=True)

    def run(self, planned: list | None) -> AuditRun:
        session = TargetSession(self.spec, self.tokenizer, self.options, detectors=(), planned=planned)
        run = AuditRun(planned=list(session.pending), answers={})
        session.run()
        run.answers = dict(session.results)
        run.neighbours = {rid: session.overlapping(rid) for rid in session.results}
        run.cached = {rid for rid, r in session.results.items() if r.cached_tokens}
        return run

    def room(self, planned) -> int:
        return REPLACEMENT_ROOM

    def compare(self, baseline: StreamResult, changed: StreamResult) -> Change | None:
        if "error" in (baseline.finish_reason, changed.finish_reason):
            return None
        tolerance = self.options.tolerance
        d = first_divergence(baseline, changed, tolerance)
        if d is None:
            return None
        return Change(index=d.index, kind="cross_request" if d.kind == "corruption" else d.kind,
                      baseline_text=baseline.text, changed_text=changed.text,
                      gap=None if d.gap is None else round(d.gap, 6), tolerance=tolerance)


def run_target_audit(spec, tokenizer, options: TargetOptions, *, console=None) -> TargetAudit:
    """The three runs; a `noninterference` report for every kept request whose answer changed (kinds
    numeric, cross_request or unknown, see the module docstring).

    Raises:
        TargetError: the server cannot be reached.
    """
    return run_noninterference(TargetSubject(spec, tokenizer, options), console=console)
