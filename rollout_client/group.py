"""One group: acquire G per-rollout resources all-or-nothing, run G rollouts of one task together, keep the
survivors (`min_group_size`), score them and assemble the wire group; or one rollout on its own, for an
environment that scores each rollout alone (`run_rollout`, `assemble`). Runs the same in the runner's
process and in a worker process."""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from api.wire.schema import ScoredData
from rollout_client.aio import RELEASE_S, acquire_all, bounded_close, in_daemon_thread, release
from rollout_client.env import Environment, ExternalSequence, Gate, Session, Task
from rollout_client.episodes import Prefix, RestoreFailed, Resumes, TurnSink
from rollout_client.errors import (
    EpisodeTruncated,
    GroupDropped,
    PromptTooLong,
    RolloutTimeout,
    exited,
    failure_reason,
)
from rollout_client.policy import Policy
from rollout_client.resources import acquire_backing_off, own_resources, warn_unbounded_pool

PROMPT_TOO_LONG = "prompt_too_long"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """A finished group (`group` set) or a skipped one (`skipped` names why)."""

    group: ScoredData | None
    skipped: str | None = None
    release_timeouts: int = 0
    """Releases of this group's resources abandoned after `release_timeout`."""
    rollout_failures: dict[str, int] = field(default_factory=dict)
    """Rollouts left out of the group (it kept `min_group_size` or more survivors), by failure reason."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What bounds a group's rollouts, the same in the runner's process and in workers."""

    token_limit: int | None = None
    turn_timeout: float | None = None
    rollout_timeout: float | None = None
    release_timeout: float | None = RELEASE_S

    def kwargs(self) -> dict[str, Any]:
        return {
            "token_limit": self.token_limit,
            "turn_timeout": self.turn_timeout,
            "rollout_timeout": self.rollout_timeout,
            "release_timeout": self.release_timeout,
        }


def rollout_seed(group_key: str, index: int) -> int:
    """A per-rollout seed, stable across processes: rollouts of a group differ, reruns repeat."""
    return int.from_bytes(hashlib.blake2b(f"{group_key}/{index}".encode(), digest_size=4).digest(), "little")


@dataclass(slots=True)
class Rollout:
    """One finished rollout apart from its session (it travels from a worker): what `build_group` reads."""

    tokens: list[int]
    masks: list[int]
    logprobs: list[float]
    turns: list[dict[str, float | int]]
    truncated: bool
    finish_reason: str | None
    tools: dict[str, dict[str, float | int]]
    score: float = 0.0
    elapsed: float = 0.0
    score_s: float = 0.0
    release_timeout: bool = False
    """Releasing its resource was abandoned after `release_timeout`."""
    external: list[ExternalSequence] | None = None
    """`Session.external`: the sequences it recorded in place of its transcript."""
    left_out: Counter[str] = field(default_factory=Counter)
    acked_turns: int = 0
    """Its turns the server acknowledged (`Session.end_turn`): the final post carries what follows them."""
    acked_tokens: int = 0
    """The tokens of those turns."""
    versions: list[int] | None = None
    """Per token, the weights version, sent with the final post when its turns sent theirs (else None)."""
    resumed_tokens: int = 0
    """Tokens it continued from another producer's turns without generating them again."""

    @classmethod
    def of(cls, s: Session, score: float, elapsed: float, score_s: float) -> Rollout:
        sink = s.turn_sink
        sent = sink is not None and bool(sink.versions_sent) and all(v is not None for v in s.versions)
        acked = 0 if sink is None or (sink.versions_sent and not sent) else sink.acked  # else posted whole
        return cls(
            s.tokens,
            s.masks,
            s.logprobs,
            s.turns,
            s.truncated,
            s.finish_reason,
            s.tools,
            score,
            elapsed,
            score_s,
            external=s.external,
            left_out=s.left_out,
            acked_turns=acked,
            acked_tokens=0 if sink is None else sink.acked_tokens,
            versions=[v for v in s.versions if v is not None] if sent else None,
            resumed_tokens=s.resumed_tokens,
        )


