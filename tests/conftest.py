"""Shared fixtures: a clean environment, and the app in-process behind an httpx client."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import settings as hypothesis_settings

from api.app import create_app
from api.config.settings import Settings
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

FLOOR_STORES = {"settings": "memory", "backend": "postgresql"}
"""The one store each store-parametrized fixture runs on in the floor tier: the API tier's (`settings`) on the
memory store, as FastAPI, pydantic and the rest serve every store alike; the store tier's (`backend`,
tests/store/conftest.py) on PostgreSQL, psycopg's. SQLite is the standard library's, with no floor to check. The
full run covers every store."""
FLOOR_EXAMPLES = 5
"""At most this many examples per hypothesis test in the floor tier: it checks that the dependencies' APIs are
the ones the code calls, which a few examples show; the edge cases are the full run's."""
EXTRAS = frozenset(
    {"pyarrow", "matplotlib", "wandb", "torch", "trl", "transformers", "tokenizers", "accelerate", "datasets"}
    | {"pandas", "polars", "duckdb", "verifiers", "selenium", "schemathesis"}
)
"""Packages of the extras and the dev tools (and theirs), absent from the floor tier's venv: a test that needs
one is skipped there. Any other missing module fails, as it would for a user (an undeclared dependency)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--floors",
        action="store_true",
        help="the floor tier (make floors-test): API tests on the memory store and store tests on PostgreSQL only, "
        f"at most {FLOOR_EXAMPLES} examples per hypothesis test, and what needs an extra's package skipped",
    )


def _extra_missing(exc: BaseException | None) -> str | None:
    """The extra's package whose absence raised `exc`, if that is what it is."""
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] in EXTRAS:
        return exc.name.split(".")[0]
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("floors"):
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        params = item.callspec.params if isinstance(item, pytest.Function) and hasattr(item, "callspec") else {}
        other_store = any(name in params and params[name] != store for name, store in FLOOR_STORES.items())
        (dropped if other_store else kept).append(item)
        # As hypothesis's own pytest plugin adjusts a test's settings: the test reads them when it runs.
        obj = getattr(item, "obj", None)
        fn: Any = getattr(obj, "__func__", obj)
        current = getattr(fn, "_hypothesis_internal_use_settings", None)
        if getattr(fn, "is_hypothesis_test", False) and current is not None and current.max_examples > FLOOR_EXAMPLES:
            fn._hypothesis_internal_use_settings = hypothesis_settings(current, max_examples=FLOOR_EXAMPLES)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


@pytest.hookimpl(tryfirst=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport | None:
    """In the floor tier, a test module that imports an extra's package is skipped, naming it."""
    if not isinstance(collector, pytest.Module) or not collector.config.getoption("floors"):
        return None
    try:
        collector.obj  # noqa: B018  # imports the module; pytest's own collection then finds it imported
    except pytest.Collector.CollectError as exc:
        missing = _extra_missing(exc.__context__)  # pytest raises it while handling the ImportError
        if missing is not None:
            reason = f"Skipped: needs {missing}, an extra's package, not in the floor tier's venv"
            return pytest.CollectReport(collector.nodeid, "skipped", (str(collector.path), 0, reason), [])
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """In the floor tier, a test that imports an extra's package is skipped, naming it."""
    try:
        return (yield)
    except ModuleNotFoundError as exc:
        missing = _extra_missing(exc) if item.config.getoption("floors") else None
        if missing is None:
            raise
        pytest.skip(f"needs {missing}, an extra's package, not in the floor tier's venv")


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
