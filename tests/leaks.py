"""Sockets left open by a test fail that test, at its teardown, naming what was left.

A socket held by an object in a reference cycle (an asyncio transport whose event loop closed with it open, an
httpx client nobody closed) is closed only by the cyclic garbage collector, whenever that next runs: its
ResourceWarning, an error under this suite's `filterwarnings = error`, then fails whichever later test happens
to trigger the collection (a hypothesis test in tests/unit can fail on transports some other test on its
worker left). Here each test's new sockets are listed after its teardown
(a directory listing, cheap); only if some are still open is garbage collected, and what that closes is
reported against the test that opened it.
"""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

SOCKETS_BEFORE = pytest.StashKey[frozenset[str]]()
FDS = Path("/proc/self/fd")
"""Linux's; where there is none (macOS), the guard is off and a leak fails whichever test collects it."""


def open_sockets() -> frozenset[str]:
    """This process's open sockets as the kernel names them ("socket:[inode]"): a directory listing, cheap."""
    names = set()
    for fd in os.listdir(FDS):
        try:
            target = os.readlink(FDS / fd)
        except OSError:  # closed while listed
            continue
        if target.startswith("socket:"):
            names.add(target)
    return frozenset(names)


def collected_leaks() -> list[str]:
    """Collect garbage now; the ResourceWarnings that raises (unclosed sockets, transports), as text."""
    leaks: list[str] = []
    pytests_hook = sys.unraisablehook

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        if isinstance(unraisable.exc_value, ResourceWarning):
            leaks.append(str(unraisable.exc_value))
        else:
            pytests_hook(unraisable)

    sys.unraisablehook = hook
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResourceWarning)  # through the hook above, not printed
            gc.collect()
    finally:
        sys.unraisablehook = pytests_hook
    return leaks


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if FDS.is_dir():
        item.stash[SOCKETS_BEFORE] = open_sockets()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """After the test's fixtures are gone (pytest's own unraisable check runs after this, too late to name it)."""
    yield
    before = item.stash.get(SOCKETS_BEFORE, None)
    if before is not None and open_sockets() - before:
        leaks = collected_leaks()
        if leaks:
            raise AssertionError(f"{item.nodeid} left {len(leaks)} open: " + "; ".join(leaks))
