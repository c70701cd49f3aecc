"""One step type from the engine to the recording: what Engine.step() returns is the `step` line, with
honest names under paged KV; recordings of earlier format versions still read and replay."""

import gzip
import json
from pathlib import Path

import pytest
from helpers import make_engine

from kvtui.cli import replay_summary
from kvtui.config import EngineConfig
from kvtui.engine import Engine, SamplingParams
from kvtui.events import PAGED_STEP_FIELDS, SLOT_STEP_FIELDS, VERSION, StepEvent, parse_event
from kvtui.record import read_recording

OLD = Path(__file__).parents[1] / "data" / "recordings"
# Recordings written by earlier kvtui versions (kept verbatim, gzipped): version 1 with slot KV
# (recordings/bucketing_off.jsonl as first committed) and version 2 with paged KV
# (recordings/shared_system_prompt_no_prefix_caching.jsonl before format 3).
OLD_RECORDINGS = ["v1_bucketing_off.jsonl.gz", "v2_shared_system_prompt_no_prefix_caching.jsonl.gz"]


def _unpacked(name: str, tmp_path: Path) -> Path:
    path = tmp_path / name.removesuffix(".gz")
    path.write_bytes(gzip.decompress((OLD / name).read_bytes()))
    return path


def _engine(tiny, **kw) -> Engine:
    config = EngineConfig(**{"num_slots": 2, "max_len": 64, "max_batch_size": 2, **kw})
    return make_engine(tiny["tiny-llama"].model, config)


def _submit_three(engine: Engine) -> None:
    for i, prompt in enumerate(([1, 2, 3], [4, 5, 6, 7], [8, 9])):
        engine.submit(f"r{i}", prompt, SamplingParams(max_new_tokens=3))


def test_the_engine_step_is_the_recorded_line(tiny):
    """A step written and read back is the engine's own step, less only the in-memory fields."""
    engine = _engine(tiny)
    _submit_three(engine)
    for report in engine.run_until_done():
        assert isinstance(report, StepEvent)
        line = json.loads(report.to_json())
        assert not set(line) & set(PAGED_STEP_FIELDS) and not {"finished", "nonfinite"} & set(line)
        back = parse_event(line)
        assert back == report.model_copy(update={
            "finished": (), "nonfinite": (),
            "running": tuple(r.model_copy(update={"top2_gap": None, "nonfinite": False, "ttft_s": None,
                                                      "sampled_with": None})
                             for r in report.running)})


def test_paged_steps_count_running_requests_by_their_own_names(tiny):
    """Under paged KV the step says running requests and max_batch_size (it used to call them slots)."""
    engine = _engine(tiny, kv="paged", block_size=4, num_blocks=40)
    _submit_three(engine)
    first = engine.step()
    assert (first.num_running, first.max_batch_size, first.num_waiting) == (2, 2, 1)
    assert (first.slots_used, first.num_slots, first.occupancy) == (None, None, 1.0)
    assert [r.slot for r in first.running] == [None, None]
    line = json.loads(first.to_json())
    assert line["kv"] == "paged" and not set(line) & set(SLOT_STEP_FIELDS)
    assert (line["num_running"], line["max_batch_size"]) == (2, 2)
    assert [(r["request_id"], r["query_tokens"]) for r in line["running"]] == [("r0", 3), ("r1", 4)]


@pytest.mark.parametrize("name", OLD_RECORDINGS)
def test_old_recordings_replay_to_the_summaries_they_were_written_with(name, tmp_path):
    header, events, summary, truncated = read_recording(_unpacked(name, tmp_path))
    assert header.version < VERSION and not truncated and summary is not None
    replayed = replay_summary(header, events, summary)
    written = summary.model_dump(exclude_unset=True)
    assert {k: v for k, v in replayed.model_dump().items() if k in written} == written


@pytest.mark.parametrize("name", OLD_RECORDINGS)
def test_old_step_lines_read_as_the_step_type(name, tmp_path):
    """Each old step line, as the old kvtui wrote it, against the step type it reads as."""
    path = _unpacked(name, tmp_path)
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    header, events, _, _ = read_recording(path)
    steps = [e for e in events if isinstance(e, StepEvent)]
    old = [line for line in raw if line["type"] == "step"]
    assert len(steps) == len(old) > 20
    paged = header.engine.get("kv") == "paged"
    for event, line in zip(steps, old):
        assert (event.step, event.t, event.num_running) == (line["step"], line["t"], line["slots_used"])
        assert event.occupancy == pytest.approx(line["slot_occupancy"])
        if paged:
            assert (event.max_batch_size, event.slots_used, event.num_slots) == (line["num_slots"], None, None)
        else:
            assert (event.slots_used, event.num_slots) == (line["slots_used"], line["num_slots"])
            assert event.max_batch_size == header.engine["max_batch_size"]
        assert [(r.request_id, r.query_tokens, r.token_id, r.piece) for r in event.running] == [
            (r["id"], r["q"], r["token"], r["piece"]) for r in line["running"]]
