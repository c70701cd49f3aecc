"""LoRA adapters: batched rows under different adapters (and none) against peft's own merged model on a
separate instance, the adapter in the prefix-cache key, the two LoRA faults, the scenario fields and
`kvtui serve`'s adapter selection."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtui.config import EngineConfig
from kvtui.engine import SamplingParams
from kvtui.engine.inputs import RequestInput
from kvtui.engine.lora import AdapterRegistry
from kvtui.models.lora import adapter_dir, local_adapter
from kvtui.scenario import ScenarioError, parse_scenario, plan_requests
from kvtui.session import Session

NEW = 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13] * 3, [20, 21, 22, 23] * 5, [30, 31, 32, 33, 34] * 4,
           [5, 6, 7, 8, 9, 10, 11, 12, 13] * 3, [40, 41, 42] * 3]
ADAPTERS = ["lora-a", "lora-b", None, "lora-b", "lora-a"]
_oracle_cache: dict = {}


def _oracle(name: str, path, prompt: list[int], new: int = NEW) -> list[int]:
    """Greedy tokens from peft's merged model (PeftModel.from_pretrained(...).merge_and_unload()) on a
    SEPARATE base instance, through transformers' own generate; path None: the base model."""
    from peft import PeftModel

    key = (name, str(path))
    if key not in _oracle_cache:
        if name == "default":
            from kvtui.models import load_model

            base = load_model("default", progress=False).model
        else:
            from kvtui.models import build_tiny

            base, _ = build_tiny(name)
        base.set_attn_implementation("eager")
        model = base if path is None else PeftModel.from_pretrained(base, str(path)).merge_and_unload()
        _oracle_cache[key] = model.eval()
    out = _oracle_cache[key].generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny["tiny-llama"]


@pytest.fixture(scope="module")
def registry(llama):
    reg = AdapterRegistry(llama.model, llama.model_id)
    reg.load("lora-a")
    reg.load("lora-b")
    return reg


def _run(llama, registry, prompts, names, config: EngineConfig, arrivals=None):
    """Submit prompt i (under adapter names[i]) at step arrivals[i]; run to the end. Returns the states."""
    engine = make_engine(llama.model, config)
    arrivals = arrivals or [0] * len(prompts)
    states, step = {}, 0
    while len(states) < len(prompts) or engine.has_unfinished():
        for i, (prompt, name) in enumerate(zip(prompts, names)):
            if arrivals[i] == step:
                lora = registry.get(name) if name else None
                states[i] = engine.submit(f"r{i}", RequestInput(tuple(prompt), lora=lora),
                                          SamplingParams(max_new_tokens=NEW))
        engine.step()
        step += 1
    return [states[i] for i in range(len(prompts))]


def _path(registry, name):
    return None if name is None else registry.get(name).path


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_mixed_adapter_rows_equal_peft_merged_generate(llama, registry, layout):
    config = EngineConfig(num_slots=4, max_len=96, max_batch_size=4, layout=layout, max_tokens_per_step=40)
    states = _run(llama, registry, PROMPTS, ADAPTERS, config, arrivals=[0, 0, 1, 2, 3])
    for i, state in enumerate(states):
        assert state.finish_detail == ""
        assert state.generated_ids == _oracle("tiny-llama", _path(registry, ADAPTERS[i]), PROMPTS[i]), i


def test_an_adapter_changes_the_answer(llama, registry):
    base, a, b = (_oracle("tiny-llama", _path(registry, n), PROMPTS[0]) for n in (None, "lora-a", "lora-b"))
    assert a != base and b != base and a != b


def test_paged_prefix_cache_never_crosses_adapters_and_hits_within_one(llama, registry):
    config = EngineConfig(kv="paged", block_size=4, num_blocks=64, max_len=96, max_batch_size=4, prefix_caching=True,
                          layout="packed")
    prompt = PROMPTS[0]  # 27 tokens: 6 full blocks of 4 may be reused
    names = ["lora-a", "lora-b", None, "lora-a", "lora-b"]
    states = _run(llama, registry, [prompt] * 5, names, config, arrivals=[0, 2, 4, 6, 8])
    assert [s.prefix_hit_tokens for s in states] == [0, 0, 0, 24, 24]
    for name, state in zip(names, states):
        assert state.generated_ids == _oracle("tiny-llama", _path(registry, name), prompt)


