"""Fault x detector truth table on tiny-llama, silence with isolation intact, and the SmolLM2
passphrase leak under stale_slot toggled mid-run."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtui.events import Arrive, Finish, Marker
from kvtui.faults import FAULTS
from kvtui.model_kinds import ModelKind
from kvtui.scenario import parse_scenario
from kvtui.session import Session

CONTAMINATION = ("cross_request", "cross_tenant", "corruption")
ONE_PROMPT = Path(__file__).parents[1] / "data" / "one_prompt.txt"

# Loads that make each paged-KV fault act (prefix caching on): shared system prompts across two tenants
# (unsalted_prefix), a tight pool under shared prefixes and mixed output lengths (block_refcount), the
# same prompt sampled several times (shared_partial_block), the same prompt sampled as n = 3 forked
# sequences each (cow_missing), two system prompts followed by a common block-aligned instruction block
# (prefix_key_no_parent).
TIER_LOAD = """seed: 0
max_requests: 12
engine: {{kv: paged, block_size: 16, max_len: 64, num_blocks: 9, max_batch_size: 2, prefix_caching: true,
          kv_offload_blocks: 32, layout: {layout}, faults: [{faults}]}}
tenants: {{count: 2}}
arrivals: {{process: constant, rate_per_s: 2.0}}
prompts: {{kind: system_prompt, count: 4, system_tokens: 32, user_tokens: {{dist: uniform, min: 2, max: 8}}}}"""
PAGED_LOADS = {
    "unsalted_prefix": """seed: 0
max_requests: 8
engine: {{kv: paged, block_size: 16, max_len: 128, prefix_caching: true, layout: {layout}, faults: [{faults}]}}
tenants: {{count: 2}}
arrivals: {{process: constant, rate_per_s: 10.0}}
prompts: {{kind: system_prompt, count: 1, system_tokens: 32, user_tokens: {{dist: uniform, min: 2, max: 8}}}}""",
    "block_refcount": """seed: 0
max_requests: 12
engine: {{kv: paged, block_size: 4, max_len: 64, num_blocks: 20, prefix_caching: true, layout: {layout},
          faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: 10.0}}
prompts: {{kind: system_prompt, count: 2, system_tokens: 16, user_tokens: {{dist: uniform, min: 2, max: 8}}}}
output_tokens: {{dist: uniform, min: 2, max: 24}}""",
    "shared_partial_block": f"""seed: 0
max_requests: 6
engine: {{{{kv: paged, block_size: 16, max_len: 256, prefix_caching: true, layout: {{layout}}, faults: [{{faults}}]}}}}
arrivals: {{{{process: constant, rate_per_s: 10.0}}}}
prompts: {{{{kind: file, path: {ONE_PROMPT}}}}}
output_tokens: 16
sampling: {{{{temperature: 1.0, ignore_eos: true}}}}""",
    "cow_missing": f"""seed: 0
max_requests: 3
engine: {{{{kv: paged, block_size: 16, max_len: 256, prefix_caching: true, layout: {{layout}}, faults: [{{faults}}]}}}}
arrivals: {{{{process: constant, rate_per_s: 10.0}}}}
prompts: {{{{kind: file, path: {ONE_PROMPT}}}}}
output_tokens: 16
sampling: {{{{temperature: 1.0, ignore_eos: true, n: 3}}}}""",
    "prefix_key_no_parent": """seed: 0
max_requests: 8
engine: {{kv: paged, block_size: 16, max_len: 128, prefix_caching: true, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: 5.0}}
prompts: {{kind: system_prompt, count: 2, system_tokens: 32, instruction_tokens: 16,
           user_tokens: {{dist: uniform, min: 2, max: 8}}}}""",
    # prompts sent as embedding rows (all of them; in pairs of equal ids and tensor with different masks)
    "embeds_unkeyed": """seed: 3
max_requests: 6
engine: {{kv: paged, block_size: 16, max_len: 256, max_batch_size: 2, prefix_caching: true, layout: {layout},
          faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: 1.0}}
prompts: {{kind: passphrase, embeds: all}}""",
    "embeds_mask_unkeyed": """seed: 3
