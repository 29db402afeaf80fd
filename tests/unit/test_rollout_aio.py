"""The generic asyncio helpers (rollout_client/aio.py) that are not covered with the group machinery."""

from __future__ import annotations

import asyncio

import pytest

from rollout_client.aio import first_error, wait_first

pytestmark = pytest.mark.anyio


async def test_wait_first_returns_on_the_event_or_on_anything_else_() -> None:
    changed = asyncio.Event()
    changed.set()  # set before: cleared first, so only a new change counts
    other = asyncio.Event()
    waiting = asyncio.create_task(wait_first(changed, other.wait()))
    await asyncio.sleep(0)
    assert not waiting.done()
    other.set()
    await waiting
    waiting = asyncio.create_task(wait_first(changed))
    await asyncio.sleep(0)
    changed.set()
    await waiting


def test_first_error_skips_the_cancellations_and_notes_the_others() -> None:
    group = BaseExceptionGroup("g", [asyncio.CancelledError(), ValueError("first"), KeyError("second")])
    error = first_error(group)
    assert isinstance(error, ValueError) and "KeyError" in (error.__notes__ or [""])[0]
    assert first_error(BaseExceptionGroup("g", [asyncio.CancelledError()])) is None