def test_reload_is_a_new_version_and_its_requests_do_not_reuse_the_old_blocks(llama):
    reg = AdapterRegistry(llama.model, llama.model_id)
    first = reg.load("lora-a")
    config = EngineConfig(kv="paged", block_size=4, num_blocks=64, max_len=96, max_batch_size=4, prefix_caching=True)
    engine = make_engine(llama.model, config)
    old = engine.submit("old", RequestInput(tuple(PROMPTS[0]), lora=first), SamplingParams(max_new_tokens=NEW))
    engine.run_until_done()
    second = reg.load("lora-a", seed=77)
    assert (first.version, second.version) == (1, 2) and first.digest != second.digest
    new = engine.submit("new", RequestInput(tuple(PROMPTS[0]), lora=second), SamplingParams(max_new_tokens=NEW))
    engine.run_until_done()
    assert (old.prefix_hit_tokens, new.prefix_hit_tokens) == (0, 0)
    assert new.generated_ids == _oracle("tiny-llama", local_adapter("tiny-llama", llama.model.config, "lora-a", 77),
                                        PROMPTS[0])


def test_local_adapters_are_made_once_with_their_seed(llama):
    path = local_adapter("tiny-llama", llama.model.config, "lora-a", 1)
    assert path == adapter_dir("tiny-llama", "lora-a", 1) and (path / "adapter_model.safetensors").is_file()
    mtime = (path / "adapter_model.safetensors").stat().st_mtime_ns
    assert local_adapter("tiny-llama", llama.model.config, "lora-a", 1) == path
    assert (path / "adapter_model.safetensors").stat().st_mtime_ns == mtime


def test_enforce_eager_rejects_an_adapter_request_alone(llama, registry):
    engine = make_engine(llama.model, num_slots=2, max_len=96, enforce_eager=True)
    bad = engine.submit("lora", RequestInput(tuple(PROMPTS[0]), lora=registry.get("lora-a")),
                        SamplingParams(max_new_tokens=NEW))
    good = engine.submit("plain", PROMPTS[1], SamplingParams(max_new_tokens=NEW))
    engine.run_until_done()
    assert bad.finish_reason.value == "rejected" and "drop --enforce-eager" in bad.finish_detail
    assert good.generated_ids == _oracle("tiny-llama", None, PROMPTS[1])


def test_gpt2_refuses_adapters_in_one_line(tiny):
    gpt2 = tiny["tiny-gpt2"]
    with pytest.raises(ValueError, match=r"^LoRA adapters run on Llama-family models .*'gpt2'"):
        AdapterRegistry(gpt2.model, gpt2.model_id).load("lora-a")


# -- faults -----------------------------------------------------------------------------------------
LOAD = """name: lora
model: tiny-llama
seed: {seed}
max_requests: {n}
engine: {{kv: paged, block_size: {block}, max_len: 128, prefix_caching: true, layout: {layout}, faults: [{faults}]}}
lora: {{adapters: {adapters}, assign: {assign}}}
{timeline}
arrivals: {{process: constant, rate_per_s: {rate}}}
prompts: {{kind: system_prompt, count: 1, system_tokens: 32, user_tokens: {{dist: uniform, min: 2, max: 8}}}}
output_tokens: 6
sampling: {{ignore_eos: true}}"""


def _session(llama, **kw):
    fields = dict(seed=0, n=6, block=16, layout="padded", faults="", adapters="[lora-a, lora-b, none]",
                  assign="round_robin", timeline="", rate=10.0) | kw
    session = Session(parse_scenario(LOAD.format(**fields)), llama, clock="virtual",
                      detectors=("prefix_provenance", "reference"))
    session.run()
    return session


