"""prefix_provenance: every block a prefix-cache hit hands to a request must hold what that request
would have computed there itself. The engine records, for each cached block, who wrote it, under
which salt (a digest) and its content key (its tokens chained to its whole prefix, computed without
any fault); for each reuse it reports those beside the reader's own content key and salt.

- a different salt: another tenant's cached prompt served this tenant (`cross_tenant`). The answer
  is right, but the hit itself leaks: a shorter TTFT tells the reader that the other tenant sent
  this prefix (the prefix-cache timing side channel, CVE-2025-46570).
- the same salt, a different content key: K/V computed under another prefix (`cross_request`).
- a block restored from the KV offload tier whose bytes after the restore are not those the tier stored
  (`cross_request`): the restore wrote them in another layout, or skipped the block, which then holds
  its previous owner's K/V. The source is the request whose bytes it holds (the previous owner), else
  the request that computed the stored block.

Encoder-decoder models (Whisper): every encoder-cache hit (StepEvent.encoder_hit_log) is checked the
same way: the cross-attention K/V a request was handed must have been computed from its own audio (the
same sha256); one computed from other audio is a cross_request report naming the request whose
admission computed it.

One event per (victim, source) pair, at the step of the hit.
"""

from __future__ import annotations

from kvtui.detect.observer import Quiet, StepSeen
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
                if block.tier and block.intact is False:
                    by_source.setdefault(block.found_writer or block.writer, []).append(block)
                elif block.writer_salt != hit.salt or block.writer_key != block.reader_key:
                    by_source.setdefault(block.writer, []).append(block)
            for source, blocks in by_source.items():
                if (hit.request_id, source) in self._seen:
                    continue
                self._seen.add((hit.request_id, source))
                events.append(_event(report, t, hit, source, blocks))
        for hit in getattr(report, "encoder_hit_log", ()) or ():
            if hit.entry_audio_hash != hit.audio_hash and (hit.request_id, hit.computed_for) not in self._seen:
                self._seen.add((hit.request_id, hit.computed_for))
                events.append(_encoder_event(report, t, hit))
        return events


class ProvenanceObserver(Quiet):
    """`prefix_provenance` as a run's observer (kvtui/run/observers.py): each step's prefix-cache and
    encoder-cache hits."""

    name = "prefix_provenance"

    def __init__(self) -> None:
        self.detector = ProvenanceDetector()

    def on_step(self, step: StepSeen) -> list[Contamination]:
        return self.detector.on_step(step.report, step.t)


def _encoder_event(report, t: float, hit) -> Contamination:
    """An encoder-cache hit on K/V computed from other audio (victim: the reader)."""
    return Contamination(
        t=t, step=report.step, detector="prefix_provenance", kind="cross_request", victim=hit.request_id,
        source=hit.computed_for, evidence=ProvenanceEvidence(
            blocks=(), hit_tokens=0, victim_tenant=None, source_tenant=None, same_salt=True, same_prefix=False,
            audio_hash=hit.audio_hash, source_audio_hash=hit.entry_audio_hash))


def _event(report, t: float, hit, source: str, blocks: list) -> Contamination:
    same_salt = all(b.writer_salt == hit.salt for b in blocks)
    # another salt under the same tenant: a speech request's audio hash is part of its salt
    cross_tenant = not same_salt and blocks[0].writer_tenant != hit.tenant
    return Contamination(
        t=t, step=report.step, detector="prefix_provenance", kind="cross_tenant" if cross_tenant else "cross_request",
        victim=hit.request_id, source=None if source == hit.request_id else source,
        evidence=ProvenanceEvidence(blocks=tuple(b.block for b in blocks), hit_tokens=sum(b.tokens for b in blocks),
                                    victim_tenant=hit.tenant, source_tenant=blocks[0].writer_tenant,
                                    same_salt=same_salt, same_prefix=all(b.writer_key == b.reader_key for b in blocks),
                                    tier_intact=_tier_intact(blocks)))


def _tier_intact(blocks: list) -> bool | None:
    """Whether every block restored from the offload tier holds the bytes the tier stored (None: no such block)."""
    restored = [b for b in blocks if b.tier]
    return all(b.intact for b in restored) if restored else None
