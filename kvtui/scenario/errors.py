"""Scenario errors: every problem is one line `<file>:<line>: <field.path>: <problem>; <fix>`.

`Problem` is what validators raise (pydantic wraps it and keeps the instance in the error's ctx, so
the formatter can read the fix and an optional sub-path below the field that raised it).
`format_validation_error` turns a pydantic ValidationError into such lines.
"""

from __future__ import annotations

import math
import re
import reprlib
import types
import typing
from collections.abc import Callable, Sequence

import pydantic

from kvtui.names import did_you_mean


class ScenarioError(Exception):
    """A scenario that cannot be used.

    Attributes:
        errors: one line per problem, `<file>:<line>: <field.path>: <problem>; <fix>` (the line
            number is left out where it is not known, e.g. for a missing file).
    """

    def __init__(self, errors: Sequence[str]):
        self.errors = [printable(e) for e in errors] or ["unknown scenario error; check the file"]
        super().__init__("\n".join(self.errors))


class Problem(ValueError):
    """Raised by validators: `problem` (what is wrong), `fix` (what to write instead) and `subpath`
    (keys below the validated field, e.g. ("set", "engine.layout") for a timeline knob)."""

    def __init__(self, problem: str, fix: str, subpath: tuple = ()):
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix, self.subpath = problem, fix, tuple(subpath)


def printable(text: str) -> str:
    """`text` on one line: control and other non-printable characters escaped (\\n, \\x1f, ...)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def path_part(part: object) -> str:
    """One element of a field path: plain names as they are, anything odd quoted."""
    if isinstance(part, int) or (isinstance(part, str) and re.fullmatch(r"[A-Za-z0-9_.\-]+", part)):
        return str(part)
    return short(part)


_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 40, 40, 4, 4, 2


def short(value: object) -> str:
    """A bounded repr of a user value (safe for huge or self-referencing YAML data)."""
    try:
        return _short.repr(value)
    except Exception:  # a value whose repr fails must not hide the real error
        return f"<{type(value).__name__}>"


_EXPONENT = re.compile(r"([-+]?)(\d+)(?:\.(\d*))?[eE]([-+]?)(\d+)")


def yaml11_exponent(value: object) -> tuple[str, str, str] | None:
    """For text such as '1e3' that YAML 1.1 (PyYAML) reads as a string because its exponent form
    lacks a dot or a sign: (what was read, the number written plainly, the number in YAML 1.1's
    exponent form), e.g. ("'1e3' (text: YAML 1.1 reads an exponent without a dot and a sign as
    text)", "1000", "1.0e+3"). None for anything else."""
    if not isinstance(value, str):
        return None
    m = _EXPONENT.fullmatch(value.strip())
    if not m or not math.isfinite(float(value)):
        return None
    sign, whole, frac, exp_sign, exp = m.groups()
    number = float(value)
    plain = str(int(number)) if number.is_integer() and abs(number) < 1e16 else repr(number)
    if "e" in plain:  # repr fell back to an exponent: give only the YAML 1.1 form
        plain = f"{sign}{whole}.{frac or '0'}e{exp_sign or '+'}{exp}"
    read = f"{short(value)} (text: YAML 1.1 reads an exponent without a dot and a sign as text)"
    return read, plain, f"{sign}{whole}.{frac or '0'}e{exp_sign or '+'}{exp}"


def type_name(value: object) -> str:
    names = {dict: "a mapping", list: "a list", str: "text", bool: "true/false", int: "an integer",
             float: "a number", type(None): "nothing (null)"}
    return names.get(type(value), f"a {type(value).__name__}")


# Example values used in "add `field: value`" fixes.
EXAMPLES = {
    "rate_per_s": "2.0", "burstiness": "0.5", "size": "4", "every_s": "1.0", "file": "traces/small.csv",
    "value": "24", "min": "1", "max": "64", "mean": "128", "stdev": "32", "sigma": "0.5",
    "values": "[16, 64]", "a": "1.5", "path": "prompts.txt", "at_s": "0.0", "prompt": '"Hello"',
    "process": "poisson", "kind": "passphrase", "dist": "fixed", "duration_s": "10.0", "requests": "[...]",
}


def _literal_choices(err: dict) -> list[str]:
    return re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))