def test_each_arrive_event_names_its_adapter_and_the_dashboard_row_shows_it(llama):
    from rich.console import Console

    from kvtui.events import Arrive
    from kvtui.tui import panels
    from kvtui.tui.snapshot_build import build_snapshot
    from kvtui.tui.state import DashboardState

    fields = dict(seed=0, n=6, block=16, layout="padded", faults="", adapters="[lora-a, lora-b, none]",
                  assign="round_robin", timeline="", rate=10.0)
    session = Session(parse_scenario(LOAD.format(**fields)), llama, clock="virtual", detectors=())
    events, state = [], DashboardState()
    session.listeners.extend([events.append, state.apply])
    session.run()
    arrivals = [e for e in events if isinstance(e, Arrive)]
    assert [(e.request_id, e.lora) for e in arrivals] == [("r000", "lora-a"), ("r001", "lora-b"), ("r002", None),
                                                         ("r003", "lora-a"), ("r004", "lora-b"), ("r005", None)]
    console = Console(width=120, color_system=None)
    with console.capture() as capture:
        console.print(panels.request_table(build_snapshot(state), 120, 10))
    rows = {line.split()[0]: line for line in capture.get().splitlines() if line.startswith("r0")}
    assert "[lora:lora-a]" in rows["r000"] and "[lora:lora-b]" in rows["r001"] and "[" not in rows["r002"]


def _provenance(session):
    return sorted({(e.victim, e.source) for e in session.contamination if e.detector == "prefix_provenance"})


def test_lora_unkeyed_prefix_names_victims_and_the_source(llama):
    session = _session(llama, faults="lora_unkeyed_prefix")
    # r000 (lora-a) computed the system prompt's blocks; r001 (lora-b), r002 (base) read them; r003 (lora-a)
    # reads blocks its own adapter wrote (no finding); r004, r005 read them under the others
    assert _provenance(session) == [("r001", "r000"), ("r002", "r000"), ("r004", "r000"), ("r005", "r000")]
    assert {e.victim for e in session.contamination if e.detector == "reference"} == {"r001", "r002", "r004", "r005"}


RELOAD = "timeline: [{at_s: 0.25, set: {lora.reload: lora-a}}]"


def test_lora_reload_stale_names_the_old_versions_writer(llama):
    session = _session(llama, faults="lora_reload_stale", adapters="[lora-a]", timeline=RELOAD)
    assert session.adapters.get("lora-a").version == 2
    assert _provenance(session) == [("r003", "r000"), ("r004", "r000"), ("r005", "r000")]
    assert {e.victim for e in session.contamination if e.detector == "reference"} == {"r003", "r004", "r005"}


@pytest.mark.parametrize("adapters,timeline", [("[lora-a, lora-b, none]", ""), ("[lora-a]", RELOAD)])
def test_the_same_loads_without_the_faults_are_silent(llama, adapters, timeline):
    session = _session(llama, adapters=adapters, timeline=timeline)
    assert session.contamination == []
    assert session.summary.prefix_cache_hits > 0


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1000), block=st.sampled_from([4, 16]), layout=st.sampled_from(["padded", "packed"]),
       rate=st.sampled_from([5.0, 20.0]))
def test_held_out_random_loads_catch_unkeyed_adapters_and_stay_silent_without(llama, seed, block, layout, rate):
    kw = dict(seed=seed, n=5, block=block, layout=layout, rate=rate, adapters="[lora-a, none, lora-b]")
    faulty, clean = _session(llama, faults="lora_unkeyed_prefix", **kw), _session(llama, **kw)
    adapter = {p.request_id: p.adapter for p in plan_requests(faulty.scenario, llama.tokenizer)}
    found = _provenance(faulty)
    assert found != [] and all(adapter[victim] != adapter[source] for victim, source in found)
    assert clean.contamination == [] and clean.summary.prefix_cache_hits > 0


