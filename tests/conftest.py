"""Shared fixtures: a clean environment, and the app in-process behind an httpx client."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import settings as hypothesis_settings

from api.config.settings import Settings
from api.http.app import create_app
from tests import pg

pytest_plugins = [
    "tests.leaks",  # a socket a test leaves open fails that test
    "pytester",  # tests/test_leaks.py runs pytest on a test that leaks
]

# Hypothesis's default 200 ms deadline per example is a timing assert: on a loaded machine (make test runs the
# suite on several workers beside each other) a slow example fails as "Unreliable test timings". Time belongs in
# bench/, never in a test's verdict.
hypothesis_settings.register_profile("rollbuf", deadline=None)
hypothesis_settings.load_profile("rollbuf")


@pytest.fixture(autouse=True)
def _clean_environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key.startswith("ROLLBUF_"):
            monkeypatch.delenv(key)
    yield


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """API tests run against every backend: the service logic must not depend on which one it talks to."""
    if request.param == "postgresql":
        with pg.database() as name:
            yield Settings(store=pg.url_of(name))
        return
    yield Settings(store="memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'rollbuf.db'}")


@pytest.fixture
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The ASGI app with its lifespan running, reached through httpx without a socket."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            yield c
