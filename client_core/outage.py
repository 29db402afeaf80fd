"""A server outage, told to the user as it happens: a client retrying a server that does not answer logs it
(once it has lasted `after_s`, then every `every_s`), and logs once more when the server answers again. The
retries themselves are silent by design; an outage of minutes must not be."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

AFTER_S = 5.0
"""An outage is logged once it has lasted this long (a blip that one retry covers is not)."""
EVERY_S = 30.0
"""While it lasts, a line this often."""


class Outage:
    """Call `failed(why)` on each failed attempt to reach the server, `answered()` on each reply."""

    def __init__(self, what: str, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.log = log
        self.clock = clock
        self.since: float | None = None
        self.logged: float | None = None

    def failed(self, why: str) -> None:
        now = self.clock()
        if self.since is None:
            self.since = now
        if now - self.since < AFTER_S:
            return
        if self.logged is None or now - self.logged >= EVERY_S:
            self.logged = now
            self.log.warning("%s unreachable for %.0f s, retrying: %s", self.what, now - self.since, why)

    def answered(self) -> None:
        if self.since is not None and self.logged is not None:
            self.log.warning("%s reachable again after %.0f s", self.what, self.clock() - self.since)
        self.since = self.logged = None
