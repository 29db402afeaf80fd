"""Python's automatic garbage collection held off while a large body is ingested.

A list of 100,000 tiny groups builds a few million container objects (parsed fields, models, records) that
live until the list is stored. The cyclic collector's full collections walk every such object while holding
the GIL: each time the heap grew by a quarter, one collection of 0.15-1.25 s found nothing to free ("collected
0": these objects are freed by reference counting when the request ends) and stalled the event loop, whichever
thread triggered it. Held off for the ingest, none runs; afterwards the objects are freed without one.

Process-wide (the collector is), counted across overlapping requests: the collector is back on when the last
large ingest ends. Large lists posted back to back, overlapping, would keep it off for good and let cyclic
garbage grow without bound: past `MAX_PAUSE_S` of one unbroken pause, the next large ingest to start or end
runs one collection (a stall every `MAX_PAUSE_S` at worst, not memory without end)."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_was_enabled = True
_since = 0.0
MAX_PAUSE_S = 10.0
"""The longest one unbroken pause lasts before a collection runs anyway."""


def _bounded() -> None:
    global _since
    now = time.monotonic()
    if _holders and _was_enabled and now - _since > MAX_PAUSE_S:
        gc.collect()
        _since = now


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic collection while inside (of any thread); the collector's state is restored after the last."""
    global _holders, _was_enabled, _since
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            _since = time.monotonic()
            gc.disable()
        _holders += 1
        _bounded()
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            _bounded()
            if _holders == 0 and _was_enabled:
                gc.enable()
