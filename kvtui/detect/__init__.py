"""Contamination detectors. Each turns what it sees into typed `Contamination` events
(kvtui.events): victim request, source request when known, step, kind and evidence.

Kinds: `cross_request` (information from another request reached the victim), `cross_tenant`
(another tenant's cached KV served the victim: paged KV prefix caching), `corruption`
(self-damage: pads, wrong offsets, NaN), `numeric` (a near-tie flipped by numerical batch variance;
never counted as contamination).
"""

from kvtui.detect.canary import CanaryDetector
from kvtui.detect.engine_signals import EngineSignalDetector
from kvtui.detect.provenance import ProvenanceDetector
from kvtui.detect.reference import ReferenceDetector, numeric_tolerance

DETECTOR_NAMES = ("reference", "canary", "attention_flow", "slot_taint", "prefix_provenance")
CONTAMINATION_KINDS = ("cross_request", "cross_tenant", "corruption")

__all__ = ["DETECTOR_NAMES", "CONTAMINATION_KINDS", "CanaryDetector", "EngineSignalDetector", "ProvenanceDetector",
           "ReferenceDetector", "numeric_tolerance"]