max_requests: 6
engine: {{kv: paged, block_size: 16, max_len: 256, max_batch_size: 2, prefix_caching: true, layout: {layout},
          faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: 1.0}}
prompts: {{kind: passphrase, embeds: mask_pairs}}""",
    # one shared system prompt under LoRA adapters a, b and none in turn; then under one adapter reloaded
    # with new weights mid-run (the later requests' cached prefix was computed under the old version)
    "lora_unkeyed_prefix": """seed: 0
max_requests: 8
engine: {{kv: paged, block_size: 16, max_len: 128, prefix_caching: true, layout: {layout}, faults: [{faults}]}}
lora: {{adapters: [lora-a, lora-b, none]}}
arrivals: {{process: constant, rate_per_s: 10.0}}
prompts: {{kind: system_prompt, count: 1, system_tokens: 32, user_tokens: {{dist: uniform, min: 2, max: 8}}}}""",
    "lora_reload_stale": """seed: 0
max_requests: 8
engine: {{kv: paged, block_size: 16, max_len: 128, prefix_caching: true, layout: {layout}, faults: [{faults}]}}
lora: {{adapters: [lora-a]}}
timeline: [{{at_s: 0.35, set: {{lora.reload: lora-a}}}}]
arrivals: {{process: constant, rate_per_s: 10.0}}
prompts: {{kind: system_prompt, count: 1, system_tokens: 32, user_tokens: {{dist: uniform, min: 2, max: 8}}}}""",
    # the KV offload tier: two tenants over four system prompts, a pool of 8 usable blocks and two requests
    # at a time, so cached prompt blocks are evicted to the tier and come back on later prefix hits
    **dict.fromkeys(("tier_key_drops_partition", "tier_layout_mismatch", "tier_partial_load"), TIER_LOAD),
}


# Faults that act on a kind of request the default load lacks: its sampling line instead (stale_bitmask:
# half the requests constrained to digits, so plain rows follow constrained ones in the bitmask buffer).
SAMPLING_LOADS = {"stale_bitmask": 'sampling: {ignore_eos: true, structured: {regex: "[0-9]{1,30}", fraction: 0.5}}'}
# The per-row sampling faults act on requests that carry sampling state: a mix of sampled requests,
# requests that ban half the vocabulary with a -100 logit_bias and greedy penalized ones, with output
# lengths that differ, so rows leave the batch while others decode.
BANS = "{" + ", ".join(f'"{i}": -100' for i in range(0, 256, 2)) + "}"
SAMPLING_SEED = 2
SAMPLING_FAULTS = ("row_state_misalign", "shared_rng", "penalty_shared_history")
SAMPLING_LOAD = """seed: {seed}
max_requests: 12
engine: {{{pool}, max_len: 128, layout: {layout}, faults: [{faults}]}}
arrivals: {{process: constant, rate_per_s: 50.0}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: 3, max: 30}}}}
output_tokens: {{dist: uniform, min: 2, max: 16}}
sampling: {{temperature: 1.0, ignore_eos: true, mix: [{{fraction: 0.35, logit_bias: {bans}}},
           {{fraction: 0.35, temperature: 0, repetition_penalty: 2.0, presence_penalty: 2.0}}]}}"""


def scenario(layout="padded", faults=(), dtype="float32", extra="", kv="slots", drop_faults=False):
    """The truth-table scenario; a paged-KV fault gets its own load (PAGED_LOADS), so does a per-row
    sampling fault (SAMPLING_LOAD); drop_faults=True the same load with the fault off."""
    if any(name in SAMPLING_FAULTS for name in faults):
        pool = "kv: paged, block_size: 16, num_blocks: 20" if kv == "paged" else "slots: 4"
        body = SAMPLING_LOAD.format(pool=pool, layout=layout, faults="" if drop_faults else ", ".join(faults),
                                    bans=BANS, seed=SAMPLING_SEED)
        return parse_scenario(f"name: truth-table\nmodel: tiny-llama\ndtype: {dtype}\n{body}\n{extra}")
    if kv == "paged" and any(name in PAGED_LOADS for name in faults):
        load = PAGED_LOADS[next(name for name in faults if name in PAGED_LOADS)]
        body = load.format(layout=layout, faults="" if drop_faults else ", ".join(faults))
        defaults = "\noutput_tokens: 8\nsampling: {ignore_eos: true}" if "output_tokens" not in body else ""
        return parse_scenario(f"name: truth-table\nmodel: tiny-llama\ndtype: {dtype}\n{body}{defaults}\n{extra}")
    # paged: 9 usable blocks of 16 tokens, so blocks change hands (and stale contents sit past a row's end)
    pool = "kv: paged, block_size: 16, num_blocks: 10" if kv == "paged" else "slots: 3"
    sampling = next((SAMPLING_LOADS[n] for n in faults if n in SAMPLING_LOADS), "sampling: {ignore_eos: true}")
    listed = [] if drop_faults else list(faults)
    return parse_scenario(f"""
