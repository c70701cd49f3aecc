"""Reading scenario files: YAML -> validated Scenario, or a ScenarioError whose lines name the file,
the YAML line, the field path, the problem and the fix. Nothing else escapes `load_scenario` and
`parse_scenario`.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvtui.names import closest
from kvtui.scenario.arrivals import PROCESS_NAMES
from kvtui.scenario.errors import ScenarioError, allowed_keys_for, describe, path_part, short, type_name
from kvtui.scenario.lengths import DIST_NAMES
from kvtui.scenario.plan import planned_arrivals
from kvtui.scenario.prompts import PROMPT_KINDS
from kvtui.scenario.schema import Scenario

MAX_SCENARIO_BYTES = 1024 * 1024
_TAG_CHOICES = {"process": PROCESS_NAMES, "kind": PROMPT_KINDS, "dist": DIST_NAMES}
_TAGS = {v for values in _TAG_CHOICES.values() for v in values}  # union tags pydantic puts in locs
_allowed = allowed_keys_for(Scenario)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; relative paths inside it are taken from its folder.

    Raises:
        ScenarioError: anything wrong, one line per problem.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError([f"{path}: (file): not found{_nearby(p)}; check the path (ready scenarios are in "
                             "scenarios/)"]) from None
    except IsADirectoryError:
        raise ScenarioError([f"{path}: (file): is a folder; give a .yaml file inside it"]) from None
    except UnicodeError:
        raise ScenarioError([f"{path}: (file): not UTF-8 text; save it as UTF-8"]) from None
    except (OSError, ValueError) as e:
        raise ScenarioError([f"{path}: (file): cannot be read ({type(e).__name__}); check permissions"]) from None
    return parse_scenario(text, source=str(path), base_dir=p.parent)


def _nearby(path: Path) -> str:
    """' (did you mean 'scenarios/passphrase.yaml'?)' for the scenario file whose name is closest to the one
    given, in its folder, else in scenarios/; '' when none is close."""
    for folder in (path.parent, Path("scenarios")):
        try:
            names = {f.stem: f for f in folder.iterdir() if f.suffix in (".yaml", ".yml")} if folder.is_dir() else {}
        except OSError:
            continue
        close = closest(path.stem, names)  # stems: a shared ".yaml" made 'nope.yaml' close to 'empty.yaml'
        if close is not None:
            return f" (did you mean '{names[close]}'?)"
    return ""


def parse_scenario(text: str, source: str = "<string>", base_dir: str | Path | None = None) -> Scenario:
    """Validate scenario YAML `text`; `source` names it in errors, `base_dir` anchors relative paths
    (default: the working directory).

    Raises:
        ScenarioError: anything wrong, one line per problem.
    """
    try:
        return _parse(text, source, Path(base_dir) if base_dir is not None else None)
    except ScenarioError:
        raise
    except RecursionError:
        raise ScenarioError([f"{source}: (document): nested too deeply; flatten the YAML"]) from None
    except Exception as e:  # a bug of ours: still one line, never a traceback
        raise ScenarioError([f"{source}: (document): internal error ({type(e).__name__}: {short(str(e))}); "
                             "please report it with the file"]) from None


def _parse(text: str, source: str, base_dir: Path | None) -> Scenario:
    if not isinstance(text, str):
        raise ScenarioError([f"{source}: (document): expected YAML text, got {type(text).__name__}; pass a str"])
    if len(text) > MAX_SCENARIO_BYTES:
        raise ScenarioError([f"{source}: (document): over 1 MiB; put large data in a trace or prompt file"])
    node, data = _read_yaml(text, source)
    if data is None:
        raise ScenarioError([f"{source}:1: (document): the scenario is empty; add fields, e.g. `max_requests: 8`"])
    if not isinstance(data, dict):
        raise ScenarioError([f"{source}:{_line(node)}: (document): expected a mapping of fields, got "
                             f"{type_name(data)}; write `field: value` lines, e.g. `max_requests: 8`"])
    dup = _first_duplicate(node)
    if dup:
        raise ScenarioError([f"{source}:{dup[0]}: {dup[1]}: duplicate key (first on line {dup[2]}); keep one"])
    if "name" not in data:
        stem = Path(source).stem if not source.startswith("<") else ""
        data = {**data, "name": stem or "scenario"}
    try:
        scenario = Scenario.model_validate(data, context={"base_dir": base_dir})
    except pydantic.ValidationError as e:
        lines = [_format(err, data, node, source) for err in e.errors()]
        raise ScenarioError(list(dict.fromkeys(lines))) from None
    scenario.add_warnings(_late_timeline(scenario, data.get("timeline"), node, source))
    return scenario


def _late_timeline(scenario: Scenario, raw: object, node: Node | None, source: str) -> list[str]:
    """A warning line for each timeline event set after the run's arrivals end (after duration_s, or
    after the last planned arrival without one): it applies only if requests are still running then."""
    if not scenario.timeline or not isinstance(raw, list) or scenario.arrivals.process == "rounds":
        return []  # rounds arrive when the rounds before finish: their times are not known here
    if scenario.duration_s is not None:
        end, what, fix = scenario.duration_s, f"duration_s ({scenario.duration_s:g} s)", "raise duration_s"
    else:
        times = [a.at_s for a in planned_arrivals(scenario)]
        end = times[-1] if times else 0.0
        what, fix = f"the last planned arrival ({end:.2f} s)", "let arrivals run longer"
    lines = []
    for i, event in enumerate(raw):
        at_s = event.get("at_s") if isinstance(event, dict) else None
        if isinstance(at_s, (int, float)) and at_s > end:
            where = _line_at(node, ["timeline", i, "at_s"])
            lines.append(f"{source}:{where}: timeline.{i}.at_s: at {at_s:g} s, after {what}: it applies only if "
                         f"requests are still running then, else never; move it earlier or {fix}")
    return lines


def _read_yaml(text: str, source: str) -> tuple[Node | None, object]:
    loader, node = None, None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        return node, (loader.construct_document(node) if node is not None else None)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f"{mark.line + 1}" if mark else "1"
        what = " ".join(str(x) for x in (e.context, e.problem) if x) or "invalid YAML"
        raise ScenarioError([f"{source}:{line}: (yaml): {what}; check indentation, colons and quotes there"]) from None
    except yaml.reader.ReaderError as e:
        line = text[: e.position].count("\n") + 1
        raise ScenarioError([f"{source}:{line}: (yaml): character {e.character!r} is not allowed in YAML; "
                             "remove it or quote it as an escape like \"\\x1f\""]) from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError) as e:
        where = _failing_scalar(node)
        raise ScenarioError([f"{source}:{where}: (yaml): cannot read a value ({short(str(e))}); "
                             "quote it if it is meant as text"]) from None
    finally:
        if loader is not None:
            loader.dispose()


def _failing_scalar(root: Node | None) -> str:
    """Line of the first scalar YAML cannot construct (e.g. the date 2024-13-45), or '1'."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ScalarNode):
            try:
                SafeConstructor().construct_object(node)
            except Exception:
                return str(_line(node))
        elif isinstance(node, MappingNode):
            stack.extend(x for pair in reversed(node.value) for x in reversed(pair))
        elif isinstance(node, SequenceNode):
            stack.extend(reversed(node.value))
    return "1"


