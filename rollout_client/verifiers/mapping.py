"""A verifiers episode as rollbuf sequences: the pure half of `rollout_client.verifiers.environment` (no I/O, no
verifiers import). It reads episodes by attribute, so it takes verifiers 0.4.0's objects (per-token streams as
lists), 0.4.1.dev's (numpy int32/bool/float32 arrays) and recorded ones alike.

Mapping, per trainable branch of every kept trace (docs/bring-your-environment-verifiers.md has the table):
tokens = `branch.token_ids` as sampled; masks = the token id where `branch.sampled_mask` is true, -100 elsewhere;
inference logprobs = `branch.logprobs` on sampled positions, Atropos's 1.0 sentinel elsewhere (verifiers
spreads 0.0 there, which is a real logprob; 1.0 is not one, so a trainer can tell the positions apart);
score = `trace.reward`; overrides name the trace, branch, agent, stop condition and turns.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from api.wire.rules import MASK_IGNORE

UNSAMPLED_LOGPROB = 1.0
"""Logprob at positions the model did not sample: Atropos's sentinel (`rollout_client.env.PROMPT_LOGPROB`)."""


@dataclass(frozen=True, slots=True)
class MappedSequence:
    """One rollbuf sequence made from one branch of one verifiers trace."""

    tokens: list[int]
    masks: list[int]
    logprobs: list[float]
    score: float
    overrides: dict[str, Any]
    weight_versions: list[int] | None = None
    """Per token, the weights version that sampled it (`branch_versions`), or None when the server reported none."""


@dataclass(frozen=True, slots=True)
class MappedEpisode:
    """What one episode gives: its sequences, and the traces/branches left out, counted by why."""

    sequences: list[MappedSequence]
    left_out: Counter[str] = field(default_factory=Counter)


def _failure_errors(episode: Any) -> list[Any]:
    """The errors that explain a failed episode: its own, else its first failed trace's."""
    errors = list(getattr(episode, "errors", None) or [])
    if not errors:  # the env's hooks ran fine: a trace failed (its own errors say why)
        for trace in getattr(episode, "traces", None) or []:
            if not getattr(trace, "ok", True) and getattr(trace, "errors", None):
                return list(trace.errors)
    return errors


def failure_detail(episode: Any) -> str:
    """The last error message of a failed episode (see `episode_failure`), for logs; "" when none."""
    errors = _failure_errors(episode)
    return str(getattr(errors[-1], "message", "")) if errors else ""


def episode_failure(episode: Any) -> str | None:
    """Why a finished episode is not a result (None: it is): `episode_timeout` when the env's own deadline
    expired, else `episode_error:<type of its last error>` (the episode's, else its first failed trace's;
    `episode_error` when none names one)."""
    if getattr(episode, "ok", False):
        return None
    if getattr(episode, "is_timeout", False):
        return "episode_timeout"
    errors = _failure_errors(episode)
    kind = getattr(errors[-1], "type", None) if errors else None
    return f"episode_error:{kind}" if kind else "episode_error"


def trace_left_out(trace: Any) -> str | None:
    """Why a trace gives no sequence (None: it gives its trainable branches): verifiers marked it `dropped`
    (0.4.1.dev: the reason it names), or its agent is not trainable (a judge, a user simulator)."""
    dropped = getattr(trace, "dropped", None)
    if dropped:
        return f"dropped:{dropped}" if isinstance(dropped, str) else "dropped"
    agent = getattr(trace, "agent", None)
    if agent is not None and not getattr(agent, "trainable", True):
        return "untrainable_trace"
    return None


def _ints(values: Any) -> list[int]:
    return [int(v) for v in np.asarray(values, dtype=np.int64).reshape(-1).tolist()]


def _bools(values: Any) -> list[bool]:
    return [bool(v) for v in np.asarray(values, dtype=bool).reshape(-1).tolist()]


def _floats(values: Any) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1).tolist()]


def branch_streams(token_ids: Any, sampled_mask: Any, logprobs: Any) -> tuple[list[int], list[int], list[float]]:
    """Tokens, masks and inference logprobs of one branch. Raises ValueError when the three streams do not
    line up (verifiers guarantees they do; a mismatch is a bug upstream, not data to guess at)."""
    tokens, sampled = _ints(token_ids), _bools(sampled_mask)
    lps = _floats(logprobs) if logprobs is not None and len(logprobs) else [0.0] * len(tokens)
    if not (len(tokens) == len(sampled) == len(lps)):
        raise ValueError(
            f"branch streams differ in length: token_ids {len(tokens)}, sampled_mask {len(sampled)}, "
            f"logprobs {len(lps)}"
        )
    masks = [t if s else MASK_IGNORE for t, s in zip(tokens, sampled, strict=True)]
    out = [lp if s else UNSAMPLED_LOGPROB for lp, s in zip(lps, sampled, strict=True)]
    return tokens, masks, out


