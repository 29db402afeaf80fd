"""Tool calls in a model's sampled text, as the common model families write them: pure parsing, no I/O.

A parser splits a completion into the text meant for the user and the calls; a call it cannot read is a
`Malformed`, to be answered to the model as a tool turn saying what was wrong (a model learns from it, and a
rollout is not lost to one bad call). Formats:

- `hermes` (Hermes, Qwen 2.5 / 3, and most open chat templates): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, any number of them;
- `llama3` (Llama 3.1+ JSON tool calling): `{"name": ..., "parameters": {...}}` as the whole reply, optionally after
  `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (with or without the list brackets).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Malformed:
    """A call the model tried to make and the parser could not read: `text` as sampled, `error` why."""

    text: str
    error: str


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str
    """The completion without its tool calls (stripped)."""
    calls: list[ToolCall | Malformed]


MAX_DEPTH = "JSON nested too deeply to read"


def _decode(text: str) -> tuple[Any, str | None]:
    """`text` as JSON, or why not: a sampled call is untrusted (1,000 nested brackets overflow json's
    recursion; that is a malformed call, not a failed rollout)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON: {exc.msg} at character {exc.pos}"
    except RecursionError:
        return None, MAX_DEPTH


def _call(obj: Any, args_key: str, text: str) -> ToolCall | Malformed:
    if not isinstance(obj, dict):
        return Malformed(text, f"a tool call is a JSON object, not {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return Malformed(text, 'a tool call needs a "name" string')
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models send the arguments as a JSON string
        args, error = _decode(args)
        if error is not None:
            return Malformed(text, f'"{args_key}" is {error}')
    if not isinstance(args, dict):
        return Malformed(text, f'"{args_key}" must be a JSON object')
    return ToolCall(name, args)


def _loads(text: str, args_key: str) -> ToolCall | Malformed:
    obj, error = _decode(text)
    if error is not None:
        return Malformed(text, error)
    return _call(obj, args_key, text)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _closing_tag(text: str, start: int) -> int:
    """Where the call whose body begins at `start` ends: the first `</tool_call>` outside a JSON string (an
    argument may hold the tag itself: code, a quoted tag), else the first at all (a body whose string never
    closes is malformed either way), else -1 (not closed)."""
    in_str = esc = False
    for k in range(start, len(text)):
        ch = text[k]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif text.startswith(_CLOSE, k):
            return k
    return text.find(_CLOSE, start)


def parse_hermes(text: str) -> Parsed:
    calls: list[ToolCall | Malformed] = []
    content: list[str] = []
    at = 0
    while (opened := text.find(_OPEN, at)) >= 0:
        content.append(text[at:opened])
        start = opened + len(_OPEN)
        end = _closing_tag(text, start)
        body = (text[start:] if end < 0 else text[start:end]).strip()
        call = _loads(body, "arguments")
        if end < 0 and isinstance(call, ToolCall):
            call = Malformed(body, "the tool call is not closed with </tool_call>")
        calls.append(call)
        at = len(text) if end < 0 else end + len(_CLOSE)
    content.append(text[at:])
    return Parsed("".join(content).strip(), calls)


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> Parsed:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG) :].strip()
    if not tagged and not body.startswith("{"):
        return Parsed(text.strip(), [])
    calls = [_loads(part.strip(), "parameters") for part in _split_top_level(body, ";") if part.strip()]
    return Parsed("", calls)


_MISTRAL = "[TOOL_CALLS]"


def parse_mistral(text: str) -> Parsed:
    at = text.find(_MISTRAL)
    if at < 0:
        return Parsed(text.strip(), [])
    content, body = text[:at].strip(), text[at + len(_MISTRAL) :].strip()
    obj, error = _decode(body)
    if error is not None:
        return Parsed(content, [Malformed(body, error)])
    items = obj if isinstance(obj, list) else [obj]
    return Parsed(content, [_call(item, "arguments", json.dumps(item)) for item in items])


def _split_top_level(text: str, sep: str) -> list[str]:
    """Split at `sep` outside JSON strings and brackets."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral}
"""By the name an environment or a model family chooses."""
