"""The drop-bias monitor on every store, fed by a run whose staleness bound drops the long, rewarding groups of
one env and every group of another: /status, /metrics and /dashboard/data show the skews and the starvation,
and each episode is logged once, however often it is polled and by however many processes."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from api.config.settings import Settings
from tests import pg
from tests.asgi import serving
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio

ROUNDS = 22
"""Enough for 20 trained and 40 dropped groups of math (the monitor judges a skew from 20 of each)."""


async def biased_run(c: httpx.AsyncClient) -> None:
    """math: each step one short, poorly scored group trained, two long, well scored ones gone stale; code: one group
    trained per step; rare (weight 2): every group stale, so it never gets a sequence."""
    reg = registration(batch_size=8, max_staleness=0)
    assert (await c.post("/register", json=reg)).status_code == 200
    await c.get("/batch")
    for name, weight in (("math", 1.0), ("code", 1.0), ("rare", 2.0)):
        assert (await c.post("/register-env", json=env(name, 4, weight=weight))).status_code == 200
    for step in range(ROUNDS):
        late = max(0, step - 1)
        good, poor = [1.0, 1.0, 1.0, float(step % 2)], [0.0, 0.0, float(step % 2), 1.0]
        groups: list[dict[str, Any]] = [
            group(4, length=64, env_id=0, seed=step, policy_step=late, scores=good),
            group(4, length=64, env_id=0, seed=100 + step, policy_step=late, scores=good),
            group(4, length=64, env_id=2, seed=200 + step, policy_step=late),
            group(4, length=8, env_id=0, seed=300 + step, policy_step=step, scores=poor),
            group(4, length=8, env_id=1, seed=400 + step, policy_step=step),
        ]
        if step == 0:  # nothing is stale at step 0: the late groups would be trained
            groups = groups[3:]
        assert (await c.post("/scored_data_list", json=groups)).status_code == 200
        formed = (await c.get("/batch")).json()["batch"]
        assert formed and len(formed) == 2


async def settled(c: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    """/status's drop_bias by env, once the monitor has seen every batch (it refreshes at most every second)."""
    with anyio.fail_after(15):
        while True:
            bias = {e["env"]: e for e in (await c.get("/status")).json()["drop_bias"]}
            if bias and bias["code_0"]["trained"] == ROUNDS:
                return bias
            await anyio.sleep(0.05)  # polling for the monitor's next refresh


