"""Telling the service that the process is stopping, when the server is asked to (SIGTERM, SIGINT).

uvicorn's graceful shutdown waits for every request in flight, up to `shutdown_timeout`, then cancels them with
an error line. A `/batch?wait=` long-poll is such a request, and nothing else tells it the server is stopping: it
held every stop for the whole timeout and was cut off with no answer. uvicorn installs its own handlers before the
app's lifespan starts (in each worker process with `--workers`); this chains one in front of them, so the long
polls are answered at once and the shutdown goes on as uvicorn runs it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def on_stop_signal(stopping: Callable[[], None]) -> Callable[[], None]:
    """Call `stopping` on the running loop when a stop signal comes, before the handler that was there (uvicorn's,
    which starts the graceful shutdown). Returns what puts the previous handlers back. Signals can be handled only
    in the main thread: elsewhere (an app run in a thread) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    previous: dict[int, object] = {}

    def handler(sig: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(stopping)
        before = previous.get(sig)
        if callable(before):
            before(sig, frame)
        elif before == signal.SIG_DFL:  # nobody else listens: what the signal would have done
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)

    for sig in SIGNALS:
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, before in previous.items():
            if signal.getsignal(sig) is handler:  # not if uvicorn restored its own originals already
                signal.signal(sig, before)  # type: ignore[arg-type]

    return restore