class Transcript(Protocol):
    """What `build_group` reads from a rollout: a `Session` or a `Rollout`."""

    tokens: list[int]
    masks: list[int]
    logprobs: list[float]
    turns: list[dict[str, float | int]]
    tools: dict[str, dict[str, float | int]]
    external: list[ExternalSequence] | None
    left_out: Counter[str]

    @property
    def truncated(self) -> bool: ...

    @property
    def finish_reason(self) -> str | None: ...


def default_min_group_size(group_size: int) -> int:
    """`min_group_size` unless set: half the group, and at least 2 (a group-relative advantage needs two).
    A group then fails only when most of its rollouts do: at G=64 with 2% of rollouts crashing, all 64
    succeed only 27% of the time, so "every rollout must succeed" failed 73% of groups and ended the run
    (error rate 0.5); with half, a group fails about never, and the run's error rate follows the rollouts'
    own once it passes one in two. Survivor groups are queued whole (`variable_group_size`), and the batcher
    fills exact batches with them (its exact-fill search, docs/batching.md)."""
    return min(group_size, max(2, math.ceil(group_size / 2)))


def needed(env: Environment) -> int:
    """How many of a group's rollouts must succeed for it to be kept."""
    if env.min_group_size is None:
        return default_min_group_size(env.group_size)
    return max(1, min(env.group_size, env.min_group_size))


def failures_of(exc: BaseException) -> dict[str, int]:
    """The failed rollouts, by reason, of the group `exc` failed (attached by `survive`; survives pickling)."""
    return dict(getattr(exc, "rollout_failures", {}))


FATAL = (PromptTooLong, GroupDropped)
"""A rollout error that ends its whole group at once, survivors or not: the same prompt is too long for all,
or the group was dropped on purpose (a pause that ran out of time)."""


async def survive(runs: Sequence[Awaitable[T]], need: int) -> tuple[list[tuple[int, T]], dict[str, int]]:
    """Run `runs` concurrently; keep the (index, result) of those that succeed and count the others by
    reason. As soon as fewer than `need` can succeed (or one raises one of FATAL), the rest are cancelled
    and the first real error is raised (a FATAL one first), the others as notes and every failure counted in
    its `rollout_failures`. Cancelling this cancels them all."""
    tasks = [asyncio.ensure_future(r) for r in runs]
    errors: list[BaseException] = []
    failures: Counter[str] = Counter()
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.cancelled():  # not by this function: environment code cancelled its own rollout
                    exc: BaseException = exited(asyncio.CancelledError("a rollout was cancelled"))
                elif (raised := t.exception()) is not None:
                    exc = raised
                else:
                    continue
                errors.append(exc)
                if not isinstance(exc, FATAL):
                    failures[failure_reason(exc)] += 1
            if any(isinstance(e, FATAL) for e in errors) or len(tasks) - len(errors) < need:
                break
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    fatal = next((e for e in errors if isinstance(e, FATAL)), None)
    if fatal is not None or len(tasks) - len(errors) < need:
        first = fatal or errors[0]
        for other in errors:
            if other is not first:
                first.add_note(f"also, in another rollout of the group: {type(other).__name__}: {other}")
        if need < len(tasks) and fatal is None:
            first.add_note(f"{len(errors)} of {len(tasks)} rollouts failed: fewer than min_group_size={need} left")
        first.rollout_failures = dict(failures)  # type: ignore[attr-defined]
        raise first
    kept = [(i, t.result()) for i, t in enumerate(tasks) if not t.cancelled() and t.exception() is None]
    return kept, dict(failures)


