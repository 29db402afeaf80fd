"""Waking this replica's long-polling trainers: at once after its own commits, and on NOTIFY after another
replica's (each replica LISTENs on a connection of its own)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

from api.store.postgres.config import PostgresConfig

log = logging.getLogger("rollbuf")

LISTEN_RETRY_S = (0.1, 0.5, 1.0, 2.0)
"""Pauses between attempts to re-open the LISTEN connection (the last one repeats)."""


@dataclass(slots=True)
class _Listener:
    """A `subscribe` callback, and whether a call of it is already scheduled on its loop."""

    callback: Callable[[], None]
    loop: asyncio.AbstractEventLoop
    pending: bool = False


class Wakeups:
    """The subscribers of one store, and the thread that LISTENs for them once there is one."""

    def __init__(self, config: PostgresConfig, url: str, replica: str) -> None:
        self._config = config
        self._url = url
        self._replica = replica
        """Sent with NOTIFY by this replica: its own notifications are ignored (it woke its trainers itself)."""
        self._lock = threading.Lock()
        self._listeners: list[_Listener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def subscribe(self, callback: Callable[[], None], *, listen: bool) -> None:
        """Call `callback` on the running loop at every wake; `listen`: start listening if nobody does yet."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._listeners.append(_Listener(callback, loop))
            if self._thread is None and listen:
                self._thread = threading.Thread(target=self._listen, name="rollbuf-listen", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the LISTEN thread (from a thread that may block)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def wake(self) -> None:
        """Call every subscriber on its loop, once for any number of wakes made before that call runs: commits
        come hundreds a second, and each wake-up of an event loop from another thread costs both threads."""
        with self._lock:
            due = [listener for listener in self._listeners if not listener.pending]
            for listener in due:
                listener.pending = True
        for listener in due:
            with contextlib.suppress(RuntimeError):  # that loop is closed
                listener.loop.call_soon_threadsafe(self._fire, listener)

    def _fire(self, listener: _Listener) -> None:
        with self._lock:
            listener.pending = False  # before the call: a commit after this point wakes it again
        listener.callback()

    def _listen(self) -> None:
        """Wake this replica's long-polls when another replica commits queued data. While the connection is
        down, long-polls still re-check on their own timer; once it listens (again), everyone wakes once (a
        notification may have been missed)."""
        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._config.conninfo, autocommit=True) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._config.channel)))
                    self.wake()  # what was committed before LISTEN took effect is seen by the re-check
                    failures = 0
                    while not self._stop.is_set():
                        # What arrived together wakes once (`stop_after` ends the wait at the first packet).
                        notes = conn.notifies(timeout=0.2, stop_after=1)
                        if any(note.payload != self._replica for note in list(notes)):
                            self.wake()
            except psycopg.Error as exc:
                pause = LISTEN_RETRY_S[min(failures, len(LISTEN_RETRY_S) - 1)]
                failures += 1
                if failures == 1:
                    log.warning("LISTEN connection to %s lost (%s); reconnecting", self._url, exc)
                self._stop.wait(pause)