def trace_overrides(trace: Any, branch: Any, episode_id: str | None) -> dict[str, Any]:
    """The per-sequence record: which trace and branch it is, why the trace stopped, how many turns it took."""
    agent = getattr(trace, "agent", None)
    rec: dict[str, Any] = {
        "trace_id": str(getattr(trace, "id", "")),
        "branch": int(getattr(branch, "index", 0)),
        "agent": str(getattr(agent, "name", "agent")),
        "stop_condition": getattr(trace, "stop_condition", None),
        "num_turns": int(getattr(trace, "num_turns", 0)),
        "truncated": bool(getattr(trace, "is_truncated", False)),
    }
    if episode_id is not None:
        rec["episode_id"] = episode_id
    versions = weight_versions(branch)
    if versions:
        rec["weight_versions"] = [min(versions), max(versions)]
    return rec


def weight_versions(branch: Any) -> list[int]:
    """The inference server's weight versions on a branch's sampled nodes (verifiers 0.4.1.dev records them
    on `MessageNode.weight_versions` where the server reports them; 0.4.0 never does: empty)."""
    out: list[int] = []
    for node in getattr(branch, "nodes", None) or []:
        for v in getattr(node, "weight_versions", None) or []:
            out.append(int(v))
    return out


def branch_versions(branch: Any, n_tokens: int) -> list[int] | None:
    """Per token of a branch, the weights version that sampled it, from its nodes' `weight_versions` (concatenated,
    the nodes' `token_ids` are the branch's tokens): a node's list is one version per token, one per sampled token
    (`mask` true), or one for the whole node. A token no node sampled carries the version of the next node that
    sampled, which read it (of the last one past it). None when a node that sampled reports no versions, or the
    nodes do not add up to the branch's tokens: nothing is guessed."""
    row: list[int | None] = []
    seen: list[int] = []
    for node in getattr(branch, "nodes", None) or []:
        ids = getattr(node, "token_ids", None)
        if ids is None:
            return None
        n = len(ids)
        mask = getattr(node, "mask", None)
        sampled = [False] * n if mask is None or not len(mask) else _bools(mask)
        if len(sampled) != n:
            return None
        given = getattr(node, "weight_versions", None)
        reported = [] if given is None else _ints(given)
        if not any(sampled):
            row += [None] * n
            continue
        if len(reported) == n:
            row += reported
        elif len(reported) == sum(sampled):
            it = iter(reported)
            row += [next(it) if s else None for s in sampled]
        elif len(reported) == 1:
            row += [reported[0]] * n
        else:
            return None
        seen += reported
    if len(row) != n_tokens or not seen:
        return None
    out: list[int] = []
    after = seen[-1]
    for v in reversed(row):  # unsampled positions: the next sampled one's version
        after = after if v is None else v
        out.append(after)
    out.reverse()
    return out


def map_episode(episode: Any, token_limit: int | None = None) -> MappedEpisode:
    """Every trainable branch of every kept trace of a successful episode, as sequences; a branch longer than
    `token_limit` (the trainer's `max_token_len`, which the server enforces) is left out as `too_long`, not
    sent to have the whole group refused. Call it only on an episode `episode_failure` passed (a failed
    episode's traces are partial)."""
    sequences: list[MappedSequence] = []
    left_out: Counter[str] = Counter()
    episode_id = getattr(episode, "id", None)
    for trace in getattr(episode, "traces", None) or []:
        why = trace_left_out(trace)
        if why is not None:
            left_out[why] += 1
            continue
        reward = float(trace.reward)
        if not math.isfinite(reward):
            left_out["non_finite_reward"] += 1
            continue
        for branch in trace.branches:
            if not getattr(branch, "trainable", True):
                left_out["untrainable_branch"] += 1
                continue
            tokens, masks, logprobs = branch_streams(branch.token_ids, branch.sampled_mask, branch.logprobs)
            if not tokens or all(m == MASK_IGNORE for m in masks):
                left_out["nothing_sampled"] += 1
                continue
            if token_limit is not None and len(tokens) > token_limit:
                left_out["too_long"] += 1
                continue
            overrides = trace_overrides(trace, branch, episode_id)
            versions = branch_versions(branch, len(tokens))
            sequences.append(MappedSequence(tokens, masks, logprobs, reward, overrides, versions))
    return MappedEpisode(sequences, left_out)


def group_verdict(scores: Sequence[float], *, require_variance: bool) -> str | None:
    """Why a group's sequences are not submitted (None: they are): fewer than two (`too_few_sequences`: no
    advantage to compute), or all scores equal when the env asks for variance (`no_reward_variance`)."""
    if len(scores) < 2:
        return "too_few_sequences"
    if require_variance and max(scores) == min(scores):
        return "no_reward_variance"
    return None
