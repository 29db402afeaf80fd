"""`Coalescer`: an env's groups that finish together go to the server in one POST /scored_data_list.

A request per group costs the server a request's parsing and a store transaction (a commit) per group; a list
of 16 costs one of each. The runner's groups often finish within a few milliseconds of each other (many run at
once), so each env's submits wait at most `linger` seconds for others to join them, and go at once when 16 (or
4 MiB of groups) are ready. A group that finds no other within the linger goes alone to /scored_data, as
without coalescing: a slow producer sends exactly what it sent before.

Each caller gets its own group's reply. The list route stores all of a list or none: a list refused as a
whole (a 4xx: one invalid group, a reused id) is sent again group by group, so that only the bad group is
refused, and so is one refused for now (`Unavailable`, 429/503: a queue with room for some of its groups but
not all; `SubmitList` raises it instead of retrying), so that the queue fills to its limit as with single
submits, each retried as before. A list that could not be sent by the deadline (`RetriesExhausted`) fails
for each of its callers. A
caller cancelled before its list is sent is left out of it; once sent, a list is seen through for the others
(and abandoned, as a cancelled single submit is, only when every caller of it has gone).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence

from api.wire.schema import ScoredData, ScoredListReply, ScoredReply
from rollout_client.errors import Rejected, Unavailable

log = logging.getLogger("rollout_client.runner")

LINGER_S = 0.002
"""How long a finished group waits for others of its env to go with it: far below a group's own time, and
what lets groups finishing at once (from many in flight) share a request."""
MAX_GROUPS = 16
"""A list is sent at once when it holds this many groups."""
MAX_BYTES = 4 << 20
"""...or about this many bytes of groups (`approx_bytes`): a list's body stays cheap to retry."""

SubmitOne = Callable[[int, ScoredData], Awaitable[ScoredReply]]
"""Submit env `i`'s group alone (POST /scored_data)."""
SubmitList = Callable[[int, Sequence[ScoredData]], Awaitable[ScoredListReply]]
"""Submit env `i`'s groups in one POST /scored_data_list (all stored, or none); a 429/503 raised at once."""


def approx_bytes(group: ScoredData) -> int:
    """A group's size on the wire, roughly (4 bytes per token per per-token field, plus message text): only
    to bound a list's body, never charged for anything."""
    tokens = sum(len(t) for t in group.tokens)
    fields = 2 + sum(f is not None for f in (group.advantages, group.ref_logprobs, group.inference_logprobs))
    text = sum(len(m.get("content") or "") for seq in group.messages or () for m in seq if isinstance(m, dict))
    return 64 + 4 * tokens * fields + 8 * len(group.scores) + text


def replies_of(reply: ScoredListReply, n: int) -> list[ScoredReply]:
    """Each group's reply from the list's: `duplicate` where `duplicate_at` names it. The list reply says which
    groups were duplicates but only how many were side-buffered: each reads "buffered" when all were (the
    last with `last_buffer_size`), "received" otherwise. (A server older than `duplicate_at` that counts
    `duplicates` names none: they read as stored, and count so.)"""
    duplicates = set(reply.duplicate_at or ())
    buffered = reply.buffered == n
    out = [
        ScoredReply(status="buffered" if buffered else "received", duplicate=k in duplicates or None) for k in range(n)
    ]
    if buffered and out:
        out[-1].buffer_size = reply.last_buffer_size
    return out


class _Batch:
    """Groups of one env waiting to go together, and their callers."""

    __slots__ = ("groups", "waiters", "nbytes", "timer", "task")

    def __init__(self) -> None:
        self.groups: list[ScoredData] = []
        self.waiters: list[asyncio.Future[ScoredReply]] = []
        self.nbytes = 0
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Task[None] | None = None
        """Sending it, once sent."""


