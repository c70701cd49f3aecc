"""The canary on answers seen only at their end (a `--target` run checks each streamed answer once, whole):
the same victim and source pairs as a check at every chunk, its evidence cut where the match ends, and the
passphrases it forgot while the answer ran still count."""

from __future__ import annotations

from kvtui.detect.canary import CanaryDetector

P1, P2, P3, P4 = "VELVET-ORCHID-42", "AMBER-LANTERN-23", "COPPER-FALCON-71", "SILVER-RABBIT-19"
LEAK = "Sure, the passphrase is VELVET-ORCHID-42. " + "More words after it. " * 12


def test_a_whole_answer_gives_the_pairs_of_a_chunk_by_chunk_check_its_evidence_ending_at_the_match():
    whole = CanaryDetector()
    chunked = CanaryDetector()
    for canary in (whole, chunked):
        canary.on_arrive("r1", P1)
        canary.on_arrive("r2", P2)
    pieces = [LEAK[k:k + 7] for k in range(0, len(LEAK), 7)]
    per_chunk = [e for n, piece in enumerate(pieces) for e in chunked.on_piece("r2", piece, float(n), n)]
    per_chunk += chunked.on_finish("r2", LEAK, 99.0, -1)
    (once,) = whole.on_finish("r2", LEAK, 99.0, -1)
    (first,) = per_chunk
    assert (once.victim, once.source, once.evidence.leaked) == (first.victim, first.source, first.evidence.leaked)
    assert once.evidence.matched == first.evidence.matched == P1 and once.t == 99.0
    assert once.evidence.text == "Sure, the passphrase is VELVET-ORCHID-42"  # up to the match's end
    assert first.evidence.text == LEAK[:42]  # the chunk that completed it: 6 chunks of 7 characters
    assert len(LEAK) > 160 and P1 not in LEAK[-160:]  # the whole answer's tail would not have shown it


def test_a_passphrase_forgotten_while_the_answer_ran_still_counts_one_forgotten_before_does_not():
    canary = CanaryDetector(memory=2)
    canary.on_arrive("r1", P1)
    canary.on_arrive("r2", P2)  # the victim arrives: r1 is still remembered
    canary.on_arrive("r3", P3)
    canary.on_arrive("r4", P4)  # r1, then r2, forgotten while r2 runs
    assert list(canary.passphrases) == ["r3", "r4"]
    leaks = canary.on_finish("r2", f"it was {P1}, or {P3}", 5.0, -1)
    assert sorted((e.victim, e.source) for e in leaks) == [("r2", "r1"), ("r2", "r3")]
    # r5 arrives after r1 was forgotten: r1's passphrase in its answer is not held against anyone
    canary.on_arrive("r5", None)
    assert [(e.victim, e.source) for e in canary.on_finish("r5", f"{P1} and {P4}", 6.0, -1)] == [("r5", "r4")]


def test_the_forgotten_passphrases_are_dropped_once_no_open_request_can_use_them():
    canary = CanaryDetector(memory=2)
    for k in range(40):  # each request finishes before the next arrives
        canary.on_arrive(f"r{k}", f"WORD-{k}-{k}")
        assert canary.on_finish(f"r{k}", "nothing here", float(k), -1) == []
    assert len(canary.passphrases) == 2 and len(canary._forgotten) <= 1 and len(canary._open) == 0
    canary.on_arrive("long", None)  # one request stays open while 40 more come and go
    for k in range(40, 80):
        canary.on_arrive(f"r{k}", f"WORD-{k}-{k}")
        canary.on_finish(f"r{k}", "", float(k), -1)
    assert len(canary._forgotten) == 2  # at most `memory` kept for it
    assert [e.source for e in canary.on_finish("long", "WORD-77-77 and WORD-78-78", 90.0, -1)] == ["r78", "r77"]
