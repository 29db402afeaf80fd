"""A task source that leases its tasks from rollbuf (docs/tasks.md): usable wherever `Tasks(...)` is, so that many
producers on many hosts share one dataset and each task is rolled out once per epoch.

Tasks are leased a few at a time (`batch`) and heartbeated while held; each task's group is sent with its lease
token as `group_id` (the runner does so for tasks that carry one), which is its submission. A task whose rollout
failed is reported failed with the producer's reason (the dataset's retry policy decides whether it is offered
again); one that was never tried to its end (the run stopped, a pause ran out of time, its group was restarted
or could not be sent) is handed back untried, to the front, without using a retry: a producer that stops
gracefully costs the dataset nothing. Leases of a producer that dies expire on the server and go back to the
front.

A lease is lost when a heartbeat answers null for it (it expired and went to another producer) or when its
expiry passes without a successful heartbeat (a producer frozen or cut off for longer than the lease): its task
may be another producer's now, so its group must not be sent (it would be trained twice). The source counts
such a lease once in `lost`, logs it, and tells the runner (`on_lost`), which drops the group. The runner awaits
`anext_task`: a source that has nothing now waits for more (the epoch's last tasks are out) and ends only when
the dataset is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import httpx

from api.wire.tasks import REASON_MAX, LeasedTask, LeaseReply, TaskHeartbeatReply
from client_core.config import DEFAULT_TIMEOUT, DEFAULT_URL, RETRY_DEADLINE_S, auth_headers
from client_core.retry import post_retrying
from rollout_client.env import Task

log = logging.getLogger("rollout_client.leased_tasks")

LEASE_KEY = "rollbuf_lease"
"""`Task.meta` key holding the lease token: the runner sends the task's group under it as `group_id`."""


def default_task(lease: LeasedTask, dataset: str) -> Task:
    """A registered task as a `Task`: a string is its prompt; an object gives `prompt`, `answer`, `id` and keeps
    the rest as meta."""
    body = lease.task
    meta: dict[str, Any] = {LEASE_KEY: lease.token, "epoch": lease.epoch, "index": lease.index}
    if isinstance(body, dict):
        rest = {k: v for k, v in body.items() if k not in ("prompt", "answer", "id")}
        tid = str(body.get("id", f"{dataset}:{lease.index}"))
        return Task(tid, str(body.get("prompt", "")), body.get("answer"), {**rest, **meta})
    return Task(f"{dataset}:{lease.index}", body if isinstance(body, str) else str(body), None, meta)


def lease_token(task: Task) -> str | None:
    """The lease token a task was handed out under, if it was leased from rollbuf."""
    token = task.meta.get(LEASE_KEY) if isinstance(task.meta, dict) else None
    return token if isinstance(token, str) else None


def bounded_reason(reason: str) -> str:
    """`reason` cut to what the server stores (`TaskFailure.reason`, REASON_MAX characters): a long error (a
    traceback in a message) still fails its task instead of being refused with a 422, leaving the lease to
    expire and the task to be retried for free."""
    if len(reason) <= REASON_MAX:
        return reason
    return reason[: REASON_MAX - 1] + "\u2026"


class Deadlines:
    """When each held lease ends, on this process's monotonic clock: a lease whose end passed without a
    successful heartbeat is lost, whatever the server says later (another producer may hold its task by then).

    The server's `expires_at` is wall-clock time; it is turned into monotonic time when the reply is read, so a
    frozen process (SIGSTOP, a suspended VM) finds its leases past their end on waking, with no heartbeat sent.
    Pure bookkeeping; the clocks are the caller's."""

    def __init__(self) -> None:
        self.ends: dict[str, float] = {}
        """Token -> the monotonic time its lease ends unless heartbeated."""

    def __contains__(self, token: object) -> bool:
        return token in self.ends

    def __len__(self) -> int:
        return len(self.ends)

    def tokens(self) -> list[str]:
        return sorted(self.ends)

    def extend(self, token: str, expires_at: float, wall: float, mono: float) -> None:
        """The server says `token`'s lease ends at `expires_at` (its wall clock); `wall` and `mono` are this
        process's clocks read at the same moment, after the reply came."""
        self.ends[token] = mono + (expires_at - wall)

    def drop(self, token: str) -> bool:
        """Forget `token` (submitted, given up or lost); whether it was held."""
        return self.ends.pop(token, None) is not None

    def lapsed(self, mono: float) -> list[str]:
        """The held leases whose end is past at `mono`, forgotten: lost."""
        out = [t for t, end in self.ends.items() if end <= mono]
        for token in out:
            del self.ends[token]
        return out


