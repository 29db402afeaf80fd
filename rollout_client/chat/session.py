"""Chat on token ids: messages rendered with the model's own chat template, tools called, and the trained
tokens exactly the ones the policy sampled.

`ChatSession` wraps a rollout's `Session`. The template is rendered as text with `apply_chat_template`
(`tools=` the tools' schemas) and appended *incrementally*: each turn adds only what the template puts after
the tokens already there (`render(messages)` minus the text of those tokens), tokenised on its own, so the
ids of earlier turns are never re-tokenised. The assistant's turn is the policy's sampled ids, untouched
(trained); everything else (template tokens, the assistant turn's closing after the sampled stop token, tool
responses, user turns) is observed (mask -100, logprob `PROMPT_LOGPROB`).

After each sampled turn the session checks that the template renders the conversation as exactly the text
of the tokens the model saw and said. When it does not (a template that trims or rewrites the assistant's
text, drops earlier reasoning, or moves the tools) the trained tokens are still what was sampled, but
inference with that template would condition on something else: the turn is flagged
(`turns[i]["template_mismatch"]`), counted (`mismatches`) and logged once per process.

Tool calls are parsed by model family (`rollout_client.chat.tool_calls`); a call that cannot be read, names no
tool, or has arguments that do not fit is answered to the model as a tool turn saying what is wrong, and
counted (the turn's `malformed`, the tool's `malformed`); a tool that raises is answered with its error and
counted as the tool's failure. Neither ends the rollout.

Works with any tokenizer that has `apply_chat_template(messages, tools=..., add_generation_prompt=...,
tokenize=False)`, `encode(text, add_special_tokens=False)` and `decode(ids, skip_special_tokens=False)`
(a `transformers` tokenizer); `transformers` is imported only by `ChatEnvironment.tokenizer()` when a model
name is given.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from rollout_client.chat.tool_calls import PARSERS, Malformed, Parsed, ToolCall
from rollout_client.chat.tools import TOOL_TIMEOUT_S, BadArguments, Tool, as_tools, bind, call_tool, valid_text
from rollout_client.env import Environment, Session, Task
from rollout_client.episodes import Prefix, RestoreFailed
from rollout_client.policy import Completion

log = logging.getLogger("rollout_client.chat")

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
_SENTINEL = "\x00rollbuf-assistant\x00"
"""Content rendered in place of the assistant's to find the template's closing of an assistant turn."""
_warned: set[str] = set()


class ChatTokenizer(Protocol):
    """What a chat session needs of a tokenizer (a `transformers` tokenizer has it all)."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: Any, **kwargs: Any) -> Any: ...


class ChatTemplateError(Exception):
    """The template cannot be rendered incrementally: adding messages changes what it rendered before them
    in a way no tokens can follow. The rollout fails (an env error): the template, not the model, is at fault."""


@dataclass(frozen=True, slots=True)
class AssistantTurn:
    completion: Completion
    content: str
    """The sampled text without its stop token: the assistant message's content."""
    parsed: Parsed
    """`content` split into text for the user and tool calls (`Malformed` for those that cannot be read)."""
    template_mismatch: bool
    call_ids: tuple[str, ...] = ()
    """One per call: the `tool_call_id` of its answer (and of the call, with `calls_as="tool_calls"`)."""

    @property
    def calls(self) -> list[ToolCall | Malformed]:
        return self.parsed.calls


