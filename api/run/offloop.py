"""Work taken off the event loop: a large input's parsing, decoding or rendering runs in a worker thread,
so the requests behind it go on meanwhile; a small one stays on the loop, where a thread hop costs more than
the work. Bodies, submissions and ledger views all go through `off_loop`, so one limiter bounds them together.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

INLINE_PARSE = 1 << 20
"""Bodies up to this size are parsed and validated on the event loop (a thread hop costs more than a
group); larger ones in a thread, so that a 30 MB list does not hold up the requests behind it."""
_BODY_WORK = anyio.CapacityLimiter(max(2, os.cpu_count() or 2))
"""Large inputs worked on at once: bounds the memory of concurrent bombs to this many times the limit."""


async def off_loop(size: int, inline_up_to: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on the event loop for small inputs, else in a worker thread (at most `_BODY_WORK` at once)."""
    if size <= inline_up_to:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args, limiter=_BODY_WORK)
