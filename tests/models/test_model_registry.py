"""The model kind is one typed enum (kvtui.model_kinds.ModelKind) and the model names live in one registry
(kvtui/models/registry.py) that every reader of a name consults: the loader, the tokenizer loader, the scenario
schema and planner, the `--llama-server` and prompt-embeds clients, `kvtui serve`'s defaults.

Architecture: every registry entry's kind is a ModelKind and its references resolve; adding an entry (with its
loader) is all it takes for every reader to take the name, and removing one makes every reader refuse it; no
module outside the registry lists model names (an ast pass). Behaviour: a name is read the same way everywhere
(any case, as `--model` takes it), and the kinds keep the strings recordings carry.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvtui.cli import app
from kvtui.faults import FAULTS, acts_on
from kvtui.model_kinds import ModelKind, model_kind
from kvtui.models import (
    ModelLoadError,
    build_tiny_tokenizer,
    check_model_available,
    load_model,
    load_tokenizer,
    registry,
)
from kvtui.models.registry import ModelEntry, kind_of
from kvtui.scenario import ScenarioError, parse_scenario

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvtui"
REGISTRY = PACKAGE / "models" / "registry.py"
# a scenario the schema takes with any model name it knows (no fault, no image or audio prompts)
PLAIN = "name: plain\nmax_requests: 2\nengine: {slots: 2, max_len: 128}\noutput_tokens: 4\nmodel: "


# -- the kind -------------------------------------------------------------------------------------------------

def test_model_kinds_are_the_strings_recordings_carry():
    assert [k.value for k in ModelKind] == ["decoder-only", "encoder-decoder", "image-text", "hybrid"]
    assert [str(ModelKind.DECODER_ONLY), f"{ModelKind.ENCODER_DECODER}", f"{ModelKind.IMAGE_TEXT:>12}"] == [
        "decoder-only", "encoder-decoder", "  image-text"]
    assert ModelKind("image-text") is ModelKind.IMAGE_TEXT and ModelKind.DECODER_ONLY == "decoder-only"
    assert json.dumps({"kind": ModelKind.ENCODER_DECODER}) == '{"kind": "encoder-decoder"}'


def test_loaded_models_and_configs_give_a_model_kind():
    """LoadedModel.kind and model_kind(config) are ModelKind members (they were plain strings)."""
    kinds = {name: load_model(name, progress=False).kind for name in ("tiny-llama", "tiny-whisper", "tiny-vision")}
    assert kinds == {"tiny-llama": ModelKind.DECODER_ONLY, "tiny-whisper": ModelKind.ENCODER_DECODER,
                     "tiny-vision": ModelKind.IMAGE_TEXT}
    assert all(type(kind) is ModelKind for kind in kinds.values())
    assert model_kind(types.SimpleNamespace(is_encoder_decoder=True)) is ModelKind.ENCODER_DECODER
    assert model_kind(types.SimpleNamespace()) is ModelKind.DECODER_ONLY


def test_the_fault_catalogue_names_kinds_as_model_kinds_and_reads_recorded_strings():
    assert {type(kind) for fault in FAULTS.values() for kind in fault.models} == {ModelKind}
    assert [acts_on("mm_hash_missing", "image-text"), acts_on("shared_cache", "image-text"),
            acts_on("stale_cross_kv", "decoder-only"), acts_on("shared_cache", ModelKind.HYBRID)] == [
        True, True, False, False]


def test_a_recording_header_keeps_the_kind_string():
    from kvtui.events import ModelInfo

    info = ModelInfo(id="tiny-vision", kind=ModelKind.IMAGE_TEXT)
    assert json.loads(info.model_dump_json())["kind"] == "image-text"
    assert ModelKind(ModelInfo.model_validate({"id": "x", "kind": "encoder-decoder"}).kind) is ModelKind.ENCODER_DECODER


# -- the registry -----------------------------------------------------------------------------------------------

def test_every_entry_has_a_model_kind_one_lower_case_name_and_references_that_resolve():
    names = registry.known_names()
    assert names == ("default", "smollm2", "tiny-llama", "tiny-gpt2", "whisper-tiny.en", "tiny-whisper",
                     "dinov2-smollm2", "tiny-vision", "tiny-qwen35moe")
    assert len(set(names)) == len(names) and all(n == n.strip().lower() for n in names)
    for entry in registry.ENTRIES:
        assert isinstance(entry.kind, ModelKind), entry.name
        refs = [r for r in (entry.load, entry.tokenizer, entry.gguf, *entry.needs) if r is not None]
        assert all(callable(registry.resolve(r)) for r in refs), entry.name
        assert entry.embeds_from is None or registry.find_model(entry.embeds_from) is not None
        assert entry.runs_on_engine != bool(entry.refusal), entry.name
    assert [(e.name, e.kind) for e in registry.ENTRIES if not e.runs_on_engine] == []


def test_every_model_name_in_the_cli_help_is_a_registry_entry():
    """The names `--model`'s help offers on every command that has it are entries the loader takes."""
    import typer.main

    group = typer.main.get_command(app)
    offered = set()
    for command in group.commands.values():
        for param in command.params:
            if "--model" in getattr(param, "opts", ()):
                words = {w.strip(".,:;`()") for w in (param.help or "").split()}
                offered |= {w for w in words if "-" in w and not w.startswith("-")} | ({"default"} & words)
    assert offered and offered <= set(registry.known_names()), offered - set(registry.known_names())