name: truth-table
seed: 3
max_requests: 6
model: tiny-llama
dtype: {dtype}
engine: {{{pool}, max_len: 128, layout: {layout}, faults: [{", ".join(listed)}]}}
arrivals: {{process: constant, rate_per_s: 50.0}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: 3, max: 30}}}}
output_tokens: 8
{sampling}
{extra}
""")


def run(tiny, spec, **kw):
    loaded = tiny["tiny-llama"] if spec.dtype == "float32" else _tiny_in(spec.dtype)
    session = Session(spec, loaded, clock="virtual", **kw)
    session.run()
    return session


def _tiny_in(dtype):
    from kvtui.models import load_model

    return load_model("tiny-llama", dtype=dtype, progress=False)


def events_of(session, kind=None, detector=None):
    return [e for e in session.contamination
            if (kind is None or e.kind == kind) and (detector is None or e.detector == detector)]


CASES = [(name, layout, kv) for name, fault in FAULTS.items() if ModelKind.DECODER_ONLY in fault.models  # cross faults: test_cross_faults.py
         for layout in fault.layouts for kv in fault.kv]
# the canary needs a model that echoes its passphrase (tiny-llama's text is random): checked on SmolLM2 below
TEXT_DETECTORS = {"canary"}
RUN = {f"r{i:03d}" for i in range(6)}


@pytest.mark.parametrize("name,layout,kv", CASES)
def test_every_listed_detector_catches_the_fault_with_its_kind_victim_and_source(tiny, name, layout, kv):
    if name == "stale_bitmask":
        pytest.importorskip("xgrammar", reason="structured output: pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi")
    fault = FAULTS[name]
    spec = scenario(layout, faults=[name], kv=kv)
    arrivals = []
    session = run(tiny, spec, listeners=(lambda e: arrivals.append(e.request_id) if isinstance(e, Arrive) else None,))
    ran = set(arrivals)  # r000, ...; with n > 1 each request's sequences 0_r000, 1_r000, ...
    reports = [e for e in session.contamination if e.counts]
    assert set(fault.caught_by) - TEXT_DETECTORS <= {e.detector for e in reports}, session.contamination
    assert session.summary.findings_by_kind.get(fault.kind, 0) >= 1, session.summary.findings_by_kind
    assert session.summary.fault_acts[name] > 0  # the fault acted where it was caught (fault.acted events)
    assert {e.victim for e in reports} <= ran
    named = [e for e in reports if e.source is not None]
    assert all(set(e.source.split(",")) <= ran - {e.victim} for e in named)
    # the victims' tokens really changed: each finding of the fault's kind has a reference witness (a
    # cross-tenant reuse serves right K/V: its answers stay the same, only the sharing leaks)
    findings = [f for f in session.metrics.findings if f.kind == fault.kind]
    assert any("reference" in f.detectors for f in findings) is (fault.kind != "cross_tenant")


def test_stale_slot_names_the_previous_owner_as_source(tiny):
    session = run(tiny, scenario("padded", faults=["stale_slot"]))
    owners = {}
    for e in events_of(session, kind="cross_request", detector="slot_taint"):
        owners[e.victim] = e.source
    assert owners, "stale_slot gave no slot_taint cross_request event"
    # the first three requests fill the 3 slots; r003..r005 reuse slots 0..2 of r000..r002
    assert owners == {"r003": "r000", "r004": "r001", "r005": "r002"}
    flows = {e.victim: e.source for e in events_of(session, detector="attention_flow")}
    assert flows == owners
    assert all(e.evidence.foreign_mass > 0.5 for e in events_of(session, detector="attention_flow"))


def test_no_request_mask_flow_points_at_an_earlier_block(tiny):
    session = run(tiny, scenario("packed", faults=["no_request_mask"]))
    flows = events_of(session, detector="attention_flow")
    assert flows and all(e.source < e.victim for e in flows)  # earlier requests sit earlier in the row


def test_racy_threads_never_stops_the_run_and_a_failed_step_is_an_event(tiny):
    """Every request ends, the damage is a finding, and each failed step (a shape error) is a corruption
    event whose victims were aborted."""
    session = run(tiny, scenario("padded", faults=["racy_threads"]))
    assert session.summary.requests_finished == 6
    assert session.summary.findings_by_kind.get("cross_request", 0) >= 1
    errors = [e for e in session.contamination if e.detector == "engine"]
    assert all(e.kind == "corruption" and e.evidence.error for e in errors)
    assert session.summary.finish_reasons.get("abort", 0) == len({e.victim for e in errors})


@pytest.mark.parametrize("layout,kv", [("padded", "slots"), ("packed", "paged")])
def test_racy_threads_runs_the_same_every_time(tiny, layout, kv):
    """The threads bind the shared cache state in a fixed order, so a headless run with racy_threads on is
    as reproducible as any other (a free-running race made its truth-table cases fail one run in three)."""
    runs = []
    for _ in range(3):
        finishes = []
        session = run(tiny, scenario(layout, faults=["racy_threads"], kv=kv),
                      listeners=(lambda e, out=finishes: isinstance(e, Finish) and out.append(e),))
        runs.append(([(f.request_id, f.finish_reason, f.output_ids) for f in sorted(finishes, key=lambda f: f.request_id)],
                     [(e.step, e.detector, e.kind, e.victim, e.source) for e in session.contamination]))
    assert runs[0] == runs[1] == runs[2]
    outputs, reports = runs[0]
    assert len(outputs) == 6 and any(r[1] == "reference" for r in reports)


def test_fault_switched_on_by_timeline_then_off(tiny):
    """stale_slot on from 0 s to 1.5 s: requests admitted meanwhile into a used slot leak; requests
    admitted after it went off are clean."""
    spec = parse_scenario("""
