"""rollout_client.chat.tools: a tool's schema from its signature and docstring is the one transformers'
`get_json_schema` writes (what chat templates are tested with), and arguments that do not fit are refused
before the tool runs."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from transformers.utils import get_json_schema

from rollout_client.chat.tools import BadArguments, Tool, as_tools, bind, call_tool, tool_schema


def search(query: str, limit: int = 5, exact: bool = False, tags: list[str] | None = None) -> list[str]:
    """Search the notes.

    The longer explanation stays out of the description's first part.

    Args:
        query: what to look for, in plain words
            (continued on a second line)
        limit: at most this many results
        exact: match the whole phrase
        tags: only notes with one of these tags

    Returns:
        The titles found.
    """
    return [query][:limit]


def convert(amount: float, unit: Literal["km", "mi"], extra: dict[str, int] | None = None) -> float:
    """Convert a distance.

    Args:
        amount: how far
        unit: the unit it is in
        extra: ignored
    """
    return amount


@pytest.mark.parametrize("fn", [search, convert])
def test_the_schema_is_what_transformers_writes(fn: Any) -> None:
    ours = tool_schema(fn)
    theirs = get_json_schema(fn)
    theirs["function"].pop("return", None)  # the return type is not shown to the model by the common templates
    theirs["function"]["description"] = theirs["function"]["description"].split("\n\n")[0]
    ours["function"]["description"] = ours["function"]["description"].split("\n\n")[0]
    assert ours == theirs


def test_arguments_that_do_not_fit_are_refused_before_the_tool_runs() -> None:
    tool = Tool(search)
    with pytest.raises(BadArguments, match="missing a required argument: 'query'"):
        bind(tool, {"limit": 2})
    with pytest.raises(BadArguments, match="unexpected keyword argument 'colour'"):
        bind(tool, {"query": "x", "colour": "red"})
    assert asyncio.run(call_tool(tool, bind(tool, {"query": "x"}))) == '["x"]'


def test_async_tools_are_awaited_and_names_are_unique() -> None:
    async def ping(host: str) -> str:
        """Ping a host.

        Args:
            host: the host
        """
        return f"pong {host}"

    tool = Tool(ping)
    assert asyncio.run(call_tool(tool, bind(tool, {"host": "a"}))) == "pong a"
    with pytest.raises(ValueError, match="two tools named 'ping'"):
        as_tools([ping, Tool(ping)])

    def bad(x: complex) -> None:
        """No."""

    with pytest.raises(TypeError, match="no JSON schema"):
        tool_schema(bad)
