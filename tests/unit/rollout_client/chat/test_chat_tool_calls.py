"""rollout_client.chat.tool_calls: each family's format read back exactly (hypothesis, any names and JSON arguments),
text around the calls kept as content, and a call that cannot be read returned as Malformed with the reason."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from rollout_client.chat.tool_calls import PARSERS, Malformed, ToolCall, parse_hermes, parse_llama3, parse_mistral

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
calls = st.lists(
    st.builds(
        ToolCall,
        st.from_regex(r"[a-z_][a-z0-9_]{0,15}", fullmatch=True),
        st.dictionaries(st.text(max_size=8), json_values, max_size=4),
    ),
    min_size=1,
    max_size=3,
)


def hermes(cs: list[ToolCall]) -> str:
    return "".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>" for c in cs)


def llama3(cs: list[ToolCall]) -> str:
    return "<|python_tag|>" + "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in cs)


def mistral(cs: list[ToolCall]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": c.name, "arguments": c.arguments} for c in cs])


@given(calls, st.sampled_from(["", "Let me check. "]))
def test_every_format_reads_back_what_a_model_wrote(cs: list[ToolCall], before: str) -> None:
    assert parse_hermes(before + hermes(cs)).calls == cs
    assert parse_hermes(before + hermes(cs)).content == before.strip()
    assert parse_llama3(llama3(cs)).calls == cs
    assert parse_mistral(before + mistral(cs)).calls == cs
    assert parse_mistral(before + mistral(cs)).content == before.strip()


def test_text_without_calls_is_content_only() -> None:
    for name, parse in PARSERS.items():
        parsed = parse("The answer is 42.")
        assert (parsed.content, parsed.calls) == ("The answer is 42.", []), name


def test_a_bare_llama3_json_reply_and_arguments_as_a_string_are_read() -> None:
    assert parse_llama3('{"name": "add", "parameters": {"a": 1}}').calls == [ToolCall("add", {"a": 1})]
    got = parse_hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>').calls
    assert got == [ToolCall("add", {"a": 1})]


def bad(parsed: Any) -> Malformed:
    [call] = parsed.calls
    assert isinstance(call, Malformed)
    return call


def test_calls_that_cannot_be_read_say_why() -> None:
    assert "not valid JSON" in bad(parse_hermes('<tool_call>{"name": "add", "arguments": {</tool_call>')).error
    assert "not closed" in bad(parse_hermes('<tool_call>{"name": "add", "arguments": {}}')).error
    assert '"name"' in bad(parse_hermes('<tool_call>{"arguments": {}}</tool_call>')).error
    assert "JSON object" in bad(parse_hermes("<tool_call>[1, 2]</tool_call>")).error
    assert "must be a JSON object" in bad(parse_llama3('{"name": "f", "parameters": [1]}')).error
    assert "not valid JSON" in bad(parse_mistral('[TOOL_CALLS][{"name": "f"')).error
    assert parse_llama3('<|python_tag|>{"name": "f", "parameters": {"s": "a;b"}}').calls == [
        ToolCall("f", {"s": "a;b"})
    ]


def test_a_thousand_nested_brackets_are_a_malformed_call_not_a_recursion_error() -> None:
    """json's parser recurses per bracket; a sampled call 1,000 deep raised RecursionError out of
    every parser (the rollout failed). Now it is a malformed call, told to the model."""
    deep = "[" * 1000 + "]" * 1000
    nested = '{"name": "f", "arguments": ' + deep + "}"
    for parsed in (
        parse_hermes(f"<tool_call>{nested}</tool_call>"),
        parse_llama3(nested),
        parse_mistral(f"[TOOL_CALLS]{deep}"),
    ):
        [call] = parsed.calls
        assert isinstance(call, Malformed) and "nested too deeply" in call.error
    [call] = parse_hermes('<tool_call>{"name": "f", "arguments": ' + json.dumps(deep) + "}</tool_call>").calls
    assert isinstance(call, Malformed) and "nested too deeply" in call.error


def test_a_closing_tag_inside_an_argument_is_part_of_the_argument() -> None:
    """A literal `</tool_call>` inside a JSON string (code the model writes, a quoted tag) does not end the call:
    the call ends at the first closing tag outside the JSON's strings."""
    args = {"code": 'print("</tool_call>")', "note": "a \\" + '" then </tool_call>'}
    text = f"Let me run it. <tool_call>{json.dumps({'name': 'python', 'arguments': args})}</tool_call> done"
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("python", args)]
    assert parsed.content == "Let me run it.  done"


def test_an_unclosed_string_still_ends_the_call_at_its_closing_tag() -> None:
    parsed = parse_hermes('<tool_call>{"name": "f", "arguments": {"a": "b}</tool_call> after')
    assert len(parsed.calls) == 1 and isinstance(parsed.calls[0], Malformed)
    assert parsed.content == "after"
