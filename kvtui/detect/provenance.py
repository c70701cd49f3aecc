"""prefix_provenance: every block a prefix-cache hit hands to a request must hold what that request
would have computed there itself. The engine records, for each cached block, who wrote it, under
which salt (a digest) and its content key (its tokens chained to its whole prefix, computed without
any fault); for each reuse it reports those beside the reader's own content key and salt.

- a different salt: another tenant's cached prompt served this tenant (`cross_tenant`). The answer
  is right, but the hit itself leaks: a shorter TTFT tells the reader that the other tenant sent
  this prefix (the prefix-cache timing side channel, CVE-2025-46570).
- the same salt, a different content key: K/V computed under another prefix (`cross_request`).

One event per (victim, source) pair, at the step of the hit.
"""

from __future__ import annotations

from kvtui.events import Contamination, ProvenanceEvidence


class ProvenanceDetector:
    """Reads StepEvent.prefix_hits (paged KV with prefix caching)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def on_step(self, report, t: float) -> list[Contamination]:
        """Events for the step's prefix-cache hits whose reused blocks came from another salt or prefix."""
        events = []
        for hit in getattr(report, "prefix_hits", ()):
            by_source: dict[str, list] = {}
            for block in hit.blocks:
                if block.writer_salt != hit.salt or block.writer_key != block.reader_key:
                    by_source.setdefault(block.writer, []).append(block)
            for source, blocks in by_source.items():
                if (hit.request_id, source) in self._seen:
                    continue
                self._seen.add((hit.request_id, source))
                events.append(_event(report, t, hit, source, blocks))
        return events


def _event(report, t: float, hit, source: str, blocks: list) -> Contamination:
    same_salt = all(b.writer_salt == hit.salt for b in blocks)
    return Contamination(
        t=t, step=report.step, detector="prefix_provenance", kind="cross_request" if same_salt else "cross_tenant",
        victim=hit.request_id, source=None if source == hit.request_id else source,
        evidence=ProvenanceEvidence(blocks=tuple(b.block for b in blocks), hit_tokens=sum(b.tokens for b in blocks),
                                    victim_tenant=hit.tenant, source_tenant=blocks[0].writer_tenant,
                                    same_salt=same_salt, same_prefix=all(b.writer_key == b.reader_key for b in blocks)))
