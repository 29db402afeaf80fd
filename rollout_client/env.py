"""The environment interface: an async `rollout(task, session)` that drives the policy, and a `score`;
or, for step-wise work, `EpisodeEnvironment` with an `Episode` (start / step with a done signal / score).

Single-turn: `await session.observe(task.prompt); await session.generate()`. Multi-turn: alternate
`observe` (tool output, user turns: not trained on) and `generate` (trained on) until done. The session
records tokens, masks, logprobs and per-turn timings; the runner turns G sessions into one group.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from api.wire.replay import ReusePolicy
from api.wire.rules import MASK_IGNORE
from rollout_client.chat.tools import valid_text
from rollout_client.episodes import COMPLETION, TOOL, Prefix, ReplayDiverged, Resumes, TurnPiece, TurnSink
from rollout_client.errors import EpisodeTruncated, PromptTooLong, SetupTimeout, TurnTimeout
from rollout_client.policy import Completion, Policy

PROMPT_LOGPROB = 1.0
"""Logprob recorded at positions the policy did not sample (prompt, tool output), as Atropos handlers do."""


@dataclass(frozen=True, slots=True)
class Task:
    """One prompt to roll out G times. Must pickle: it is sent to worker processes."""

    id: str
    prompt: str
    answer: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ExternalSequence:
    """A finished sequence a rollout generated outside its session (an agent harness that calls inference
    itself, such as verifiers'): recorded with `Session.record_sequence`, submitted as it is."""

    tokens: list[int]
    masks: list[int]
    """-100 where not trained on, else the token id (Atropos's convention)."""
    logprobs: list[float]
    """Inference logprobs, 1.0 (`PROMPT_LOGPROB`) where the policy did not sample."""
    score: float
    overrides: dict[str, Any] = field(default_factory=dict)
    weight_versions: list[int] | None = None
    """Per token, the weights version that sampled it (or, where nothing was sampled, the one that read it), when
    the harness knows them: the group carries them as `token_weight_versions` when every sequence has them."""


class Gate:
    """Lets generation requests through while open; `close()` returns once none is in flight.

    The runner closes it for a weight update: after `await close()`, no request is at the inference server
    and none can start until `open()`. `close(timeout)` gives up waiting after `timeout` seconds and says
    so; `holders()` then names the tasks (groups) whose requests are still in flight, for the caller to
    cancel.

    `weights` is the version of the weights that requests let through now are served by, as the runner knows
    it: it changes only while the gate is shut and drained during a weight sync the runner took part in
    (`rollout_client.runner.watch`), so each turn records the version that sampled it (its `weights`).
    """

    def __init__(self) -> None:
        self.weights: int | None = None
        """The weights version requests let through now are served by (None: not known)."""
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self._holders: Counter[asyncio.Task[Any]] = Counter()

    @asynccontextmanager
    async def generation(self, owner: asyncio.Task[Any] | None = None) -> AsyncIterator[None]:
        """Hold the gate for one request; `owner` (default: the current task) is what `holders()` reports."""
        while not self._open.is_set():
            await self._open.wait()
        holder = owner or asyncio.current_task()
        self._active += 1
        self._idle.clear()
        if holder is not None:
            self._holders[holder] += 1
        try:
            yield
        finally:
            self._active -= 1
            if holder is not None:
                self._holders[holder] -= 1
                if self._holders[holder] <= 0:
                    del self._holders[holder]
            if self._active == 0:
                self._idle.set()

    async def close(self, timeout: float | None = None) -> bool:
        """Stop new requests and wait until none is in flight: True, or False once `timeout` s have passed
        with some still in flight (the gate stays closed)."""
        self.shut()
        return await self.drained(timeout)

    def shut(self) -> None:
        """Stop new requests now, without waiting: an `open()` after this wins, whatever waits on `drained`."""
        self._open.clear()

    async def drained(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight: True, or False after `timeout` s."""
        if timeout is None:
            await self._idle.wait()
            return True
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def holders(self) -> set[asyncio.Task[Any]]:
        """The tasks with a request in flight now."""
        return set(self._holders)

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()


class Session:
    """One rollout's transcript. Each rollout gets its own session: no state leaks between rollouts.

    Within the token budget (`token_limit`, or the model's context when smaller): once the policy has
    generated, text observed past the budget (a long tool output) is clipped and the episode is marked
    `truncated`; the next `generate()` then raises `EpisodeTruncated`, which ends the rollout and keeps what
    it has (the runner submits it).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        gate: Gate | None = None,
        token_limit: int | None = None,
        max_tokens: int = 256,
        seed: int | None = None,
        resource: Any = None,
        turn_timeout: float | None = None,
        owner: asyncio.Task[Any] | None = None,
    ) -> None:
        self.policy = policy
        self.gate = gate or Gate()
        self.token_limit = token_limit
        self.max_tokens = max_tokens
        self.seed = seed
        self.resource = resource
        """What the environment's `resource(task)` context manager yielded for this rollout (a sandbox, ...)."""
        self.turn_timeout = turn_timeout
        """Bound on one `generate()` once it is at the inference server (waiting at a closed gate is not
        counted): past it, TurnTimeout."""
        self.owner = owner
        """The group's task: what a pause that runs out of time cancels."""
        self.deadline: asyncio.Timeout | None = None
        """The rollout's timeout (set by `run_group`); pushed back by the time spent waiting at a closed gate."""
        self.state: dict[str, Any] = {}
        """Anything the environment keeps for this rollout alone (an episode, a sandbox handle)."""
        self.tokens: list[int] = []
        self.masks: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[dict[str, float | int]] = []
        self.completions: list[Completion] = []
        self.truncated = False
        """The episode reached the token budget: tool output was clipped or a completion stopped at it."""
        self.tools: dict[str, dict[str, float | int]] = {}
        """Per tool name: `calls`, `failures`, `seconds` (recorded by `async with session.tool(name)`), and
        `malformed` (calls a chat session refused before running the tool: `rollout_client.chat.session`)."""
        self.external: list[ExternalSequence] | None = None
        """Sequences recorded with `record_sequence` (None: none). When set, they are this rollout's part of
        the group, 0 or more sequences with their own scores, in place of the session's own transcript."""
        self.left_out: Counter[str] = Counter()
        """What this rollout left out of the group (traces, branches), by reason: summed over the group into
        its `group_overrides["left_out"]`."""
        self.versions: list[int | None] = []
        """Per token, the weights version that sampled it (or, observed, the one in use then): None, not known."""
        self.log: list[dict[str, Any]] = []
        """The current turn's completions and tool results, posted as its `tool_results` (rollout_client.episodes)."""
        self.mark = 0
        """Where the current turn begins (the tokens before it are in ended turns)."""
        self.next_turn = 0
        """The number `end_turn` gives the current turn."""
        self.turn_sink: TurnSink | None = None
        """Where ended turns are posted (set by the runner for an env that posts each rollout and resumes)."""
        self.resumed = False
        """True when the session was rebuilt from another producer's turns and `Environment.restore` gave its
        `state`: the env's `rollout` continues the episode from there (at generation `len(turns)`)."""
        self.resumed_tokens = 0
        """Tokens taken from another producer's turns (`load_prefix`, `replay`) rather than generated again."""
        self.prefix: Prefix | None = None
        """The acknowledged turns a resumed session was loaded from (`load_prefix`): what a chat session is
        rebuilt from."""
        self._replay: Prefix | None = None
        self._replayed = 0

    def load_prefix(self, prefix: Prefix) -> None:
        """Start from a slot's acknowledged turns without generating them again: their tokens are the transcript,
        their recorded completions its generations (so the next one's seed follows them)."""
        self.tokens, self.masks, self.logprobs = list(prefix.tokens), list(prefix.masks), list(prefix.logprobs)
        self.versions = list(prefix.versions) if prefix.versions is not None else [None] * len(prefix.tokens)
        for g in prefix.generations or []:
            ids = prefix.tokens[g.start : g.start + g.length]
            self.completions.append(Completion(ids, prefix.logprobs[g.start : g.start + g.length], g.text, g.finish))
            self.turns.append(self._record(g.start, g.length, self.versions[g.start] if g.length else None))
        self.mark, self.next_turn, self.resumed = len(self.tokens), prefix.turns, True
        self.resumed_tokens, self.prefix = len(prefix.tokens), prefix

    def replay(self, prefix: Prefix) -> None:
        """Run the env's turns again against the prefix's recorded completions (its tools are deterministic):
        `generate` answers with them, without the policy, until the prefix's turns have ended again."""
        self._replay, self._replayed, self.resumed_tokens = prefix, 0, len(prefix.tokens)

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    @staticmethod
    def _record(start: int, length: int, weights: int | None) -> dict[str, float | int]:
        turn: dict[str, float | int] = {"prompt_tokens": start, "completion_tokens": length, "wait_s": 0.0}
        turn["generate_s"] = 0.0
        if weights is not None:
            turn["weights"] = weights
        return turn

    async def end_turn(self, *, snapshot: bytes | str | None = None, tool_results: Iterable[Any] = ()) -> None:
        """A turn of the episode ended (a step, a tool call answered): what the session appended since the last
        turn is posted as one turn, with `tool_results` (JSON) and the env's state after it (`snapshot`: bytes,
        or a URI the env's `restore` resolves), and is durable once acknowledged. Returns once the turn is queued
        for posting, not when it is acknowledged. Without a runner posting turns it only marks the boundary.
        Raises SlotLost when the slot passed to another producer."""
        self.log.extend({TOOL: r} for r in tool_results)
        if self._replay is not None:
            self._end_replayed_turn(self._replay)
            return
        if len(self.tokens) == self.mark:
            return  # nothing appended: the log goes with the next turn
        versions = self.versions[self.mark :]
        piece = TurnPiece(
            self.next_turn,
            self.tokens[self.mark :],
            self.masks[self.mark :],
            self.logprobs[self.mark :],
            None if any(v is None for v in versions) else [v for v in versions if v is not None],
            self.log,
            snapshot,
        )
        self.mark, self.next_turn, self.log = len(self.tokens), self.next_turn + 1, []
        if self.turn_sink is not None:
            await self.turn_sink.put(piece)

    def _end_replayed_turn(self, prefix: Prefix) -> None:
        if len(self.tokens) != prefix.ends[self.next_turn]:
            raise ReplayDiverged(
                f"replayed turn {self.next_turn} ends at token {len(self.tokens)}, the recorded one at "
                f"{prefix.ends[self.next_turn]}"
            )
        self.mark, self.next_turn, self.log = len(self.tokens), self.next_turn + 1, []
        if self.next_turn == prefix.turns:
            self._replay = None
            if prefix.versions is not None:
                self.versions = list(prefix.versions)  # the prefix's tokens keep the versions that made them

    def _replayed_generation(self, prefix: Prefix) -> Completion:
        gens = prefix.generations or []
        if self._replayed >= len(gens) or gens[self._replayed].start != len(self.tokens):
            raise ReplayDiverged(
                f"generation {self._replayed} replayed at token {len(self.tokens)}: not recorded there"
            )
        g = gens[self._replayed]
        self._replayed += 1
        end = g.start + g.length
        out = Completion(prefix.tokens[g.start : end], prefix.logprobs[g.start : end], g.text, g.finish)
        weights = prefix.versions[g.start] if prefix.versions is not None and g.length else None
        self._append(out, self._record(g.start, g.length, weights), weights)
        if out.finish_reason == "length" and self.room is not None and self.room <= 0:
            self.truncated = True  # as when it was generated
        return out

    def _append(self, out: Completion, turn: dict[str, float | int], weights: int | None) -> None:
        self.turns.append(turn)
        self.tokens.extend(out.token_ids)
        self.masks.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.versions.extend([weights] * len(out.token_ids))
        self.completions.append(out)
        self.log.append({COMPLETION: out.text, "tokens": len(out.token_ids), "finish": out.finish_reason})

    @property
    def room(self) -> int | None:
        """Tokens left within `token_limit` and the model's context (the policy's `context_length`, once known;
        None: no limit): text observed past the context is clipped there, not at a larger trainer budget,
        where the next turn could not be sampled anyway."""
        context = getattr(self.policy, "context_length", None)
        limits = [n for n in (self.token_limit, context) if isinstance(n, int)]
        return min(limits) - len(self.tokens) if limits else None

    @property
    def finish_reason(self) -> str | None:
        """Why the episode ended: "length" when truncated at the budget, else the last completion's reason."""
        if self.truncated:
            return "length"
        return self.completions[-1].finish_reason if self.completions else None

    async def observe(self, text: str) -> list[int]:
        """Append text the policy did not write (prompt, tool output): tokenised by the policy, not trained on.

        Once the policy has generated, whatever does not fit the token budget is cut off (the episode is
        then `truncated`); the prompt itself is never cut (a prompt too long skips the group)."""
        return self.observe_tokens(await self.policy.tokenize(valid_text(text)))

    def observe_tokens(self, ids: list[int]) -> list[int]:
        """`observe` for text already tokenised (a chat template's turn): clipped to the budget as `observe`
        clips, and returns the ids kept."""
        room = self.room
        if self.turns and room is not None and len(ids) > room:
            ids = ids[: max(0, room)]
            self.truncated = True
        self.observe_ids(ids)
        return ids

    def observe_ids(self, ids: list[int]) -> None:
        if self._replay is not None and self._replay.tokens[len(self.tokens) : len(self.tokens) + len(ids)] != ids:
            raise ReplayDiverged(f"replayed text at token {len(self.tokens)} is not what the prefix recorded")
        self.versions.extend([self.gate.weights] * len(ids))
        self.tokens.extend(ids)
        self.masks.extend([MASK_IGNORE] * len(ids))
        self.logprobs.extend([PROMPT_LOGPROB] * len(ids))

    async def generate(self, max_tokens: int | None = None) -> Completion:
        """Let the policy continue the transcript; its tokens are trained on. Waits while the runner is paused.

        Raises PromptTooLong when the prompt already fills the token budget, EpisodeTruncated when a later
        turn has no room left, TurnTimeout past `turn_timeout`.
        """
        if self.turns and (self.truncated or (self.room is not None and self.room <= 0)):
            self.truncated = True
            raise EpisodeTruncated(len(self.tokens), self.token_limit or 0)
        if self._replay is not None:
            return self._replayed_generation(self._replay)
        loop = asyncio.get_running_loop()
        queued = time.perf_counter()
        remaining = None
        if self.deadline is not None and not self.gate.is_open and (when := self.deadline.when()) is not None:
            remaining = when - loop.time()  # a paused rollout's clock stops until the gate opens
            self.deadline.reschedule(None)
        async with self.gate.generation(self.owner):
            if remaining is not None and self.deadline is not None:
                self.deadline.reschedule(loop.time() + remaining)
            weights = self.gate.weights  # read once through the gate: the version this request is served by
            started = time.perf_counter()
            seed = None if self.seed is None else self.seed + len(self.turns)
            try:
                async with asyncio.timeout(self.turn_timeout):
                    out = await self.policy.generate(
                        list(self.tokens),
                        max_tokens=max_tokens or self.max_tokens,
                        token_limit=self.token_limit,
                        seed=seed,
                    )
            except TimeoutError:
                raise TurnTimeout(f"generate() took more than turn_timeout={self.turn_timeout} s") from None
            except PromptTooLong:
                if not self.turns:
                    raise
                self.truncated = True  # the model's context, tighter than the budget, is full
                raise EpisodeTruncated(len(self.tokens), self.token_limit or 0) from None
        turn: dict[str, float | int] = {
            "prompt_tokens": len(self.tokens),
            "completion_tokens": len(out.token_ids),
            "wait_s": round(started - queued, 6),
            "generate_s": round(time.perf_counter() - started, 6),
        }
        if weights is not None:
            turn["weights"] = weights
        self._append(out, turn, weights)
        if out.context_full or (out.finish_reason == "length" and self.room is not None and self.room <= 0):
            self.truncated = True  # stopped at the trainer's budget or at the model's context
        return out

    @asynccontextmanager
    async def tool(self, name: str) -> AsyncIterator[None]:
        """Time one tool call (`async with session.tool("python"): ...`); an error escaping it counts as a
        failure of that tool (and still propagates)."""
        t0 = time.perf_counter()
        failed = True
        try:
            yield
            failed = False
        finally:
            rec = self.tool_record(name)
            rec["calls"] += 1
            rec["failures"] += int(failed)
            rec["seconds"] = round(rec["seconds"] + time.perf_counter() - t0, 6)

    def tool_record(self, name: str) -> dict[str, float | int]:
        """The tool's entry in `tools`: `calls`, `failures` (it raised), `seconds`, `malformed` (called with
        arguments that do not fit it: never run)."""
        return self.tools.setdefault(name, {"calls": 0, "failures": 0, "seconds": 0.0, "malformed": 0})

    def record_sequences(self, sequences: Iterable[ExternalSequence]) -> None:
        """This rollout's part of the group is what it generated outside the session: `sequences`, possibly
        none (then it adds nothing to the group). See `record_sequence`."""
        if self.external is None:
            self.external = []
        for sequence in sequences:
            self.record_sequence(sequence)

    def record_sequence(self, sequence: ExternalSequence) -> None:
        """Contribute a sequence generated outside this session (see `external`). Its lengths must agree."""
        n = len(sequence.tokens)
        if not n or len(sequence.masks) != n or len(sequence.logprobs) != n:
            raise ValueError(
                f"record_sequence: tokens ({n}), masks ({len(sequence.masks)}) and logprobs "
                f"({len(sequence.logprobs)}) must be non-empty and of one length"
            )
        if self.external is None:
            self.external = []
        self.external.append(sequence)

    @property
    def last_text(self) -> str:
        return self.completions[-1].text if self.completions else ""


async def enter_worker_setup(stack: AsyncExitStack, env: Environment) -> None:
    """Enter `env.worker_setup()` on `stack` within `env.setup_timeout` (SetupTimeout past it)."""
    try:
        async with asyncio.timeout(env.setup_timeout) as deadline:
            await stack.enter_async_context(env.worker_setup())
    except TimeoutError:
        if not deadline.expired():
            raise
        raise SetupTimeout(
            f"worker_setup() of env {env.name!r} did not finish within setup_timeout={env.setup_timeout} s "
            f"(raise {type(env).__name__}.setup_timeout if it needs longer)"
        ) from None


class Environment(ABC):
    """Subclass and set the class attributes; instances must pickle (they are sent to worker processes)."""

    name: str = "env"
    group_size: int = 4
    """G: rollouts per task (one group)."""
    weight: float = 1.0
    """Share of batches relative to other environments."""
    max_tokens: int = 256
    """Default completion length per `generate` (clipped to the token budget)."""
    min_batch_allocation: float | None = None
    group_retries: int = 0
    """How many times a group that failed is run again (fresh sessions, same task) before it counts as
    failed. Leave 0 unless a rollout has no effect outside itself (rerunning it is safe)."""

    min_group_size: int | None = None
    """Keep a group when at least this many of its rollouts succeed: the failed ones are left out (counted
    in `RunnerStats.rollouts_failed`) and the survivors submitted as one group. Fewer: the group fails.
    None (default): half the group, at least 2 (`group.default_min_group_size`: a crash in one rollout of a
    large group does not cost the other 63); `group_size` to require every rollout. Below `group_size`, the
    runner registers the env with `variable_group_size` so that the server queues such groups whole (never
    combined with other prompts)."""
    scores_each_rollout: bool = False
    """True when `score(task, session)` reads that rollout alone (no group-relative scoring, nothing shared
    across the group): the runner then schedules the rollouts one by one, spread over the worker processes,
    each acquiring its own resource. False (default): a group's rollouts run and are scored in one process."""
    posts_each_rollout: bool = False
    """With `scores_each_rollout`: each rollout is posted to rollbuf as it ends (a per-rollout group,
    docs/rollouts.md), acknowledged durably, and the server seals the group; a producer killed mid-group loses
    none of its finished rollouts (their missing siblings are leased to other producers, which this runner also
    takes). Worth it for rollouts of seconds to minutes (agentic episodes), where a lost group is paid again;
    False (default): a group is submitted whole when its rollouts end (a tenth of the server's CPU per
    rollout, any server version, the env's `skip_reason` applies)."""
    max_resources: int | None = None
    """Capacity of the shared pool `resource()` draws from (sandboxes on a capped server): at most this many
    rollouts of this env hold a resource at once, over every worker. A group that runs together is admitted
    only when all its G fit, so groups never each hold part of the pool and wait for the rest. None: the
    runner does not know the pool's size, and groups that run together acquire theirs one group at a time
    (`resources.Turns`), which is safe but serial."""
    acquire_timeout: float | None = 300.0
    """How long a group (or a rollout run on its own) keeps retrying `resource()` that raises
    ResourceExhausted, with backoff, before it fails (`resource_timeout`)."""
    setup_timeout: float | None = 120.0
    """Bound on entering `worker_setup()` (a tool server that never comes up): past it the process cannot
    start (SetupTimeout, naming the env): the run fails with it, not a silent stall."""
    variable_group_size: bool = False
    """Registered with `variable_group_size`: a group may hold more or fewer sequences than `group_size` (a
    rollout that records 0 or several sequences with `Session.record_sequence`)."""
    max_token_staleness: int | None = None
    """Registered with the env: the server serves masked (-100) the trained tokens that weights more than this many
    steps older than the batch sampled (each token's version: `token_weight_versions`, which the runner sends).
    None: none is masked for its age."""
    reuse: ReusePolicy | None = None
    """Registered with the env: its reuse policy where it differs from the trainer's (`ReusePolicy(max_served=1)`
    opts it out of reuse; docs/replay.md). None: the trainer's applies."""
    on_new_weights: Literal["continue", "restart", "drain"] = "continue"
    """What its groups in flight do when the trainer announces new weights (`rollout_client.runner.following`):
    "continue" (their episodes span versions; stamped with the oldest, `generation_params["weight_versions"]`
    holds [min, max]), "restart" (cancelled and run again with the new weights) or "drain" (when the trainer
    begins a sync with `TrainerClient.weight_sync`, no new group starts, those in flight finish, and the trainer
    pushes the weights once every live producer has drained: no episode spans a sync, production pauses). With
    `weight_sync` every policy's versions are exact (`weight_versions_exact`): the runner holds its generation
    requests for the push; with announcements alone they are the runner's estimate."""

    resumes: Resumes = "restart"
    """With `posts_each_rollout`, how a rollout whose producer died continues on another producer
    (docs/episodes.md): "snapshot" (its turns are posted as they end, `Session.end_turn`, and the next producer
    rebuilds the session from their tokens and the env's state with `restore` from the last snapshot),
    "replay" (the env's tools are deterministic: the next producer runs the env's turns again against the
    recorded completions, without the policy) or "restart" (default: it starts again from the prompt; no
    turn is posted)."""

    def snapshot(self, task: Task, session: Session) -> bytes | str | None:
        """The env's state after a turn, for `resumes = "snapshot"`: bytes (at most the server's
        `rollout_max_snapshot_bytes`) or a URI where the env keeps it (a sandbox image, a volume). None: none.
        `EpisodeEnvironment` posts it with each step; a free-form `rollout` passes it to `Session.end_turn`."""
        return None

    def restore(self, task: Task, snapshot: bytes | str) -> dict[str, Any]:
        """The rollout's `session.state` rebuilt from the last snapshot a turn posted (bytes, or the URI), for
        `resumes = "snapshot"`: `rollout` then runs with `session.resumed` true and continues from there."""
        raise NotImplementedError(f"{type(self).__name__} resumes from snapshots but does not define restore()")

    def skip_reason(self, sequences: int, scores: list[float]) -> str | None:
        """Why a finished group is not submitted (None: it is); the runner counts it in `skipped[reason]`.
        Called with the group's sequence count and scores once every rollout is scored."""
        return None

    def resource(self, task: Task) -> AbstractAsyncContextManager[Any]:
        """Per-rollout resources (a sandbox, a browser): entered before the rollout, exited after. The G
        rollouts of a group acquire theirs all-or-nothing. Raise ResourceExhausted when the pool has none
        free now: the runner releases what the group holds, backs off and tries again."""
        return nullcontext()

    def worker_setup(self) -> AbstractAsyncContextManager[Any]:
        """What the rollouts of one process share (a client, a tool server, a connection pool): entered once
        per worker process before its first rollout (once in the runner's process without workers), exited
        when that process stops: on shutdown and when a worker is recycled (not when it is killed: out of
        memory, a group past its deadline). Keep what it sets up on `self`: each worker has its own copy of
        the environment."""
        return nullcontext()

    @abstractmethod
    async def rollout(self, task: Task, session: Session) -> None:
        """Drive the policy through `session` until the episode is done."""

    @abstractmethod
    def score(self, task: Task, session: Session) -> float:
        """The rollout's reward. May be CPU-heavy: with worker processes it runs there, off the main loop."""


class Episode(Protocol):
    """One rollout's world, for environments that are easiest to write step by step."""

    def start(self) -> str:
        """The first observation (the prompt)."""
        ...

    def step(self, completion: str) -> tuple[str | None, bool]:
        """React to the policy's completion: the next observation (None for nothing to add) and whether
        the episode is done."""
        ...

    def score(self) -> float: ...


class EpisodeEnvironment(Environment):
    """An environment written as `episode(task) -> Episode`: a fresh episode per rollout (its state is that
    rollout's alone), stepped until done or `max_turns` completions."""

    max_turns: int = 8

    @abstractmethod
    def episode(self, task: Task) -> Episode: ...

    async def rollout(self, task: Task, session: Session) -> None:
        """Each step is a turn (`Session.end_turn`), with the env's `snapshot` when it resumes from them; a
        session resumed from one (`session.resumed`) continues its restored episode."""
        if session.resumed:
            episode = session.state["episode"]
        else:
            episode = session.state["episode"] = self.episode(task)
            await session.observe(episode.start())
        for _ in range(len(session.turns), self.max_turns):
            out = await session.generate()
            observation, done = episode.step(out.text)
            if done:
                return
            if observation:
                await session.observe(observation)
            snapshot = self.snapshot(task, session) if self.resumes == "snapshot" and not session.replaying else None
            await session.end_turn(snapshot=snapshot, tool_results=[observation])

    def score(self, task: Task, session: Session) -> float:
        episode: Episode = session.state["episode"]
        return episode.score()
