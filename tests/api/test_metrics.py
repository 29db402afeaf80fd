"""/metrics, /healthz, /readyz and the server's log lines, after a small run on each backend."""

from __future__ import annotations

import json
import logging
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api import logs
from api.app import create_app
from api.batches import service as batches_flow
from api.config.settings import Settings
from api.logs import RateLimiter
from api.meters import TimedStore
from api.store.base import Store
from tests.factories import registration
from tests.small_run import MAX_ENV_QUEUE_GROUPS, check_process_metrics, check_store_metrics, parse_metrics, small_run

pytestmark = pytest.mark.anyio

DOCS = Path(__file__).parents[2] / "docs"


@pytest.fixture
async def run_client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings.model_copy(update={"max_env_queue_groups": MAX_ENV_QUEUE_GROUPS}))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            yield c


async def test_every_metric_after_a_small_run(run_client: httpx.AsyncClient) -> None:
    before = parse_metrics((await run_client.get("/metrics")).text)
    expected = await small_run(run_client)
    reply = await run_client.get("/metrics")
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = parse_metrics(reply.text)
    check_store_metrics(after, expected)
    check_process_metrics(after, before, expected)


async def test_reset_clears_the_run_counters(run_client: httpx.AsyncClient) -> None:
    await small_run(run_client)
    await run_client.get("/reset_data")
    samples = parse_metrics((await run_client.get("/metrics")).text)
    assert samples[("rollbuf_batches_total", ())] == 0
    assert samples[("rollbuf_step", ())] == 0
    assert not [k for k in samples if k[0] == "rollbuf_groups_received_total"]


async def test_metrics_off(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"metrics": False}))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            assert (await c.get("/metrics")).status_code == 404
            assert (await c.get("/dashboard/data")).status_code == 200
            assert "x-request-id" not in (await c.get("/healthz")).headers


async def test_probes(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).json() == {"status": "ok"}


