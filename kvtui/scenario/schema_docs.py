"""The scenario format reference (docs/scenarios.md), generated from the pydantic schema.

Every field's name, type, default, bounds and description come from the models in kvtui/scenario/
(their JSON schema); each section's text is the model's docstring; the timeline knobs come from
RUNTIME_KNOBS. Only the introduction below is written by hand. tests/architecture/test_docs.py checks that
docs/scenarios.md equals `render()`; after changing the schema, regenerate it with

    python -m kvtui.scenario.schema_docs --write
"""

from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

import pydantic

from kvtui.scenario.arrivals import (
    Burst,
    Constant,
    Gamma,
    Poisson,
    Rounds,
    RoundSpec,
    Scripted,
    ScriptedRequest,
    Stage,
    Trace,
)
from kvtui.scenario.lengths import Choice, Fixed, LogNormal, Normal, Uniform, Zipf
from kvtui.scenario.lora import LoraSection
from kvtui.scenario.prompts import (
    AudioPrompts,
    FilePrompts,
    ImagePassphrasePrompts,
    MultiTurnPrompts,
    PassphrasePrompts,
    SpokenPassphrasePrompts,
    SyntheticPrompts,
    SystemPromptPrompts,
    TracePassphrasePrompts,
)
from kvtui.scenario.request_ids import DuplicateIds, NearDuplicateIds, RequestIds, UniqueIds
from kvtui.scenario.sampling import MixEntry
from kvtui.scenario.schema import (
    SLO,
    Bucketing,
    Dashboard,
    EngineSection,
    Expect,
    SamplingSection,
    Scenario,
    Sessions,
    StructuredSection,
    ThinkTime,
)
from kvtui.scenario.tenants import Tenants
from kvtui.scenario.timeline import RUNTIME_KNOBS, TimelineEvent

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "scenarios.md"
REGENERATE = "python -m kvtui.scenario.schema_docs --write"

INTRO = """\
# Scenario format

<!-- Generated from the schema in kvtui/scenario/ by `{regenerate}`; do not edit by hand. -->

A scenario is a YAML file that says who arrives when, saying what, served by which engine. `kvtui run
FILE` runs it; `kvtui validate FILE` checks it and prints it with every default filled in. A small one:

```yaml
name: passphrase
seed: 0
max_requests: 8                            # stop after 8 requests
model: default                             # SmolLM2-135M-Instruct
engine: {{slots: 4, max_len: 512, layout: padded}}
arrivals: {{process: poisson, rate_per_s: 2.0}}
prompts: {{kind: passphrase}}
output_tokens: {{dist: fixed, value: 24}}   # or just: 24
sampling: greedy
timeline:
  - {{at_s: 2.5, set: {{fault: stale_slot, on: true}}, marker: "isolation off"}}
expect: {{contamination: none}}
```

Conventions:

- Units are in the names: `_s` is seconds, `_per_s` per second, `_tokens` and lengths are tokens,
  `_bytes` bytes. Times count from the start of the run, on the run's clock (virtual or wall).
- Types are strict. A quoted `"4"` is text, not a number; true/false are not numbers; numbers must be
  finite. Unknown keys are errors (with the closest known key suggested), and so is a key written twice.
- YAML 1.1 (what PyYAML reads) takes an exponent as a number only with a dot and a signed exponent:
  `1.0e+3` is a number, `1e3` is the text "1e3". Write `1000` or `1.0e+3`.
- Relative paths (model folders, trace files, prompt files) are taken from the scenario file's folder.
- A run must stop by itself: an endless arrival process (constant, poisson or gamma with `rate_per_s`,
  burst) needs `max_requests` and/or `duration_s`, whichever comes first ends the arrivals. Requests in
  flight then finish.
- A problem is reported as one line, `FILE:LINE: field.path: problem; fix`, and `kvtui` exits with code
  2. Things that are valid but probably not meant (a timeline event after the arrivals end) are
  reported as `warning:` lines.
- The engine's KV pool must fit in memory and `engine.max_len` within a model's learned position
  table; where the model's geometry is known without loading it, `kvtui validate` checks both.
- A scenario must be able to test something. `kvtui validate` and `kvtui run` plan its requests (with
  the model's tokenizer) and refuse it when none fits the engine (prompt + `output_tokens` above
  `engine.max_len` with `on_too_long: reject`, a prompt of `max_len` tokens or more, or more blocks than
  a paged pool gives one request): every request would be rejected. When only some do not fit, a
  `warning:` line says how many. A fault in `engine.faults` or switched on by the timeline must act in
  the engine's KV mode and in the layout in effect when it is switched on (`kvtui faults` lists both);
  one that cannot would never fire.

The sections below list every field. "allowed" gives the bounds; a field with no default is required.
"""