def test_names_are_read_in_any_case_by_every_reader():
    for name in registry.known_names():
        assert registry.find_model(f"  {name.upper()} ") is registry.find_model(name)
    assert [kind_of(" Tiny-Whisper"), kind_of("SMOLLM2"), kind_of("tiny-qwen35moe"), kind_of("./tiny-llama")] == [
        ModelKind.ENCODER_DECODER, ModelKind.DECODER_ONLY, ModelKind.HYBRID, None]


def test_the_hybrid_loads_on_the_engine_as_a_hybrid():
    check_model_available(" TINY-QWEN35MOE")
    loaded = load_model(" TINY-QWEN35MOE")
    assert (loaded.model_id, loaded.kind) == ("tiny-qwen35moe", ModelKind.HYBRID)
    assert loaded.model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


@pytest.fixture
def probe_entry(monkeypatch):
    """A new model added the way the registry says: one entry whose loader, tokenizer and check live in a
    module of their own (here a stand-in module: tiny-llama's weights under the new name). Returns the calls."""
    from kvtui.models.loader import load_tiny

    calls = []

    def load(name, dtype, progress):
        calls.append(("load", name, dtype))
        return dataclasses.replace(load_tiny(registry.TINY_LLAMA.name, dtype, progress), model_id=name)

    def tokenizer():
        calls.append(("tokenizer",))
        return build_tiny_tokenizer()

    module = types.ModuleType("kvtui_registry_probe")
    module.load, module.tokenizer, module.need = load, tokenizer, lambda: calls.append(("need",))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    entry = ModelEntry("tiny-probe", ModelKind.DECODER_ONLY, "tiny-probe", load="kvtui_registry_probe:load",
                       tokenizer="kvtui_registry_probe:tokenizer", needs=("kvtui_registry_probe:need",))
    monkeypatch.setattr(registry, "ENTRIES", (*registry.ENTRIES, entry))
    return calls


def test_one_new_entry_is_a_model_every_reader_takes(probe_entry):
    loaded = load_model(" Tiny-Probe", dtype="bfloat16", progress=False)
    assert (loaded.model_id, loaded.kind, loaded.dtype) == ("tiny-probe", ModelKind.DECODER_ONLY, torch.bfloat16)
    check_model_available("TINY-PROBE")
    assert len(load_tokenizer("tiny-probe")) == 259
    assert probe_entry == [("load", "tiny-probe", torch.bfloat16), ("need",), ("tokenizer",)]
    assert kind_of("tiny-probe") is ModelKind.DECODER_ONLY
    assert parse_scenario(PLAIN + "tiny-probe").model == "tiny-probe"
    with pytest.raises(ModelLoadError) as err:
        load_model("tiny-prob")
    assert str(err.value) == (
        "unknown model 'tiny-prob' (did you mean 'tiny-probe'?): use default (alias smollm2), tiny-llama, tiny-gpt2, "
        "whisper-tiny.en, tiny-whisper, dinov2-smollm2, tiny-vision, tiny-qwen35moe, tiny-probe, a local Hugging Face model "
        "directory, or a path to a .gguf file")


