"""When a worker process is replaced by a fresh one: after a MemoryError (its heap is suspect: the next
group would fail the same way), after `max_groups` groups, or above `max_rss_bytes` of resident memory
(environments that leak). Pure: the pool counts the groups it places on a worker (`spent`), the worker reports
what it sees of itself (`reason`), the pool acts on both."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

MEMORY_ERROR = "memory_error"
MAX_GROUPS = "max_groups"
RSS = "rss"
STUCK = "stuck"
"""Not decided here: the runner's watchdog kills a worker whose group ran past its deadline."""


@dataclass(frozen=True, slots=True)
class RecyclePolicy:
    """`None` turns a rule off."""

    max_groups: int | None = None
    max_rss_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_groups is not None and self.max_groups < 1:
            raise ValueError(f"RecyclePolicy max_groups (recycle_after_groups) must be >= 1, got {self.max_groups}")
        if self.max_rss_bytes is not None and self.max_rss_bytes < 1:
            raise ValueError(f"RecyclePolicy max_rss_bytes (max_worker_rss_bytes) must be > 0: {self.max_rss_bytes}")

    def spent(self, placed: int) -> bool:
        """Whether a worker given `placed` groups (or rollouts run alone) takes no more. The pool counts them as
        it places them: a worker that counted the groups it finished took up to `max_in_flight - 1` more
        before it said so, and how many depended on timing."""
        return self.max_groups is not None and placed >= self.max_groups

    def reason(self, rss_bytes: int | None, memory_error: bool = False) -> str | None:
        """Why a worker that holds `rss_bytes` (or just hit a MemoryError) must be replaced, or None."""
        if memory_error:
            return MEMORY_ERROR
        if self.max_rss_bytes is not None and rss_bytes is not None and rss_bytes > self.max_rss_bytes:
            return RSS
        return None


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux /proc), else its peak (getrusage); None if neither."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except (OSError, ValueError):
        return None
