"""Metrics and logs of real server processes: `--workers 2`, and two replicas on one SQLite file."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from api.ingest.service import REFUSALS_FLUSH_S
from tests import pg
from tests.servers import running_server
from tests.small_run import (
    MAX_ENV_QUEUE_GROUPS,
    Expected,
    check_process_metrics,
    check_store_metrics,
    parse_metrics,
    small_run,
    total,
)

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

LIMIT = ("--max-env-queue-groups", str(MAX_ENV_QUEUE_GROUPS))
STAMP = r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR) \[(\d+)\] "


def fresh_connections(url: str) -> httpx.AsyncClient:
    """A new connection per request, so the kernel spreads requests over the worker processes."""
    return httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


async def until_both_workers_answered(c: httpx.AsyncClient, log: Path) -> int:
    """GET /healthz on fresh connections until the log shows that both workers answered one; how many were sent.
    (Which worker accepts a connection is the kernel's choice: under load one may take many in a row.)"""
    pattern = re.compile(STAMP + r"rollbuf.request: GET /healthz 200")
    for sent in range(1, 501):
        assert (await c.get("/healthz")).status_code == 200
        pids = {m.group(2) for line in log.read_text().splitlines() if (m := pattern.match(line))}
        if len(pids) == 2:
            return sent
    raise AssertionError("500 requests on fresh connections all went to one worker")


async def until_refusals_written(c: httpx.AsyncClient, expected: Expected) -> None:
    """Refusals are counted in the refusing process and written within `REFUSALS_FLUSH_S`: poll another
    replica until it sees them."""
    deadline = time.monotonic() + 10 * REFUSALS_FLUSH_S
    key = ("rollbuf_backpressure_rejections_total", (("env", "math_0"),))
    while parse_metrics((await c.get("/metrics")).text).get(key) != expected.backpressure["math_0"]:
        assert time.monotonic() < deadline, "refusals not written"
        await asyncio.sleep(0.05)  # polling interval


async def test_metrics_with_two_workers_and_a_second_replica(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    with (
        running_server(store, log_a, "--workers", "2", "--log-level", "debug", *LIMIT) as a,
        running_server(store, log_b, *LIMIT) as b,
    ):
        async with fresh_connections(a.url) as ca, fresh_connections(b.url) as cb:
            before_a = parse_metrics((await ca.get("/metrics")).text)
            before_b = parse_metrics((await cb.get("/metrics")).text)
            expected = await small_run(ca)
            probes = await until_both_workers_answered(ca, log_a)
            await until_refusals_written(cb, expected)
            after_a = parse_metrics((await ca.get("/metrics")).text)
            after_b = parse_metrics((await cb.get("/metrics")).text)
            assert (await ca.get("/readyz")).status_code == 200
            assert (await cb.get("/healthz")).status_code == 200
    # The run's state and counters come from the store: both replicas report them.
    check_store_metrics(after_a, expected)
    check_store_metrics(after_b, expected)
    # Timings: replica A's two workers summed (every request counted exactly once), replica B saw none.
    check_process_metrics(after_a, before_a, expected)
    scored = {"route": "/scored_data", "method": "POST"}
    assert total(after_b, "rollbuf_request_duration_seconds_count", **scored) == 0
    assert total(before_b, "rollbuf_request_duration_seconds_count", **scored) == 0

    lines = log_a.read_text().splitlines()
    logged = [line for line in lines if re.match(STAMP, line)]
    assert len(logged) == len(lines), [line for line in lines if not re.match(STAMP, line)][:5]
    healthz = {"route": "/healthz", "method": "GET", "status": "200"}
    grew = total(after_a, "rollbuf_request_duration_seconds_count", **healthz)
    assert grew - total(before_a, "rollbuf_request_duration_seconds_count", **healthz) == probes, "counted once each"
    pids = {dict(ls)["pid"] for (n, ls), _ in after_a.items() if n == "rollbuf_process_resident_memory_bytes"}
    assert len(pids) == 2, "one memory series per worker"
    batch_lines = [line for line in lines if "rollbuf: batch step=" in line]
    assert len(batch_lines) == expected.batches
    assert re.search(r"batch step=0 groups=2 sequences=8 tokens=64 mix=\[math_0=8\] formation_ms=\d", batch_lines[0])
    assert any(re.search(r"WARNING \[\d+\] rollbuf: refused POST /scored_data 422 .*field=masks", x) for x in lines)
    assert any(re.search(r"refused POST /scored_data 503 env=math_0 field=- rule=queue full", x) for x in lines)
    request_lines = [line for line in lines if "rollbuf.request: " in line]
    assert all(re.search(r"request_id=[0-9a-f]{16}$", line) for line in request_lines)


async def test_json_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with running_server("memory://", log, "--log-format", "json", "--log-level", "debug") as server:
        async with httpx.AsyncClient(base_url=server.url) as c:
            assert (await c.get("/status", headers={"X-Request-ID": "req-7"})).headers["x-request-id"] == "req-7"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert all({"time", "level", "logger", "message", "pid"} <= set(r) for r in records)
    assert any(r["logger"] == "rollbuf.request" and r["request_id"] == "req-7" for r in records)
    assert any(r["logger"] == "uvicorn.access" and "/status" in r["message"] for r in records)


async def test_metrics_on_two_postgresql_replicas(tmp_path: Path) -> None:
    """Two replicas (`rollbuf serve` processes) on one PostgreSQL database: both report the run's values."""
    with pg.database() as name:
        store = pg.url_of(name)
        with (
            running_server(store, tmp_path / "a.log", *LIMIT) as a,
            running_server(store, tmp_path / "b.log", *LIMIT) as b,
        ):
            async with fresh_connections(a.url) as ca, fresh_connections(b.url) as cb:
                before_a = parse_metrics((await ca.get("/metrics")).text)
                expected = await small_run(ca)
                await until_refusals_written(cb, expected)
                after_a = parse_metrics((await ca.get("/metrics")).text)
                after_b = parse_metrics((await cb.get("/metrics")).text)
                assert (await cb.get("/readyz")).status_code == 200
    check_store_metrics(after_a, expected)
    check_store_metrics(after_b, expected)
    check_process_metrics(after_a, before_a, expected)
