"""The buffer's operations, each one store transaction: registration, ingest, batch formation, status.

This module is the orchestration: which transaction runs, against which remembered run state, and what the
process does around it (wake long-polls, log a formed batch). What each transaction decides lives in its
own module, written once over `Txn`: `ingest` (storing submissions, which `submissions` validated),
`formation` (forming a batch), `status` (the views). Every check that can fail runs before the first write,
so a rejected request leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field, replace
from functools import partial
from typing import Any, cast

from api.batches.formation import FormationRules
from api.batches.service import Batches
from api.batches.wakeups import Wakeups
from api.errors import Conflict, InvalidData, NotFound, Unavailable
from api.ingest import submissions
from api.ingest.queue_limits import QueueLimits
from api.ingest.submissions import Submission
from api.ingest.submit import VALIDATION_ROUNDS, QueueFull, StaleRun, expire_txn, submit_txn
from api.ledger.drop_bias_watch import BiasWatch
from api.ledger.rules import LedgerSettings
from api.ledger.service import PRUNE, Ledger
from api.logs import request_env
from api.owners import ANYONE, Actor
from api.producers.service import Producers
from api.producers.stored import ProducerSettings, load_weights_and_pending, report_txn
from api.rollouts.service import Rollouts, SweepSettings, siblings_due_txn
from api.run import state, stats
from api.run.kept import Kept, ReadAhead
from api.run.offloop import INLINE_PARSE, off_loop
from api.run.state import ANON_NAME, EnvRecord, RunState
from api.scheduler import Periodic, Scheduler
from api.store.base import Store, Txn
from api.tasks import ending
from api.tasks.service import Tasks
from api.views.status import env_status, status_txn
from api.wire.records import GroupRecord, decode
from api.wire.schema import (
    EnvDropBias,
    EnvRegistered,
    EnvStatus,
    Info,
    RegisterEnv,
    Registration,
    ScoredReply,
    Status,
)

log = logging.getLogger("rollbuf")

REFUSALS_FLUSH_S = 1.0
"""Longest time a refusal's count waits in memory before it is written (with every other one since)."""
LATEST_MAX_BYTES = 4 << 20
"""Largest group (as stored) that GET /latest_example shows; a larger one leaves the previous example."""
REFUSALS, SWEEP = "refusals", "side_buffer_sweep"
"""The ingest flow's background jobs' names (the ledger's are `api.ledger.service`'s, the open-group sweep's
`api.rollouts.service.SWEEP_JOB`)."""