# -- scenarios ----------------------------------------------------------------------------------------
def test_scenario_errors_name_the_field_and_the_fix(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_requests: 2\nmodel: tiny-llama\nlora: {adapters: [lora-z]}\n")
    with pytest.raises(ScenarioError) as e:
        from kvtui.scenario import load_scenario

        load_scenario(bad)
    assert len(e.value.errors) == 1 and e.value.errors[0].startswith(f"{bad}:3: lora.adapters.0:")
    assert "lora-a" in e.value.errors[0]
    with pytest.raises(ScenarioError) as e:
        parse_scenario("max_requests: 2\nmodel: tiny-llama\nlora: {adapters: [lora-a]}\n"
                       "timeline: [{at_s: 1, set: {lora.reload: lora-b}}]\n")
    assert len(e.value.errors) == 1 and "timeline.0.set.lora.reload" in e.value.errors[0]
    assert "add it to lora.adapters" in e.value.errors[0]


@pytest.mark.smollm
def test_smollm2_mixed_adapter_batch_equals_peft_merged_generate(smollm2):
    """SmolLM2-135M: one batch of rows under lora-a, lora-b and none, each equal to peft's merged model's
    greedy generate on a separate SmolLM2 instance."""
    reg = AdapterRegistry(smollm2.model, smollm2.model_id)
    reg.load("lora-a")
    reg.load("lora-b")
    prompts, names = PROMPTS[:3], ["lora-a", "lora-b", None]
    config = EngineConfig(num_slots=3, max_len=96, max_batch_size=3, layout="packed")
    states = _run(smollm2, reg, prompts, names, config)
    for prompt, name, state in zip(prompts, names, states):
        assert state.finish_detail == ""
        assert state.generated_ids == _oracle("default", _path(reg, name), prompt), name


# -- review fixes: each pinned by a value the code before the fix got wrong --------------------------------------
def test_an_adapter_whose_input_width_does_not_fit_is_refused_at_load(llama, tmp_path):
    """Made for a model with the same hidden size and another intermediate size: down_proj's A is
    [r, 2 x intermediate]. It used to load, and its first request stopped the engine on a shape error."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from kvtui.engine.lora import load_adapter

    config = llama.model.config.__class__.from_dict({**llama.model.config.to_dict(),
                                                     "intermediate_size": 2 * llama.model.config.intermediate_size})
    model = get_peft_model(AutoModelForCausalLM.from_config(config),
                           LoraConfig(r=4, target_modules=["down_proj"], init_lora_weights=False))
    model.save_pretrained(str(tmp_path / "wide"))
    with pytest.raises(ValueError, match="down_proj does not fit this model"):
        load_adapter(llama.model, "wide", tmp_path / "wide")


def test_a_corrupt_weights_file_is_one_line(llama, registry, tmp_path):
    import shutil

    from kvtui.engine.lora import load_adapter

    folder = tmp_path / "corrupt"
    shutil.copytree(registry.get("lora-a").path, folder)
    (folder / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"^cannot read LoRA adapter 'c' from .*corrupt: ") as caught:
        load_adapter(llama.model, "c", folder)
    assert "\n" not in str(caught.value)


def test_no_cache_salt_spells_another_tenants_salt_and_adapter(llama, registry):
    """The salt and the adapter are two keys of the first block: a base request whose cache_salt is the
    string the adapter's request's partition used to be ("t1|lora:...") gets no hit."""
    adapter = registry.get("lora-a")
    engine = make_engine(llama.model, kv="paged", prefix_caching=True, max_len=64, num_slots=2)
    prompt = tuple(PROMPTS[0])
    first = engine.submit("a", RequestInput(prompt, lora=adapter), SamplingParams(max_new_tokens=2), cache_salt="t1")
    engine.run_until_done()
    spelled = f"t1|lora:{adapter.name}@{adapter.version}:{adapter.digest}"
    second = engine.submit("b", RequestInput(prompt), SamplingParams(max_new_tokens=2), cache_salt=spelled)
    engine.run_until_done()
    assert (first.prefix_hit_tokens, second.prefix_hit_tokens) == (0, 0)


def test_racy_threads_runs_each_request_under_its_adapter(llama, registry):
    """Alone, with nothing to race against, a request under racy_threads answers what it answers without
    the fault: peft's merged lora-a model (it used to answer the base model's tokens)."""
    config = EngineConfig(num_slots=2, max_len=64, faults=frozenset({"racy_threads"}))
    (state,) = _run(llama, registry, [PROMPTS[1]], ["lora-a"], config)
    assert list(state.generated_ids) == _oracle("tiny-llama", _path(registry, "lora-a"), PROMPTS[1])


def test_a_bfloat16_run_with_adapters_runs_them(tiny):
    """bfloat16 turns the batch-invariant mode on by default, where adapters do not run: with a `lora`
    section the default is off, so the adapter requests run instead of being rejected."""
    spec = parse_scenario("name: bf16\nmodel: tiny-llama\ndtype: bfloat16\nseed: 1\nmax_requests: 4\n"
                          "engine: {kv: paged, prefix_caching: true}\nlora: {adapters: [lora-a, none]}\n"
                          "arrivals: {process: poisson, rate_per_s: 4.0}\nprompts: {kind: passphrase}\n"
                          "output_tokens: 4\n")
    from kvtui.models import load_model

    session = Session(spec, load_model("tiny-llama", dtype="bfloat16", progress=False), clock="virtual")
    session.run()
    assert session.summary.finish_reasons == {"length": 4} and session.config.batch_invariant is False


# -- bad adapter folders: every value one line naming the file and the field or tensor -------------------------
def _folder(registry, tmp_path, name: str = "bad"):
    """A copy of tiny-llama's lora-a folder to spoil."""
    import shutil

    folder = tmp_path / name
    shutil.copytree(registry.get("lora-a").path, folder)
    return folder


