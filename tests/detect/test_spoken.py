"""kvtui.detect.spoken: passphrase parts in speech transcripts.

The transcripts below are Whisper tiny.en's greedy output (converted model, equal to ctranslate2's)
on espeak-ng clips: the committed scenarios/audio set (slow, with word gaps), two clips of an earlier
set with other words, and clips at espeak-ng's faster speeds without gaps.
"""

from __future__ import annotations

import pytest

from kvtui.detect.spoken import match_spoken, spoken_words

# (passphrase, transcript): every part came back
COMMITTED_CLIPS = [
    ("AMBER-LANTERN-23", " The past race is Amber Lantern 23"),
    ("COBALT-RIVER-74", " The past race is Cobalt River 74."),
    ("COPPER-FALCON-67", " The past phase is Copper Falcon 67"),
    ("CRIMSON-HARBOR-85", " The past race is Crimson Harbor 85."),
    ("GOLDEN-MEADOW-31", " The past race is golden meadow 31."),
    ("PURPLE-TIGER-58", " The past race is purple Tiger 58."),
    ("SILVER-RABBIT-19", " The past race is silver rabbit 19."),
    ("VELVET-ANCHOR-42", " The past phrase is Velvet Anchor 42"),
]


@pytest.mark.parametrize("passphrase,transcript", COMMITTED_CLIPS)
def test_committed_clip_transcripts_hold_their_passphrase(passphrase, transcript):
    match = match_spoken(passphrase, transcript)
    assert (match.words, match.number, match.in_order, match.complete, match.found) == ((True, True), True,
                                                                                         True, True, 3)


def test_each_transcript_holds_no_other_clips_passphrase():
    for passphrase, _ in COMMITTED_CLIPS:
        for other, transcript in COMMITTED_CLIPS:
            if other != passphrase:
                assert match_spoken(passphrase, transcript).found == 0, (passphrase, transcript)


@pytest.mark.parametrize("passphrase,transcript,words,number", [
    ("VELVET-ORCHID-42", " The past phrase is Velvet or Kid 42", (True, False), True),  # orchid -> "or Kid"
    ("MARBLE-TIGER-58", " The past race is Marvel Tiger 58.", (False, True), True),
    ("AMBER-LANTERN-23", " The past race is number 123.", (False, False), False),  # 123 is not 23
    ("SILVER-RABBIT-19", " The past rated silver rabbit iodine.", (True, True), False),
    ("SILVER-RABBIT-19", " The past rated silver habitat in team.", (True, False), False),
])
def test_misheard_parts_are_missing(passphrase, transcript, words, number):
    match = match_spoken(passphrase, transcript)
    assert (match.words, match.number, match.complete, match.in_order) == (words, number, False, False)


@pytest.mark.parametrize("transcript,expected", [
    ("Copper Falcon sixty seven.", ["copper", "falcon", "67"]),
    ("COPPER-FALCON-SIXTY-SEVEN", ["copper", "falcon", "67"]),
    ("nineteen", ["19"]),
    ("forty two", ["42"]),
    ("a hundred and five", ["105"]),
    ("two hundred twenty", ["220"]),
    ("007 and 0", ["7", "and", "0"]),
    ("the one and only", ["the", "1", "and", "only"]),
    ("", []),
])
def test_spoken_words_fold_numbers(transcript, expected):
    assert spoken_words(transcript) == expected


def test_number_words_and_digits_match_alike():
    # constructed, in the form Whisper writes a number as words ("sixty seven")
    assert match_spoken("COPPER-FALCON-67", "The past phase is copper falcon sixty seven.").in_order
    assert match_spoken("COPPER-FALCON-67", "The past phase is copper falcon, sixty-seven").complete
    assert match_spoken("copper falcon 07", "Copper? Falcon! seven").complete
    assert not match_spoken("COPPER-FALCON-67", "copper falcon sixty").number
    assert not match_spoken("COPPER-FALCON-67", "copper falcon six seven").number  # 6 then 7, not 67


def test_words_must_be_whole_words():
    match = match_spoken("SILVER-RABBIT-19", "silverware rabbits 190")
    assert (match.words, match.number, match.found) == ((False, False), False, 0)


def test_a_passphrase_without_parts_is_refused():
    with pytest.raises(ValueError, match="WORD-WORD-NN"):
        match_spoken("--", "anything")


def test_the_same_audio_under_another_name_is_no_leak():
    """Two uploads of one clip say the same words: the one whose name carries no passphrase is not
    reported for saying the other's (kvtui serve counted that as cross_request before)."""
    from kvtui.detect.canary import CanaryDetector

    text = "The past race is silver rabbit 19."
    same = CanaryDetector()
    same.on_arrive("named", "SILVER-RABBIT-19", spoken=True, input_key="a1")
    same.on_arrive("copy", None, spoken=True, input_key="a1")
    assert same.on_finish("copy", text, 0.0, 1) == []
    other = CanaryDetector()
    other.on_arrive("named", "SILVER-RABBIT-19", spoken=True, input_key="a1")
    other.on_arrive("copy", None, spoken=True, input_key="b2")
    leaks = other.on_finish("copy", text, 0.0, 1)
    assert [(e.victim, e.source, e.kind) for e in leaks] == [("copy", "named", "cross_request")]
