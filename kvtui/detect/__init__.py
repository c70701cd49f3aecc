"""Contamination detectors. Each turns what it sees into typed `Contamination` events
(kvtui.events): victim request, source request when known, step, kind and evidence.

Kinds: `cross_request` (information from another request reached the victim), `cross_tenant`
(another tenant's cached KV served the victim: paged KV prefix caching), `corruption` (self-damage
that happens with no other request present), `numeric` (a near tie flipped by numerical batch
variance; never counted as contamination). findings.py joins the reports on one victim.

The detector classes are imported from their modules (canary, constraint, engine_signals,
provenance, reference, sampling: sampling_provenance, state_provenance); this package itself imports no torch, so replaying a recording stays light.
Each module also holds its detector's observer (a `...Observer` deriving from observer.Quiet), the
shape in which a run holds it (kvtui/run/observers.py: the protocol, the registry, build_observers).
"""

DETECTOR_NAMES = ("reference", "canary", "attention_flow", "slot_taint", "prefix_provenance", "constraint",
                  "sampling_provenance", "state_provenance")
CONTAMINATION_KINDS = ("cross_request", "cross_tenant", "corruption")

_LAZY = {"CanaryDetector": "canary", "EngineSignalDetector": "engine_signals", "ReferenceDetector": "reference",
         "numeric_tolerance": "reference", "Findings": "findings", "ProvenanceDetector": "provenance",
         "ConstraintDetector": "constraint", "SamplingProvenanceDetector": "sampling",
         "StateProvenanceDetector": "state_provenance"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kvtui.detect.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvtui.detect' has no attribute {name!r}")


__all__ = ["CONTAMINATION_KINDS", "DETECTOR_NAMES", *_LAZY]