class Coalescer:
    """Submits per env key, coalesced into lists (`submit`); `linger` 0 sends each group alone at once."""

    def __init__(
        self,
        one: SubmitOne,
        many: SubmitList,
        *,
        linger: float = LINGER_S,
        max_groups: int = MAX_GROUPS,
        max_bytes: int = MAX_BYTES,
        size: Callable[[ScoredData], int] = approx_bytes,
    ) -> None:
        if not 0 <= linger < math.inf or max_groups < 1 or max_bytes < 1:
            raise ValueError(
                f"a finite linger >= 0 s, max_groups >= 1 and max_bytes >= 1; got {linger}, {max_groups}, {max_bytes}"
            )
        self._one = one
        self._many = many
        self.linger = linger
        self.max_groups = max_groups
        self.max_bytes = max_bytes
        self._size = size
        self._pending: dict[int, _Batch] = {}
        self._sending: set[asyncio.Task[None]] = set()
        self.lists = 0
        """Lists the server acknowledged."""
        self.listed = 0
        """Groups acknowledged in them."""

    async def submit(self, key: int, group: ScoredData) -> ScoredReply:
        """Env `key`'s group, sent within `linger` s, alone or in a list; its own reply (or error)."""
        if self.linger <= 0:
            return await self._one(key, group)
        nbytes = self._size(group)
        batch = self._pending.get(key)
        if batch is not None and batch.nbytes + nbytes > self.max_bytes:
            self._flush(key)  # what waits goes now; this group starts the next list
            batch = None
        if batch is None:
            batch = self._pending[key] = _Batch()
            batch.timer = asyncio.get_running_loop().call_later(self.linger, self._flush, key)
        waiter: asyncio.Future[ScoredReply] = asyncio.get_running_loop().create_future()
        batch.groups.append(group)
        batch.waiters.append(waiter)
        batch.nbytes += nbytes
        if len(batch.groups) >= self.max_groups or batch.nbytes >= self.max_bytes:
            self._flush(key)
        try:
            return await waiter
        except asyncio.CancelledError:
            if batch.task is not None and all(w.done() for w in batch.waiters):
                batch.task.cancel()  # every caller of the list has gone: abandon it, as a single submit is
            raise

    def flush(self) -> None:
        """Send whatever waits, now (a runner that stops does not wait out the linger)."""
        for key in list(self._pending):
            self._flush(key)

    async def aclose(self, timeout: float | None = None) -> None:
        """Send whatever waits and see every list through, for up to `timeout` s: past it, what is still being
        sent is abandoned (its callers, if any are left, get CancelledError)."""
        self.flush()
        if not self._sending:
            return
        _, late = await asyncio.wait(set(self._sending), timeout=timeout)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)

    def _flush(self, key: int) -> None:
        batch = self._pending.pop(key, None)
        if batch is None:
            return
        if batch.timer is not None:
            batch.timer.cancel()
        live = [(g, w) for g, w in zip(batch.groups, batch.waiters, strict=True) if not w.done()]
        if not live:  # every caller was cancelled before it went
            return
        batch.groups, batch.waiters = [g for g, _ in live], [w for _, w in live]
        task = asyncio.get_running_loop().create_task(self._send(key, batch.groups, batch.waiters))
        batch.task = task
        self._sending.add(task)
        task.add_done_callback(lambda t: self._sent(t, batch.waiters))

    def _sent(self, task: asyncio.Task[None], waiters: list[asyncio.Future[ScoredReply]]) -> None:
        self._sending.discard(task)
        for w in waiters:  # abandoned (every caller gone, or aclose), even before it started: none waits for ever
            if not w.done():
                w.cancel()

    async def _send(self, key: int, groups: list[ScoredData], waiters: list[asyncio.Future[ScoredReply]]) -> None:
        if len(groups) == 1:
            await _answer(waiters[0], self._one(key, groups[0]))
            return
        try:
            reply = await self._many(key, groups)
        except (Rejected, Unavailable) as exc:  # one bad group, or no room for all: alone, each as it may
            level = logging.INFO if isinstance(exc, Rejected) else logging.DEBUG
            log.log(level, "a list of %d groups was refused (%s): sending them one by one", len(groups), exc)
            await asyncio.gather(
                *(_answer(w, self._one(key, g)) for g, w in zip(groups, waiters, strict=True) if not w.done())
            )
            return
        except Exception as exc:  # RetriesExhausted, a reply that does not parse...: the same for each
            for w in waiters:
                if not w.done():
                    w.set_exception(exc)
            return
        self.lists += 1
        self.listed += len(groups)
        for w, r in zip(waiters, replies_of(reply, len(groups)), strict=True):
            if not w.done():
                w.set_result(r)


async def _answer(waiter: asyncio.Future[ScoredReply], call: Awaitable[ScoredReply]) -> None:
    """`call`'s reply, or its error, to `waiter` (unless its caller has gone)."""
    try:
        reply = await call
    except Exception as exc:
        if not waiter.done():
            waiter.set_exception(exc)
    else:
        if not waiter.done():
            waiter.set_result(reply)
