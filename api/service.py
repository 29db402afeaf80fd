"""The buffer's operations, each one store transaction: registration, ingest, batch formation, status.

Decisions come from the pure modules (`validation`, `filters`, `batcher`); this module reads the state they
need from a `Txn`, calls them, and writes back what they decided. Every check that can fail runs before
the first write, so a rejected request leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgpack

from api import state, stats
from api.batcher import BatchSpec, EnvWindow, NoBatch, Plan, plan_batch, scale_shares, take_window
from api.errors import Conflict, Gone, InvalidData, Loc, NotFound, Unavailable
from api.filters import STALE, filter_reason, release_from_buffer
from api.idempotency import content_digest, remember, same_content
from api.json_groups import JsonGroup
from api.logs import request_env
from api.metrics import FORMATION_SECONDS
from api.records import GroupRecord, encode, msgpack_array_header
from api.schema import (
    EnvRegistered,
    EnvStatus,
    Info,
    RegisterEnv,
    Registration,
    ScoredReply,
    Status,
)
from api.state import EnvRecord, RunState
from api.store.base import ANON_ENV, BufferedGroup, ItemMeta, QueueCounts, QueuedItem, Store, Txn
from api.validation import GroupLimits, check_policy_step, pack_group

log = logging.getLogger("rollbuf")

MIN_ENV_WEIGHT = 0.01
"""Floor of `env_weight` in /status-env, as in Atropos: no env is told to stop producing entirely."""
ANON_NAME = "(no env_id)"


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """Backpressure: beyond these, submissions get 503 + Retry-After and nothing is stored."""

    max_groups: int | None = None
    max_tokens: int | None = None
    max_env_groups: int | None = None
    max_env_tokens: int | None = None
    max_group_seqs: int = 4096
    retry_after: float = 2.0


class QueueFull(Unavailable):
    """A queue limit refused a submission (counted as backpressure per env, in its own transaction)."""


class StaleRun(Exception):
    """What a submission was validated against no longer holds in the store (the trainer re-registered, the
    data was reset, the step moved under a group stamped with it): validate it again against `run`."""

    def __init__(self, run: RunState) -> None:
        super().__init__("the run changed since this submission was validated")
        self.run = run


VALIDATION_ROUNDS = 3
"""Times a submission is validated against a newer run state before the client is asked to send it again."""


@dataclass(frozen=True, slots=True)
class Submission:
    """One validated group on its way into the store."""

    env_id: int | None
    record: GroupRecord
    payload: bytes
    key: str | None
    """Idempotency key: the group id (scoped by env) or the request's Idempotency-Key."""
    digest: str | None = None
    """Digest of the content as sent (`api.idempotency`), with a key: a reused key with other content is a 409."""
    loc: tuple[str | int, ...] = ("body",)
    """Where the group is in its request (`("body", 3)` in a list): errors found in the transaction name it."""
    sent_policy_step: int | None = None
    """`policy_step` as sent; None: stamped with the step the group was validated at."""

    @property
    def where(self) -> str:
        """How a 409 names this group: "the group", or "body[3]" in a list."""
        return f"body[{self.loc[1]}]" if len(self.loc) > 1 else "the group"

    @classmethod
    def of(
        cls, record: GroupRecord, payload: bytes, key: str | None, sent_policy_step: int | None, loc: Loc
    ) -> Submission:
        digest = None if key is None else content_digest(record, sent_policy_step)
        return cls(record.env_id, record, payload, key, digest, tuple(loc), sent_policy_step)


@dataclass(frozen=True, slots=True)
class Formation:
    """How a batch was just formed (absent when a kept batch is served again): for the log and the metrics."""

    seqs_by_env: dict[str, int]
    seconds: float


HEADER_MAX = 32
"""Longest `FormedBatch` header: a msgpack array of three ints (1 + 3 * 9 bytes)."""


