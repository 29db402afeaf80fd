"""Posting a rollout's turns as they end (docs/episodes.md): `TurnPoster` takes each turn its session ends
(`Session.end_turn`) and posts it in the background, in order, so that generation goes on while the server
acknowledges it (a 503 is retried with backoff, as every post is). Once a turn is acknowledged it is durable: a
producer that takes the slot's lease continues from it.

A turn the server refuses for good (a 422, the slot's turns bound) stops the posting of this slot's turns: the
rest of the rollout goes with its final post, which carries whatever follows the last acknowledged turn. A 409
naming `body.producer_id`, `body.group_id` or `body.slot` says the slot is another producer's now (its lease passed on,
or the other producer finished it): the rollout stops (`SlotLost`) rather than generate what its final post would
lose.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from api.wire.rollouts import SlotPrefix, TurnView
from client_core.errors import ClientError, Rejected
from rollout_client.episodes import Prefix, SlotLost, TurnPiece, consistent_versions
from rollout_client.leases.open_groups import OpenGroups

log = logging.getLogger("rollout_client.runner")

BACKLOG = 4
"""Turns a session may have ended and not yet had acknowledged before `put` waits: the rollout runs ahead of
the server by this many turns at most (what a killed producer can lose beyond its turn in progress)."""


PASSED_ON = (["body", "producer_id"], ["body", "group_id"], ["body", "slot"])
"""Where a turn's 409 says the rollout can no longer be this producer's: the slot's lease passed to another
producer (`producer_id`), the group is no longer open (`group_id`: sealed or expired, perhaps with the slot another
producer finished), or the slot is acknowledged (`slot`: another producer's final post came first)."""


def lost_lease(exc: Rejected) -> bool:
    """A 409 saying the slot is not this producer's to go on with (`PASSED_ON`): generating the rest of the rollout
    would be wasted, as its final post would be refused or `redone`."""
    return exc.status == 409 and any(isinstance(e, dict) and e.get("loc") in PASSED_ON for e in exc.errors)


class TurnPoster:
    """A slot's turns, posted in order in the background (`rollout_client.episodes.TurnSink`)."""

    def __init__(self, groups: OpenGroups, group_id: str, slot: int, prefix: Prefix | None = None) -> None:
        self.groups = groups
        self.group_id = group_id
        self.slot = slot
        self.acked = 0 if prefix is None else prefix.turns
        """Turns acknowledged: the resumed prefix's, then this producer's."""
        self.acked_tokens = 0 if prefix is None else len(prefix.tokens)
        self.versions_sent: bool | None = None if prefix is None else prefix.versions is not None
        """Whether the slot's turns send per-token versions (None: no turn yet)."""
        self.stopped: str | None = None
        """Why this slot's turns are no longer posted (the final post carries the rest), or None."""
        self.lost: SlotLost | None = None
        self._queue: deque[TurnPiece] = deque()
        self._room = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def put(self, piece: TurnPiece) -> None:
        """Queue the turn; wait only while `BACKLOG` turns are unacknowledged. SlotLost once a turn was refused
        because the slot passed to another producer."""
        if self.lost is not None:
            raise self.lost
        if self.stopped is not None:
            return
        self._queue.append(piece)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._post_all(), name=f"turns {self.group_id}#{self.slot}")
        async with self._room:
            await self._room.wait_for(lambda: len(self._queue) <= BACKLOG)
        if self.lost is not None:
            raise self.lost

    async def flush(self) -> None:
        """Every queued turn acknowledged (or given up): the final post may go. SlotLost as `put`."""
        if self._task is not None:
            await self._task
        if self.lost is not None:
            raise self.lost

    def close(self) -> None:
        """Stop posting (the rollout ended or was cancelled): what was not acknowledged is not sent."""
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def posted(self) -> Prefix | None:
        """The slot's prefix once the turns queued here are posted: what the rollout continues from after the
        worker that ran it died (the turns it handed over are kept). SlotLost as `put`."""
        if self._task is not None:
            await asyncio.wait([self._task])  # done, or cancelled by `close`: either way nothing more is posted
        if self.lost is not None:
            raise self.lost
        if not self.acked:
            return None
        return await read_prefix(self.groups, self.group_id, self.slot, self.acked)

    async def _post_all(self) -> None:
        try:
            while self._queue and self.stopped is None and self.lost is None:
                await self._post(self._queue[0])
                self._queue.popleft()
                async with self._room:
                    self._room.notify_all()
        finally:
            if self.stopped is not None or self.lost is not None:
                self._queue.clear()
            async with self._room:
                self._room.notify_all()

    async def _post(self, piece: TurnPiece) -> None:
        ok, versions = consistent_versions(self.versions_sent, piece.versions)
        if not ok:
            self.stopped = "versions"  # an earlier turn sent versions this one does not know
            return
        try:
            reply = await self.groups.turn(
                self.group_id,
                self.slot,
                piece.turn,
                piece.tokens,
                piece.masks,
                inference_logprobs=piece.logprobs,
                token_weight_versions=versions,
                tool_results=piece.log,
                snapshot=piece.snapshot,
            )
        except Rejected as exc:
            if lost_lease(exc):
                self.lost = SlotLost(f"slot {self.slot} of group {self.group_id} passed to another producer: {exc}")
            else:
                self.stopped = f"refused: {exc}"
                log.warning(
                    "turn %d of %s#%d refused; the rest goes with the final post: %s",
                    piece.turn,
                    self.group_id,
                    self.slot,
                    exc,
                )
            return
        except ClientError as exc:  # retried until the deadline: the final post carries the rest
            self.stopped = f"unsent: {exc}"
            log.warning("turn %d of %s#%d not posted: %s", piece.turn, self.group_id, self.slot, exc)
            return
        if self.versions_sent is None:
            self.versions_sent = versions is not None
        self.acked = reply.turns
        self.acked_tokens += len(piece.tokens)


async def prefix_of(groups: OpenGroups, group_id: str, slot: int, given: SlotPrefix | None) -> Prefix | None:
    """The whole prefix a lease carries (`SlotLease.prefix`), reading the turns it left out (GET /rollouts/turns,
    page by page) when it was too large to carry them; None when no turn is in."""
    if given is None or given.turns == 0:
        return None
    if given.complete:
        return Prefix.of(list(given.items), given.snapshot)
    return await read_prefix(groups, group_id, slot, given.turns)


async def read_prefix(groups: OpenGroups, group_id: str, slot: int, turns: int | None = None) -> Prefix | None:
    """The slot's acknowledged turns as the server holds them (GET /rollouts/turns, page by page, up to `turns`
    when given); None when none is in."""
    items: list[TurnView] = []
    snapshot = None
    while turns is None or len(items) < turns:
        page = await groups.turns(group_id, slot, len(items))
        if not page.items:
            break
        items += page.items
        snapshot = page.snapshot
        if page.complete:
            break
    return Prefix.of(items, snapshot) if items else None