class ChatSession:
    """A rollout as messages: `add()` system/user/tool messages, `generate()` the assistant's turn (sampled
    on token ids), `run_tools()` its calls; `step()` does the last two. `messages` is the conversation."""

    def __init__(
        self,
        session: Session,
        tokenizer: ChatTokenizer,
        *,
        tools: Sequence[Callable[..., Any] | Tool] = (),
        parser: str | Callable[[str], Parsed] = "hermes",
        template_kwargs: dict[str, Any] | None = None,
        calls_as: Literal["text", "tool_calls"] = "text",
        tool_timeout: float | None = TOOL_TIMEOUT_S,
    ) -> None:
        self.session = session
        self.tool_timeout = tool_timeout
        """Bound on one tool call (a `Tool`'s own `timeout` wins): past it the model is told, the tool's
        failure counted, and the rollout goes on."""
        self.tokenizer = tokenizer
        self.tools = as_tools(tools)
        self.schemas = [t.schema for t in self.tools.values()]
        if isinstance(parser, str) and parser not in PARSERS:
            raise ValueError(f"parser {parser!r}: not one of {sorted(PARSERS)}")
        self.parse = PARSERS[parser] if isinstance(parser, str) else parser
        self.template_kwargs = template_kwargs or {}
        if calls_as not in ("text", "tool_calls"):
            raise ValueError(f'calls_as={calls_as!r}: "text" or "tool_calls"')
        self.calls_as = calls_as
        """How the assistant's calls are put in its message for the template: "text", as sampled, in `content`
        (templates that render content as is: Qwen, Hermes); "tool_calls", parsed into the message's
        `tool_calls` with the rest of the text as `content` (templates that write calls themselves from that
        field: Llama 3.1). A turn with a call that cannot be read keeps its text either way."""
        self.messages: list[Message] = []
        self.mismatches = 0
        """Turns where the template's rendering differed from the tokens (see the module's docstring)."""
        self.malformed = 0
        """Tool calls answered with what was wrong instead of run."""
        self._text = ""
        """The text of the session's tokens so far: what the model has seen and said."""
        self._rendered = 0
        """How many of `messages` are in the session's tokens."""
        self._flag = False
        self._call_ids = itertools.count()
        self._special = set(getattr(tokenizer, "all_special_ids", None) or [])
        """Ids that end a turn when sampled last: the tokenizer's special tokens (or at least its eos)."""
        if isinstance(eos := getattr(tokenizer, "eos_token_id", None), int):
            self._special.add(eos)

    # ------------------------------------------------------------------------------------------ rendering

    def render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        if not messages:
            return ""
        out = self.tokenizer.apply_chat_template(
            messages,
            tools=self.schemas or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )
        if not isinstance(out, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}, not text")
        return out

    def _observe(self, text: str) -> None:
        """Append template text the model did not write: tokenised on its own, masked, clipped to the budget."""
        if not text:
            return
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if self.tokenizer.decode(ids, skip_special_tokens=False) != text:
            self._mismatch("the tokenizer does not decode a template delta back to its text")
        kept = self.session.observe_tokens(ids)
        self._text += text if len(kept) == len(ids) else str(self.tokenizer.decode(kept, skip_special_tokens=False))

    def _mismatch(self, why: str) -> None:
        self._flag = True
        key = f"{type(self.tokenizer).__name__}:{why}"
        if key not in _warned:
            _warned.add(key)
            log.warning(
                "chat template mismatch (%s): the tokens trained on are the ones sampled, but the "
                "template renders this conversation differently; counted in turns[i]['template_mismatch']",
                why,
            )

    def _flush(self) -> None:
        """Put the messages added since the last turn, and the generation prompt, into the session's tokens."""
        full = self.render(self.messages, True)
        if full.startswith(self._text):
            delta = full[len(self._text) :]
        else:  # earlier turns render differently now: keep their tokens, append what the template adds
            if not self.session.truncated:  # (text clipped at the budget differs from the template's anyway)
                self._mismatch("earlier turns re-rendered differently")
            base = self.render(self.messages[: self._rendered], False)
            if full.startswith(base):
                delta = full[len(base) :]
            elif (end := _end_of_old(base, full)) is not None:  # the template drops text of earlier turns
                delta = full[end:]  # (Qwen 3 drops earlier reasoning): what it adds after them is the delta
            else:
                raise ChatTemplateError(
                    f"adding {len(self.messages) - self._rendered} message(s) changes how the template renders the "
                    "ones before them: the conversation cannot continue on the same tokens"
                )
        self._rendered = len(self.messages)
        self._observe(delta)

    def _closing(self, stop: str) -> str:
        """The template's text after an assistant message's content (`<|im_end|>\\n`), less the stop token the
        model already sampled (`\\n`)."""
        probe = self.render([*self.messages[:-1], {"role": "assistant", "content": _SENTINEL}], False)
        at = probe.rfind(_SENTINEL)
        closing = probe[at + len(_SENTINEL) :] if at >= 0 else ""
        if closing.startswith(stop):
            return closing[len(stop) :]
        return "" if stop else closing  # a stop token the template does not use: the model's turn ended there

    # ------------------------------------------------------------------------------------------ turns

    def add(self, *messages: Message) -> None:
        """Append messages (rendered into tokens at the next `generate()`, all at once: a template may render
        consecutive tool messages as one turn)."""
        for m in messages:
            if m.get("role") not in ROLES:
                raise ValueError(f"message role {m.get('role')!r}: not one of {ROLES}")
            if not isinstance(m.get("content"), str):
                raise ValueError("message content must be text")
        self.messages.extend(messages)

    async def generate(self, max_tokens: int | None = None) -> AssistantTurn:
        """The assistant's turn: sampled on the session's tokens (trained on exactly those ids), appended as a
        message, its closing template tokens observed, and checked against the template's rendering."""
        self._flag = False
        self._flush()
        out = await self.session.generate(max_tokens)
        ids = list(out.token_ids)
        content, stop = self._split(ids, out.finish_reason)
        self._text += content + stop
        content, parsed, call_ids = self._assistant(ids, out.finish_reason)
        self._rendered = len(self.messages)
        rendered = self.render(self.messages, False)
        if rendered.startswith(self._text):  # the template renders what was sampled: its closing follows
            self._observe(rendered[len(self._text) :])
        else:
            if not self.session.truncated:
                self._mismatch("assistant turn rendered differently from the sampled tokens")
            self._observe(self._closing(stop))
        malformed = sum(isinstance(c, Malformed) for c in parsed.calls)
        self.malformed += malformed
        self.mismatches += int(self._flag)
        if self.session.turns:
            self.session.turns[-1].update(
                template_mismatch=int(self._flag), tool_calls=len(parsed.calls), malformed=malformed, tool_s=0.0
            )
        return AssistantTurn(out, content, parsed, self._flag, call_ids)

    def _split(self, ids: list[int], finish: str | None) -> tuple[str, str]:
        """A sampled turn's text: its content, and the stop token it ended on ("" if none)."""
        if ids and finish == "stop" and ids[-1] in self._special:
            content = str(self.tokenizer.decode(ids[:-1], skip_special_tokens=False))
            return content, str(self.tokenizer.decode(ids[-1:], skip_special_tokens=False))
        return str(self.tokenizer.decode(ids, skip_special_tokens=False)), ""

    def _assistant(self, ids: list[int], finish: str | None) -> tuple[str, Parsed, tuple[str, ...]]:
        """Append the assistant message of a sampled turn: its content, calls parsed, and their ids."""
        content, _ = self._split(ids, finish)
        parsed = self.parse(content) if self.tools else Parsed(content, [])
        call_ids = tuple(f"call{next(self._call_ids):05d}" for _ in parsed.calls)  # 9 alphanumerics, as Mistral's
        message: Message = {"role": "assistant", "content": content}
        if self.calls_as == "tool_calls" and parsed.calls and all(isinstance(c, ToolCall) for c in parsed.calls):
            message = {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for i, c in zip(call_ids, parsed.calls, strict=True)
                    if isinstance(c, ToolCall)
                ],
            }
        self.messages.append(message)
        return content, parsed, call_ids

    def resume(self, opening: Sequence[Message], prefix: Prefix) -> None:
        """Rebuild the conversation from a slot's acknowledged turns, loaded into the session
        (`Session.load_prefix`), without generating or calling anything again: each recorded generation's
        tokens become its assistant message (parsed as `generate` parses them) and each turn's recorded tool
        results its tool messages. RestoreFailed (the slot restarts from the prompt) when the turns' log does
        not fit their tokens: the template must render the rebuilt messages as exactly the prefix's text."""
        self.add(*opening)
        gens = prefix.generations
        if gens is None:
            raise RestoreFailed("the turns' log does not account for their completions")
        rendered, start = 0, 0
        for t, end in enumerate(prefix.ends):
            parsed, call_ids = Parsed("", []), tuple[str, ...]()
            for g in gens:
                if start <= g.start < end:
                    _, parsed, call_ids = self._assistant(prefix.tokens[g.start : g.start + g.length], g.finish)
                    rendered = len(self.messages)
            start, results = end, prefix.tools[t]
            if len(results) != len(parsed.calls) or not all(isinstance(r, str) for r in results):
                raise RestoreFailed(f"turn {t} records {len(results)} tool result(s) for {len(parsed.calls)} call(s)")
            if results:
                self.add(
                    *(
                        {"role": "tool", "name": c.name if isinstance(c, ToolCall) else "invalid", "content": r,
                         "tool_call_id": i}
                        for c, r, i in zip(parsed.calls, results, call_ids, strict=True)
                    )
                )  # fmt: skip
        self._rendered = rendered
        self._text = self.render(self.messages[:rendered], False)
        if str(self.tokenizer.decode(prefix.tokens, skip_special_tokens=False)) != self._text:
            raise RestoreFailed("the template does not render the turns' messages as the prefix's tokens")

    async def run_tools(self, turn: AssistantTurn) -> list[Message]:
        """Run the turn's calls in order and add their answers as tool messages (returned): a tool's result, or
        what was wrong with the call, or the error the tool raised."""
        replies: list[Message] = []
        malformed = 0
        t0 = time.perf_counter()
        for call, call_id in zip(turn.calls, turn.call_ids, strict=True):
            name = call.name if isinstance(call, ToolCall) else "invalid"
            if isinstance(call, Malformed):
                text = f"Error: the tool call could not be read: {call.error}."
            elif (tool := self.tools.get(call.name)) is None:
                text = f"Error: there is no tool named {call.name!r}. The tools are: {', '.join(self.tools)}."
                malformed += 1
            else:
                text, bad = await self._call(tool, call)
                malformed += bad
            replies.append({"role": "tool", "name": name, "content": text, "tool_call_id": call_id})
        self.malformed += malformed
        if self.session.turns:
            rec = self.session.turns[-1]
            rec["malformed"] = int(rec.get("malformed", 0)) + malformed
            rec["tool_s"] = round(time.perf_counter() - t0, 6)
        self.add(*replies)
        return replies

    async def _call(self, tool: Tool, call: ToolCall) -> tuple[str, bool]:
        """The text answered to the model, and whether the call was malformed (arguments that do not fit)."""
        try:
            bound = bind(tool, call.arguments)
        except BadArguments as exc:
            self.session.tool_record(tool.name)["malformed"] += 1
            return f"Error: bad arguments: {exc}", True
        limit = tool.timeout if tool.timeout is not None else self.tool_timeout
        try:
            async with self.session.tool(tool.name):  # timed; an error is the tool's failure
                async with asyncio.timeout(limit) as deadline:
                    return valid_text(await call_tool(tool, bound)), False
        except TimeoutError:
            if not deadline.expired():
                raise
            return f"Error: {tool.name} took more than {limit} s and was stopped.", False
        except Exception as exc:  # told to the model, like any tool output; cancellation still propagates
            return valid_text(f"Error: {type(exc).__name__}: {exc}"), False

    async def step(self, max_tokens: int | None = None) -> AssistantTurn:
        """`generate()`, then `run_tools()` if the turn called any."""
        turn = await self.generate(max_tokens)
        if turn.calls:
            await self.run_tools(turn)
        return turn

    @property
    def last_content(self) -> str:
        """The last assistant message's text without its tool calls."""
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return str(self.parse(m["content"]).content)
        return ""


