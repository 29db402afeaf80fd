"""`rollout_client.runner.following.Beats`, the producer's heartbeat, against a port nothing listens on: one log line
while the server is unreachable (rate-limited), and one saying what the producer waits for."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from rollout_client.client import HEARTBEAT_DEADLINE_S, RolloutClient
from rollout_client.runner.following import Beats
from rollout_client.runner.stats import RunnerStats
from tests.servers import free_port

pytestmark = pytest.mark.anyio


async def test_beats_log_once_while_the_server_is_unreachable_and_say_what_they_wait_for(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stats = RunnerStats()
    stats.paused["turns"] = "ahead_of_trainer"
    stats.trainer_step = 7
    url = f"http://127.0.0.1:{free_port()}"
    async with RolloutClient(url, retry_deadline=0.0) as client:  # nothing listens
        beats = Beats([client], ["turns"], stats, lambda: 3, interval=0.05)
        with caplog.at_level(logging.WARNING, logger="rollout_client.runner"):
            running = asyncio.create_task(beats.run())
            while sum("unreachable" in r.getMessage() for r in caplog.records) < 1 or stats.server_reachable:
                await asyncio.sleep(0.05)  # polling: the first beat's retries end within HEARTBEAT_DEADLINE_S
            first = time.monotonic()
            while time.monotonic() - first < 2 * HEARTBEAT_DEADLINE_S + 0.5:
                await asyncio.sleep(0.05)  # more beats fail meanwhile: rate-limited, not logged again
            running.cancel()
    lines = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith(f"rollbuf server {url} unreachable for") for m in lines) == 1, lines
    assert not stats.server_reachable
    waits = [m for m in lines if m.startswith("waiting for new weights")]
    assert len(waits) == 1 and "generating with step 3, the trainer is at step 7" in waits[0]
    body = beats.beat_body(time.monotonic())
    assert body.held == {} and body.env_ids == [] and body.weights_step == 3  # not registered: no env to name


async def test_a_server_that_answers_errors_is_not_told_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    """Each retry of a heartbeat the server answers 500 to is an answer: however long the retries take past
    `reply_within`, the server is there, and the heartbeat is told refused, not the server unreachable."""
    answers = 0

    async def handle(request: httpx.Request) -> httpx.Response:
        nonlocal answers
        answers += 1
        return httpx.Response(500, json={"detail": "a bug"})

    stats = RunnerStats()
    http = httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://rb")
    async with RolloutClient("http://rb", http_client=http) as client:
        beats = Beats([client], ["turns"], stats, lambda: 0, interval=60.0, reply_within=0.05)
        with caplog.at_level(logging.WARNING, logger="rollout_client.runner"):
            running = asyncio.create_task(beats.run())
            while not any("refused a heartbeat" in r.getMessage() for r in caplog.records):
                await asyncio.sleep(0.05)  # polling: the retries end within HEARTBEAT_DEADLINE_S
            running.cancel()
    await http.aclose()
    lines = [r.getMessage() for r in caplog.records]
    assert answers > 1 and stats.server_reachable, lines
    assert not any("unreachable" in m for m in lines), lines
