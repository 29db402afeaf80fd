"""The collector held off during large ingests (api/ingest/gc_pause.py): restored after the last, and bounded in
time."""

from __future__ import annotations

import gc
from typing import Any

import pytest

from api.ingest import gc_pause


def _counting() -> tuple[list[int], Any]:
    runs: list[int] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            runs.append(info["generation"])

    return runs, callback


def test_overlapping_pauses_restore_the_collector_after_the_last() -> None:
    assert gc.isenabled()
    with gc_pause.collection_paused():
        with gc_pause.collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "one large ingest still runs"
    assert gc.isenabled()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_pause_kept_up_by_overlapping_ingests_collects_once_its_bound_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large lists posted back to back, overlapping, never let the count fall to 0: past MAX_PAUSE_S a collection
    runs anyway, so cyclic garbage cannot grow without bound. That full collection, in the test process, finalizes
    what tests before this one left on its worker (in CI: anyio's connect coroutines of a loop closed mid-connect,
    whose `finally` could not reach their closed loop). Their finalizers' errors are not this test's subject and do
    not fail it."""
    runs, callback = _counting()
    gc.callbacks.append(callback)
    try:
        with gc_pause.collection_paused():
            with gc_pause.collection_paused():
                pass
            assert runs == [], "within the bound: no collection"
            monkeypatch.setattr(gc_pause, "MAX_PAUSE_S", 0.0)
            with gc_pause.collection_paused():
                assert runs == [2], "past the bound, the next ingest to start collects"
                assert not gc.isenabled()
    finally:
        gc.callbacks.remove(callback)
    assert gc.isenabled()