@dataclass(frozen=True, slots=True)
class FormedBatch:
    """A batch, held as the bytes the store keeps: formed, stored and served with one copy of the payloads."""

    step: int
    """The step this batch moved the run from."""
    n_groups: int
    seqs: int
    tokens: int
    stored: bytes
    """A small msgpack header (groups, sequences, tokens), then `records`: what `Txn.get_batch` returns."""
    offset: int
    """Where `records` starts in `stored`."""
    formation: Formation | None = None

    @property
    def records(self) -> memoryview:
        """A msgpack array of group records (docs/binary-format.md), a view into `stored` (no copy)."""
        return memoryview(self.stored)[self.offset :]

    @classmethod
    def build(cls, step: int, n_groups: int, seqs: int, tokens: int, payloads: list[bytes]) -> FormedBatch:
        header = msgpack.packb([n_groups, seqs, tokens])
        stored = b"".join([header, msgpack_array_header(n_groups), *payloads])
        return cls(step, n_groups, seqs, tokens, stored, len(header))

    def prefix(self) -> bytes:
        """What precedes the group payloads in `stored`: the header and the records' array header (`Txn.put_batch`)."""
        return self.stored[: self.offset + len(msgpack_array_header(self.n_groups))]

    @classmethod
    def unpack(cls, step: int, data: bytes) -> FormedBatch:
        unpacker = msgpack.Unpacker()
        unpacker.feed(data[:HEADER_MAX])  # only the header: feeding all of a large batch copied it twice
        n_groups, seqs, tokens = unpacker.unpack()
        return cls(step, n_groups, seqs, tokens, data, unpacker.tell())


@dataclass(slots=True)
class BatchWaiting:
    reason: str | None = None
    blocked: bool = False
    not_registered: bool = False


