"""A tool-using chat environment that runs without downloads, for the demo, the tests and the fake inference
server: a byte-level tokenizer built locally with `tokenizers` (one id per byte, 0-255, then the special
tokens of the common chat formats) carrying Qwen2.5's real chat template (tools included), a calculator
tool, and `chat_script`, the scripted model that plays it in each tool-call format.

`local_tokenizer()` needs `tokenizers` and `transformers` (imported on first use); `ByteChatCodec` is the
same tokenizer without them (the fake inference server decodes prompts and encodes answers with it).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rollout_client.chat.session import ChatEnvironment, ChatTokenizer, Message
from rollout_client.env import Session, Task
from rollout_client.policy import stable_unit

SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",  # Qwen / ChatML
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",  # Llama 3
    "<|python_tag|>",
    "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",  # Mistral
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
)  # fmt: skip
"""Ids 256, 257, ... in this order."""

SPECIAL_ID = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""  # noqa: E501 (verbatim)
"""Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct), verbatim."""

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
"""Meta-Llama-3-8B-Instruct's chat template, verbatim: it trims each message's content."""

LLAMA31_JSON_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {#- Llama 3.1 doesn't pass all tests if the tools are in the system prompt #}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- if messages[0]['content'] is string %}
        {%- set system_message = messages[0]['content']|trim %}
    {%- else %}
        {%- set system_message = messages[0]['content'][0]['text']|trim %}
    {%- endif %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- if tools is not none %}
        {%- set system_message = "You are a helpful assistant with tool calling capabilities. Only reply with a tool call if the function exists in the library provided by the user. If it doesn't exist, just reply directly in natural language. When you receive a tool call response, use the output to format an answer to the original user question." %}
    {%- else %}
        {%- set system_message = "" %}
    {%- endif %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call. " }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. ' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- if messages[0]['content'] is string %}
            {%- set first_user_message = messages[0]['content']|trim %}
        {%- else %}
            {%- set first_user_message = messages[0]['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | map('trim') | join('\n') %}
        {%- endif %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. ' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
        {%- if message['content'] is string %}
            {{- message['content'] | trim}}
        {%- else %}
            {%- for content in message['content'] %}
                {%- if content['type'] == 'text' %}
                    {{- content['text'] | trim }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if message.tool_calls|length > 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- elif message.tool_calls|length == 0 %}
            {{- "No tool calls found." }}
        {%- else %}
            {%- set tool_call = message.tool_calls[0].function %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name|trim + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is string %}
            {{- { "output": message.content } | tojson }}
        {%- else %}
            {%- for content in message['content']  %}
                {%- if content['type']  == 'text' %}
                    {{- { "output": content['text']  } | tojson }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501 (verbatim)
"""Llama 3.1's chat template for JSON tool calls (vLLM's examples/tool_chat_template_llama3.1_json.jinja, from
Meta's): tools in the first user message, calls written from the assistant message's `tool_calls`, tool
results as `ipython` turns. Pass `date_string` in the template kwargs for a rendering that does not change
with the day."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character map, which byte-level BPE vocabularies are written in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


@functools.lru_cache(maxsize=4)
def local_tokenizer(chat_template: str = QWEN25_TEMPLATE, eos_token: str = "<|im_end|>") -> ChatTokenizer:
    """A `transformers.PreTrainedTokenizerFast`: byte-level BPE with no merges (id = byte), `SPECIAL_TOKENS`
    from 256, and `chat_template`. Built in memory: no download. Cached per process."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
    )  # optional: only the chat demo and tests need it
    from transformers import PreTrainedTokenizerFast  # optional: only the chat demo and tests need it

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    extra = [s for s in SPECIAL_TOKENS if s not in (eos_token, "<|endoftext|>")]
    out: ChatTokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token="<|endoftext|>",
        bos_token="<|begin_of_text|>",
        extra_special_tokens=extra,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )
    return out


_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")


class ByteChatCodec:
    """`local_tokenizer()`'s encoding without tokenizers or transformers: bytes as ids 0-255, special tokens
    from 256 (tests check that the two agree)."""

    @staticmethod
    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for part in _SPLIT.split(text):
            ids.extend([SPECIAL_ID[part]] if part in SPECIAL_ID else part.encode())
        return ids

    @staticmethod
    def decode(ids: Sequence[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode(errors="replace"))
            run = bytearray()
            out.append(SPECIAL_TOKENS[i - 256])
        out.append(run.decode(errors="replace"))
        return "".join(out)


# ------------------------------------------------------------------------------------------- the env

Format = Literal["hermes", "llama3", "mistral"]
_QUESTION = re.compile(r"Q: (\d+) ([+*]) (\d+) =")
_RESULT = re.compile(r"RESULT (-?\d+)")
STOP = {"hermes": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}
"""Each family's end of turn."""