async def test_readyz_is_503_while_the_sqlite_file_is_locked(tmp_path: Path) -> None:
    """Another process holding SQLite's write lock: the store does not answer within 2 s."""
    db = tmp_path / "r.db"
    app = create_app(Settings(store=f"sqlite:///{db}"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            assert (await c.get("/readyz")).status_code == 200
            holder = sqlite3.connect(db, isolation_level=None)
            holder.execute("BEGIN EXCLUSIVE")
            try:
                reply = await c.get("/readyz")
                assert reply.status_code == 503
                assert reply.json()["code"] == "unavailable"  # the one error shape
                assert (await c.get("/healthz")).status_code == 200  # the process still answers
            finally:
                holder.execute("ROLLBACK")
                holder.close()
            assert (await c.get("/readyz")).status_code == 200


async def test_probes_and_dashboard_page_are_open_metrics_need_the_key(tmp_path: Path) -> None:
    app = create_app(Settings(store="memory://", api_key="s3cret"))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            for path in ("/healthz", "/readyz", "/dashboard"):
                assert (await c.get(path)).status_code == 200, path
            for path in ("/metrics", "/dashboard/data"):
                assert (await c.get(path)).status_code == 401, path
                assert (await c.get(path, headers={"Authorization": "Bearer s3cret"})).status_code == 200


async def test_request_id_is_echoed_or_made(client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="rollbuf.request"):
        echoed = await client.get("/status", headers={"X-Request-ID": "trace-42"})
        made = await client.get("/status")
    assert echoed.headers["x-request-id"] == "trace-42"
    assert len(made.headers["x-request-id"]) == 16
    lines = [r.getMessage() for r in caplog.records if r.name == "rollbuf.request"]
    assert any("GET /status 200" in line and "request_id=trace-42" in line for line in lines)
    assert any(f"request_id={made.headers['x-request-id']}" in line for line in lines)


async def test_log_lines_of_a_small_run(
    run_client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "REFUSALS", logs.RateLimiter())  # earlier tests' refusals are not held against it
    with caplog.at_level(logging.INFO, logger="rollbuf"):
        await small_run(run_client)
    lines = [r.getMessage() for r in caplog.records if r.name == "rollbuf"]
    batches = [line for line in lines if line.startswith("batch step=")]
    assert len(batches) == 3
    assert batches[0].startswith("batch step=0 groups=2 sequences=8 tokens=64 mix=[math_0=8] formation_ms=")
    assert "mix=[math_0=4 code_0=4]" in batches[2] or "mix=[code_0=4 math_0=4]" in batches[2]
    refused = [line for line in lines if line.startswith("refused")]
    assert any(" 422 " in line and "field=masks" in line for line in refused), refused
    assert any(" 503 " in line and "env=math_0" in line and "queue full" in line for line in refused), refused


async def test_a_long_poll_that_stalls_logs_why(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batches_flow, "STALL_WARN_S", 0.2)
    monkeypatch.setattr(batches_flow, "STALLS", RateLimiter(interval=0.2, burst=1))  # not another test's
    await client.post("/register", json=registration(batch_size=8))
    with caplog.at_level(logging.WARNING, logger="rollbuf"):
        reply = await client.get("/batch", params={"wait": 0.8})
    assert reply.json()["batch"] is None
    stalls = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stall:")]
    assert stalls and "waiting for data: 0 of 8 sequences queued" in stalls[0], stalls


async def test_grafana_dashboard_and_docs_name_only_metrics_that_exist(run_client: httpx.AsyncClient) -> None:
    await small_run(run_client)
    text = (await run_client.get("/metrics")).text
    served = {name for name, _ in parse_metrics(text)}
    dashboard = json.loads((DOCS / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"rollbuf_[a-z_]+", e)}
    assert used and used <= served, used - served
    documented = set(re.findall(r"^\| `(rollbuf_[a-z_]+)` \|", (DOCS / "observability.md").read_text(), re.M))
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in served}
    # A labelled counter has no series until its first sample (a refusal of another key's resource): declared all
    # the same, whether or not a test before this one in the process made one.
    families |= {f.name + "_total" if f.type == "counter" else f.name for f in text_string_to_metric_families(text)}
    assert documented == families, documented ^ families


async def test_per_env_series_are_capped_and_the_rest_summed() -> None:
    """10,000 envs made /metrics 12.9 MB: past `metrics_max_envs` the rest are summed under one label."""
    from tests.factories import env, group

    app = create_app(Settings(store="memory://", metrics_max_envs=3))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            await c.post("/register", json=registration(batch_size=64))
            await c.get("/batch")
            for i in range(10):
                env_id = (await c.post("/register-env", json=env(f"e{i}", 4))).json()["env_id"]
                assert (await c.post("/scored_data", json=group(4, env_id=env_id, seed=i))).status_code == 200
            samples = parse_metrics((await c.get("/metrics")).text)
    received = {k[1]: v for k, v in samples.items() if k[0] == "rollbuf_groups_received_total"}
    assert received == {
        (("env", "e0_0"),): 1,
        (("env", "e1_0"),): 1,
        (("env", "e2_0"),): 1,
        (("env", "(other envs)"),): 7,
    }
    assert samples[("rollbuf_envs", ())] == 10
    assert sum(v for k, v in samples.items() if k[0] == "rollbuf_queue_groups") == 10


def test_the_timed_store_passes_on_every_store_method() -> None:
    """The store the app uses is wrapped to time its transactions: a `Store` method it does not override would
    answer with the base class's default instead of the backend's (as `expecting` once did, and the SQL
    stores' group commit never heard of the requests being prepared)."""
    methods = {name for name, value in vars(Store).items() if callable(value) and not name.startswith("_")}
    assert methods <= set(vars(TimedStore)), f"not passed on: {sorted(methods - set(vars(TimedStore)))}"