@dataclass(slots=True)
class Service:
    store: Store
    limits: QueueLimits = field(default_factory=QueueLimits)
    latest: GroupRecord | None = None
    """The last group queued by this process (GET /latest_example is a debugging aid, not state)."""
    _run: RunState | None = None
    """The run state this process's last transaction saw: submissions are validated against it without a read
    of their own, and their transaction checks that it still holds (`ingest`)."""
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.store.subscribe(self._notify)  # data queued through another process sharing the store

    def data_changed(self) -> asyncio.Event:
        """An event set the next time this process queues data (long-polling trainers wait on it)."""
        return self._changed

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # ----------------------------------------------------------------------------- trainer

    async def register_trainer(self, reg: Registration) -> int:
        def txn_fn(txn: Txn) -> None:
            run = state.load(txn)
            if run.registration is None:
                state.save_run(txn, reg, started=False)
                state.save_step(txn, reg.starting_step)
                return
            if run.registration != reg:
                changed = sorted(k for k, v in reg.model_dump().items() if getattr(run.registration, k) != v)
                raise Conflict(
                    f"a trainer is already registered with a different configuration ({', '.join(changed)}); "
                    "GET /reset_data first to start a new run",
                    loc=("body", changed[0]) if changed else ("body",),
                )

        await self.store.transact(txn_fn)
        return secrets.randbits(128)

    async def ping(self) -> None:
        """One read transaction: raises when the store does not answer (/readyz)."""
        await self.store.transact(lambda txn: txn.get_value(state.STEP_KEY))

    async def snapshot(self) -> stats.Snapshot:
        """Everything the operator's views show (/metrics, /dashboard, W&B), read in one transaction."""
        return await self.store.read(lambda txn: stats.snapshot(txn, ANON_NAME))

    async def run_state(self) -> RunState:
        run = await self.store.read(state.load)
        self._run = run
        return run

    async def info(self) -> Info:
        run = await self.run_state()
        if run.registration is None:
            return Info(batch_size=-1, max_token_len=-1)
        return Info(batch_size=run.registration.batch_size, max_token_len=run.registration.max_token_len)

    async def reset(self) -> None:
        await self.store.transact(lambda txn: txn.clear())
        self.latest = None
        self._run = None

    # ----------------------------------------------------------------------------- envs

    async def register_env(self, reg: RegisterEnv) -> EnvRegistered | None:
        """None while the trainer has not asked for its first batch (envs are told to wait)."""

        def txn_fn(txn: Txn) -> EnvRegistered | None:
            run = state.load(txn)
            if run.registration is None or not run.started:
                return None
            batch_size = run.registration.batch_size
            if reg.group_size > batch_size:
                raise InvalidData(
                    ("body", "group_size"),
                    f"group_size {reg.group_size} exceeds the trainer's batch_size {batch_size}: "
                    "a group is never split, so it could never be served",
                )
            same_name = sum(1 for e in run.envs if e.desired_name == reg.desired_name)
            env = EnvRecord(
                env_id=len(run.envs),
                desired_name=reg.desired_name,
                wandb_name=f"{reg.desired_name}_{same_name}",
                weight=reg.weight,
                group_size=reg.group_size,
                max_token_length=reg.max_token_length,
                min_batch_allocation=reg.min_batch_allocation,
            )
            state.save_envs(txn, [*run.envs, env])
            warning = None
            if run.registration.max_batch_tokens is None and batch_size % reg.group_size:
                warning = (
                    f"group_size {reg.group_size} does not divide batch_size {batch_size}: batches can be filled "
                    "exactly only together with other environments' groups"
                )
            return EnvRegistered(
                env_id=env.env_id,
                wandb_name=env.wandb_name,
                checkpoint_dir=run.registration.checkpoint_dir,
                starting_step=run.step,
                checkpoint_interval=run.registration.save_checkpoint_interval,
                num_steps=run.registration.num_steps,
                warning=warning,
            )

        return await self.store.transact(txn_fn)

    async def disconnect_env(self, env_id: int) -> str | None:
        """None on success, else why not (Atropos answers failures in-band)."""

        def txn_fn(txn: Txn) -> str | None:
            run = state.load(txn)
            env = run.env(env_id)
            if env is None:
                return f"no environment with env_id {env_id}"
            env.connected = False
            state.save_envs(txn, run.envs)
            return None

        return await self.store.transact(txn_fn)

    async def env_status(self, env_id: int) -> EnvStatus:
        def txn_fn(txn: Txn) -> EnvStatus:
            run = state.load(txn)
            env = run.env(env_id)
            if env is None:
                raise NotFound(f"no environment with env_id {env_id}")
            return env_status(run, env, txn.counts(), self.limits)

        return await self.store.read(txn_fn)

    # ----------------------------------------------------------------------------- ingest

    def limits_for(self, run: RunState) -> GroupLimits:
        assert run.registration is not None
        return GroupLimits(
            max_token_len=run.registration.max_token_len,
            max_group_seqs=min(run.registration.batch_size, self.limits.max_group_seqs),
            max_group_tokens=run.registration.max_batch_tokens,
        )

    def ingest_limits(self, run: RunState) -> GroupLimits:
        """What one group may hold in this run; 503 before a trainer registered (handlers retry 5xx)."""
        if run.registration is None:
            raise Unavailable("no trainer has registered yet: POST /register first", self.limits.retry_after)
        return self.limits_for(run)

    async def ingest(self, validate: Callable[[RunState], Awaitable[list[Submission]]]) -> list[ScoredReply]:
        """Validate a request's groups (`validate`) and store them all-or-nothing.

        They are validated against the run state this process saw last, not a fresh read: one store round trip
        less per request, which is what a shared database charges most for. The transaction checks that what
        validation relied on still holds, and if not (another process changed the run), they are validated
        again against the state it found. A request refused against a remembered state is validated once more
        against a fresh read before the refusal stands (an env registered through another process since)."""
        run, remembered = (self._run, True) if self._run is not None else (await self.run_state(), False)
        for _ in range(VALIDATION_ROUNDS):
            try:
                subs = await validate(run)
            except (InvalidData, Unavailable):
                if not remembered:
                    raise
                fresh = await self.run_state()
                if fresh == run:
                    raise
                run, remembered = fresh, False
                continue
            try:
                return await self.store_submissions(subs, run)
            except StaleRun as stale:
                run, remembered = stale.run, False
        raise Unavailable("the run kept changing while this request was validated; send it again", 0)

    async def submit(
        self, groups: Sequence[JsonGroup], run: RunState, idempotency_key: str | None = None
    ) -> list[ScoredReply]:
        """Validate, pack and store groups all-or-nothing (`prepare`, then `store_submissions`)."""
        return await self.store_submissions(self.prepare(groups, run, idempotency_key), run)

    def prepare(
        self, groups: Sequence[JsonGroup], run: RunState, idempotency_key: str | None = None
    ) -> list[Submission]:
        """Validate and pack JSON groups. Synchronous and touching no store, so the route can run it in a
        worker thread for a large body. `run` is a recent snapshot; the transaction re-checks that the run
        it was validated against is still the one in the store, and the policy steps against its step."""
        limits = self.ingest_limits(run)
        subs: list[Submission] = []
        for i, group in enumerate(groups):
            sd = group.data
            loc: tuple[str | int, ...] = ("body", i) if idempotency_key is None and len(groups) > 1 else ("body",)
            env = None if sd.env_id is None else run.env(sd.env_id)
            request_env.set(ANON_NAME if sd.env_id is None else env.wandb_name if env else f"env_id {sd.env_id}")
            if sd.env_id is not None and env is None:
                raise InvalidData((*loc, "env_id"), f"no environment with env_id {sd.env_id} is registered")
            try:
                record = pack_group(sd, env_id=sd.env_id, current_step=run.step, limits=limits, columns=group.columns)
            except InvalidData as exc:
                raise exc.at(*loc) from None
            key = idempotency_key or group_key(sd.env_id, sd.group_id)
            subs.append(Submission.of(record, encode(record), key, sd.policy_step, loc))
        return subs

    async def store_submissions(self, subs: Sequence[Submission], run: RunState) -> list[ScoredReply]:
        """Store groups validated against `run` all-or-nothing (the JSON and binary paths both end here);
        `StaleRun` if the store's run state no longer agrees with `run` on what validation used."""
        try:
            replies, self._run = await self.store.transact(
                lambda txn: self._submit_txn(txn, subs, run), replies=[s.key for s in subs if s.key]
            )
        except StaleRun as stale:
            self._run = stale.run
            raise
        except QueueFull:
            names = {_env_name(run, s.env_id) for s in subs}
            request_env.set(",".join(sorted(names)))
            await self.store.transact(lambda txn: stats.count_backpressure(txn, names))
            raise
        if subs:
            self.latest = subs[-1].record
            self._notify()
        return replies

    def _submit_txn(
        self, txn: Txn, subs: Sequence[Submission], seen_run: RunState
    ) -> tuple[list[ScoredReply], RunState]:
        run = state.load(txn)
        if not _still_valid(subs, seen_run, run):
            raise StaleRun(run)
        for sub in subs:  # against the step now, not the snapshot's: it may have moved since
            try:
                check_policy_step(sub.sent_policy_step, run.step)
            except InvalidData as exc:
                raise exc.at(*sub.loc) from None
        counts = txn.counts()
        replies: list[ScoredReply | None] = []
        fresh: list[tuple[int, Submission]] = []
        first_in_request: dict[str, int] = {}  # a key used twice in one list: the later one repeats the first
        repeats: list[tuple[int, int]] = []
        for i, sub in enumerate(subs):
            old = txn.get_reply(sub.key) if sub.key else None
            if sub.key is not None and old is not None:
                if not same_content(old, sub.digest):
                    raise Conflict(reused_key_message(sub))
                replies.append(ScoredReply.model_validate_json(old).model_copy(update={"duplicate": True}))
            elif sub.key is not None and sub.key in first_in_request:
                first = first_in_request[sub.key]
                if subs[first].digest != sub.digest:
                    raise Conflict(reused_key_message(sub, earlier=subs[first].where))
                replies.append(None)
                repeats.append((i, first))
            else:
                replies.append(None)
                fresh.append((i, sub))
                if sub.key is not None:
                    first_in_request[sub.key] = i
        self._check_capacity(counts, [s for _, s in fresh])
        reg = run.registration
        assert reg is not None
        received: dict[str, int] = {}
        for i, sub in fresh:
            env_id = ANON_ENV if sub.env_id is None else sub.env_id
            env = run.env(env_id)
            name = env.wandb_name if env else ANON_NAME
            received[name] = received.get(name, 0) + 1
            step = sub.record.policy_step
            reason = filter_reason(sub.record.scores, reg)
            if reason is not None:
                state.count_dropped(txn, name, reason)
                reply = ScoredReply(status="received")
            elif env is not None and sub.record.seqs != env.group_size:
                reply = self._buffer(txn, env, sub, step)
            else:
                self._enqueue(txn, env_id, sub.record.seqs, sub.record.n_tokens, step, sub.payload)
                reply = ScoredReply(status="received")
            if sub.key:
                txn.put_reply(sub.key, remember(reply.model_dump_json(exclude_none=True), sub.digest))
            replies[i] = reply
        for i, first in repeats:
            first_reply = replies[first]
            assert first_reply is not None
            replies[i] = first_reply.model_copy(update={"duplicate": True})
        stats.count_received(txn, received)
        return [r for r in replies if r is not None], run

    def _check_capacity(self, counts: dict[int, QueueCounts], subs: Sequence[Submission]) -> None:
        lim = self.limits
        if not subs or not (lim.max_groups or lim.max_tokens or lim.max_env_groups or lim.max_env_tokens):
            return
        total = sum(counts.values(), QueueCounts())
        add_groups = len(subs)
        add_tokens = sum(s.record.n_tokens for s in subs)
        full = None
        if lim.max_groups is not None and total.groups + add_groups > lim.max_groups:
            full = f"the queue holds {total.groups} groups; the limit is {lim.max_groups}"
        elif lim.max_tokens is not None and total.tokens + add_tokens > lim.max_tokens:
            full = f"the queue holds {total.tokens} tokens; the limit is {lim.max_tokens}"
        else:
            per_env: dict[int, QueueCounts] = {}
            for s in subs:
                env_id = ANON_ENV if s.env_id is None else s.env_id
                per_env[env_id] = per_env.get(env_id, QueueCounts()) + QueueCounts(
                    1, 1, s.record.seqs, s.record.n_tokens
                )
            for env_id, add in per_env.items():
                have = counts.get(env_id, QueueCounts())
                if lim.max_env_groups is not None and have.groups + add.groups > lim.max_env_groups:
                    full = f"env {env_id} has {have.groups} groups queued; the limit is {lim.max_env_groups}"
                elif lim.max_env_tokens is not None and have.tokens + add.tokens > lim.max_env_tokens:
                    full = f"env {env_id} has {have.tokens} tokens queued; the limit is {lim.max_env_tokens}"
        if full:
            raise QueueFull(f"queue full: {full}; retry later", lim.retry_after)

    @staticmethod
    def _enqueue(txn: Txn, env_id: int, seqs: int, tokens: int, step: int, payload: bytes) -> None:
        meta = ItemMeta(item_id=txn.next_item_id(), seqs=seqs, tokens=tokens, policy_step=step)
        txn.append(env_id, QueuedItem(meta=meta, n_groups=1, payload=payload))

    def _buffer(self, txn: Txn, env: EnvRecord, sub: Submission, step: int) -> ScoredReply:
        buffer = [*txn.get_buffer(env.env_id), BufferedGroup(sub.record.seqs, sub.record.n_tokens, step, sub.payload)]
        picked = release_from_buffer([g.seqs for g in buffer], env.group_size)
        if picked:
            for i in picked:
                g = buffer[i]
                self._enqueue(txn, env.env_id, g.seqs, g.tokens, g.policy_step, g.payload)
            buffer = [g for i, g in enumerate(buffer) if i not in set(picked)]
        txn.set_buffer(env.env_id, buffer)
        return ScoredReply(status="buffered", buffer_size=sum(g.seqs for g in buffer))

    # ----------------------------------------------------------------------------- batches

    async def next_batch(self, step: int | None = None) -> FormedBatch | BatchWaiting:
        """Batch `step`, forming it if it is the next one; without `step`, form the next batch (Atropos).

        With `step`, batch N stays available until batch N+1 is asked for, so a trainer that retries or
        restarts gets the same batch again: nothing skipped, nothing trained twice. The first call of either
        kind marks the run as started (environments may register from then on).
        """
        result = await self.store.transact(lambda txn: self._batch_txn(txn, step))
        if isinstance(result, FormedBatch) and result.formation is not None:
            formed = result.formation
            FORMATION_SECONDS.observe(formed.seconds)
            mix = " ".join(f"{name}={n}" for name, n in formed.seqs_by_env.items())
            log.info(
                "batch step=%d groups=%d sequences=%d tokens=%d mix=[%s] formation_ms=%.2f",
                result.step, result.n_groups, result.seqs, result.tokens, mix, formed.seconds * 1000,
            )  # fmt: skip
        return result

    def _batch_txn(self, txn: Txn, step: int | None) -> FormedBatch | BatchWaiting:
        run = state.load(txn)
        reg = run.registration
        if reg is None:
            return BatchWaiting(not_registered=True)
        if not run.started:
            state.save_run(txn, reg, started=True)
        if step is None:
            return self._form(txn, run, keep=False)
        if step > run.step:
            raise Conflict(
                f"batch {step} cannot be formed yet: the next batch to form is {run.step}", loc=("query", "step")
            )
        txn.drop_batches_before(step)  # asking for N acknowledges every batch before it
        if step < run.step:
            stored = txn.get_batch(step)
            if stored is None:
                raise Gone(
                    f"batch {step} is no longer available: a later batch was asked for, or it was "
                    "handed out without ?step=",
                    loc=("query", "step"),
                )
            return FormedBatch.unpack(step, stored)
        return self._form(txn, run, keep=True)

    def _form(self, txn: Txn, run: RunState, *, keep: bool) -> FormedBatch | BatchWaiting:
        start = time.perf_counter()
        reg = run.registration
        assert reg is not None
        spec = BatchSpec(reg.batch_size, reg.max_batch_tokens, reg.min_batch_fill)
        min_step = None if reg.max_staleness is None else run.step - reg.max_staleness
        connected_shares = scale_shares({e.env_id: e.min_batch_allocation for e in run.envs if e.connected})
        windows: list[EnvWindow] = []
        env_ids = [ANON_ENV, *(e.env_id for e in run.envs)]
        counts = txn.counts()
        for env_id in env_ids:
            env = run.env(env_id)
            share = connected_shares.get(env_id, 0.0)
            if counts.get(env_id, QueueCounts()).items == 0 and share == 0.0:
                continue
            win = take_window(txn.head(env_id), min_step=min_step, max_seqs=spec.batch_size, max_tokens=spec.max_tokens)
            name = env.wandb_name if env else ANON_NAME
            if win.stale:
                txn.pop(env_id, [m.item_id for m in win.stale])
                state.count_dropped(txn, name, STALE, len(win.stale))
            windows.append(EnvWindow(env_id, name, env.weight if env else 1.0, share, win.items))
        plan = plan_batch(windows, spec, state.load_credits(txn))
        if isinstance(plan, NoBatch):
            state.save_blocked(txn, plan.reason if plan.blocked else None)
            return BatchWaiting(reason=plan.reason, blocked=plan.blocked)
        batch, seqs_by_env = self._apply(txn, run, plan, keep)
        return dataclasses.replace(batch, formation=Formation(seqs_by_env, time.perf_counter() - start))

    @staticmethod
    def _apply(txn: Txn, run: RunState, plan: Plan, keep: bool) -> tuple[FormedBatch, dict[str, int]]:
        """Pop the planned items and advance the step; with `keep`, the store keeps the batch by reference to
        the popped payloads (no copy of them), until a later step is asked for. Also returns the sequences
        taken per env."""
        payloads: list[bytes] = []
        order: list[int] = []
        n_groups = 0
        groups_by_env: dict[str, int] = {}
        seqs_by_env: dict[str, int] = {}
        staleness: dict[int, int] = {}
        for env_id, item_ids in plan.take.items():
            name = _env_name(run, env_id)
            for item in txn.pop(env_id, item_ids, keep_for=run.step if keep else None):
                payloads.append(item.payload)
                order.append(item.meta.item_id)
                n_groups += item.n_groups
                groups_by_env[name] = groups_by_env.get(name, 0) + item.n_groups
                seqs_by_env[name] = seqs_by_env.get(name, 0) + item.meta.seqs
                age = run.step - item.meta.policy_step
                staleness[age] = staleness.get(age, 0) + item.n_groups
        stats.count_batch(txn, groups_by_env, seqs_by_env, staleness)
        state.save_credits(txn, plan.credits)
        state.save_blocked(txn, None)
        state.save_step(txn, run.step + 1)
        batch = FormedBatch.build(run.step, n_groups, plan.seqs, plan.tokens, payloads)
        if keep:
            txn.put_batch(batch.step, batch.prefix(), order)
        return batch, seqs_by_env

    # ----------------------------------------------------------------------------- status

    async def status(self) -> Status:
        def txn_fn(txn: Txn) -> Status:
            run = state.load(txn)
            total = sum(txn.counts().values(), QueueCounts())
            return Status(
                current_step=run.step if run.registration else 0,
                queue_size=total.groups,
                queued_sequences=total.seqs,
                queued_tokens=total.tokens,
                blocked_reason=state.load_blocked(txn),
                dropped=state.load_dropped(txn),
            )

        return await self.store.read(txn_fn)


