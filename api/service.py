"""The buffer's operations, each one store transaction: registration, ingest, batch formation, status.

This module is the orchestration: which transaction runs, against which remembered run state, and what the
process does around it (wake long-polls, log a formed batch). What each transaction decides lives in its
own module, written once over `Txn`: `ingest` (storing submissions, which `submissions` validated),
`formation` (forming a batch), `status` (the views). Every check that can fail runs before the first write,
so a rejected request leaves nothing behind.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import InitVar, dataclass, field, replace
from typing import Any, cast

from api.batches.formation import FormationRules
from api.batches.reuse import beyond_trainer, not_served_reason
from api.batches.service import Batches
from api.batches.wakeups import Wakeups
from api.errors import Conflict, InvalidData, NotFound
from api.ingest.queue_limits import QueueLimits
from api.ingest.service import SWEEP, Ingest
from api.ledger.drop_bias_watch import BiasWatch
from api.ledger.rules import LedgerSettings
from api.ledger.service import PRUNE, Ledger
from api.owners import ANYONE, Actor
from api.producers.service import Producers
from api.producers.stored import ProducerSettings, load_weights_and_pending, report_txn
from api.rollouts import metrics as rollout_metrics
from api.rollouts.service import Rollouts, SweepSettings
from api.rollouts.txns import siblings_due_txn
from api.run import state, stats
from api.run.blobs import BlobTier
from api.run.kept import Kept, ReadAhead
from api.run.state import ANON_NAME, EnvRecord, RunState, visible_env
from api.scheduler import Periodic, Scheduler
from api.store.base import Store, Txn
from api.tasks import ending
from api.tasks import metrics as task_metrics
from api.tasks.service import Tasks
from api.views import blob_metrics
from api.views import metrics as views_metrics
from api.views.dashboard import body as dashboard_body
from api.views.status import env_status, status_txn
from api.wire.records import MSGPACK
from api.wire.replay import ReusePolicy
from api.wire.schema import (
    EnvDropBias,
    EnvRegistered,
    EnvStatus,
    Info,
    RegisterEnv,
    Registration,
    Status,
)

log = logging.getLogger("rollbuf")


@dataclass(slots=True)
class Service:
    store: Store
    limits: QueueLimits = field(default_factory=QueueLimits)
    read_ahead: ReadAhead = field(default_factory=ReadAhead)
    """How far a trainer in commit mode may read past its last commit."""
    blobs: BlobTier | None = None
    """The blob tier (docs/payloads.md): large values stored once by content, outside the rows; None: none."""
    rules: FormationRules = field(default_factory=FormationRules)
    """How far formation looks ahead, when a passed-over group is due, how long a quiet minimum share holds."""
    _run: RunState | None = None
    """The run state this process's last transaction saw: submissions are validated against it without a read
    of their own, and their transaction checks that it still holds (`ingest`)."""
    wakeups: Wakeups = field(default_factory=Wakeups)
    """Long-polling trainers wait here for a change a batch may be formed from."""
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
    ingest: Ingest = field(init=False)
    """The ingest flow: /scored_data's groups validated and stored, its refusals counted, the side buffers swept."""
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
        self.ledger = Ledger(self.store, books or LedgerSettings(), bias or BiasWatch(), self.blobs)
        self.ingest = Ingest(
            self.store,
            lambda: self._run,
            self._remember,
            self.ledger.recorder,
            self.wakeups.changed,
            self.jobs.ask,
            self.run_state,
            self.limits,
            blobs=self.blobs,
        )
        self.producers = Producers(
            self.store, producer_settings or ProducerSettings(), lambda: self._run, siblings_due=siblings_due_txn
        )
        self.rollouts = Rollouts(
            self.store,
            lambda body, resumes: self.ingest.submit(
                body, MSGPACK, many=False, caller=ANYONE, sealed=True, resumes=resumes
            ),
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
            blobs=self.blobs,
        )
        self.tasks = Tasks(self.store, self.wakeups.changed)
        self.store.subscribe(self.wakeups.changed)  # changes committed by another process sharing the store
        # Each runs in the background when asked, never on a request's path: ingest's (`Ingest.jobs`), the
        # ledger's (`Ledger.jobs`) and the open-group sweep (`Rollouts.job`).
        self.periodic = [*self.ingest.jobs, *self.ledger.jobs, self.rollouts.job]
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

    # ----------------------------------------------------------------------------- trainer

    def _check_reuse(self, policy: ReusePolicy | None) -> None:
        """A policy that serves a group again is refused while replay is not served (409: a valid policy this server
        does not serve, which it would otherwise acknowledge and then ignore), and needs the ledger: each reuse is a
        ledger row, written with the batch (docs/replay.md), so a server without one refuses it. Both before
        anything is stored."""
        if (why := not_served_reason(policy)) is not None:
            raise Conflict(f"reuse.{why}", loc=("body", "reuse", "max_served"))
        if policy is not None and policy.reuses and not self.ledger.settings.enabled:
            raise Conflict(
                f"reuse.max_served {policy.max_served} serves groups again, and every reuse is recorded in the "
                "ledger: this server runs with ledger off (leave reuse out, or set max_served 1)",
                loc=("body", "reuse", "max_served"),
            )

    async def register_trainer(self, reg: Registration) -> int:
        self._check_reuse(reg.reuse)

        def txn_fn(txn: Txn) -> None:
            run = state.load(txn, self._run)
            if run.registration is None:
                state.save_run(txn, reg, started=False)
                state.save_step(txn, reg.starting_step)
                state.save_kept(txn, Kept(reg.starting_step))
                return
            if run.registration != reg:
                before = run.registration.model_dump()
                changed = sorted(k for k, v in reg.model_dump().items() if before.get(k) != v)
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
        refused = self.ingest.refused  # counted, not written yet: the views show them all the same
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
        self.ingest.reset()
        self._run = None

    # ----------------------------------------------------------------------------- envs

    async def register_env(self, reg: RegisterEnv, caller: Actor = ANYONE) -> EnvRegistered | None:
        """None while the trainer has not asked for its first batch (envs are told to wait)."""
        self._check_reuse(reg.reuse)

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
            if reg.reuse is not None and (beyond := beyond_trainer(run.registration.reuse, reg.reuse)) is not None:
                field, why = beyond
                raise Conflict(
                    f"reuse.{why}: an env may reuse less than the trainer allows, or opt out, never more",
                    loc=("body", "reuse", field),
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
                max_token_staleness=reg.max_token_staleness,
                reuse=None if reg.reuse is None else reg.reuse.model_dump(),
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

    async def close(self) -> None:
        """Stop the background jobs, and write what is counted in memory (refusals) before the store closes."""
        await self.jobs.close()
        await self.ingest.close()

    # ----------------------------------------------------------------------------- status

    async def status(self) -> Status:
        self.jobs.ask(SWEEP)
        now = time.time()
        status, seen, finished = await self.store.read(
            lambda txn: (
                status_txn(txn, self._run),
                report_txn(txn, now, self.producers.settings, self._run),
                self._finished(txn, now),
            )
        )
        seen = self.producers.graced(seen, now)
        status = status.model_copy(
            update={
                "weights_step": seen.weights_step,
                "producers": seen.producers,
                "finished": finished,
                "stall_reason": None if finished else seen.stall_reason,
            }
        )
        if self.blobs is not None:
            status = status.model_copy(update={"blobs": self.blobs.stats.status()})
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

    async def metrics(self, max_envs: int, max_producers: int, max_datasets: int) -> bytes:
        """GET /metrics: the Prometheus exposition of the run's counters and gauges, the ledger's drop bias, the
        producers, the datasets and the open groups, with this process's timings."""
        snap = await self.snapshot()
        body = views_metrics.render(
            snap, await self.ledger.drop_bias(), await self.producers.report(), max_envs, max_producers
        )
        body += task_metrics.render(await self.tasks.datasets(), max_datasets)
        rollouts = await self.rollouts.totals()
        self.rollouts.in_use(rollouts.get("open", 0))
        blobs = blob_metrics.render(None if self.blobs is None else self.blobs.stats)
        return body + rollout_metrics.render(rollouts) + blobs

    async def dashboard_data(self, max_envs: int, max_producers: int, max_datasets: int) -> dict[str, Any]:
        """GET /dashboard/data: one consistent snapshot of the buffer, per env for at most `max_envs` envs (the rest
        summed, as /metrics does)."""
        snap = await self.snapshot(max_envs)
        rollouts = await self.rollouts.open_groups()
        return dashboard_body(
            snap,
            await self.ledger.drop_bias(),
            await self.producers.report(),
            max_envs,
            await self.tasks.datasets(),
            rollouts,
            max_datasets=max_datasets,
            max_producers=max_producers,
        )

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
