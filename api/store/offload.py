"""Transactions too large for the event loop. A store whose transactions run on the loop (the
memory store) runs one started inside `large()` in a worker thread instead, every other transaction waiting
for it: storing a list of 100,000 tiny groups on the loop holds it 6.7-8.8 s (64 s on a loaded machine), and no
other request, not even `GET /`, is answered meanwhile. Stores that already run transactions in a thread
of their own (SQLite, PostgreSQL) ignore it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

LARGE: ContextVar[bool] = ContextVar("rollbuf_large_transaction", default=False)


@contextmanager
def large() -> Iterator[None]:
    """The transactions this task starts inside are large: off the event loop where the store would run them on it."""
    token = LARGE.set(True)
    try:
        yield
    finally:
        LARGE.reset(token)