def _set_config(folder, change) -> None:
    import json

    config = json.loads((folder / "adapter_config.json").read_text())
    change(config)
    (folder / "adapter_config.json").write_text(json.dumps(config))


BAD_CONFIGS = [  # (how adapter_config.json is spoiled, what the one line says after "<folder>/adapter_config.json: ")
    (lambda c: c.update(r=0), "r must be a positive integer (the adapter's rank), got 0"),
    (lambda c: c.update(r=-4), "r must be a positive integer (the adapter's rank), got -4"),
    (lambda c: c.update(r="8"), "r must be a positive integer (the adapter's rank), got \"8\""),
    (lambda c: c.update(r=2.5), "r must be a positive integer (the adapter's rank), got 2.5"),
    (lambda c: c.update(r=True), "r must be a positive integer (the adapter's rank), got true"),
    (lambda c: c.pop("r"), "r is missing (the adapter's rank); peft's save_pretrained writes it"),
    (lambda c: c.update(lora_alpha="x"), "lora_alpha must be a finite number, got \"x\""),
    (lambda c: c.update(lora_alpha=None), "lora_alpha must be a finite number, got null"),
    (lambda c: c.update(lora_alpha=float("nan")), "lora_alpha must be a finite number, got nan"),
    (lambda c: c.update(lora_alpha=float("inf")), "lora_alpha must be a finite number, got inf"),
    (lambda c: c.pop("lora_alpha"), "lora_alpha is missing (the adapter's scale); peft's save_pretrained writes it"),
    (lambda c: c.update(use_rslora="yes"), "use_rslora must be true or false, got \"yes\""),
    (lambda c: c.update(target_modules=5), "target_modules must be a non-empty list of module names, got 5"),
    (lambda c: c.update(target_modules=[]), "target_modules must be a non-empty list of module names, got []"),
    (lambda c: c.update(target_modules=["q_proj", "lm_head"]),
     "target_modules: kvtui runs LoRA on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, not 'lm_head'"),
    (lambda c: c.update(target_modules="(q_proj"),
     "target_modules must be a list of module names or a regular expression, got \"(q_proj\" (missing ), unterminated "
     "subpattern at position 0)"),
    (lambda c: c.update(peft_type="IA3"), "peft_type must be \"LORA\" (a LoRA adapter), got \"IA3\""),
    (lambda c: c.update(lora_dropout=2), "lora_dropout must be a number from 0 to below 1, got 2"),
    (lambda c: c.update(bias=1), "bias must be one of none, all, lora_only, got 1"),
]


