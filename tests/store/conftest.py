"""Backends for the contract suite: every test that takes `store` or `new_url` runs once per backend."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from api.store import Store, make_store
from tests import pg

BACKENDS = ["memory", "sqlite", "postgresql"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_url(backend: str, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A URL for a fresh, empty store of this backend each time it is called (PostgreSQL: a database of this
    test's own, a schema per store)."""
    n = itertools.count()
    if backend == "postgresql":
        with pg.database() as name:
            yield lambda: pg.url_of(name, schema=f"store_{next(n)}")
        return
    yield lambda: "memory://" if backend == "memory" else f"sqlite:///{tmp_path / f'store-{next(n)}.db'}"


@pytest.fixture
async def store(new_url: Callable[[], str]) -> AsyncIterator[Store]:
    s = make_store(new_url())
    try:
        yield s
    finally:
        await s.close()
