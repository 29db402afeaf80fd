"""Tools for chat environments: a JSON schema from a Python function's signature and docstring (the shape
`transformers.utils.get_json_schema` gives and chat templates render), and the call of one tool on the
arguments a model wrote, sync or async, with what went wrong said in words the model can act on.

Pure apart from calling the tool: the chat session (rollout_client.chat.session) times the calls and records them.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin

_SCALARS: dict[Any, str] = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
_ARGS = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$", re.MULTILINE)
_SECTION = re.compile(r"^\s*(Returns?|Raises|Yields|Examples?|Notes?):\s*$", re.MULTILINE)
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def _type_schema(tp: Any) -> dict[str, Any]:
    """JSON schema of one annotation, as transformers writes it (Optional as `nullable`)."""
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        kinds = sorted({_SCALARS.get(type(a), "string") for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        out: dict[str, Any] = (
            _type_schema(rest[0]) if len(rest) == 1 else {"type": sorted({_type_schema(a)["type"] for a in rest})}
        )
        if len(rest) < len(args):
            out["nullable"] = True
        return out
    if origin in (list, tuple, set, Sequence) or tp in (list, tuple, set):
        array: dict[str, Any] = {"type": "array"}
        if args and args[0] is not Ellipsis:
            array["items"] = _type_schema(args[0])
        return array
    if origin is dict or tp is dict:
        obj: dict[str, Any] = {"type": "object"}
        if len(args) == 2:
            obj["additionalProperties"] = _type_schema(args[1])
        return obj
    if tp is Any or tp is inspect.Parameter.empty:
        return {}
    raise TypeError(f"no JSON schema for the annotation {tp!r}: use int, float, str, bool, list, dict, Literal")


def _docstring(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The description (the text before `Args:`) and each argument's description (Google style)."""
    doc = inspect.getdoc(fn) or ""
    m = _ARGS.search(doc)
    if m is None:
        return _SECTION.split(doc, maxsplit=1)[0].strip(), {}
    description, rest = doc[: m.start()].strip(), doc[m.end() :]
    if (end := _SECTION.search(rest)) is not None:
        rest = rest[: end.start()]
    args: dict[str, str] = {}
    current = None
    for line in rest.splitlines():
        if (a := _ARG_LINE.match(line)) is not None and (current is None or not line.startswith("        ")):
            current = a.group(1)
            args[current] = a.group(2).strip()
        elif current is not None and line.strip():
            args[current] = f"{args[current]} {line.strip()}".strip()
    return description, args


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """`{"type": "function", "function": {name, description, parameters}}` from the signature (types) and the
    docstring (the description, and `Args:` for each parameter's): what chat templates render as the tools."""
    description, docs = _docstring(fn)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = _type_schema(hints.get(name, p.annotation))
        if name in docs:
            prop["description"] = docs[name]
        properties[name] = prop
        if p.default is p.empty:
            required.append(name)
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    return {"type": "function", "function": {"name": fn.__name__, "description": description, "parameters": parameters}}


_SURROGATE = re.compile("[\ud800-\udfff]")
TOOL_TIMEOUT_S = 60.0
"""Default bound on one call of an async tool: past it the call is cancelled and the model told so."""


def valid_text(text: str) -> str:
    """`text` as valid UTF-8: a lone surrogate (a tool echoing bytes decoded with `surrogateescape`, a bad
    JSON escape) cannot be tokenised, and would fail the rollout; it becomes "\ufffd"."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)
    return text


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the schema it is shown (`tool_schema(fn)` unless given). `timeout`
    bounds one call of an async tool (None: the chat session's `tool_timeout`); a sync tool runs on the event
    loop and cannot be cut short: make a slow one async (`asyncio.to_thread`)."""

    fn: Callable[..., Any]
    schema: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not self.schema:
            object.__setattr__(self, "schema", tool_schema(self.fn))
        object.__setattr__(self, "signature", inspect.signature(self.fn))  # once: it costs ~20 us a call

    signature: inspect.Signature = field(init=False, repr=False, compare=False)

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])


class BadArguments(Exception):
    """The model's arguments do not fit the tool's signature: a malformed call, told to the model."""


def as_tools(tools: Sequence[Callable[..., Any] | Tool]) -> dict[str, Tool]:
    out: dict[str, Tool] = {}
    for t in tools:
        tool = t if isinstance(t, Tool) else Tool(t)
        if tool.name in out:
            raise ValueError(f"two tools named {tool.name!r}")
        out[tool.name] = tool
    return out


def bind(tool: Tool, arguments: dict[str, Any]) -> inspect.BoundArguments:
    """The model's arguments bound to the tool's signature; BadArguments (saying why) when they do not fit."""
    try:
        return tool.signature.bind(**arguments)
    except TypeError as exc:
        raise BadArguments(f"{tool.name}: {exc}") from None


async def call_tool(tool: Tool, bound: inspect.BoundArguments) -> str:
    """Run the tool (awaited when async); its result as the text the model reads: a string as is, anything
    else as JSON. The tool's own errors propagate."""
    result = tool.fn(*bound.args, **bound.kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result if isinstance(result, str) else json.dumps(result, default=str)
