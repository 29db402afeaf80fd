"""In-process backend: fast, and gone with the process. For tests and for runs that accept losing the queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

from api.store.base import Store, Txn
from api.store.memory.state import State
from api.store.memory.txn import MemoryTxn
from api.store.offload import LARGE

T = TypeVar("T")

__all__ = ["MemoryStore", "MemoryTxn", "State"]


class MemoryStore(Store):
    """Transactions run to completion on the event loop without awaiting, so none interleave; a large one
    (`api.store.offload`) runs in a worker thread while the others wait for it, the loop free meanwhile."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._state = State()
        self._large: asyncio.Future[object] | None = None
        """The large transaction running in a worker thread, if any."""

    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        while self._large is not None:
            await asyncio.wait({self._large})  # neither cancels it nor raises its error
        if not LARGE.get():
            return self._run(fn)
        work: asyncio.Future[T] = asyncio.ensure_future(asyncio.to_thread(self._run, fn))
        self._large = cast("asyncio.Future[object]", work)
        work.add_done_callback(self._ended)  # first of its callbacks: those waiting see it gone when they wake
        return await asyncio.shield(work)  # a caller that gives up does not end it: it is done, or undone, whole

    def _ended(self, _: object) -> None:
        self._large = None

    def _run(self, fn: Callable[[Txn], T]) -> T:
        txn = MemoryTxn(self._state)
        try:
            return fn(txn)
        except BaseException:
            txn.rollback()
            raise