def describe(err: dict, allowed_keys: Callable[[tuple], list[str]],
             tag_choices: dict[str, Sequence[str]] | None = None) -> tuple[str, str, tuple]:
    """(problem, fix, extra subpath) for one pydantic error dict; `tag_choices` lists the values of
    each union tag (process, kind, dist) for the fix of a missing tag."""
    kind, loc, value = err["type"], tuple(err["loc"]), err.get("input")
    field = str(loc[-1]) if loc else "scenario"
    ctx = err.get("ctx") or {}
    exc = ctx.get("error")
    if isinstance(exc, Problem):
        return exc.problem, exc.fix, exc.subpath
    if kind == "missing":
        return "required field is missing", f"add `{field}: {EXAMPLES.get(field, '...')}`", ()
    if kind == "extra_forbidden":
        keys = allowed_keys(loc[:-1])
        hint = did_you_mean(loc[-1], keys)
        return (f"unknown field {short(loc[-1])}{hint}",
                f"remove it or use one of: {', '.join(keys)}" if keys else "remove it", ())
    if kind == "literal_error":
        choices = _literal_choices(err)
        return (f"unknown value {short(value)}{did_you_mean(value, choices)}",
                f"use one of: {', '.join(choices)}", ())
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = ctx.get("discriminator", "").strip("'")
        choices = _literal_choices({"ctx": {"expected": ctx.get("expected_tags", "")}})
        choices = choices or list((tag_choices or {}).get(tag, ()))
        if kind == "union_tag_not_found":
            return f"`{tag}` is missing", f"add `{tag}: <one of {', '.join(choices)}>`", ()
        return (f"unknown {tag} {short(ctx.get('tag'))}{did_you_mean(ctx.get('tag'), choices)}",
                f"use one of: {', '.join(choices)}", (tag,))
    found = _number_problem(kind, value) or _shape_problem(kind, value, ctx)
    if found:
        return (*found, ())
    msg = str(err.get("msg", kind))
    return msg.removeprefix("Value error, "), "check the value against the scenario reference", ()


# pydantic error type -> (problem, fix); {type}, {value} and {max_length} are filled in
_SHAPES = {
    **dict.fromkeys(("model_type", "model_attributes_type", "dict_type"), (
        "expected a mapping (key: value lines), got {type}", "write it as `key: value` entries")),
    "list_type": ("expected a list, got {type}", "write it as `- item` lines or [a, b]"),
    "finite_number": ("expected a finite number, got {value}", "write a number like 2.0"),
    **dict.fromkeys(("bool_type", "bool_parsing"), ("expected true or false, got {value}", "write true or false")),
    **dict.fromkeys(("string_type", "string_unicode"), ("expected text, got {value}",
                                                         'write text, quoted if needed: "..."')),
    "string_too_short": ("must not be empty", "write some text"),
    "too_short": ("must not be empty", "give at least one entry"),
    **dict.fromkeys(("string_too_long", "too_long"), ("too long ({max_length} at most)", "shorten it")),
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _number_problem(kind: str, value: object) -> tuple[str, str] | None:
    """(problem, fix) for a value that is not a number (with YAML 1.1's '1e3' explained), else None."""
    yaml_number = yaml11_exponent(value)
    if kind in ("int_type", "int_parsing", "int_from_float"):
        if yaml_number and float(value).is_integer():
            return f"expected a whole number, got {yaml_number[0]}", f"write {yaml_number[1]}"
        return f"expected a whole number, got {short(value)}", "write an integer like 4"
    if kind in ("float_type", "float_parsing"):
        if yaml_number:
            return f"expected a number, got {yaml_number[0]}", f"write {' or '.join(dict.fromkeys(yaml_number[1:]))}"
        return f"expected a number, got {short(value)}", "write a number like 2.0"
    return None


def _shape_problem(kind: str, value: object, ctx: dict) -> tuple[str, str] | None:
    """(problem, fix) for a wrong type, size or bound, else None."""
    if kind in _SHAPES:
        problem, fix = _SHAPES[kind]
        return problem.format(type=type_name(value), value=short(value), max_length=ctx.get("max_length")), fix
    if kind in _BOUNDS:
        op, limit = _BOUNDS[kind], next(iter(ctx.values()), "?")
        return f"must be {op} {limit}, got {short(value)}", f"use a value {op} {limit}"
    return None


def allowed_keys_for(root: type[pydantic.BaseModel]) -> Callable[[tuple], list[str]]:
    """A function giving the field names allowed at a pydantic loc (tags of unions included)."""

    def walk(loc: tuple) -> list[str]:
        tp: object = root
        for el in loc:
            tp = _step(tp, el)
            if tp is None:
                return []
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
            return list(tp.model_fields)
        return []

    return walk


def _unwrap(tp: object) -> object:
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _step(tp: object, el: object) -> object:
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # a tagged union: `el` is the tag
        for member in typing.get_args(tp):
            if isinstance(member, type) and issubclass(member, pydantic.BaseModel):
                for f in member.model_fields.values():
                    if typing.get_origin(f.annotation) is typing.Literal and el in typing.get_args(f.annotation):
                        return member
        return None
    if origin in (list, tuple):
        return typing.get_args(tp)[0] if isinstance(el, int) else None
    if origin is dict:
        return typing.get_args(tp)[1]
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        f = tp.model_fields.get(el) if isinstance(el, str) else None
        return f.annotation if f else None
    return None
