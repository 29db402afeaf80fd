"""A task source that leases its tasks from rollbuf (docs/tasks.md): usable wherever `Tasks(...)` is, so that many
producers on many hosts share one dataset and each task is rolled out once per epoch.

Tasks are leased a few at a time (`batch`) and heartbeated while held; each task's group is sent with its lease
token as `group_id` (the runner does so for tasks that carry one), which is its submission. A group that ends
without a score is reported failed (the dataset's retry policy decides whether it is offered again); leases of a
producer that dies expire on the server and go back to the front. The runner awaits `anext_task`: a source that
has nothing now waits for more (the epoch's last tasks are out) and ends only when the dataset is done.
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

from api.wire.tasks import LeasedTask, LeaseReply, TaskHeartbeatReply
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


class LeasedTasks:
    """Tasks of rollbuf dataset `dataset`, leased `batch` at a time and heartbeated every `heartbeat_s` (a third
    of the lease by default, from the first reply)."""

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
        self.producer_id = producer_id or f"{socket.gethostname()}-{os.getpid()}-tasks"
        self.batch = batch
        self.poll_s = poll_s
        self.heartbeat_s = heartbeat_s
        self.to_task = to_task
        self.retry_deadline = retry_deadline
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=auth_headers(api_key), timeout=DEFAULT_TIMEOUT, transport=transport
        )
        self._ready: deque[Task] = deque()
        self._held: set[str] = set()
        """Tokens leased and not yet submitted or given up: heartbeated."""
        self._beats: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[Any]] = set()
        self.done = False
        self.lost = 0
        """Leases the server said were lost (their tasks went to another producer)."""

    async def _call(self, path: str, body: dict[str, Any]) -> Any:
        return await post_retrying(self._http, path, body, self.retry_deadline)

    def next_task(self) -> Task | None:
        """The runner awaits `anext_task`; a blocking caller gets what is leased already, or None."""
        return self._ready.popleft() if self._ready else None

    async def anext_task(self) -> Task | None:
        """The next leased task; waits while the dataset has none now; None once it is done."""
        while not self._ready:
            if self.done:
                return None
            body = {"dataset": self.dataset, "producer_id": self.producer_id, "n": self.batch}
            reply = LeaseReply.model_validate(await self._call("/tasks/lease", body))
            for lease in reply.leases:
                self._held.add(lease.token)
                self._ready.append(self.to_task(lease, self.dataset))
                if self.heartbeat_s is None:
                    self.heartbeat_s = max(0.05, (lease.expires_at - time.time()) / 3)
            if self._held and self._beats is None:
                self._beats = asyncio.create_task(self._heartbeats(), name=f"task-leases-{self.dataset}")
            if not reply.leases:
                self.done = reply.done
                if not self.done:
                    await asyncio.sleep(self.poll_s)
        return self._ready.popleft()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s or 1.0)
            tokens = sorted(self._held)
            if not tokens:
                continue
            try:
                reply = TaskHeartbeatReply.model_validate(await self._call("/tasks/heartbeat", {"tokens": tokens}))
            except Exception as exc:  # the next beat tries again; a lease that expires meanwhile goes elsewhere
                log.warning("task lease heartbeat failed: %s", exc)
                continue
            for token, expires in reply.expires_at.items():
                if expires is None and token in self._held:
                    self._held.discard(token)
                    self.lost += 1

    def report(self, task: Task, mean_score: float) -> None:
        """Its group was acknowledged: the server holds its fate now."""
        token = lease_token(task)
        if token is not None:
            self._held.discard(token)

    def discard(self, task: Task) -> None:
        """Its group ended without a score: the lease ends as failed (the dataset's retry policy applies)."""
        token = lease_token(task)
        if token is None or token not in self._held:
            return
        self._held.discard(token)
        job = asyncio.get_running_loop().create_task(self._fail(token, "no group: the rollout ended without one"))
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
            self._held.discard(token)
            await self._fail(token, None)
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        await self._http.aclose()
