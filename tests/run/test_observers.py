"""Detectors as observers (kvtui/run/observers.py): the run loops hold no detector attribute, the registry
names every detector, every observer has the protocol's shape, and the reports reach a run in the same
order, with the same victims and sources, as when each detector was wired into the session by hand
(the expected lists were taken from that code on the same scenarios)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI
from test_faults import scenario

import kvtui.detect
from kvtui.detect import DETECTOR_NAMES
from kvtui.detect.observer import Arrival, DrainBudget, Finished, Quiet, StepSeen
from kvtui.run.observers import OBSERVERS, TARGET_OBSERVERS, Observer, ObserverContext, build_observers
from kvtui.scenario import load_scenario
from kvtui.session import Session

ROOT = Path(__file__).parents[2]
# the attributes the sessions once held a detector in, and every detector name
DETECTOR_ATTRIBUTES = {"canary", "reference", "provenance", "constraint", "sampling", "signals", *DETECTOR_NAMES}


def _self_attribute(node) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
        node.value.id == "self" else None


@pytest.mark.parametrize("path", ["kvtui/session.py", "kvtui/remote/session.py"])
def test_no_session_tests_or_holds_a_detector_attribute(path):
    """No `self.<detector> is (not) None`, and no `self.<detector> = ...`: detectors are in self.observers."""
    tested, held = [], []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            tested += [name for side in (node.left, *node.comparators)
                       if (name := _self_attribute(side)) in DETECTOR_ATTRIBUTES]
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            held += [name for t in targets if (name := _self_attribute(t)) in DETECTOR_ATTRIBUTES]
    assert tested == [] and held == []


def test_the_registry_names_every_detector_and_each_observer_class_is_registered(tiny):
    assert set(DETECTOR_NAMES) <= set(OBSERVERS) and set(OBSERVERS) - set(DETECTOR_NAMES) == {"engine"}
    assert set(TARGET_OBSERVERS) <= set(DETECTOR_NAMES)
    loaded = tiny["tiny-llama"]
    built = build_observers(DETECTOR_NAMES, ObserverContext(DETECTOR_NAMES, loaded, loaded.tokenizer))
    # every observer class of kvtui/detect/ is one of those the registry builds
    classes = set()
    for module in pkgutil.iter_modules(kvtui.detect.__path__):
        mod = importlib.import_module(f"kvtui.detect.{module.name}")
        classes |= {c for _, c in inspect.getmembers(mod, inspect.isclass)
                    if issubclass(c, Quiet) and c is not Quiet and c.__module__ == mod.__name__}
    assert {type(o) for o in built} == classes and len(classes) == 7
    # in the order their reports go out: the engine's signals, ..., the canary, the reference last
    assert [o.name for o in built] == ["engine", "prefix_provenance", "constraint", "sampling_provenance",
                                       "state_provenance", "canary", "reference"]
    for o in built:
        assert isinstance(o, Observer), type(o)
        assert o.name in OBSERVERS and OBSERVERS[o.name](ObserverContext(DETECTOR_NAMES, loaded, loaded.tokenizer)).name \
            == o.name
    assert not isinstance(object(), Observer)


def test_build_observers_builds_each_factory_once_and_a_target_only_what_it_sees_from_outside(tiny):
    loaded = tiny["tiny-llama"]
    context = ObserverContext((), loaded, loaded.tokenizer)
    [engine] = build_observers(("slot_taint", "attention_flow"), context)
    assert (engine.name, engine.detector.taint, engine.detector.flow) == ("engine", True, True)
    [engine] = build_observers(("attention_flow",), context)  # taint off: the names, not the context's
    assert (engine.detector.taint, engine.detector.flow) == (False, True)
    assert [o.name for o in build_observers((), context)] == ["engine"]  # the engine's own errors always
    assert [o.name for o in build_observers(("reference", "canary"), target=True)] == ["canary"]
    assert build_observers(("reference",), target=True) == []
    with pytest.raises(ValueError, match="unknown detector 'canery'; known: reference, canary"):
        build_observers(("canery",), context)


def test_quiet_observer_reports_nothing_and_waits_for_nothing():
    quiet = Quiet()
    assert quiet.on_arrive(Arrival("r0", "VELVET-ORCHID-42")) == []
    assert quiet.on_step(StepSeen(0.5, 3, (("r0", "hi"),))) == []
    assert quiet.on_finish(Finished("r0", "hi", 0.5, 3, "stop", completed=True)) == []
    assert quiet.drain(DrainBudget(lambda: 0.0)) == []
    assert (quiet.pending, quiet.counts(), quiet.skip_pending()) == (0, None, 0)


def test_canary_observer_names_victim_and_source_from_pieces_and_final_text():
    from kvtui.detect.canary import CanaryObserver

    canary = CanaryObserver()
    canary.on_arrive(Arrival("r0", "VELVET-ORCHID-42"))
    canary.on_arrive(Arrival("r1", "COPPER-RIVER-17"))
    assert canary.on_step(StepSeen(1.0, 4, (("r1", "the VELVET"), ("r0", "VELVET")))) == []
    [leak] = canary.on_step(StepSeen(1.5, 5, (("r1", "-ORCHID"),)))
    assert (leak.detector, leak.victim, leak.source, leak.step, leak.t, leak.evidence.matched) == \
        ("canary", "r1", "r0", 5, 1.5, "VELVET-ORCHID")
    assert canary.on_finish(Finished("r1", "the VELVET-ORCHID", 2.0, 6, "stop")) == []  # reported once
    assert canary.on_finish(Finished("r0", "COPPER-RIVER", 2.0, 6, "rejected")) == []  # never ran: not read
    [late] = canary.on_finish(Finished("r0", "RIVER-17", 2.0, 6, "stop"))
    assert (late.victim, late.source, late.step) == ("r0", "r1", 6)


def contamination(session) -> list[tuple]:
    return [(e.detector, e.kind, e.victim, e.source, e.step) for e in session.contamination]


def test_stale_slot_reports_reach_the_run_in_the_order_the_hand_wired_detectors_gave(tiny):
    session = Session(scenario("padded", faults=["stale_slot"]), tiny["tiny-llama"], clock="virtual")
    session.run()
    r = "cross_request"
    assert contamination(session) == [
        ("slot_taint", r, "r003", "r000", 8), ("attention_flow", r, "r003", "r000", 8),
        ("slot_taint", r, "r004", "r001", 9), ("slot_taint", r, "r005", "r002", 9),
        ("attention_flow", r, "r004", "r001", 9), ("attention_flow", r, "r005", "r002", 9),
        ("reference", r, "r003", None, 8), ("reference", r, "r004", None, 9), ("reference", r, "r005", None, 9)]
    assert session.observer("reference").checked == 6 and session.observer("reference").pending == 0
    assert session.summary.contamination_by_fault == {"stale_slot": 9}  # each counted for the fault of its step
    assert session.observer("slot_taint") is None  # one observer, "engine", holds slot_taint and attention_flow


def test_row_state_misalign_interleaves_constraint_and_sampling_reports_as_before(tiny):
    session = Session(scenario("padded", faults=["row_state_misalign"]), tiny["tiny-llama"], clock="virtual")
    session.run()
    r, c, s, ref = "cross_request", "constraint", "sampling_provenance", "reference"
    assert contamination(session) == [
        (c, r, "r001", "r000", 11), (c, r, "r003", "r002", 11), (s, r, "r001", "r000", 11),
        (s, r, "r002", "r001", 11), (s, r, "r003", "r002", 11), (s, r, "r003", "r000", 15),
        (s, r, "r004", "r001", 15), (c, r, "r005", "r000", 17), (s, r, "r005", "r000", 17),
        (s, r, "r008", "r007", 23), (s, r, "r009", "r008", 23), (ref, r, "r001", None, 11),
        (ref, r, "r002", None, 11), (ref, r, "r003", None, 11), (ref, r, "r004", None, 15),
        (c, r, "r008", "r000", 26), (s, r, "r008", "r000", 26), (s, r, "r011", "r007", 26),
        (s, r, "r011", "r000", 33), (ref, r, "r005", None, 17), (ref, r, "r009", None, 23),
        (ref, r, "r008", None, 24), (ref, r, "r011", None, 36)]


def test_only_the_named_detectors_report(tiny):
    session = Session(scenario("padded", faults=["stale_slot"]), tiny["tiny-llama"], clock="virtual",
                      detectors=("attention_flow",))
    session.run()
    assert [o.name for o in session.observers] == ["engine"] and session.observer("reference") is None
    assert {e.detector for e in session.contamination} == {"attention_flow"}
    assert {(e.victim, e.source) for e in session.contamination} == {("r003", "r000"), ("r004", "r001"),
                                                                      ("r005", "r002")}


def test_smollm2_stale_slot_canary_names_the_same_victims_and_sources(smollm2):
    """scenarios/faults/stale_slot.yaml: the later requests answer with the earlier owners' passphrases."""
    session = Session(load_scenario(ROOT / "scenarios/faults/stale_slot.yaml"), smollm2, clock="virtual")
    session.run()
    canary = [(e.victim, e.source, e.step) for e in session.contamination if e.detector == "canary"]
    assert canary == [("r002", "r000", 45), ("r005", "r001", 61), ("r004", "r000", 77)]
    phrases = session.observer("canary").detector.passphrases
    assert all(phrases[e.source] == e.evidence.leaked for e in session.contamination if e.detector == "canary")
    assert [(e.victim, e.step) for e in session.contamination if e.detector == "reference"] == [
        ("r002", 15), ("r003", 18), ("r005", 50), ("r004", 47)]