def _format(err: dict, data: dict, node: Node | None, source: str) -> str:
    problem, fix, sub = describe(err, _allowed, _TAG_CHOICES)
    path = _clean_path(tuple(err["loc"]) + tuple(sub), data)
    dotted = ".".join(path_part(p) for p in path) or "(document)"
    return f"{source}:{_line_at(node, path)}: {dotted}: {problem}; {fix}"


def _clean_path(loc: tuple, data: object) -> list:
    """The loc as the user wrote it: union tags that pydantic inserts are dropped."""
    out, cur = [], data
    for el in loc:
        if isinstance(cur, dict) and _has_key(cur, el):
            out.append(el)
            cur = cur[el]
        elif isinstance(cur, list) and isinstance(el, int) and 0 <= el < len(cur):
            out.append(el)
            cur = cur[el]
        elif el in _TAGS and isinstance(el, str):
            continue
        else:
            out.append(el)
            cur = None
    return out


def _has_key(d: dict, key: object) -> bool:
    try:
        return key in d
    except TypeError:
        return False


def _line(node: Node | None) -> int:
    return node.start_mark.line + 1 if node is not None else 1


def _key_value(key: Node) -> object:
    if not isinstance(key, ScalarNode):
        return None
    try:
        return SafeConstructor().construct_object(key)
    except Exception:  # a key YAML could not build: matched by its text below
        return key.value


def _line_at(node: Node | None, path: list) -> int:
    """YAML line of the deepest part of `path` found in the node tree (best effort)."""
    line = _line(node)
    for el in path:
        nxt = None
        if isinstance(node, MappingNode):
            for k, v in node.value:
                kv = _key_value(k)
                if kv == el or (isinstance(k, ScalarNode) and k.value == str(el)):
                    line, nxt = _line(k), v
        elif isinstance(node, SequenceNode) and isinstance(el, int) and 0 <= el < len(node.value):
            nxt = node.value[el]
            line = _line(nxt)
        if nxt is None:
            break
        node = nxt
    return line


def _first_duplicate(root: Node | None) -> tuple[int, str, int] | None:
    """(line, key, first line) of the first key written twice in one mapping (YAML keeps the last
    silently), merge keys excepted."""
    stack, seen_nodes = [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, MappingNode):
            keys: dict = {}
            for k, v in node.value:
                if k.tag != "tag:yaml.org,2002:merge" and isinstance(k, ScalarNode):
                    if k.value in keys:
                        return _line(k), k.value, keys[k.value]
                    keys[k.value] = _line(k)
                stack.extend((k, v))
        elif isinstance(node, SequenceNode):
            stack.extend(node.value)
    return None
