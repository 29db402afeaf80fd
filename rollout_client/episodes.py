"""Durable episodes, the pure part (docs/episodes.md): what one turn of a rollout posts (`TurnPiece`), the
acknowledged turns a resumed slot continues from (`Prefix`, built from a slot lease's `prefix`), and the rules
that decide how a leased slot continues (`resume_mode`).

A session keeps a log per turn of what happened in it, posted as the turn's `tool_results`: one
`{"completion": text, "tokens": n, "finish": reason}` entry per generation (the policy's text is needed to
replay the env's turns against it; `tokens` splits the turn's trained runs into generations) and one
`{"tool": result}` entry per tool result the env named. A producer that continues the slot reads the same log
back: how many generations the prefix holds (the next generation's seed follows them) and, to replay, each
completion's text.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from api.wire.rollouts import TurnSnapshot, TurnView
from api.wire.rules import MASK_IGNORE

Resumes = Literal["restart", "snapshot", "replay"]
"""How an env's slot continues on another producer: from the prompt (its turns are not posted), from its last
snapshot (`Environment.restore`), or by replaying its deterministic tools against the recorded completions."""

COMPLETION = "completion"
"""The log entry's key for one generation's text."""
TOOL = "tool"
"""The log entry's key for one tool result the env named."""


class ReplayDiverged(Exception):
    """A replayed turn did not append what the prefix holds (the env's tools are not deterministic after all):
    the slot restarts from the prompt."""


class RestoreFailed(Exception):
    """The env's `restore` could not rebuild its state from the last snapshot: the slot restarts from the prompt."""


class TurnSink(Protocol):
    """Where a session's turns go as they end (`rollout_client.runner.turns.TurnPoster`): `put` returns once the
    turn is queued (it waits only while too many are), `flush` once every queued turn is acknowledged or given
    up; `acked` and `acked_tokens` count what the server holds (the resumed prefix included)."""

    acked: int
    acked_tokens: int
    versions_sent: bool | None

    async def put(self, piece: TurnPiece) -> None: ...

    async def flush(self) -> None: ...

    def close(self) -> None: ...


class SlotLost(Exception):
    """The slot's lease passed to another producer (a turn was refused with 409 `body.producer_id`): this
    rollout must stop, the other producer continues it."""


@dataclass(frozen=True, slots=True)
class TurnPiece:
    """One turn as it is posted: what the session appended since the last turn ended."""

    turn: int
    tokens: list[int]
    masks: list[int]
    logprobs: list[float]
    versions: list[int] | None
    """Per token, the weights version that sampled (or read) it; None when some are not known."""
    log: list[dict[str, Any]]
    snapshot: bytes | str | None


@dataclass(frozen=True, slots=True)
class Generation:
    """One recorded completion of a prefix: where its tokens start, how many, its text and finish reason."""

    start: int
    length: int
    text: str
    finish: str | None


@dataclass(frozen=True, slots=True)
class Prefix:
    """A slot's acknowledged turns, concatenated: what a resumed session starts from."""

    turns: int
    tokens: list[int]
    masks: list[int]
    logprobs: list[float]
    versions: list[int] | None
    """Per token, as the turns posted them (None when they did not)."""
    ends: list[int]
    """Per turn, the token index it ends at."""
    generations: list[Generation] | None
    """The recorded completions, in order; None when the turns' logs do not account for their trained tokens
    (not posted by a runner): such a prefix cannot be replayed."""
    tools: list[list[Any]]
    """Per turn, the tool results the env named."""
    snapshot: bytes | str | None
    """The last snapshot a turn carried: its bytes, or the URI the env resolves."""

    @classmethod
    def of(cls, items: Sequence[TurnView], snapshot: TurnSnapshot | None) -> Prefix:
        tokens: list[int] = []
        masks: list[int] = []
        logprobs: list[float] = []
        versions: list[int] | None = []
        ends: list[int] = []
        tools: list[list[Any]] = []
        logs: list[Any] = []
        for item in items:
            tokens += item.tokens
            masks += item.masks
            logprobs += item.inference_logprobs or [1.0] * len(item.tokens)
            if versions is not None and item.token_weight_versions is not None:
                versions += item.token_weight_versions
            else:
                versions = None
            ends.append(len(tokens))
            entries = item.tool_results or []
            logs += entries
            tools.append([e[TOOL] for e in entries if isinstance(e, dict) and TOOL in e])
        return cls(
            len(items), tokens, masks, logprobs, versions, ends, generations(masks, logs), tools, unpack(snapshot)
        )


def unpack(snapshot: TurnSnapshot | None) -> bytes | str | None:
    """A lease's snapshot as the env's `restore` takes it: the inline bytes, or the URI."""
    if snapshot is None:
        return None
    if snapshot.data is not None:
        return base64.b64decode(snapshot.data)
    return snapshot.uri


def generations(masks: Sequence[int], log: Sequence[Any]) -> list[Generation] | None:
    """The completions a prefix holds: its trained tokens (mask not -100) split in order by the log's
    completion entries' lengths. None when they do not add up to the trained runs (a log not a runner's)."""
    entries = [e for e in log if isinstance(e, dict) and COMPLETION in e]
    out: list[Generation] = []
    pos = 0
    for e in entries:
        n, text, finish = e.get("tokens"), e.get(COMPLETION), e.get("finish")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0 or not isinstance(text, str):
            return None
        while pos < len(masks) and masks[pos] == MASK_IGNORE:
            pos += 1
        if pos + n > len(masks) or any(m == MASK_IGNORE for m in masks[pos : pos + n]):
            return None
        out.append(Generation(pos, n, text, finish if isinstance(finish, str) else None))
        pos += n
    if any(m != MASK_IGNORE for m in masks[pos:]):
        return None
    return out


def resume_mode(
    resumes: Resumes,
    on_new_weights: str,
    prefix: Prefix | None,
    weights: int | None,
) -> Resumes:
    """How a leased slot continues: "restart" (from the prompt) unless it has a prefix and the env declares
    how to continue it, the prefix's log accounts for its completions (a runner posted it: the next
    generation's seed follows them), a snapshot mode has a snapshot, and the weights allow: an env that does
    not `continue` across weight changes restarts a prefix some of whose tokens other weights sampled."""
    if prefix is None or not prefix.turns or resumes == "restart":
        return "restart"
    if prefix.generations is None or (resumes == "snapshot" and prefix.snapshot is None):
        return "restart"
    if on_new_weights != "continue" and weights is not None and prefix.versions is not None:
        if any(v != weights for v in prefix.versions):
            return "restart"
    return resumes


def consistent_versions(sent: bool | None, versions: list[int] | None) -> tuple[bool, list[int] | None]:
    """Whether a turn can be posted given whether the slot's earlier turns sent versions (`sent`, None: no turn
    yet), and the versions to send: every turn of a slot sends them, or none does. A turn without versions
    after turns with them cannot be posted (False): the rest of the rollout goes with the final post."""
    if sent is None:
        return True, versions
    if sent:
        return (versions is not None), versions
    return True, None