async def acquire_resources(
    env: Environment, task: Task, n: int, release_timeout: float | None = RELEASE_S
) -> tuple[list[Any], AsyncExitStack]:
    """`n` of the env's resources, all-or-nothing; "exhausted" means let go of all, back off, try again. An env
    without resources (`resource` not overridden: a null context each) gets n Nones at once: entering n null
    contexts concurrently costs a group more tasks than its rollouts."""
    if not own_resources(env):
        return [None] * n, AsyncExitStack()
    on_stuck = warn_unbounded_pool(env)
    return await acquire_backing_off(
        lambda: acquire_all([env.resource(task) for _ in range(n)], release_timeout, on_stuck), env.acquire_timeout
    )


async def play(env: Environment, task: Task, session: Session, rollout_timeout: float | None) -> float:
    """One rollout within `rollout_timeout` (time paused excluded); returns how long it took. A truncated
    episode is kept; a BaseException from env code (`exit()`) becomes EnvExited."""
    t0 = time.perf_counter()
    deadline = None
    try:
        async with asyncio.timeout(rollout_timeout) as deadline:
            session.deadline = deadline
            await env.rollout(task, session)
    except EpisodeTruncated:
        pass  # kept as it is, marked truncated
    except TimeoutError:
        if deadline is not None and deadline.expired():
            raise RolloutTimeout(f"rollout took more than rollout_timeout={rollout_timeout} s") from None
        raise
    except (SystemExit, KeyboardInterrupt, GeneratorExit) as exc:
        raise exited(exc) from exc
    finally:
        session.deadline = None
    return time.perf_counter() - t0


def check_scores(scores: Sequence[float]) -> None:
    for i, score in enumerate(scores):
        if not math.isfinite(score):
            raise ValueError(f"score() returned {score} for rollout {i}: scores must be finite numbers")


async def run_group(
    env: Environment,
    task: Task,
    policy: Policy,
    *,
    gate: Gate | None = None,
    token_limit: int | None = None,
    group_key: str = "",
    turn_timeout: float | None = None,
    rollout_timeout: float | None = None,
    release_timeout: float | None = RELEASE_S,
    on_rollout_end: Callable[[], None] | None = None,
    on_acquired: Callable[[], None] | None = None,
) -> GroupOutcome:
    """G rollouts of `task`, run together, each with its own session and resource; then scored.

    A rollout that raises fails the group unless `env.min_group_size` of them still succeed (then the group
    is the survivors, the failures counted by reason in `rollout_failures`): the first real error is raised
    (the others as notes), after the resources are released. `turn_timeout` bounds each generation request
    (TurnTimeout), `rollout_timeout` each rollout, time paused at the gate excluded (RolloutTimeout). An
    episode that reaches `token_limit` after its first turn ends there and is kept, marked truncated.
    Resources are acquired all-or-nothing, backing off while `resource()` raises ResourceExhausted. Scoring
    runs in a daemon thread (off the loop); a score that is not a finite number fails the group; releasing
    the resources is bounded by `release_timeout`. `on_rollout_end()` is called as each rollout ends (its
    slot is free), `on_acquired()` once the group holds all its resources (its turn to acquire ends: `Turns`).
    A BaseException from the environment's code (`exit()`) fails the group as EnvExited.
    """
    gate = gate or Gate()
    owner = asyncio.current_task()
    resources, stack = await acquire_resources(env, task, env.group_size, release_timeout)
    try:
        if on_acquired is not None:
            on_acquired()
        sessions = [
            Session(
                policy,
                gate=gate,
                token_limit=token_limit,
                max_tokens=env.max_tokens,
                seed=rollout_seed(group_key, i),
                resource=res,
                turn_timeout=turn_timeout,
                owner=owner,
            )
            for i, res in enumerate(resources)
        ]

        async def one(session: Session) -> float:
            try:
                return await play(env, task, session, rollout_timeout)
            finally:
                if on_rollout_end is not None:
                    on_rollout_end()

        try:
            kept, failures = await survive([one(s) for s in sessions], needed(env))
        except PromptTooLong:  # the same prompt for all G: one too long means the whole group
            closed = await bounded_close(stack, release_timeout)
            return GroupOutcome(None, PROMPT_TOO_LONG, release_timeouts=int(not closed))
        survivors = [sessions[i] for i, _ in kept]
        elapsed = [t for _, t in kept]
        t0 = time.perf_counter()
        # resources still held: a verifier may need them; off the loop: a verifier may never return
        scores = await in_daemon_thread(lambda: [float(env.score(task, s)) for s in survivors])
        score_s = (time.perf_counter() - t0) / len(survivors)
        check_scores(scores)
    except BaseException as exc:
        await release(stack, exc, release_timeout)
        raise
    closed = await bounded_close(stack, release_timeout)
    return finish(env, task, survivors, scores, elapsed, score_s, int(not closed), failures)