class LeasedTasks:
    """Tasks of rollbuf dataset `dataset`, leased `batch` at a time and heartbeated every `heartbeat_s` (a third
    of the lease by default, from the first reply).

    The runner tells it how each task's group ended: `report` (acknowledged), `fail(task, reason)` (the rollout
    failed), `hand_back(task)` (never tried to its end); `discard(task)` fails it with a generic reason, for
    callers that cannot say why. `holds(task)` is False once its lease is lost; `on_lost(callback)` hears each
    lost lease's token as it is found."""

    def __init__(
        self,
        dataset: str,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        producer_id: str | None = None,
        batch: int = 4,
        poll_s: float = 0.5,
        heartbeat_s: float | None = None,
        to_task: Callable[[LeasedTask, str], Task] = default_task,
        retry_deadline: float = RETRY_DEADLINE_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.dataset = dataset
        self._producer_id = producer_id
        self.batch = batch
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.to_task = to_task
        self.retry_deadline = retry_deadline
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=auth_headers(api_key), timeout=DEFAULT_TIMEOUT, transport=transport
        )
        self._ready: deque[Task] = deque()
        self._held = Deadlines()
        """Tokens leased and not yet submitted, given up or lost: heartbeated, each with the end of its lease."""
        self._beats: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self._listeners: list[Callable[[str], None]] = []
        self._sending: set[str] = set()
        """Tokens whose group is on its way to the server (`sending`): its reply decides their fate."""
        self._unsure: set[str] = set()
        """Of those, tokens a heartbeat answered null for or whose end passed meanwhile: lost, unless the group
        was acknowledged (the heartbeat may have seen this very group's submission)."""
        self.done = False
        self.lost = 0
        """Leases lost: a heartbeat answered null (the task went to another producer), the lease's end passed
        without a successful heartbeat, or the server refused the group sent under it (`lose`). Their groups are
        not sent."""

    @property
    def producer_id(self) -> str:
        """The producer its leases are taken for, which the server binds each lease to: a group sent under a
        lease must name it (`producer_id`). As given, else the id of the runner that uses this source
        (`for_producer`), else this host and process; fixed from the first lease on."""
        if self._producer_id is None:
            self._producer_id = f"{socket.gethostname()}-{os.getpid()}-tasks"
        return self._producer_id

    def for_producer(self, producer_id: str) -> None:
        """Lease for `producer_id` (the runner's, which sends the groups and heartbeats under it) unless an id was
        given or leases were taken already."""
        if self._producer_id is None:
            self._producer_id = producer_id

    async def _call(self, path: str, body: dict[str, Any]) -> Any:
        return await post_retrying(self._http, path, body, self.retry_deadline)

    def next_task(self) -> Task | None:
        """The runner awaits `anext_task`; a blocking caller gets what is leased already, or None."""
        self._expire()
        while self._ready:
            task = self._ready.popleft()
            if self.holds(task):
                return task
        return None

    async def anext_task(self) -> Task | None:
        """The next leased task; waits while the dataset has none now; None once it is done. A task whose lease
        was lost before it started is skipped (counted in `lost`)."""
        while True:
            if (task := self.next_task()) is not None:
                return task
            if self.done:
                return None
            body = {"dataset": self.dataset, "producer_id": self.producer_id, "n": self.batch}
            reply = LeaseReply.model_validate(await self._call("/tasks/lease", body))
            wall, mono = time.time(), time.monotonic()
            for lease in reply.leases:
                self._held.extend(lease.token, lease.expires_at, wall, mono)
                self._ready.append(self.to_task(lease, self.dataset))
                if self.heartbeat_s is None:
                    self.heartbeat_s = max(0.05, (lease.expires_at - wall) / 3)
            if self._held and self._beats is None:
                self._beats = asyncio.create_task(self._heartbeats(), name=f"task-leases-{self.dataset}")
            if not reply.leases:
                self.done = reply.done
                if not self.done:
                    await asyncio.sleep(self.poll_s)

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call `callback(token)` for each lease found lost from now on (the runner cancels its group)."""
        self._listeners.append(callback)

    def holds(self, task: Task) -> bool:
        """Whether this producer still holds `task`'s lease (a task not leased from rollbuf: always): False once
        a heartbeat said it was lost or its end passed without one."""
        self._expire()
        token = lease_token(task)
        return token is None or token in self._held

    def sending(self, task: Task) -> bool:
        """The runner is about to send `task`'s group: whether it may (`holds`). From then on the server's reply
        decides: a heartbeat that answers null meanwhile may have seen this group's own submission, so the lease
        counts as lost only if the group is refused (`lose`)."""
        if not self.holds(task):
            return False
        if (token := lease_token(task)) is not None:
            self._sending.add(token)
        return True

    def _expire(self) -> None:
        """Leases whose end passed without a successful heartbeat are lost: handed back (untried) in case the
        server has not given them to anyone yet, so that their tasks go to the front at once."""
        for token in self._held.lapsed(time.monotonic()):
            if token in self._sending:
                self._unsure.add(token)  # its group's reply decides
                continue
            self._lost(token, "its lease ended without a successful heartbeat")
            self._end(token, None)

    def _lost(self, token: str, why: str) -> None:
        self.lost += 1
        log.warning("task lease %s lost (%s): its group is dropped", token, why)
        for callback in list(self._listeners):
            callback(token)

    def _settled(self, token: str) -> bool:
        """Its group's fate is known: forget that it was being sent; whether a heartbeat or the clock had said
        it was lost meanwhile."""
        self._sending.discard(token)
        unsure = token in self._unsure
        self._unsure.discard(token)
        return unsure

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s or 1.0)
            self._expire()  # first: a process that was frozen past its leases must not renew them now
            tokens = self._held.tokens()
            if not tokens:
                continue
            try:
                reply = TaskHeartbeatReply.model_validate(await self._call("/tasks/heartbeat", {"tokens": tokens}))
            except Exception as exc:  # the next beat tries again; a lease that ends meanwhile is lost
                log.warning("task lease heartbeat failed: %s", exc)
                continue
            wall, mono = time.time(), time.monotonic()
            for token, expires in reply.expires_at.items():
                if token not in self._held:
                    continue  # ended or lost while the heartbeat was on its way
                if expires is None:
                    self._held.drop(token)
                    if token in self._sending:
                        self._unsure.add(token)  # its group's reply decides
                    else:
                        self._lost(token, "the heartbeat says another producer has its task")
                else:
                    self._held.extend(token, expires, wall, mono)

    def report(self, task: Task, mean_score: float) -> None:
        """Its group was acknowledged: the server holds its fate now."""
        token = lease_token(task)
        if token is not None:
            self._held.drop(token)
            self._settled(token)

    def fail(self, task: Task, reason: str) -> None:
        """Its rollout failed (`reason`, the producer's own, cut to what the server stores): the lease ends as
        failed, and the dataset's retry policy decides whether the task is offered again."""
        self._give_up(task, bounded_reason(reason) or "failed")

    def hand_back(self, task: Task) -> None:
        """It was never tried to its end (the run stopped, a pause ran out of time, its group was restarted or
        not sent): the lease ends untried, its task back at the front without using a retry."""
        self._give_up(task, None)

    def discard(self, task: Task) -> None:
        """Its group ended without a score, for a reason the caller does not give: failed (`fail`)."""
        self._give_up(task, "no group: the rollout ended without one")

    def lose(self, task: Task) -> None:
        """The server refused its group because the lease is not this producer's any more (a 409): lost, not
        given up (the task is another producer's)."""
        token = lease_token(task)
        if token is None:
            return
        held = self._held.drop(token)
        if self._settled(token) or held:
            self._lost(token, "the server refused its group")

    def _give_up(self, task: Task, reason: str | None) -> None:
        token = lease_token(task)
        if token is None:
            return
        self._settled(token)
        if self._held.drop(token):
            self._end(token, reason)  # else submitted, or lost: nothing of it is this producer's to end

    def _end(self, token: str, reason: str | None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a blocking caller (`next_task` outside a loop): the lease expires on the server
            return
        job = loop.create_task(self._fail(token, reason))
        self._pending.add(job)
        job.add_done_callback(self._pending.discard)

    async def _fail(self, token: str, reason: str | None) -> None:
        try:
            await self._call("/tasks/fail", {"token": token, "reason": reason})
        except Exception as exc:  # the lease expires instead
            log.warning("could not end task lease %s: %s", token, exc)

    async def aclose(self) -> None:
        """Hand back the leases not started (to the front, not retries) and stop heartbeating."""
        untried = [t for t in (lease_token(task) for task in self._ready) if t is not None]
        self._ready.clear()
        for token in untried:
            if self._held.drop(token):
                await self._fail(token, None)
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        await self._http.aclose()