# section heading -> the models it documents (a union's members get one subsection each)
SECTIONS: list[tuple[str, str, list[type[pydantic.BaseModel]]]] = [
    ("Top level", "", [Scenario]),
    ("engine", "", [EngineSection, Bucketing]),
    ("arrivals", "One of the processes below, chosen by `process`. The generators are pure: the same "
                 "scenario and seed give the same times (rounds: the same order, at times set by when the "
                 "requests before finish).", [Constant, Poisson, Gamma, Burst, Trace, Scripted, Rounds,
                                              Stage, ScriptedRequest, RoundSpec]),
    ("tenants", "", [Tenants]),
    ("lora", "", [LoraSection]),
    ("request_ids", "", [RequestIds, UniqueIds, DuplicateIds, NearDuplicateIds]),
    ("sessions", "", [Sessions, ThinkTime]),
    ("prompts", "One of the kinds below, chosen by `kind`.", [PassphrasePrompts, SyntheticPrompts, FilePrompts,
                                                              SystemPromptPrompts, MultiTurnPrompts,
                                                              SpokenPassphrasePrompts, AudioPrompts,
                                                              ImagePassphrasePrompts, TracePassphrasePrompts]),
    ("Length distributions", "`output_tokens` and `prompts.prompt_tokens` take one of these, chosen by `dist`; a "
                             "bare integer `24` means `{dist: fixed, value: 24}`. Lengths are whole tokens, drawn "
                             "from the scenario seed's own stream.", [Fixed, Uniform, Normal, LogNormal, Choice, Zipf]),
    ("sampling", "", [SamplingSection, StructuredSection, MixEntry]),
    ("slo", "", [SLO]),
    ("expect", "", [Expect]),
    ("dashboard", "", [Dashboard]),
    ("timeline", "", [TimelineEvent]),
]
# model -> its heading; the anchor is GitHub's slug of it
HEADINGS = {Scenario: "Top level", EngineSection: "engine", Bucketing: "engine.bucketing", SamplingSection: "sampling",
            StructuredSection: "sampling.structured",
            MixEntry: "sampling.mix entry",
            Tenants: "tenants", LoraSection: "lora", RequestIds: "request_ids", Sessions: "sessions",
            ThinkTime: "think time",
            SLO: "slo", Expect: "expect", Dashboard: "dashboard", TimelineEvent: "timeline", Stage: "stage",
            ScriptedRequest: "scripted request", RoundSpec: "round"}
UNION_TAGS = {"process": "arrivals", "kind": "prompts", "dist": "Length distributions", "ids": "request_ids"}


def heading(model: type[pydantic.BaseModel]) -> str:
    """A model's section title: its union tag value (e.g. `gamma`) or its entry in HEADINGS."""
    for tag in UNION_TAGS:
        field = model.model_fields.get(tag)
        if field is not None and getattr(field.annotation, "__args__", None):
            return field.annotation.__args__[0]
    return HEADINGS[model]


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return "#" + re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def value_text(value: object) -> str:
    """A default or bound as YAML flow text: 1.0, true, null, padded, {enabled: false}, [a, b]."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, dict):  # union tags first, nulls left out
        items = sorted(((k, v) for k, v in value.items() if v is not None), key=lambda kv: kv[0] not in UNION_TAGS)
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, str) and not re.fullmatch(r"[\w.\-]+", value):
        return json.dumps(value)
    return str(value)


def link_for(ref: str, defs: dict) -> str:
    """A markdown link to the section of the model a `$ref` names."""
    model = _MODELS[ref.rsplit("/", 1)[-1]]
    title = heading(model)
    return f"[{title}]({anchor(title)})"


def type_text(prop: dict, defs: dict) -> str:
    """A property's type in words: integer, number, text, true/false, a list, a link to its section."""
    if "$ref" in prop:
        return f"mapping: {link_for(prop['$ref'], defs)}"
    if "discriminator" in prop:
        tag = prop["discriminator"]["propertyName"]
        return f"mapping by `{tag}`: [{UNION_TAGS[tag]}]({anchor(UNION_TAGS[tag])})"
    if "anyOf" in prop:
        kinds = [type_text(p, defs) for p in prop["anyOf"] if p.get("type") != "null"]
        nullable = len(kinds) < len(prop["anyOf"])
        return " or ".join(kinds) + (" or null" if nullable else "")
    if "const" in prop:
        return f"`{prop['const']}`"
    if "enum" in prop:
        return "one of " + ", ".join(f"`{v}`" for v in prop["enum"])
    if prop.get("type") == "array":
        return f"list of {type_text(prop.get('items', {}), defs)}"
    names = {"integer": "integer", "number": "number", "string": "text", "boolean": "true/false", "object": "mapping"}
    return names.get(prop.get("type"), "any")