def test_without_its_entry_no_reader_knows_a_model(monkeypatch):
    monkeypatch.setattr(registry, "ENTRIES", tuple(e for e in registry.ENTRIES if e.name != "tiny-gpt2"))
    for read in (load_model, check_model_available, load_tokenizer):
        with pytest.raises(ModelLoadError, match=r"^unknown model 'tiny-gpt2'.*: use default \(alias smollm2\), "
                                                 r"tiny-llama, whisper-tiny.en, "):
            read("tiny-gpt2")
    assert kind_of("tiny-gpt2") is None
    with pytest.raises(ScenarioError, match="unknown model 'tiny-gpt2'"):
        parse_scenario(PLAIN + "tiny-gpt2")
    from kvtui.remote.embeds import embedding_table

    with pytest.raises(ModelLoadError, match="model 'tiny-gpt2' is not supported there"):
        embedding_table("tiny-gpt2")


GENERIC_WORDS = {"default"}  # a registry name that is also a common word (cost model "default", rope_type "default")


def literal_name_lists(path: Path, names: set[str], root: Path = ROOT) -> list[str]:
    """Where `path` spells model names in a tuple, list, set or dict keys, or compares with one."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        elif isinstance(node, ast.Compare):
            items = [node.left, *node.comparators]
        else:
            continue
        found = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
        if found:
            hits.append(f"{path.relative_to(root)}:{node.lineno} {found}")
    return hits


def test_no_module_outside_the_registry_lists_or_compares_model_names():
    names = set(registry.known_names()) - GENERIC_WORDS
    hits = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != REGISTRY
            for hit in literal_name_lists(path, names)]
    assert hits == []


def test_the_name_check_sees_a_spelled_out_list(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('WHISPER_NAMES = ("whisper-tiny.en", "tiny-whisper")\nok = key == "tiny-vision"\n'
                     'fine = {"default": 1, "x": "tiny-gpt2"}\n')
    names = set(registry.known_names()) - GENERIC_WORDS
    assert [hit.split(" ", 1)[1] for hit in literal_name_lists(probe, names, root=tmp_path)] == [
        "['whisper-tiny.en', 'tiny-whisper']", "['tiny-vision']"]


def test_importing_the_registry_imports_no_torch_and_the_loader_no_whisper_or_image_encoder():
    code = ("import sys\nfrom kvtui.models.registry import kind_of\nassert kind_of('tiny-whisper') == 'encoder-decoder'\n"
            "print('torch' in sys.modules)\nimport kvtui.models.loader\n"
            "print(sorted(m for m in sys.modules if m.startswith(('kvtui.models.whisper', 'kvtui.models.vision', "
            "'kvtui.models.dinov2', 'kvtui.models.hybrid', 'ctranslate2', 'transformers.models.whisper'))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["False", "[]"]


# -- one reading of a name everywhere (each of these refused a name `--model` takes) ---------------------------

def test_validate_takes_an_image_model_named_in_capitals():
    """`--model TINY-VISION` loads tiny-vision (load_model reads names in any case); the image-prompt check
    compared the name case-sensitively and said it had no image encoder."""
    result = CliRunner().invoke(app, ["validate", "scenarios/images.yaml", "--model", "TINY-VISION"])
    assert result.exit_code == 0, result.stderr
    assert "has no image encoder" not in result.stderr


def test_prompt_embeds_rows_for_a_tiny_model_named_in_another_case():
    from kvtui.remote.embeds import embedding_table

    assert torch.equal(embedding_table(" Tiny-Llama"), embedding_table("tiny-llama"))


def test_serve_takes_the_speech_decoders_positions_for_any_spelling(monkeypatch):
    """`kvtui serve --model TINY-WHISPER` without --max-len: the decoder's 64 learned positions, as for
    `tiny-whisper` (the default 512 is past the table, and the engine refuses it)."""
    import kvtui.serve.main as serve_main

    seen = {}

    def stop(options, **_):
        seen["max_len"] = options.max_len
        raise serve_main.BadInput("stopped before serving")

    monkeypatch.setattr(serve_main, "run_serve", stop)
    for name in ("tiny-whisper", "TINY-WHISPER", "tiny-llama"):
        result = CliRunner().invoke(app, ["serve", "--model", name, "--port", "0"])
        assert result.exit_code == 2 and "stopped before serving" in result.stderr, result.stderr
        assert seen.pop("max_len") == (64 if "whisper" in name.lower() else 512), name
