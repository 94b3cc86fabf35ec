"""Tool calls in an assistant turn's text: `ToolCall`, `ParseFailure`, and one parser per chat-template format.

A parser is any callable

    parser(text: str, tool_names: Collection[str] | None) -> list[ToolCall | ParseFailure]

that takes the text of one assistant turn (decoded with or without special tokens: both work for the parsers here)
and returns, in the order they appear, the calls it found and the attempts it could not read. `tool_names` are the
tools the episode offers: a well-formed call to another name is a `ParseFailure` of kind `"unknown_tool"`; `None`
accepts any name. An empty list means the turn calls no tool, so the episode ends there.

The formats (what the model was trained to write, set by its chat template):
  - `parse_hermes`: Hermes / Qwen2.5 / Qwen3 / ChatML-family models, `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`, any number per turn. A JSON list of calls inside one tag is accepted too (the APIGen format
    SmolLM2-Instruct was fine-tuned on: `<tool_call>[{...}, {...}]</tool_call>`).
  - `parse_llama3_json`: Llama 3.1 / 3.2 JSON tool calls, the whole turn one object `{"name": ..., "parameters":
    {...}}`, possibly after `<|python_tag|>`; Llama's built-in tools (`brave_search.call(query="...")`) are not
    supported and are reported as malformed.

`parser_for_template` picks one from a chat template's text. TRL instead attaches a response schema to the
tokenizer for the chat templates it knows and parses with `tokenizer.parse_response`; a malformed call there falls
back to plain text silently. Here a malformed call is reported, so it can be answered and counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# The JSON keys a call's arguments may come under: Hermes and OpenAI write "arguments", Llama 3 "parameters".
_ARGUMENT_KEYS = ("arguments", "parameters")
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_LLAMA_END_TOKENS = ("<|eot_id|>", "<|eom_id|>")
_PYTHON_TAG = "<|python_tag|>"
# How deep a call's JSON may nest (arrays and objects). Python's `json` recurses once per level, and the deep copy
# each reward function gets of the episode (its `tool_calls` included) twice: a policy writing a few hundred `[`
# would end the run there. No tool's arguments need more than a handful of levels.
MAX_JSON_DEPTH = 100


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def as_message(self) -> dict:
        """The call as chat templates read it in an assistant message's `tool_calls` list."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParseFailure:
    """An attempted call that cannot run. `kind` is `"malformed"` (bad JSON, no name, arguments not an object, an
    unclosed tag) or `"unknown_tool"` (well formed, but `name` is not a tool of the episode); `reason` says what is
    wrong, in words the model can be shown; `text` is the offending part of the turn."""

    kind: Literal["malformed", "unknown_tool"]
    reason: str
    text: str
    name: str | None = None