def calculate(a: int, op: Literal["+", "*"], b: int) -> str:
    """Compute a + b or a * b exactly.

    Args:
        a: the left operand
        op: the operator
        b: the right operand
    """
    if op not in ("+", "*"):
        raise ValueError(f"unknown operator {op!r}")
    return f"RESULT {a + b if op == '+' else a * b}"


def tool_call_text(fmt: str, name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the family writes it."""
    if fmt == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    if fmt == "llama3":  # JSON tool calling (custom tools): the bare object; built-in tools add <|python_tag|>
        return json.dumps({"name": name, "parameters": arguments})
    return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": arguments}])


CUT_SHORT = 0.25
"""The share of first attempts `chat_script` cuts short (by `stable_unit` of the prompt and seed)."""


def chat_script(prompt: str, seed: int, fmt: str = "hermes", stop: str | None = None) -> str:
    """The scripted chat model: asks the calculator in the `fmt` family's tool-call format, then answers with
    its result. Deterministic per prompt and seed: a quarter of first attempts are cut short (a malformed call,
    which the session answers with the reason; the model then calls again), a fifth mistype an operand."""
    end = STOP[fmt] if stop is None else stop
    if results := _RESULT.findall(prompt):
        return f"The answer is {results[-1]}.{end}"
    q = _QUESTION.search(prompt)
    if q is None:
        return f"I cannot tell.{end}"
    a, op, b = int(q.group(1)), q.group(2), int(q.group(3))
    r = stable_unit(prompt, seed)
    call = tool_call_text(fmt, "calculate", {"a": a, "op": op, "b": b if r < 0.8 else b + 1})
    if r < CUT_SHORT and "Error:" not in prompt:  # cut short: the JSON does not close
        call = call.replace("}\n</tool_call>", "\n</tool_call>") if fmt == "hermes" else call[:-1]
    return f"Let me compute that. {call}{end}" if fmt != "llama3" else f"{call}{end}"


def answer_of(text: str) -> str | None:
    m = re.search(r"The answer is (-?\d+)", text)
    return m.group(1) if m else None


@dataclass
class ToolChat(ChatEnvironment):
    """Sums and products asked in a chat; the model calls `calculate` and answers; exact match scores 1. By
    default Qwen2.5's template with Hermes tool calls; `LLAMA31_JSON_TEMPLATE` with `eos="<|eot_id|>"`,
    `parser="llama3"`, `calls_as="tool_calls"` for Llama 3.1's. The tokenizer is `local_tokenizer()`: no
    download."""

    name: str = "tool_chat"
    group_size: int = 4
    weight: float = 1.0
    max_tokens: int = 160
    parser: str = "hermes"
    template: str = QWEN25_TEMPLATE
    eos: str = "<|im_end|>"
    calls_as: Literal["text", "tool_calls"] = "text"
    template_vars: dict[str, Any] = field(default_factory=dict)

    def tokenizer(self) -> ChatTokenizer:
        return local_tokenizer(self.template, self.eos)

    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.template_vars)

    def tools(self) -> list[Any]:
        return [calculate]

    def messages(self, task: Task) -> list[Message]:
        return [
            {"role": "system", "content": "You are a careful assistant. Use the calculator."},
            {"role": "user", "content": task.prompt},
        ]

    def score(self, task: Task, session: Session) -> float:
        return 1.0 if answer_of(self.chat(session).last_content) == task.answer else 0.0
