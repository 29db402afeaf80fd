"""A server outage, told to the user as it happens: a client retrying a server that does not answer logs it
(once it has lasted `after_s`, then every `every_s`), and logs once more when the server answers again. The
retries themselves are silent by design; an outage of minutes must not be.

A request can also go unanswered without failing: a server stopped (SIGSTOP) or a connection silenced keeps it
waiting until its read timeout (30 s by default). A caller that knows how long an answer should take (the
producer's heartbeat) says so with `unanswered` once that bound has passed: told at once, since the wait itself
was the bound, and ended by the reply if it comes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

AFTER_S = 5.0
"""An outage is logged once it has lasted this long (a blip that one retry covers is not)."""
EVERY_S = 30.0
"""While it lasts, a line this often."""


class Outage:
    """Call `failed(why)` on each failed attempt to reach the server, `answered()` on each reply (an error reply
    too: the server is there), and `unanswered(why, since)` for a request still waiting past its caller's bound."""

    def __init__(self, what: str, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.log = log
        self.clock = clock
        self.since: float | None = None
        self.logged: float | None = None
        self.answered_at: float | None = None
        """When the server last answered (any reply, an error too): a request sent before then is not a sign of
        an outage however long it waits (a long-poll, retries of a 503)."""

    @property
    def told(self) -> bool:
        """An outage is going on and was logged (a blip that one retry covered is not told)."""
        return self.logged is not None

    def failed(self, why: str) -> None:
        now = self.clock()
        if self.since is None:
            self.since = now
        if now - self.since >= AFTER_S:
            self._tell(now, why)

    def unanswered(self, why: str, since: float) -> None:
        """A request sent at `since` has had no answer for as long as its caller waits for one: an outage that
        began then at the latest, told now."""
        if self.since is None or since < self.since:
            self.since = since
        self._tell(self.clock(), why)

    def _tell(self, now: float, why: str) -> None:
        if self.logged is None or now - self.logged >= EVERY_S:
            self.logged = now
            assert self.since is not None
            self.log.warning("%s unreachable for %.0f s, retrying: %s", self.what, now - self.since, why)

    def answered(self) -> None:
        now = self.clock()
        if self.since is not None and self.logged is not None:
            self.log.warning("%s reachable again after %.0f s", self.what, now - self.since)
        self.since = self.logged = None
        self.answered_at = now
