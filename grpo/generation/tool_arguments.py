"""A tool call's arguments checked against its tool's JSON schema before the call (`checked_arguments`).

The schema is the one the model was shown: what transformers' `get_json_schema` makes of the function's type hints
and docstring (tools.py's `make_tool`). Without the check, `{"a": "3"}` reaches `def f(a: int)` as a string, and
Python runs on with it (`"3" * 4` is `'3333'`). Checked here, the subset of JSON Schema that `get_json_schema`
writes: `type` (one or a list), `nullable`, `enum` (a `Literal`, an `Enum`, a docstring's `(choices: [...])`),
`anyOf` (a union of arrays or objects), `items` and `prefixItems` (lists and tuples), `additionalProperties` (a
dict's values), `properties` and `required`. A type it does not know (`image`, `audio`) is not checked. JSON's
types are not Python's: `true` is a boolean and never an integer, and an integer is a number.

Where this departs from JSON Schema: the function takes no argument its signature does not name (tools may not take
`**kwargs`), so an unknown argument is a problem; and a number with no fraction (`3.0`), which JSON Schema counts as
an integer, is passed to the tool as the integer its hint asks for.

TRL checks nothing: it calls the tool with the model's arguments, and a missing or unknown one fails as the
tool's `TypeError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# What each JSON type is called in the answer the model reads.
_NAMES = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "a boolean (true or false)",
    "null": "null",
    "array": "an array",
    "object": "an object",
}


class ArgumentError(ValueError):
    """A call's arguments do not fit its tool's schema; the message lists every problem, in words for the model."""


def checked_arguments(arguments: Mapping[str, Any], parameters: Mapping[str, Any]) -> dict[str, Any]:
    """`arguments` (a call's, as parsed) checked against `parameters` (the `parameters` of the tool's schema), as
    the tool is to get them: every number with no fraction given where the schema asks for an integer made one.
    Raises `ArgumentError` listing each unknown argument, each missing required one, and each value of the wrong
    type or not among the allowed values (nested values too: `items[2]`, `scores["b"]`).

    >>> parameters = {"properties": {"a": {"type": "integer"}, "s": {"type": "string"}}, "required": ["a", "s"]}
    >>> checked_arguments({"a": 2.0, "s": "x"}, parameters)
    {'a': 2, 's': 'x'}
    >>> try:
    ...     checked_arguments({"a": "3", "b": 1}, parameters)
    ... except ArgumentError as problems:
    ...     print(problems)
    a must be an integer, not the string "3"; unknown argument b; missing required argument s (the arguments are: a, s)
    """
    problems: list[str] = []
    checked = _object(arguments, {**parameters, "additionalProperties": False}, "", problems)
    if problems:
        names = ", ".join(parameters.get("properties", {})) or "none"
        raise ArgumentError(f"{'; '.join(problems)} (the arguments are: {names})")
    return checked


def _check(value: Any, schema: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    """`value` checked against `schema` (problems appended, naming `where`), an integral number made an int where
    the schema asks for an integer."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            found: list[str] = []
            converted = _check(value, option, where, found)
            if not found:
                return converted
        problems.append(f"{where} must be one of the forms its schema allows, not {_shown(value)}")
        return value
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        kind = next((k for k in kinds if _is_a(value, k)), None)
        if kind is None:
            allowed = " or ".join(_NAMES.get(k, k) for k in kinds) + (" or null" if schema.get("nullable") else "")
            problems.append(f"{where} must be {allowed}, not {_shown(value)}")
            return value
        if kind == "integer" and isinstance(value, float):
            value = int(value)
    if "enum" in schema and not any(_same(value, allowed) for allowed in schema["enum"]):
        problems.append(f"{where} must be one of {json.dumps(schema['enum'])}, not {_shown(value)}")
    if isinstance(value, list):
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", {})
        return [
            _check(item, prefix[i] if i < len(prefix) else items, f"{where}[{i}]", problems)
            for i, item in enumerate(value)
        ]
    if isinstance(value, dict):
        return _object(value, schema, where, problems)
    return value


def _object(value: Mapping[str, Any], schema: Mapping[str, Any], where: str, problems: list[str]) -> dict:
    """An object's members checked: `properties` by name, the others against `additionalProperties` (False: none
    allowed), and the `required` ones present. `where` empty: the call's arguments themselves."""
    properties, extra = schema.get("properties", {}), schema.get("additionalProperties", {})
    checked = {}
    for key, member in value.items():
        inner = key if not where else f"{where}[{json.dumps(key)}]"
        if key in properties:
            checked[key] = _check(member, properties[key], inner, problems)
        elif extra is False:
            problems.append(f"unknown argument {key}" if not where else f"{where} has no member {json.dumps(key)}")
        else:
            checked[key] = _check(member, extra if isinstance(extra, Mapping) else {}, inner, problems)
    for key in schema.get("required", []):
        if key not in value:
            problems.append(f"missing required argument {key}" if not where else f"{where} needs {json.dumps(key)}")
    return checked


def _is_a(value: Any, kind: str) -> bool:
    """Whether `value`, as parsed from JSON, is of JSON type `kind` (a type this module does not know: yes)."""
    if isinstance(value, bool):  # a Python bool is an int; a JSON boolean is neither an integer nor a number
        return kind == "boolean"
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float))
    types = {"string": str, "null": type(None), "array": (list, tuple), "object": Mapping, "boolean": bool}
    return isinstance(value, types[kind]) if kind in types else True


def _same(value: Any, allowed: Any) -> bool:
    """`value == allowed` as JSON compares them: `true` is not `1`."""
    return isinstance(value, bool) == isinstance(allowed, bool) and value == allowed


def _shown(value: Any) -> str:
    """`value` described for the model: its JSON type and, for a scalar, the value (cut to 40 characters)."""
    kind = next((k for k in ("boolean", "integer", "number", "string", "null") if _is_a(value, k)), None)
    if kind is None:
        return "an array" if isinstance(value, (list, tuple)) else "an object"
    if kind == "null":
        return "null"
    text = json.dumps(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"the {'number' if kind == 'integer' else kind} {text}"
