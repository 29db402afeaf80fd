"""A runner whose rollbuf server stops answering: a server process SIGSTOPped mid-run is reported unresponsive
while the runner's heartbeat still waits for its answer (`Timeouts.server_reply`), not at the request's read
timeout; SIGCONT, and the answer that comes reports the recovery."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import httpx
import pytest

from rollout_client import RolloutRunner, ScriptedPolicy, Tasks, Timeouts
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task
from tests.runs import HANG_GUARD_S, start_trainer, until
from tests.servers import running_server

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_a_stopped_server_is_reported_while_a_heartbeat_waits_and_so_is_its_recovery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The runner's requests wait without a read timeout here: only the heartbeat's bound on its answer can tell
    the outage (a read timeout, 30 s by default, used to be the first to)."""
    with running_server("memory://", tmp_path / "s.log", "--producer-gone-after", "3") as server:  # beats: 0.5 s
        start_trainer(server.url, batch_size=8)
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            client_options={"timeout": httpx.Timeout(None)},
            timeouts=Timeouts(server_reply=1.0, shutdown=2.0),
        )
        with caplog.at_level(logging.WARNING, logger="rollout_client"):
            run = asyncio.create_task(runner.run())
            await until(lambda: runner.stats.accepted >= 2, "first groups")
            os.killpg(server.proc.pid, signal.SIGSTOP)
            try:
                await until(lambda: not runner.health().server_reachable, "the stopped server reported")
            finally:
                os.killpg(server.proc.pid, signal.SIGCONT)
            await until(lambda: runner.health().server_reachable, "the recovery reported")
            accepted = runner.stats.accepted
            await until(lambda: runner.stats.accepted > accepted, "groups accepted again")
            runner.stop()
            await asyncio.wait_for(run, HANG_GUARD_S)
    lines = [r.getMessage() for r in caplog.records]
    told = [m for m in lines if m.startswith(f"rollbuf server {server.url} unreachable for")]
    assert told and "POST /producers/heartbeat: no answer after 1 s" in told[0], lines
    assert sum(m.startswith(f"rollbuf server {server.url} reachable again after") for m in lines) >= 1, lines