async def test_skews_and_starvation_show_in_every_view(settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="rollbuf")
    async with serving(settings, drop_bias_starve_steps=3) as c:
        await biased_run(c)
        bias = await settled(c)
        math, code, rare = bias["math_0"], bias["code_0"], bias["rare_0"]
        assert math["flags"] == ["length_skew", "reward_skew"]
        assert math["trained"] == ROUNDS and math["dropped"] == {"stale": 2 * (ROUNDS - 1)}
        assert math["length_skew"] == pytest.approx(64 / 8 - 1) and math["reward_skew"] > 1
        assert rare["flags"] == ["starved"] and rare["share"] == 0 and rare["floor"] == 0.25
        assert rare["below_floor_steps"] == ROUNDS and rare["dropped"] == {"stale": ROUNDS - 1}
        assert code["flags"] == [] and code["share"] == 0.5

        metrics = (await c.get("/metrics")).text
        assert 'rollbuf_drop_bias_condition{condition="length_skew",env="math_0"} 1.0' in metrics
        assert 'rollbuf_drop_bias_condition{condition="starved",env="rare_0"} 1.0' in metrics
        assert 'rollbuf_drop_bias_condition{condition="starved",env="code_0"} 0.0' in metrics
        assert 'rollbuf_drop_bias_mean{env="math_0",fate="dropped",quantity="length"} 64.0' in metrics
        data = (await c.get("/dashboard/data")).json()["drop_bias"]
        assert [e["env"] for e in data["envs"]] == ["math_0", "code_0", "rare_0"]
        assert data["thresholds"]["starve_steps"] == 3

        for _ in range(3):  # polled again and again: nothing more is logged
            await c.get("/status")
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "drop bias" in r.getMessage()
    ]
    assert len([w for w in warnings if "'rare_0' is starved" in w]) == 1, warnings
    assert len([w for w in warnings if "skews env 'math_0' by length" in w]) == 1, warnings
    assert len([w for w in warnings if "skews env 'math_0' by reward" in w]) == 1, warnings


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_an_episode_is_logged_once_by_all_the_processes_sharing_a_store(
    kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two apps on one SQLite file or PostgreSQL database, as `--workers 2` or two replicas run them."""
    caplog.set_level(logging.INFO, logger="rollbuf")
    with contextlib.ExitStack() as stack:
        if kind == "postgresql":
            store = pg.url_of(stack.enter_context(pg.database()))
        else:
            store = f"sqlite:///{tmp_path / 'shared.db'}"
        settings = Settings(store=store, drop_bias_starve_steps=3)
        async with serving(settings) as first:
            await biased_run(first)
            await settled(first)
            async with serving(settings) as second:
                assert (await settled(second))["rare_0"]["flags"] == ["starved"]
                await settled(first)
    starved = [r for r in caplog.records if "'rare_0' is starved" in r.getMessage()]
    assert len(starved) == 1


async def test_without_the_ledger_the_monitor_is_off() -> None:
    async with serving(Settings(store="memory://"), ledger=False) as c:
        await c.post("/register", json=registration(batch_size=8))
        assert (await c.get("/status")).json()["drop_bias"] == []
        assert "rollbuf_drop_bias" not in (await c.get("/metrics")).text


async def test_the_monitor_counts_groups_passed_over(settings: Settings) -> None:
    """A survivor group passed over for whole ones behind it shows in the env's drop_bias entry."""
    async with serving(settings) as c:
        reg = registration(batch_size=256, max_token_len=64, no_exact_fill="wait")
        assert (await c.post("/register", json=reg)).status_code == 200
        await c.get("/batch")
        await c.post("/register-env", json=env("surv", 64, variable_group_size=True))
        for i, s in enumerate([61, 64, 64, 64, 64]):
            await c.post("/scored_data", json=group(s, length=4, seed=i, group_id=f"g{i}", logprobs=False))
        assert [g["group_id"] for g in (await c.get("/batch")).json()["batch"]] == ["g1", "g2", "g3", "g4"]
        with anyio.fail_after(15):
            while not (bias := (await c.get("/status")).json()["drop_bias"]):
                await anyio.sleep(0.05)  # polling for the monitor's next refresh
        assert {e["env"]: e["passed_over"] for e in bias} == {"surv_0": 1}


async def test_no_accepted_score_breaks_a_view(settings: Settings) -> None:
    """A group scoring 1e200 made GET /status 500 for good (OverflowError in the monitor), on every store: every
    view answers, with finite numbers or nulls, whatever finite scores were accepted."""
    big = 1.7976931348623157e308
    async with serving(settings) as c:
        assert (await c.post("/register", json=registration(batch_size=4))).status_code == 200
        await c.get("/batch")
        assert (await c.post("/register-env", json=env("math", 4))).status_code == 200
        for i, scores in enumerate([[1e200] * 4, [0.0, 1e200, -1e200, 1.0], [big, -big, big, -big], [5e-324] * 4]):
            body = group(4, env_id=0, seed=i, scores=scores)
            assert (await c.post("/scored_data", json=body)).status_code == 200
            assert (await c.get("/batch")).status_code == 200
        with anyio.fail_after(15):
            while not (bias := (await c.get("/status")).json()["drop_bias"]) or bias[0]["trained"] < 4:
                await anyio.sleep(0.05)  # polling for the monitor's next refresh
        for path in ("/status", "/metrics", "/dashboard/data", "/ledger/steps/1"):
            reply = await c.get(path)
            assert reply.status_code == 200, (path, reply.text)
            if path == "/metrics":  # NaN is Prometheus's stated "none yet"; an infinite value is no answer
                values = [line.rsplit(" ", 1)[1] for line in reply.text.splitlines() if not line.startswith("#")]
                assert not {"+Inf", "-Inf", "inf", "-inf"} & set(values)
            else:
                assert "NaN" not in reply.text and "Infinity" not in reply.text, path


async def test_the_dashboard_reads_no_unchanged_env_and_converts_a_report_once(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/dashboard/data with 10,000 envs: a poll that re-read and parsed every env (twice) and converted the
    drop-bias report's 10,000 entries again took 0.47 s. Envs unchanged since this process read them are
    not read, and a report is converted once."""
    import api.ledger.drop_bias
    import api.run.state

    await client.post("/register", json=registration(batch_size=4))
    await client.get("/batch")
    for i in range(3):
        await client.post("/register-env", json=env(desired_name=f"e{i}", group_size=4))
    applied: list[int] = []
    real_apply = api.run.state._apply
    monkeypatch.setattr(
        api.run.state, "_apply", lambda envs, changed: (applied.append(len(changed)), real_apply(envs, changed))
    )
    converted: list[int] = []
    real_json = api.ledger.drop_bias.Report.to_json
    monkeypatch.setattr(api.ledger.drop_bias.Report, "to_json", lambda self: (converted.append(1), real_json(self))[1])
    first = (await client.get("/dashboard/data")).json()  # may refresh the drop-bias report (it reads the envs)
    applied.clear()
    second = (await client.get("/dashboard/data")).json()
    assert [e["name"] for e in second["envs"]] == [e["name"] for e in first["envs"]] == ["e0_0", "e1_0", "e2_0"]
    assert first["drop_bias"] is not None and second["drop_bias"] == first["drop_bias"]
    assert sum(applied) == 0  # every env was known to this process already (2 x 3 parsed before)
    assert len(converted) <= 1  # once per report (the first poll may refresh it)
