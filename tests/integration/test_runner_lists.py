"""The runner against a real server process (SQLite): groups that finish together go in /scored_data_list
requests (fewer requests than groups, as the server's /metrics count them), every group is stored exactly
once and counted once; with `submit_linger=0` each goes alone to /scored_data, as before coalescing. A list
the queue has room for only in part fills it group by group, to its limit."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rollout_client import Environment, RolloutRunner, ScriptedPolicy, Session, Task, Tasks, Timeouts
from rollout_client.examples import arithmetic_script, arithmetic_task
from rollout_client.runner.pacing import QUEUE_FULL
from tests.runs import HANG_GUARD_S, drain, start_trainer, status, until
from tests.servers import running_server
from tests.small_run import parse_metrics, total

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

WAVE = 32
"""Rollouts that finish together: each waits (bounded) until its wave has started."""
WAVE_GUARD_S = 20.0
STARTED: list[int] = [0]
WAVES: dict[int, asyncio.Event] = {}


def _wave(target: int) -> asyncio.Event:
    return WAVES.setdefault(target, asyncio.Event())


@dataclass
class Together(Environment):
    """Rollouts end in waves of WAVE, as groups do when many run at once against one inference server."""

    name: str = "together"
    group_size: int = 2

    async def rollout(self, task: Task, session: Session) -> None:
        await session.observe(task.prompt)
        STARTED[0] += 1
        target = -(-STARTED[0] // WAVE) * WAVE
        if STARTED[0] == target:
            _wave(target).set()
        with contextlib.suppress(TimeoutError):  # a wave that never fills must not hang the test
            await asyncio.wait_for(_wave(target).wait(), WAVE_GUARD_S)
        await session.generate()

    def score(self, task: Task, session: Session) -> float:
        return float((session.seed or 0) % 2)


@pytest.mark.parametrize("linger", [0.1, 0.0], ids=["coalesced", "linger-0"])
async def test_groups_finishing_together_go_in_lists_and_are_stored_once(tmp_path: Path, linger: float) -> None:
    STARTED[0] = 0
    WAVES.clear()
    groups = 3 * WAVE // 2  # three waves of rollouts, in groups of 2
    with running_server(f"sqlite:///{tmp_path / 'r.db'}", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=16)
        runner = RolloutRunner(
            server.url,
            [(Together(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=WAVE,
            timeouts=Timeouts(submit_linger=linger),
        )
        stats = await asyncio.wait_for(runner.run(max_groups=groups), HANG_GUARD_S)
        assert stats.produced == stats.accepted == groups and stats.duplicates == 0 and not stats.skipped
        samples = parse_metrics(httpx.get(server.url + "/metrics").text)
        requests = {
            route: total(samples, "rollbuf_request_duration_seconds_count", route=route, method="POST", status="200")
            for route in ("/scored_data", "/scored_data_list")
        }
        assert total(samples, "rollbuf_groups_received_total") == groups  # its one env
        if linger:
            assert requests["/scored_data_list"] >= 1 and sum(requests.values()) < groups, requests
        else:
            assert requests == {"/scored_data": groups, "/scored_data_list": 0}
        served = drain(server.url)
        assert len(served) + status(server.url)["queue_size"] == groups
        assert len({g["group_id"] for g in served}) == len(served), "no group stored twice"


async def test_a_list_the_queue_has_room_for_in_part_fills_it_group_by_group(tmp_path: Path) -> None:
    """Room for 5 groups, a wave of 16 in one list: the 503 for the whole list sends them alone, 5 are stored
    (as single submits would have filled it) and the runner sees the queue full."""
    STARTED[0] = 0
    WAVES.clear()
    with running_server("memory://", tmp_path / "s.log", "--max-queue-groups", "5", "--retry-after", "1") as server:
        start_trainer(server.url, batch_size=64)
        env = Together()
        runner = RolloutRunner(
            server.url,
            [(env, Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=WAVE,
            timeouts=Timeouts(submit_linger=0.1, shutdown=0.5),
        )
        run = asyncio.create_task(runner.run())
        await until(
            lambda: runner.stats.accepted == 5 and runner.stats.paused.get(env.name) == QUEUE_FULL,
            "the queue filled to its limit",
        )
        runner.stop()
        stats = await asyncio.wait_for(run, HANG_GUARD_S)
        samples = parse_metrics(httpx.get(server.url + "/metrics").text)
        refused = total(samples, "rollbuf_request_duration_seconds_count", route="/scored_data_list", status="503")
        assert refused >= 1 and status(server.url)["queue_size"] == stats.accepted == 5