def test_a_target_run_builds_its_observers_with_build_observers(monkeypatch):
    from test_target import TOK, phrases
    from test_target import scenario as target_scenario

    import kvtui.remote.session as remote
    from kvtui.detect.canary import CanaryObserver

    calls = []

    def spy(names, context=None, *, target=False):
        calls.append((tuple(names), target))
        return build_observers(names, context, target=target)

    monkeypatch.setattr(remote, "build_observers", spy)
    spec = target_scenario(4)
    fake = FakeOpenAI(leak=True, delay_s=0.01)
    options = remote.TargetOptions(url="http://fake", transport=fake.transport())
    both = remote.TargetSession(spec, TOK, options, detectors=("reference", "canary"))
    assert [type(o) for o in both.observers] == [CanaryObserver]  # its reference: solo reruns after the load
    session = remote.TargetSession(spec, TOK, options, detectors=("canary",))
    assert calls == [(("reference", "canary"), True), (("canary",), True)]
    session.run()
    by_phrase = phrases(spec)
    truth = {(by_phrase[victim], by_phrase[leaked]) for victim, leaked in fake.leaks}
    assert len(truth) == 3
    assert {(e.victim, e.source) for e in session.contamination if e.detector == "canary"} == truth
    assert session.observer("canary").detector.passphrases == {rid: p for p, rid in by_phrase.items()}
