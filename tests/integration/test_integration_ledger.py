"""The ledger in real server processes, on every store: a scripted run with filters, side-buffer expiry and a
staleness bound accounts for every acknowledged group exactly once (served, dropped with its reason, held or
queued), across a kill -9 and a restart on the durable stores."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import ledger_script, pg
from tests.servers import start_server


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "postgresql":
        with pg.database() as name:
            yield pg.url_of(name)
        return
    yield "memory://" if request.param == "memory" else f"sqlite:///{tmp_path / 'rollbuf.db'}"


def test_the_ledger_accounts_for_every_group_once_across_kill_9(store: str, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    server = start_server(store, log, None, *ledger_script.SETTINGS)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            batches = ledger_script.first_part(c)
        if not store.startswith("memory"):  # a memory store is gone with its process: no restart to survive
            server.kill(signal.SIGKILL)
            server = start_server(store, log, server.port, *ledger_script.SETTINGS)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            batches |= ledger_script.second_part(c)
            ledger_script.check(c, batches)
    finally:
        server.kill(signal.SIGTERM)