async def run_rollout(
    env: Environment,
    task: Task,
    policy: Policy,
    index: int,
    *,
    gate: Gate | None = None,
    token_limit: int | None = None,
    group_key: str = "",
    turn_timeout: float | None = None,
    rollout_timeout: float | None = None,
    release_timeout: float | None = RELEASE_S,
    owner: asyncio.Task[Any] | None = None,
    turn_sink: TurnSink | None = None,
    prefix: Prefix | None = None,
    mode: Resumes = "restart",
) -> Rollout:
    """Rollout `index` of a group on its own (for `env.scores_each_rollout`): its resource, the rollout, its
    score, the release; the runner assembles the group from them (`assemble`). Bounded like `run_group`.
    `owner` (default: the current task) is what a pause that runs out of time cancels: the group's task.
    `turn_sink`: where its turns are posted as they end; `prefix` and `mode`: another producer's acknowledged
    turns it continues from (docs/episodes.md)."""
    gate = gate or Gate()
    (resource,), stack = await acquire_resources(env, task, 1, release_timeout)
    try:
        session = Session(
            policy,
            gate=gate,
            token_limit=token_limit,
            max_tokens=env.max_tokens,
            seed=rollout_seed(group_key, index),
            resource=resource,
            turn_timeout=turn_timeout,
            owner=owner or asyncio.current_task(),
        )
        session.turn_sink = turn_sink
        if prefix is not None and mode == "snapshot" and prefix.snapshot is not None:
            session.load_prefix(prefix)
            try:
                session.state = env.restore(task, prefix.snapshot)
            except Exception as exc:
                raise RestoreFailed(f"restore() of env {env.name!r} failed: {type(exc).__name__}: {exc}") from exc
        elif prefix is not None and mode == "replay":
            session.replay(prefix)
        try:
            elapsed = await play(env, task, session, rollout_timeout)
            if turn_sink is not None:
                await turn_sink.flush()
        finally:
            if turn_sink is not None:
                turn_sink.close()
        t0 = time.perf_counter()
        (score,) = await in_daemon_thread(lambda: [float(env.score(task, session))])
        check_scores([score])
        rollout = Rollout.of(session, score, elapsed, time.perf_counter() - t0)
    except BaseException as exc:
        await release(stack, exc, release_timeout)
        raise
    rollout.release_timeout = not await bounded_close(stack, release_timeout)
    return rollout


def assemble(
    env: Environment, task: Task, rollouts: Sequence[Rollout], failures: dict[str, int], *, judged: bool = True
) -> GroupOutcome:
    """The group of the rollouts that survived, run one by one. `judged=False`: the group is kept whatever the
    env's `skip_reason` says (its rollouts were posted one by one, and the server sealed it)."""
    score_s = sum(r.score_s for r in rollouts) / len(rollouts)
    scores = [r.score for r in rollouts]
    released = sum(r.release_timeout for r in rollouts)
    elapsed = [r.elapsed for r in rollouts]
    if not judged:
        group = build_group(task, rollouts, scores, elapsed, score_s)
        return GroupOutcome(group, release_timeouts=released, rollout_failures=failures)
    return finish(env, task, rollouts, scores, elapsed, score_s, released, failures)


