"""In-process backend: fast, and gone with the process. For tests and for runs that accept losing the queue."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from api.store.base import Store, Txn
from api.store.memory.state import State
from api.store.memory.txn import MemoryTxn

T = TypeVar("T")

__all__ = ["MemoryStore", "MemoryTxn", "State"]


class MemoryStore(Store):
    """Transactions run to completion on the event loop without awaiting, so none interleave."""

    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._state = State()

    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        txn = MemoryTxn(self._state)
        try:
            return fn(txn)
        except BaseException:
            txn.rollback()
            raise