name: on-then-off
seed: 3
max_requests: 12
model: tiny-llama
engine: {slots: 2, max_len: 128}
arrivals: {process: constant, rate_per_s: 4.0}
prompts: {kind: synthetic, prompt_tokens: {dist: uniform, min: 3, max: 30}}
output_tokens: 8
sampling: {ignore_eos: true}
timeline: [{at_s: 0.0, set: {fault: stale_slot, on: true}},
           {at_s: 1.5, set: {fault: stale_slot, on: false}, marker: isolation restored}]
""")
    finishes = []
    session = Session(spec, tiny["tiny-llama"], clock="virtual",
                      listeners=(lambda e: isinstance(e, Finish) and finishes.append(e),))
    session.run()
    assert [(on, t) for t, _, on in session.fault_history] == [(True, pytest.approx(0.0, abs=0.3)),
                                                                (False, pytest.approx(1.5, abs=0.3))]
    off_at = session.fault_history[1][0]
    admitted = {f.request_id: f.scheduled_s for f in finishes}
    before = {rid for rid, t in admitted.items() if t < off_at}
    after = set(admitted) - before
    victims = {e.victim for e in session.contamination if e.counts}
    assert len(before) >= 3 and len(after) >= 3
    assert victims and victims <= before  # leaks while on ...
    assert not victims & after  # ... and none once off


@st.composite
def clean_scenarios(draw):
    layout = draw(st.sampled_from(["padded", "packed"]))
    side = draw(st.sampled_from(["right", "left"]))
    slots = draw(st.integers(1, 4))
    n = draw(st.integers(1, 8))
    lo = draw(st.integers(1, 40))
    hi = draw(st.integers(lo, 60))
    out = draw(st.integers(1, 10))
    budget = draw(st.sampled_from([16, 64, 1024]))
    bucketing = draw(st.booleans())
    rate = draw(st.sampled_from([1.0, 10.0, 100.0]))
    temperature = draw(st.sampled_from([0.0, 0.8]))
    return parse_scenario(f"""