def bounds_text(prop: dict) -> str:
    """A property's bounds: >= 1, <= 4096, 1 to 200 characters, at most 16 items (null branches skipped)."""
    if "anyOf" in prop:
        return "; ".join(filter(None, (bounds_text(p) for p in prop["anyOf"] if p.get("type") != "null")))
    parts = []
    for key, op in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in prop:
            parts.append(f"{op} {value_text(prop[key])}")
    for low, high, unit in (("minLength", "maxLength", "characters"), ("minItems", "maxItems", "items")):
        if high in prop:
            parts.append(f"{prop.get(low, 0)} to {prop[high]} {unit}")
        elif prop.get(low):
            parts.append(f"at least {prop[low]} {unit}")
    return ", ".join(parts)


def default_text(name: str, prop: dict, required: list[str]) -> str:
    """The default as YAML text ('x-default' where the loader fills it in); 'required' when there is
    none; nested sections point below."""
    if "x-default" in prop:
        return f"`{prop['x-default']}`"
    if name in required or "default" not in prop:
        return "required"
    if "$ref" in prop and prop["$ref"] != "#/$defs/Bucketing":
        return "see below"
    return f"`{value_text(prop['default'])}`"


def cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def field_table(model: type[pydantic.BaseModel]) -> list[str]:
    """The markdown table of a model's fields, its union tag first."""
    schema = model.model_json_schema()
    defs, props, required = schema.get("$defs", {}), schema["properties"], schema.get("required", [])
    names = sorted(props, key=lambda n: n not in UNION_TAGS)
    rows = ["| field | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for name in names:
        prop = props[name]
        if name in UNION_TAGS and "const" in prop:
            rows.append(f"| `{name}` | `{prop['const']}` | required | | selects this {name} |")
            continue
        rows.append("| " + " | ".join(cell(t) for t in (
            f"`{name}`", type_text(prop, defs), default_text(name, prop, required), bounds_text(prop),
            prop.get("description", ""))) + " |")
    return rows


def model_section(model: type[pydantic.BaseModel], level: str) -> list[str]:
    """Heading, docstring and field table of one model."""
    doc = inspect.cleandoc(model.__doc__ or "")
    lines = [f"{level} {heading(model)}", ""]
    if doc and model is not Scenario:
        lines += [" ".join(doc.split()), ""]
    return lines + field_table(model) + [""]


def knob_table() -> list[str]:
    """The runtime knobs a timeline event may set."""
    rows = ["| knob | type | allowed | what it changes |", "|---|---|---|---|"]
    for knob, (engine_field, adapter) in RUNTIME_KNOBS.items():
        schema = adapter.json_schema()
        if knob == "arrivals.rate_per_s":
            what = "the arrival rate from `at_s` on (constant, poisson or gamma with rate_per_s)"
        elif knob == "arrivals.burstiness":
            what = "the gamma process's burstiness from `at_s` on"
        elif knob == "fault":
            what = "the isolation fault to switch (docs/faults.md)"
        elif knob == "on":
            what = "with `fault`: on (default true) or off"
        elif knob == "lora.reload":
            what = ("loads that LoRA adapter (named in `lora.adapters`) again with new weights: version + 1; "
                    "`none` is the base model, never reloaded")
        else:
            what = f"engine `{engine_field}` from the next step"
        rows.append("| " + " | ".join(cell(t) for t in (
            f"`{knob}`", type_text(schema, {}), bounds_text(schema), what)) + " |")
    return rows


def render() -> str:
    """docs/scenarios.md as a string."""
    lines = [INTRO.format(regenerate=REGENERATE)]
    for title, text, models in SECTIONS:
        if models == [Scenario]:
            lines += [f"## {title}", ""] + field_table(Scenario) + [""]
            continue
        lines += [f"## {title}", ""] + ([text, ""] if text else [])
        for i, model in enumerate(models):
            level = "##" if i == 0 and len(models) == 1 or model in (EngineSection, TimelineEvent, RequestIds) else "###"
            section = model_section(model, level)
            lines += section[2:] if level == "##" else section
    lines += ["### Knobs", "", "`set` keys; the `engine.` prefix may be left out (`max_batch_size: 2`).", ""]
    lines += knob_table() + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


_MODELS = {m.__name__: m for _, _, models in SECTIONS for m in models}


def main(argv: list[str] | None = None) -> int:
    """Print the reference, or with --write save it to docs/scenarios.md."""
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--write" in argv:
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
