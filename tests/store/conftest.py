"""The `store` fixture: every contract test runs once per backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from api.store import Store, make_store


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    url = "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'store.db'}"
    s = make_store(url)
    try:
        yield s
    finally:
        await s.close()