seed: {draw(st.integers(0, 10_000))}
max_requests: {n}
model: tiny-llama
engine: {{slots: {slots}, max_len: 128, layout: {layout}, padding_side: {side}, max_tokens_per_step: {budget},
          bucketing: {str(bucketing).lower()}}}
arrivals: {{process: poisson, rate_per_s: {rate}}}
prompts: {{kind: synthetic, prompt_tokens: {{dist: uniform, min: {lo}, max: {hi}}}}}
output_tokens: {out}
sampling: {{temperature: {temperature}, ignore_eos: true}}
""")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clean_scenarios())
def test_isolation_intact_gives_no_contamination(tiny, spec):
    session = run(tiny, spec)
    bad = [e for e in session.contamination if e.kind in CONTAMINATION]
    assert bad == []


def test_bf16_with_isolation_intact_has_no_cross_request_events(tiny):
    session = run(tiny, scenario("padded", dtype="bfloat16"))
    assert events_of(session, kind="cross_request") == []
    assert events_of(session, detector="attention_flow") == [] and events_of(session, detector="slot_taint") == []


@pytest.mark.smollm
def test_smollm2_passphrase_stale_slot_mid_run_leaks_a_named_passphrase(smollm2):
    from pathlib import Path

    text = Path("scenarios/passphrase.yaml").read_text()
    spec = parse_scenario(text + "\ntimeline: [{at_s: 1.0, set: {fault: stale_slot, on: true}, "
                                 "marker: isolation off}]\n", source="passphrase+stale_slot")
    markers = []
    session = Session(spec, smollm2, clock="virtual", listeners=(markers.append,),
                      detectors=("canary", "slot_taint"))
    session.run()
    stale = {}
    for m in markers:
        if isinstance(m, Marker) and "(stale_slot)" in m.text:
            victim, _, rest = m.text.partition(" took slot ")
            stale[victim] = rest.split(" of ")[1].split(" kept")[0]
    assert stale, "no slot was reused after stale_slot went on"
    leaks = events_of(session, kind="cross_request", detector="canary")
    assert leaks, f"no canary leak; outputs: {[e for e in markers if isinstance(e, Finish)]}"
    def earlier_owners(victim):  # a stale slot carries every earlier owner's tokens along the chain
        chain = []
        while victim in stale:
            victim = stale[victim]
            chain.append(victim)
        return chain

    for leak in leaks:
        assert leak.source in earlier_owners(leak.victim)  # the victim answered with an earlier owner's
        assert leak.evidence.matched.upper() in leak.evidence.text.upper()  # the fragment is really there
        assert leak.evidence.matched in leak.evidence.leaked
    finished = {m.request_id: m for m in markers if isinstance(m, Finish)}
    first = leaks[0]
    assert session.observer("canary").detector.passphrases[first.source] == first.evidence.leaked
    victim_text = finished[first.victim].output_text.upper()
    assert first.evidence.matched.upper() in victim_text  # the leak is in the victim's final answer


@pytest.mark.smollm
@pytest.mark.parametrize("name", [n for n, f in FAULTS.items() if TEXT_DETECTORS & set(f.caught_by)
                                  and ModelKind.DECODER_ONLY in f.models])  # speech models: test_cross_faults.py
def test_text_detectors_catch_the_fault_on_smollm2(smollm2, name):
    """The canary column of the truth table: the library's fault scenario on SmolLM2, which echoes
    passphrases, makes a victim say another request's passphrase."""
    from kvtui.scenario import load_scenario

    spec = load_scenario(f"scenarios/faults/{name}.yaml")
    session = Session(spec, smollm2, clock="virtual", detectors=("canary",))
    session.run()
    leaks = events_of(session, kind="cross_request", detector="canary")
    assert leaks, f"{name}: no canary leak"
    for leak in leaks:
        assert leak.source != leak.victim and leak.evidence.matched.upper() in leak.evidence.text.upper()
        assert session.observer("canary").detector.passphrases[leak.source] == leak.evidence.leaked