def finish(
    env: Environment,
    task: Task,
    rollouts: Sequence[Transcript],
    scores: Sequence[float],
    elapsed: Sequence[float],
    score_s: float,
    release_timeouts: int,
    failures: dict[str, int],
) -> GroupOutcome:
    """The group of the finished rollouts, or why it is not submitted: no sequence at all (rollouts that
    recorded none), or the env's `skip_reason` (no reward variance, ...)."""
    final = sequence_scores(rollouts, scores)
    skip = "no_sequences" if not final else env.skip_reason(len(final), final)
    if skip is not None:
        return GroupOutcome(None, skip, release_timeouts=release_timeouts, rollout_failures=failures)
    group = build_group(task, rollouts, scores, elapsed, score_s)
    return GroupOutcome(group, release_timeouts=release_timeouts, rollout_failures=failures)


def sequence_scores(sessions: Sequence[Transcript], scores: Sequence[float]) -> list[float]:
    """The group's scores, one per sequence it will hold: a session's own score, or the scores of the
    sequences it recorded (`Session.external`)."""
    out: list[float] = []
    for s, score in zip(sessions, scores, strict=True):
        out.extend([float(seq.score) for seq in s.external] if s.external is not None else [score])
    return out


def build_group(
    task: Task, sessions: Sequence[Transcript], scores: Sequence[float], elapsed: Sequence[float], score_s: float
) -> ScoredData:
    """The wire group: tokens, masks (-100 where not generated), inference logprobs, scores, and per-rollout
    record in `overrides`: `turns` (prompt/completion tokens, gate wait and generation seconds per turn),
    `num_turns`, `truncated`, `finish_reason`, `tools` (calls, failures, seconds per tool), timings.

    A session with recorded `external` sequences contributes those instead (0 or more, each with its own
    score and overrides, plus the rollout's timings); its `scores[i]` is not used."""
    tokens: list[list[int]] = []
    masks: list[list[int]] = []
    logprobs: list[list[float]] = []
    out_scores: list[float] = []
    overrides: list[dict[str, Any]] = []
    versions: list[list[int] | None] = []
    for s, t, score in zip(sessions, elapsed, scores, strict=True):
        timing = timings(t, score_s)
        if s.external is not None:
            for seq in s.external:
                tokens.append(seq.tokens)
                masks.append(seq.masks)
                logprobs.append(seq.logprobs)
                out_scores.append(float(seq.score))
                overrides.append({**timing, **seq.overrides})
                versions.append(seq.weight_versions)
            continue
        versions.append(None)  # the runner stamps a session's from its turns (`runner.following.token_versions`)
        tokens.append(s.tokens)
        masks.append(s.masks)
        logprobs.append(s.logprobs)
        out_scores.append(score)
        overrides.append({**timing, **transcript_record(s)})
    return ScoredData(
        tokens=tokens,
        masks=masks,
        scores=out_scores,
        inference_logprobs=logprobs,
        overrides=overrides,
        group_overrides=group_overrides(task, sessions),
        token_weight_versions=known
        if versions and len(known := [v for v in versions if v is not None]) == len(versions)
        else None,
    )


def timings(elapsed: float, score_s: float) -> dict[str, Any]:
    """A rollout's timings, as its `overrides` entry carries them."""
    return {"rollout_s": round(elapsed, 6), "score_s": round(score_s, 6)}


def transcript_record(s: Transcript) -> dict[str, Any]:
    """A transcript's record, as its `overrides` entry carries it."""
    return {
        "turns": s.turns,
        "num_turns": len(s.turns),
        "truncated": s.truncated,
        "finish_reason": s.finish_reason,
        "tools": s.tools,
    }


def group_overrides(task: Task, sessions: Sequence[Transcript]) -> dict[str, Any]:
    """The group's record: its task, and what its rollouts left out, by reason (when they left out any)."""
    out: dict[str, Any] = {"task_id": task.id}
    left_out: Counter[str] = Counter()
    for s in sessions:
        left_out.update(s.left_out)
    if left_out:
        out["left_out"] = dict(sorted(left_out.items()))
    return out