def _still_valid(subs: Sequence[Submission], seen: RunState, run: RunState) -> bool:
    """Whether what validating `subs` against `seen` relied on holds in `run`: the trainer's registration (the
    limits), every env named, and the step stamped on groups that sent no `policy_step`."""
    if run.registration != seen.registration:
        return False
    for sub in subs:
        if sub.env_id is not None and run.env(sub.env_id) is None:
            return False
        if sub.sent_policy_step is None and run.step != seen.step:
            return False
    return True


def group_key(env_id: int | None, group_id: str | None) -> str | None:
    """The idempotency key of a group id: ids are scoped by env."""
    return f"g:{env_id}:{group_id}" if group_id else None


def reused_key_message(sub: Submission, earlier: str | None = None) -> str:
    assert sub.key is not None
    kind, _, rest = sub.key.partition(":")
    if kind == "k":
        what = f"Idempotency-Key {rest!r}"
    else:
        env, _, gid = rest.partition(":")
        what = f"group_id {gid!r}" + ("" if env == "None" else f" of env_id {env}")
    before = f"by {earlier} of this request" if earlier else "before"
    return (
        f"{sub.where}: {what} was used {before} for a group with different content; nothing was stored. "
        "A group id names one group: send a new group under a new id (the same group again is acknowledged "
        "as a duplicate)."
    )