@pytest.mark.parametrize("change,message", BAD_CONFIGS, ids=[m.split(" ")[0] + str(i) for i, (_, m) in
                                                           enumerate(BAD_CONFIGS)])
def test_every_bad_adapter_config_value_is_one_line_naming_the_field(llama, registry, tmp_path, change, message):
    """r: 0 used to raise ZeroDivisionError and a string lora_alpha a TypeError (a plain-text 500 in kvtui
    serve); a negative or fractional r, a NaN alpha or target_modules: 5 loaded as if nothing were wrong."""
    from kvtui.engine.lora import load_adapter

    folder = _folder(registry, tmp_path)
    _set_config(folder, change)
    with pytest.raises(ValueError) as caught:
        load_adapter(llama.model, "bad", folder)
    assert str(caught.value) == f"{folder / 'adapter_config.json'}: {message}"


def test_a_config_that_is_no_json_object_is_one_line(llama, registry, tmp_path):
    from kvtui.engine.lora import load_adapter

    folder = _folder(registry, tmp_path)
    (folder / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError) as caught:
        load_adapter(llama.model, "bad", folder)
    assert str(caught.value) == (f"{folder / 'adapter_config.json'}: expected a JSON object of peft LoraConfig fields, "
                                 "got list")


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_missing_file_is_named_with_its_folder_not_peft_hub_text(llama, registry, tmp_path, missing):
    """peft takes a local folder without its files for a hub id ("Repo id must be in the form ...")."""
    from kvtui.engine.lora import load_adapter

    folder = _folder(registry, tmp_path)
    (folder / missing).unlink()
    with pytest.raises(ValueError) as caught:
        load_adapter(llama.model, "bad", folder)
    also = " (nor adapter_model.bin)" if missing == "adapter_model.safetensors" else ""
    assert str(caught.value) == (f"{folder}: no {missing}{also} in this folder; a peft LoRA folder holds "
                                 "adapter_config.json and adapter_model.safetensors (peft's save_pretrained writes "
                                 "both)")


def _spoil_weights(folder, change) -> str:
    """Apply change(state dict) to the folder's weights; returns the first key (sorted)."""
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "adapter_model.safetensors")
    change(state)
    save_file(state, folder / "adapter_model.safetensors")
    return sorted(state)[0]


@pytest.mark.parametrize("what,change,says", [
    ("nan", lambda s, k: s[k].__setitem__((0, 0), float("nan")), "holds NaN; an adapter's weights must be finite numbers"),
    ("inf", lambda s, k: s[k].__setitem__((1, 2), -float("inf")),
     "holds infinity; an adapter's weights must be finite numbers"),
])
def test_non_finite_adapter_weights_are_refused_at_load_naming_the_tensor(llama, registry, tmp_path, what, change, says):
    """They used to load (and the adapter's requests answer NaN logprobs: a plain-text 500 in kvtui serve)."""
    from kvtui.engine.lora import load_adapter

    folder = _folder(registry, tmp_path)
    key = _spoil_weights(folder, lambda s: change(s, sorted(s)[0]))
    with pytest.raises(ValueError) as caught:
        load_adapter(llama.model, "bad", folder)
    assert str(caught.value) == f"{folder / 'adapter_model.safetensors'}: {key} {says}"


def test_weights_whose_delta_overflows_the_models_dtype_are_refused(llama, registry, tmp_path):
    """Every weight x 1e20: each is a finite float32, but lora_B @ lora_A x scaling (~1e40 x r) is not; peft's
    merged model would hold inf there. It used to load."""
    from kvtui.engine.lora import load_adapter

    folder = _folder(registry, tmp_path)
    _spoil_weights(folder, lambda s: [t.mul_(1e20) for t in s.values()])
    with pytest.raises(ValueError) as caught:
        load_adapter(llama.model, "big", folder)
    assert str(caught.value) == (f"{folder / 'adapter_model.safetensors'}: layer 0 down_proj: lora_B @ lora_A x scaling "
                                 "(the weight delta peft's merge adds) overflows float32, the model's dtype: the "
                                 "adapter's weights are too large")