def json_depth(value: Any) -> int:
    """How many arrays and objects deep `value` nests (0 for a number or a string), counted without recursion and
    stopping once past `MAX_JSON_DEPTH`."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_JSON_DEPTH:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def decode_json(text: str, position: int | None = None) -> tuple[Any, int, str | None]:
    """The JSON value of `text` (all of it; with `position`, the value starting there, which may end anywhere), the
    index where it ends, and None; or (None, position, the reason it cannot be a call). Whatever the policy writes
    is a reason, never an exception: bad JSON, nesting past `MAX_JSON_DEPTH` (Python's parser raises
    `RecursionError` at about 1,000 levels), or an integer longer than Python converts (4,300 digits by default)."""
    start = position or 0
    try:
        if position is None:
            value, end = json.loads(text), len(text)
        else:
            value, end = json.JSONDecoder().raw_decode(text, position)
    except json.JSONDecodeError as error:
        return None, start, f"is not valid JSON: {error}"
    except RecursionError:
        return None, start, f"nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
    except ValueError as error:  # Python's limit on the digits of an integer (sys.set_int_max_str_digits)
        return None, start, f"holds a number too long to read ({str(error).split(';')[0]})"
    if json_depth(value) > MAX_JSON_DEPTH:
        return None, start, f"nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects"
    return value, end, None


ToolCallParser = Callable[[str, "Collection[str] | None"], "list[ToolCall | ParseFailure]"]


def read_call(payload: Any, text: str, tool_names: Collection[str] | None) -> ToolCall | ParseFailure:
    """One decoded JSON call (`{"name": str, "arguments" or "parameters": object or JSON string}`) as a `ToolCall`,
    or the reason it is not one. Missing or null arguments mean none (a call of a tool without parameters)."""
    if not isinstance(payload, Mapping):
        return ParseFailure("malformed", f"a tool call must be a JSON object, got {type(payload).__name__}", text)
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ParseFailure("malformed", 'a tool call needs a "name" string', text)
    arguments = next((payload[key] for key in _ARGUMENT_KEYS if key in payload), None)
    if isinstance(arguments, str):  # OpenAI-style arguments, serialised as a JSON string
        arguments, _, reason = decode_json(arguments)
        if reason is not None:
            return ParseFailure("malformed", f"the arguments of '{name}' are a string that {reason}", text, name)
    arguments = {} if arguments is None else arguments
    if not isinstance(arguments, Mapping):
        return ParseFailure("malformed", f"the arguments of '{name}' must be a JSON object", text, name)
    if tool_names is not None and name not in tool_names:
        offered = ", ".join(sorted(tool_names)) or "none"
        return ParseFailure("unknown_tool", f"there is no tool '{name}' (the tools are: {offered})", text, name)
    return ToolCall(name, dict(arguments))


def parse_hermes(text: str, tool_names: Collection[str] | None = None) -> list[ToolCall | ParseFailure]:
    """The calls in `<tool_call>...</tool_call>` blocks, each holding one JSON call or a JSON list of calls.

    >>> parse_hermes('Let me add.<tool_call>\\n{"name": "add", "arguments": {"a": 1, "b": 2}}\\n</tool_call>')
    [ToolCall(name='add', arguments={'a': 1, 'b': 2})]
    >>> parse_hermes("<tool_call>{'name': 'add'}</tool_call>")[0].kind
    'malformed'

    Text outside the blocks is the turn's content and is ignored. An opening tag left unclosed (the turn was cut,
    or the model stopped) is a malformed call. A block whose JSON contains the closing tag inside a string ends
    there: the parser does not read JSON strings to find the end of a block.
    """
    found: list[ToolCall | ParseFailure] = []
    end = 0
    for block in _HERMES_BLOCK.finditer(text):
        end = block.end()
        body = block.group(1).strip()
        payload, _, reason = decode_json(body)
        if reason is not None:
            found.append(ParseFailure("malformed", f"the tool call {reason}", block.group(0)))
            continue
        for item in payload if isinstance(payload, list) else [payload]:
            found.append(read_call(item, block.group(0), tool_names))
    rest = text.find("<tool_call>", end)
    if rest != -1:
        found.append(ParseFailure("malformed", "a <tool_call> tag is never closed with </tool_call>", text[rest:]))
    return found


def parse_llama3_json(text: str, tool_names: Collection[str] | None = None) -> list[ToolCall | ParseFailure]:
    """Llama 3.1 / 3.2 JSON calls: the turn is `{"name": ..., "parameters": {...}}`, possibly after `<|python_tag|>`.

    >>> parse_llama3_json('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>')
    [ToolCall(name='add', arguments={'a': 1, 'b': 2})]
    >>> parse_llama3_json("The answer is 3.")
    []

    Llama's templates allow one call per turn; several objects separated by whitespace or `;` are all read. A turn
    that does not start with `{` (after the tag) is an answer, not a call, and so is a JSON object without a
    `"name"` (the model answering in JSON) unless `<|python_tag|>` announced a call. Text after the last call is
    ignored unless it starts another object that does not parse.
    """
    body = text.strip()
    for token in _LLAMA_END_TOKENS:
        body = body.removesuffix(token).rstrip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        if tagged:
            return [ParseFailure("malformed", "after <|python_tag|> a tool call must be a JSON object", body)]
        return []
    found: list[ToolCall | ParseFailure] = []
    position = 0
    while position < len(body) and body[position] == "{":
        payload, end, reason = decode_json(body, position)
        if reason is not None:
            found.append(ParseFailure("malformed", f"the tool call {reason}", body[position:]))
            break
        if not found and not tagged and isinstance(payload, Mapping) and "name" not in payload:
            return []  # an answer written as JSON, not a call
        found.append(read_call(payload, body[position:end], tool_names))
        position = end
        while position < len(body) and (body[position].isspace() or body[position] == ";"):
            position += 1
    return found


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parser_for_template(chat_template: str | Mapping[str, str] | None) -> ToolCallParser:
    """The parser for the tool-call format a chat template renders, read from the template's text.

    A template that writes `<tool_call>` is Hermes-style; one that writes `<|python_tag|>` or asks for a
    `"parameters"` dictionary is Llama 3's JSON format. Anything else, a template without tool support included
    (SmolLM2-Instruct's renders neither `tools` nor `tool_calls`), gets `parse_hermes`: the ChatML-family format,
    and the one SmolLM2-Instruct was fine-tuned to call tools in. A tokenizer's dict of named templates is read
    from its `"tool_use"` entry, else its `"default"` one.
    """
    if isinstance(chat_template, Mapping):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    template = chat_template or ""
    if "<tool_call>" in template:
        return parse_hermes
    if _PYTHON_TAG in template or '"parameters"' in template:
        return parse_llama3_json
    return parse_hermes


def resolve_parser(parser: str | ToolCallParser | None, chat_template: str | Mapping[str, str] | None = None):
    """The parser a user asked for: a name in `TOOL_CALL_PARSERS`, a callable (used as is), or None (read from
    `chat_template` by `parser_for_template`)."""
    if parser is None:
        return parser_for_template(chat_template)
    if callable(parser):
        return parser
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"Unknown tool-call parser {parser!r}: use one of {sorted(TOOL_CALL_PARSERS)}, a callable "
            "`parser(text, tool_names) -> list[ToolCall | ParseFailure]`, or None to pick one from the chat template."
        )
    return TOOL_CALL_PARSERS[parser]