def _env_name(run: RunState, env_id: int | None) -> str:
    env = None if env_id is None else run.env(env_id)
    return env.wandb_name if env else ANON_NAME


def env_status(run: RunState, env: EnvRecord, counts: dict[int, QueueCounts], limits: QueueLimits) -> EnvStatus:
    """/status-env as Atropos computes it, from per-env counts instead of a scan of the queue."""
    connected = [e for e in run.envs if e.connected]
    total_weight = sum(e.max_token_length * max(0.0, e.weight) for e in connected)
    weight = env.max_token_length * env.weight / total_weight if total_weight > 0 else 1.0
    min_total = sum(e.min_batch_allocation or 0.0 for e in connected)
    batch_size = run.registration.batch_size if run.registration else 0
    group_size = max(1, env.group_size)
    self_seqs = counts.get(env.env_id, QueueCounts()).seqs
    others = 0
    for env_id, c in counts.items():
        if env_id == env.env_id:
            continue
        other = run.env(env_id)
        reserved = int(batch_size * (other.min_batch_allocation or 0.0)) if other and other.connected else 0
        others += max(0, c.seqs - reserved)
    sizes = [e.group_size for e in run.envs if counts.get(e.env_id, QueueCounts()).items]
    capacity = _capacity_groups(counts, env, limits)
    return EnvStatus(
        current_step=run.step,
        queue_size=(self_seqs + others) // group_size,
        unallocated_fraction=max(0.0, 1.0 - min_total),
        self_queue_size=self_seqs // group_size,
        max_group_size=max([1, *sizes]),
        env_weight=max(MIN_ENV_WEIGHT, weight),
        queue_capacity_groups=capacity,
    )


def _capacity_groups(counts: dict[int, QueueCounts], env: EnvRecord, limits: QueueLimits) -> int | None:
    total = sum(counts.values(), QueueCounts())
    mine = counts.get(env.env_id, QueueCounts())
    room: list[int] = []
    if limits.max_groups is not None:
        room.append(limits.max_groups - total.groups)
    if limits.max_env_groups is not None:
        room.append(limits.max_env_groups - mine.groups)
    # Tokens a group of this env takes: its queued average, or before it has any, the most it could take.
    avg_tokens = mine.tokens / mine.groups if mine.groups else env.group_size * env.max_token_length
    if avg_tokens > 0:
        if limits.max_tokens is not None:
            room.append(math.floor((limits.max_tokens - total.tokens) / avg_tokens))
        if limits.max_env_tokens is not None:
            room.append(math.floor((limits.max_env_tokens - mine.tokens) / avg_tokens))
    return max(0, min(room)) if room else None