def test_the_delta_bound_refuses_exactly_what_overflows_the_dtype():
    """The Cauchy-Schwarz bound only decides when the product is computed: B's row and A's column of norm 300
    bound an entry by 90000 > float16's 65504, yet orthogonal they give 0 (kept); aligned, 90000 (refused), as
    float16's own product of the two says."""
    from kvtui.engine.lora_files import delta_overflows

    a = torch.tensor([[300.0], [0.0]])  # [r=2, in=1]
    aligned, orthogonal = torch.tensor([[300.0, 0.0]]), torch.tensor([[0.0, 300.0]])  # [out=1, r=2]
    assert not torch.isfinite(aligned.half() @ a.half()).all() and torch.isfinite(orthogonal.half() @ a.half()).all()
    assert delta_overflows(a, aligned, 1.0, torch.float16) is True
    assert delta_overflows(a, orthogonal, 1.0, torch.float16) is False
    assert delta_overflows(a, aligned, 1.0, torch.float32) is False


# -- engine modes: one check for serve, run and validate; rejection codes that say what happened --------------
def test_an_adapter_request_the_engine_cannot_run_is_coded_adapter_unsupported(llama, registry):
    """It was coded `empty`, as if its prompt had no tokens (kvtui serve answered that as empty_prompt)."""
    engine = make_engine(llama.model, num_slots=2, max_len=96, batch_invariant=True)
    bad = engine.submit("lora", RequestInput(tuple(PROMPTS[0]), lora=registry.get("lora-a")),
                        SamplingParams(max_new_tokens=NEW))
    engine.run_until_done()
    assert (bad.finish_reason.value, bad.finish_code) == ("rejected", "adapter_unsupported")
    assert bad.finish_detail == "LoRA adapters are not supported in the batch-invariant mode: drop --batch-invariant"


def test_batch_invariant_with_a_lora_section_is_one_error_naming_the_field(tmp_path):
    from kvtui.scenario import load_scenario

    path = tmp_path / "bi.yaml"
    path.write_text("max_requests: 2\nmodel: tiny-llama\nengine: {batch_invariant: true}\nlora: {adapters: [lora-a]}\n")
    with pytest.raises(ScenarioError) as e:
        load_scenario(path)
    assert e.value.errors == [f"{path}:3: engine.batch_invariant: LoRA adapters are not supported in the "
                              "batch-invariant mode, and the `lora` section loads lora-a; set engine.batch_invariant "
                              "to false or leave it null (off when adapters run), or drop the `lora` section"]


def test_a_session_refuses_adapters_its_engine_cannot_run(llama):
    """Rather than rejecting every adapter request (8 of 12 were rejected, 0 findings, exit 0)."""
    spec = parse_scenario("max_requests: 2\nmodel: tiny-llama\nlora: {adapters: [lora-a, none]}\n")
    with pytest.raises(ValueError) as e:
        Session(spec, llama, clock="virtual", engine_overrides={"batch_invariant": True})
    assert str(e.value) == "LoRA adapters are not supported in the batch-invariant mode: drop --batch-invariant"


def test_reloading_none_says_none_is_the_base_model():
    """docs/scenarios.md listed `none` as a lora.reload value, and validate answered "add it to lora.adapters"
    with `none` already there."""
    with pytest.raises(ScenarioError) as e:
        parse_scenario("max_requests: 2\nmodel: tiny-llama\nlora: {adapters: [lora-a, none]}\n"
                       "timeline: [{at_s: 1, set: {lora.reload: none}}]\n")
    assert e.value.errors == ["<string>:4: timeline.0.set.lora.reload: `none` is the base model, not an adapter: the base model's "
                              "weights are never reloaded; name a built-in adapter the `lora` section loads (lora-a, "
                              "lora-b, lora-c), or drop the event"]
    from kvtui.scenario.schema_docs import render

    row = next(line for line in render().splitlines() if line.startswith("| `lora.reload` |"))
    assert row.split(" | ")[1] == "one of `lora-a`, `lora-b`, `lora-c`"


