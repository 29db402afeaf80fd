"""Python's automatic garbage collection held off while a large body is ingested (issue 35).

A list of 100,000 tiny groups builds a few million container objects (parsed fields, models, records) that
live until the list is stored. The cyclic collector's full collections walk every such object while holding
the GIL: each time the heap grew by a quarter, one collection of 0.15-1.25 s found nothing to free ("collected
0": these objects are freed by reference counting when the request ends) and stalled the event loop, whichever
thread triggered it. Held off for the ingest, none runs; afterwards the objects are freed without one.

Process-wide (the collector is), counted across overlapping requests: the collector is back on when the last
large ingest ends, so a pause lasts at most as long as requests whose bodies the body limits bound."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_was_enabled = True


@contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic collection while inside (of any thread); the collector's state is restored after the last."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
