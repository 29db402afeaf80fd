"""A worker's turns, posted by the runner (docs/episodes.md, "Worker processes"): a rollout that runs in a worker
process ends its turns there (`Session.end_turn`), but the slot's lease, its `TurnPoster` and its HTTP client are
the runner's. `RelayedTurns` is the worker's turn sink: each call is a request to the runner, which the runner's
`TurnRelay` answers by calling the slot's `TurnPoster`, so that a worker's turns are posted exactly as an
in-process rollout's: in order, `end_turn` waiting while 4 are unacknowledged, `SlotLost` raised in the rollout
once the slot passed to another producer.

Messages (over the pool's `Channel`). Worker to runner: ("turn", job, TurnPiece), ("turn_flush", job),
("turn_close", job). Runner to worker, after each "turn" and "turn_flush": ("turns", job, acked, acked_tokens,
versions_sent, lost), `lost` the `SlotLost` message or None. One request per job is in flight at a time (a
rollout awaits each); a request for a job the runner does not know as that worker's (it ended, or the worker
is wrong) is answered `lost`, and what it carried is not posted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from rollout_client.episodes import SlotLost, TurnPiece, TurnSink
from rollout_client.workers.ipc import ChannelClosed

log = logging.getLogger("rollout_client.workers")

Send = Callable[[tuple[Any, ...]], None]
"""How a message goes to the other side."""

TURN = "turn"
FLUSH = "turn_flush"
CLOSE = "turn_close"
REPLY = "turns"
REQUESTS = (TURN, FLUSH, CLOSE)
NOT_HELD = "the runner holds no turn poster for this rollout (it ended, or it is not this worker's)"


class ProtocolError(Exception):
    """A worker sent a message the runner cannot read: the worker is killed (its slots resume from their turns)."""


def request(msg: tuple[Any, ...]) -> tuple[str, int, TurnPiece | None]:
    """A worker's turn request, checked: its kind, its job and (for "turn") its piece. ProtocolError otherwise."""
    kind = msg[0]
    if len(msg) != (3 if kind == TURN else 2):
        raise ProtocolError(f"{kind!r} with {len(msg) - 1} fields")
    job = msg[1]
    if not isinstance(job, int) or isinstance(job, bool):
        raise ProtocolError(f"{kind!r} whose job is {type(job).__name__}, not int")
    piece = msg[2] if kind == TURN else None
    if kind == TURN and not isinstance(piece, TurnPiece):
        raise ProtocolError(f"'turn' that carries {type(piece).__name__}, not a TurnPiece")
    return kind, job, piece


class TurnRelay:
    """The runner's side: the `TurnPoster` of each job that posts turns, and the requests its worker sends."""

    def __init__(self) -> None:
        self.sinks: dict[int, TurnSink] = {}
        """Job id -> its slot's turn poster, while the job runs."""
        self._busy: dict[int, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.refused = 0
        """Requests answered `lost` because the job was not the worker's (or had ended)."""

    def add(self, job: int, sink: TurnSink) -> None:
        self.sinks[job] = sink
        self._busy[job] = asyncio.Lock()

    def remove(self, job: int) -> None:
        self.sinks.pop(job, None)
        self._busy.pop(job, None)

    def handle(self, jobs: Callable[[int], bool], msg: tuple[Any, ...], send: Send) -> None:
        """Answer one request of a worker whose jobs are those `jobs(job)` is true of (`send`: to that worker).
        ProtocolError if the message is malformed."""
        kind, job, piece = request(msg)
        sink = self.sinks.get(job) if jobs(job) else None
        if sink is None:
            if kind != CLOSE:
                self.refused += 1
                log.warning("a rollout worker sent %r for job %d: %s", kind, job, NOT_HELD)
                send((REPLY, job, 0, 0, None, NOT_HELD))
            return
        if kind == CLOSE:
            sink.close()
            return
        task = asyncio.get_running_loop().create_task(self._answer(job, sink, piece, send))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, job: int, sink: TurnSink, piece: TurnPiece | None, send: Send) -> None:
        lost: str | None = None
        async with self._busy.setdefault(job, asyncio.Lock()):  # in the order the worker sent them
            try:
                if piece is not None:
                    await sink.put(piece)
                else:
                    await sink.flush()
            except SlotLost as exc:
                lost = str(exc)
        with contextlib.suppress(ChannelClosed):  # the worker died meanwhile: its slot resumes from the turns
            send((REPLY, job, sink.acked, sink.acked_tokens, sink.versions_sent, lost))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


class RelayedTurns:
    """The worker's side (`rollout_client.episodes.TurnSink`): each turn goes to the runner, which posts it; the
    counts are the runner's poster's, as its last answer gave them."""

    def __init__(self, job: int, send: Send, prefix_turns: int, prefix_tokens: int) -> None:
        self.job = job
        self._send = send
        self.acked = prefix_turns
        self.acked_tokens = prefix_tokens
        self.versions_sent: bool | None = None
        self._reply: asyncio.Future[tuple[Any, ...]] | None = None

    def answered(self, msg: tuple[Any, ...]) -> None:
        """The runner's answer to the request in flight."""
        if self._reply is not None and not self._reply.done():
            self._reply.set_result(msg)

    async def _ask(self, msg: tuple[Any, ...]) -> None:
        self._reply = asyncio.get_running_loop().create_future()
        self._send(msg)
        _, _, acked, acked_tokens, versions_sent, lost = await self._reply
        self.acked, self.acked_tokens, self.versions_sent = acked, acked_tokens, versions_sent
        if lost is not None:
            raise SlotLost(lost)

    async def put(self, piece: TurnPiece) -> None:
        await self._ask((TURN, self.job, piece))

    async def flush(self) -> None:
        await self._ask((FLUSH, self.job))

    def close(self) -> None:
        self._send((CLOSE, self.job))