# -- the summary row -------------------------------------------------------------------------------------------
def test_the_summary_has_a_row_of_adapters_versions_and_reloads_and_a_replay_too(llama, tmp_path):
    from rich.console import Console

    from kvtui.cli.replay import replay_summary
    from kvtui.record import read_recording
    from kvtui.summary import print_summary

    record = tmp_path / "lora.jsonl"
    spec = parse_scenario(LOAD.format(seed=0, n=6, block=16, layout="padded", faults="", adapters="[lora-a, none]",
                                      assign="round_robin", rate=4.0,
                                      timeline="timeline: [{at_s: 0.3, set: {lora.reload: lora-a}}]"))
    session = Session(spec, llama, clock="virtual", detectors=(), record_path=record)
    session.run()
    # arrivals every 0.25 s from 0, lora-a and the base model in turn: r000 (0 s) under lora-a v1; the reload at
    # 0.3 s; r002 (0.5 s) and r004 (1.0 s) under v2; r001, r003, r005 the base model
    assert session.summary.lora_requests == {"lora-a@1": 1, "none": 3, "lora-a@2": 2}
    assert session.summary.lora_reloads == {"lora-a": 1}
    console = Console(width=200, color_system=None)
    with console.capture() as capture:
        print_summary(session.summary, session.header(), console)
    row = next(line for line in capture.get().splitlines() if line.strip().startswith("LoRA adapters"))
    assert row.split("LoRA adapters", 1)[1].strip() == ("lora-a: 3 requests (v1 1, v2 2), reloaded 1 time; base "
                                                        "model: 3 requests")
    header, events, recorded, _ = read_recording(record)
    replayed = replay_summary(header, events, recorded)
    assert (replayed.lora_requests, replayed.lora_reloads) == ({"lora-a@1": 1, "none": 3, "lora-a@2": 2}, {"lora-a": 1})


LORA_RUN = "name: l\nmodel: tiny-llama\nmax_requests: 4\nlora: {adapters: [lora-a, none]}\noutput_tokens: 2\n"


@pytest.mark.parametrize("flags,line", [
    (["--batch-invariant"], "LoRA adapters are not supported in the batch-invariant mode, and the scenario's lora "
                            "section loads lora-a: drop --batch-invariant, or the lora section"),
    (["--enforce-eager"], "LoRA adapters run on kvtui's fused forward, which --enforce-eager replaces, and the "
                          "scenario's lora section loads lora-a: drop --enforce-eager, or the lora section"),
])
def test_run_refuses_adapters_its_flags_cannot_run_before_loading_anything(monkeypatch, capsys, tmp_path, flags, line):
    """`kvtui run` used to load the model, reject 8 of 12 adapter requests (coded `empty`), report 0 findings and
    exit 0; `kvtui serve` refused the same flags in one line."""
    import sys

    import kvtui.models
    from kvtui.cli.app import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model or tokenizer was loaded before the check")

    monkeypatch.setattr(kvtui.models, "load_model", no_load)
    monkeypatch.setattr(kvtui.models, "load_tokenizer", no_load)
    path = tmp_path / "l.yaml"
    path.write_text(LORA_RUN)
    monkeypatch.setattr(sys, "argv", ["kvtui", "run", str(path), "--headless", *flags])
    assert main() == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {path}: {line}"]


def test_validate_refuses_batch_invariant_with_adapters_in_one_line(monkeypatch, capsys, tmp_path):
    import sys

    from kvtui.cli.app import main

    path = tmp_path / "bi.yaml"
    path.write_text(LORA_RUN + "engine: {batch_invariant: true}\n")
    monkeypatch.setattr(sys, "argv", ["kvtui", "validate", str(path)])
    assert main() == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {path}:6: engine.batch_invariant: LoRA adapters are not supported in the batch-invariant mode, and "
        "the `lora` section loads lora-a; set engine.batch_invariant to false or leave it null (off when adapters "
        "run), or drop the `lora` section"]