@dataclass(slots=True)
class Service:
    store: Store
    limits: QueueLimits = field(default_factory=QueueLimits)
    read_ahead: ReadAhead = field(default_factory=ReadAhead)
    """How far a trainer in commit mode may read past its last commit."""
    rules: FormationRules = field(default_factory=FormationRules)
    """How far formation looks ahead, when a passed-over group is due, how long a quiet minimum share holds."""
    _latest: bytes | None = None
    """The stored record of the last group of at most `LATEST_MAX_BYTES` this process queued."""
    _run: RunState | None = None
    """The run state this process's last transaction saw: submissions are validated against it without a read
    of their own, and their transaction checks that it still holds (`ingest`)."""
    wakeups: Wakeups = field(default_factory=Wakeups)
    """Long-polling trainers wait here for a change a batch may be formed from."""
    refusals_flush_s: float = REFUSALS_FLUSH_S
    _refused: dict[str, int] = field(default_factory=dict)
    """Submissions refused for a full queue, by env name, not written yet (`_count_refused`)."""
    books: InitVar[LedgerSettings | None] = None
    """The ledger: whether it is written, how long it and retained payloads are kept (docs/ledger.md)."""
    bias: InitVar[BiasWatch | None] = None
    """The drop-bias monitor, fed from the ledger (`Ledger.bias`)."""
    jobs: Scheduler = field(default_factory=Scheduler)
    """This process's background jobs (`__post_init__` names them)."""
    producer_settings: InitVar[ProducerSettings | None] = None
    """When a producer that stops heartbeating counts as gone, and how many are kept (`Producers.settings`)."""
    _bias_entries: tuple[object, tuple[tuple[str, int], ...], list[EnvDropBias]] = (None, (), [])
    """The last drop-bias report and /status's entries for it (`status`)."""
    rollout_sweep: InitVar[SweepSettings | None] = None
    """How often, and over how many groups, the open-group sweep runs (`Rollouts.sweeping`)."""
    ledger: Ledger = field(init=False)
    """The ledger's flow: its reads, its retention, the drop-bias monitor."""
    producers: Producers = field(init=False)
    """The producers' flow: heartbeats, weights, who is producing."""
    rollouts: Rollouts = field(init=False)
    """The per-rollout groups' flow, and its sweep's state."""
    batches: Batches = field(init=False)
    """The batches' flow: forming, acknowledging, and GET /batch's long-poll."""
    tasks: Tasks = field(init=False)
    """The tasks' flow: datasets registered and read, leases taken, heartbeated and given up."""
    periodic: list[Periodic] = field(init=False)
    """The flows' background jobs, as each declares it (`api.scheduler.Periodic`)."""

    def __post_init__(
        self,
        books: LedgerSettings | None,
        bias: BiasWatch | None,
        producer_settings: ProducerSettings | None,
        rollout_sweep: SweepSettings | None,
    ) -> None:
        self.ledger = Ledger(self.store, books or LedgerSettings(), bias or BiasWatch())
        self.producers = Producers(
            self.store, producer_settings or ProducerSettings(), lambda: self._run, siblings_due=siblings_due_txn
        )
        self.rollouts = Rollouts(
            self.store,
            lambda body: self.ingest(body, "application/json", many=False, caller=ANYONE),
            self.ledger.recorder,
            self.limits,
            lambda: self._run,
            rollout_sweep or SweepSettings(),
        )
        self.batches = Batches(
            self.store,
            lambda: self._run,
            self._remember,
            self.ledger.recorder,
            self.producers,
            self.jobs,
            (SWEEP, PRUNE),
            self.read_ahead,
            self.rules,
            self.wakeups,
        )
        self.tasks = Tasks(self.store, self.wakeups.changed)
        self.store.subscribe(self.wakeups.changed)  # changes committed by another process sharing the store
        # Each runs in the background when asked, never on a request's path: refusals counted in memory are written
        # together; the side buffers' expired groups are swept from a live run's calls (an env whose groups expire
        # may send nothing more); the ledger's (`Ledger.jobs`) and the open-group sweep (`Rollouts.job`).
        self.periodic = [
            Periodic(REFUSALS, self._flush_refused),
            Periodic(SWEEP, self._sweep, lambda: self.limits.side.sweep_every()),
            *self.ledger.jobs,
            self.rollouts.job,
        ]
        for job in self.periodic:
            self.jobs.declare(job)

    async def start(self) -> None:
        """Start the jobs that run by the clock (from the app's lifespan, in its loop)."""
        await self.rollouts.start()
        for job in self.periodic:
            if job.by_clock:
                self.jobs.keep_asking(job.name)

    def _remember(self, run: RunState) -> None:
        self._run = run

    @property
    def latest(self) -> GroupRecord | None:
        """The last group queued by this process, of those of at most `LATEST_MAX_BYTES` (GET /latest_example is
        a debugging aid, not state: a bounded copy of its record, never a view into the request that sent it)."""
        return None if self._latest is None else decode(self._latest)

    # ----------------------------------------------------------------------------- trainer

    async def register_trainer(self, reg: Registration) -> int:
        def txn_fn(txn: Txn) -> None:
            run = state.load(txn, self._run)
            if run.registration is None:
                state.save_run(txn, reg, started=False)
                state.save_step(txn, reg.starting_step)
                state.save_kept(txn, Kept(reg.starting_step))
                return
            if run.registration != reg:
                changed = sorted(k for k, v in reg.model_dump().items() if getattr(run.registration, k) != v)
                raise Conflict(
                    f"a trainer is already registered with a different configuration ({', '.join(changed)}); "
                    "GET /reset_data first to start a new run",
                    loc=("body", changed[0]) if changed else ("body",),
                )

        await self.store.transact(txn_fn)
        self.wakeups.changed()
        return secrets.randbits(128)

    async def ping(self) -> None:
        """One read transaction: raises when the store does not answer (/readyz)."""
        await self.store.transact(lambda txn: txn.get_value(state.STEP_KEY))

    async def snapshot(self, max_envs: int | None = None) -> stats.Snapshot:
        """Everything the operator's views show (/metrics, /dashboard, W&B), read in one transaction; per env for
        the first `max_envs` envs, the rest summed (`stats.snapshot`)."""
        refused = dict(self._refused)  # counted, not written yet: the views show them all the same
        known = self._run
        return await self.store.read(lambda txn: stats.snapshot(txn, ANON_NAME, refused, known, max_envs))

    @property
    def known_run(self) -> RunState | None:
        """The run state this process's last transaction saw: a transaction reads the envs past it only as far as
        they changed (`state.load`)."""
        return self._run

    async def run_state(self) -> RunState:
        run = await self.store.read(lambda txn: state.load(txn, self._run))
        self._run = run
        return run

    async def info(self) -> Info:
        run = await self.run_state()
        if run.registration is None:
            return Info(batch_size=-1, max_token_len=-1)
        return Info(batch_size=run.registration.batch_size, max_token_len=run.registration.max_token_len)

    async def reset(self) -> None:
        await self.store.transact(lambda txn: txn.clear())
        self.wakeups.changed()
        self._latest = None
        self._run = None

    # ----------------------------------------------------------------------------- envs

    async def register_env(self, reg: RegisterEnv, caller: Actor = ANYONE) -> EnvRegistered | None:
        """None while the trainer has not asked for its first batch (envs are told to wait)."""

        def txn_fn(txn: Txn) -> tuple[EnvRegistered | None, RunState]:
            run = state.load(txn, self._run)
            if run.registration is None or not run.started:
                return None, run
            batch_size = run.registration.batch_size
            if reg.group_size > batch_size:
                raise InvalidData(
                    ("body", "group_size"),
                    f"group_size {reg.group_size} exceeds the trainer's batch_size {batch_size}: "
                    "a group is never split, so it could never be served",
                )
            same_name = txn.count_named(reg.desired_name)
            env = EnvRecord(
                env_id=len(run.envs),
                desired_name=reg.desired_name,
                wandb_name=f"{reg.desired_name}_{same_name}",
                weight=reg.weight,
                group_size=reg.group_size,
                max_token_length=reg.max_token_length,
                min_batch_allocation=reg.min_batch_allocation,
                owner=caller.owner,
                variable_group_size=reg.variable_group_size,
            )
            after = state.save_env(txn, run, env)
            warning = None
            if run.registration.max_batch_tokens is None and batch_size % reg.group_size:
                warning = (
                    f"group_size {reg.group_size} does not divide batch_size {batch_size}: batches can be filled "
                    "exactly only together with other environments' groups"
                )
            reply = EnvRegistered(
                env_id=env.env_id,
                wandb_name=env.wandb_name,
                checkpoint_dir=run.registration.checkpoint_dir,
                starting_step=run.step,
                checkpoint_interval=run.registration.save_checkpoint_interval,
                num_steps=run.registration.num_steps,
                warning=warning,
            )
            return reply, after

        reply, self._run = await self.store.transact(txn_fn)
        self.wakeups.changed()
        return reply

    async def disconnect_env(self, env_id: int, caller: Actor = ANYONE) -> str | None:
        """None on success, else why not (Atropos answers failures in-band)."""

        def txn_fn(txn: Txn) -> tuple[str | None, RunState]:
            run = state.load(txn, self._run)
            env = visible_env(caller, run, env_id)
            if env is None:
                return f"no environment with env_id {env_id}", run
            return None, state.save_env(txn, run, replace(env, connected=False))

        error, self._run = await self.store.transact(txn_fn)
        self.wakeups.changed()
        return error

    # ----------------------------------------------------------------------------- ingest

    async def ingest(
        self,
        raw: bytes | bytearray,
        content_type: str | None,
        *,
        many: bool,
        key: str | None = None,
        caller: Actor = ANYONE,
    ) -> list[ScoredReply]:
        """Validate a request's groups (`api.ingest.submissions.decode`: JSON or msgpack, one or a list, `key` the
        request's Idempotency-Key as `submissions.request_key`) and store them all-or-nothing.

        They are validated against the run state this process saw last, not a fresh read: one store round trip
        less per request, which is what a shared database charges most for. The transaction checks that what
        validation relied on still holds, and if not (another process changed the run), they are validated
        again against the state it found. A request refused against a remembered state is validated once more
        against a fresh read before the refusal stands (an env registered through another process since)."""
        with self.store.expecting():  # a group commit starting meanwhile may wait for this request's groups
            run, remembered = (self._run, True) if self._run is not None else (await self.run_state(), False)
            for _ in range(VALIDATION_ROUNDS):
                try:
                    subs = await self._decode(raw, content_type, run, many=many, key=key)
                except (InvalidData, Unavailable):
                    if not remembered:
                        raise
                    fresh = await self.run_state()
                    if fresh == run:
                        raise
                    run, remembered = fresh, False
                    continue
                for sub in subs:
                    if sub.env_id is not None and visible_env(caller, run, sub.env_id) is None:
                        unknown = f"no environment with env_id {sub.env_id} is registered"
                        raise InvalidData((*sub.loc, "env_id"), unknown)
                try:
                    return await self.store_submissions(subs, run, caller)
                except StaleRun as stale:
                    run, remembered = stale.run, False
            raise Unavailable("the run kept changing while this request was validated; send it again", 0)

    async def _decode(
        self, raw: bytes | bytearray, content_type: str | None, run: RunState, *, many: bool, key: str | None
    ) -> list[Submission]:
        """`submissions.decode` on the event loop for a small body, in a worker thread for a large one (other
        requests go on meanwhile); the env it names is kept for the request's log line either way (on the loop
        it is set in the request's own context, so no copy of it is needed)."""
        if len(raw) <= INLINE_PARSE:
            return submissions.decode(raw, content_type, run, self.limits, many=many, key=key)
        ctx = contextvars.copy_context()
        try:
            return await off_loop(
                len(raw), INLINE_PARSE, ctx.run,
                partial(submissions.decode, raw, content_type, run, self.limits, many=many, key=key),
            )  # fmt: skip
        finally:
            request_env.set(ctx.get(request_env))

    async def store_submissions(
        self, subs: Sequence[Submission], run: RunState, caller: Actor = ANYONE
    ) -> list[ScoredReply]:
        """Store groups validated against `run` all-or-nothing (the JSON and binary paths both end here);
        `StaleRun` if the store's run state no longer agrees with `run` on what validation used. `caller`: who
        sent them (the ledger names its key; a group under a task lease must be its holder's)."""
        try:
            replies, self._run = await self.store.transact(
                lambda txn: submit_txn(txn, subs, run, self.limits, self.ledger.recorder(), caller),
                replies=[s.key for s in subs if s.key],
            )
        except StaleRun as stale:
            self._run = stale.run
            raise
        except QueueFull:
            names = {run.env_name(s.env_id) for s in subs}
            request_env.set(",".join(sorted(names)))
            self._count_refused(names)
            raise
        if subs:
            kept = [s.payload for s in subs if len(s.payload) <= LATEST_MAX_BYTES]
            if kept:
                self._latest = bytes(kept[-1])
            self.wakeups.changed()
        return replies

    def _count_refused(self, names: set[str]) -> None:
        """Count a refusal without a write of its own: a handler retrying into a full queue once ran one write
        transaction per 503 (7,671 of them grew the WAL to 959 MB). Refusals add up in memory and are written
        together at most every `REFUSALS_FLUSH_S` (a crash loses at most that much of a counter, never data)."""
        for name in names:
            self._refused[name] = self._refused.get(name, 0) + 1
        self.jobs.ask(REFUSALS)

    async def _flush_refused(self) -> bool:
        await asyncio.sleep(self.refusals_flush_s)  # gathering refusals: one write for all of them
        refused, self._refused = self._refused, {}
        try:
            await self.store.transact(lambda txn: txn.add_counts(stats.BACKPRESSURE, refused))
        except Unavailable:
            for name, n in refused.items():  # the store is down: counted with the next flush
                self._refused[name] = self._refused.get(name, 0) + n
        return bool(self._refused)  # more came meanwhile (or the store was down): flushed again

    async def _sweep(self) -> None:
        """Expire held groups of every env (`SideLimits.sweep_every`)."""
        if not await self.store.read(lambda txn: bool(txn.held.counts())):
            return  # the common case: nothing held, nothing written
        n = await self.store.transact(
            lambda txn: expire_txn(txn, time.time(), self.limits.side, self._run, self.ledger.recorder())
        )
        if n:
            log.info("side buffer: %d held groups expired after %.0f s (counted as dropped: %s)",
                     n, self.limits.side.ttl, "side_buffer_expired")  # fmt: skip

    async def close(self) -> None:
        """Stop the background jobs, and write what is counted in memory (refusals) before the store closes."""
        await self.jobs.close()
        if self._refused:
            refused, self._refused = self._refused, {}
            try:
                await self.store.transact(lambda txn: txn.add_counts(stats.BACKPRESSURE, refused))
            except Unavailable:
                log.warning("refusals not counted at shutdown, the store being unavailable: %s", refused)

    # ----------------------------------------------------------------------------- status

    async def status(self) -> Status:
        self.jobs.ask(SWEEP)
        now = time.time()
        status, seen, finished = await self.store.read(
            lambda txn: (status_txn(txn, self._run), report_txn(txn, now, self.producers.settings, self._run),
                         self._finished(txn, now))
        )  # fmt: skip
        seen = self.producers.graced(seen, now)
        status = status.model_copy(
            update={"weights_step": seen.weights_step, "producers": seen.producers, "finished": finished,
                    "stall_reason": None if finished else seen.stall_reason}
        )  # fmt: skip
        if status.rollouts is not None:
            self.rollouts.in_use(status.rollouts.open)
        report = await self.ledger.drop_bias()
        if report is None:
            return status
        passed_over = tuple(sorted(status.passed_over.items()))
        cached, cached_over, entries = self._bias_entries
        if cached is not report or cached_over != passed_over:  # converted once per report, not once per request
            entries = [
                EnvDropBias.model_construct(
                    **{**cast(dict[str, Any], e.to_status()), "passed_over": status.passed_over.get(e.env, 0)}
                )
                for e in report.envs
            ]
            self._bias_entries = (report, passed_over, entries)
        return status.model_copy(update={"drop_bias": entries})

    def _finished(self, txn: Txn, now: float) -> bool:
        """Whether the run is finished (api/tasks/ending.py): read in /status's transaction."""
        end, _ = ending.read(txn, state.load(txn, self._run), now, self.producers.settings.gone_after)
        return ending.finished(txn, end)

    async def env_status(self, env_id: int, caller: Actor = ANYONE) -> EnvStatus:
        def txn_fn(txn: Txn) -> tuple[EnvStatus, RunState]:
            run = state.load(txn, self._run)
            env = visible_env(caller, run, env_id)
            if env is None:
                raise NotFound(f"no environment with env_id {env_id}")
            blocked = state.load_blocked(txn)
            reply = env_status(run, env, txn.counts(), txn.held.counts(), self.limits, blocked)
            weights, pending = load_weights_and_pending(txn)
            return reply.model_copy(update={"weights_step": weights, "weights_pending": pending}), run

        reply, self._run = await self.store.read(txn_fn)
        return reply


def visible_env(caller: Actor, run: RunState, env_id: int) -> EnvRecord | None:
    """The env, if it exists and `caller` may act on it; None otherwise, so that another key's env answers as an
    unknown one (an env key uses only the envs it registered, bound to its name so rotating its secret keeps
    them; trainer and admin keys act on any env where the route lets them: a trainer disconnects an env that
    holds its batches back)."""
    env = run.env(env_id)
    if env is None or caller.hides(env.owner, "env"):
        return None
    return env