def _end_of_old(base: str, full: str) -> int | None:
    """Where the earlier messages end in `full`, a rendering that changed them (dropped a turn's reasoning):
    after the first occurrence, past where the two first differ, of the longest tail of `base` found there
    (the last earlier message's closing, at least). None when not even its last character is found."""
    c = 0
    for a, b in zip(base, full, strict=False):
        if a != b:
            break
        c += 1
    tail, rest = base[c:], full[c:]
    lo, hi = 0, len(tail)  # a tail found means every shorter tail is found: search its length by halves
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tail[len(tail) - mid :] in rest:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return None
    return c + rest.index(tail[len(tail) - lo :]) + lo


@functools.lru_cache(maxsize=8)
def pretrained_tokenizer(name: str) -> ChatTokenizer:
    """`transformers.AutoTokenizer.from_pretrained(name)`, loaded once per process (imports transformers)."""
    from transformers import AutoTokenizer  # only chat environments that name a model need it

    tok: ChatTokenizer = AutoTokenizer.from_pretrained(name)
    return tok


class ChatEnvironment(Environment):
    """A tool-using chat environment: `messages(task)` opens the conversation, the policy answers and calls
    `tools()` until it answers without a call (or `max_turns`); `score(task, session)` reads
    `session.state["chat"]` (a ChatSession). The template is the model's own: `tokenizer_name` (loaded with
    transformers, once per process) or an overridden `tokenizer()`."""

    tokenizer_name: str | None = None
    parser: str = "hermes"
    """The model family's tool-call format: "hermes" (Qwen 2.5/3, Hermes), "llama3", "mistral"."""
    max_turns: int = 8
    calls_as: Literal["text", "tool_calls"] = "text"
    """How calls go into the assistant message for the template (see `ChatSession.calls_as`)."""
    tool_timeout: float | None = TOOL_TIMEOUT_S
    """Bound on one tool call (see `ChatSession.tool_timeout`)."""

    def tokenizer(self) -> ChatTokenizer:
        if self.tokenizer_name is None:
            raise NotImplementedError("set tokenizer_name (a model on the Hub or a local path) or override tokenizer()")
        return pretrained_tokenizer(self.tokenizer_name)

    def tools(self) -> Sequence[Callable[..., Any] | Tool]:
        return ()

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the template (`enable_thinking=False`, ...)."""
        return {}

    @abstractmethod
    def messages(self, task: Task) -> list[Message]: ...

    def chat(self, session: Session) -> ChatSession:
        """The rollout's chat session (made on first use, kept in `session.state["chat"]`)."""
        if "chat" not in session.state:
            session.state["chat"] = ChatSession(
                session,
                self.tokenizer(),
                tools=self.tools(),
                parser=self.parser,
                template_kwargs=self.template_kwargs(),
                calls_as=self.calls_as,
                tool_timeout=self.tool_timeout,
            )
        chat: ChatSession = session.state["chat"]
        return chat

    async def rollout(self, task: Task, session: Session) -> None:
        """Each step that calls tools is a turn (`Session.end_turn`, its tool results recorded, with the env's
        `snapshot` when it resumes from them); a session resumed from a snapshot rebuilds the conversation from
        the turns (`ChatSession.resume`) and continues it."""
        chat = self.chat(session)
        if session.resumed and session.prefix is not None:
            chat.resume(self.messages(task), session.prefix)
        else:
            chat.add(*self.messages(task))
        for _ in range(len(session.turns), self.max_turns):
            turn = await chat.step()
            if not turn.calls:
                return
            replies = chat.messages[-len(turn.calls) :]
            snapshot = self.snapshot(task, session) if self.resumes == "snapshot" and not session.replaying else None
            await session.end_turn(snapshot=snapshot, tool_results=[m["content"] for m in replies])
