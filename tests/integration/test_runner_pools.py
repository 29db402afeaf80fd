"""Shared resource pools of unknown size (no `max_resources`) against real rollbuf server processes and the
stand-in's capped sandbox pool: groups that would each hold part of the pool take turns to acquire and finish,
and a group that still waits for part of it is named in a warning with the fix. The docs' `Sandboxed` env is
test_runner_agentic.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollout_client import RolloutRunner, ScriptedPolicy, Tasks, Timeouts, resources
from rollout_client.examples import arithmetic_script, arithmetic_task
from tests.integration.test_runner_agentic import Sandboxed, finish, until
from tests.runs import start_trainer
from tests.servers import running_server
from tests.standin import running_standin

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_groups_on_a_blocking_pool_without_max_resources_take_turns_and_finish(tmp_path: Path) -> None:
    """The docs' Sandboxed env without max_resources on a blocking pool of 8, G=8, 16 in flight: acquiring at
    once, two groups each took part of the pool and waited for the rest, forever. Its groups take turns to
    acquire (the turn kept by the runner, told by the worker when a group holds all its units), so each gets
    its 8 as the one before ends. In process: tests/unit/rollout_client/test_rollout_resources.py."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as pool:
        start_trainer(server.url, batch_size=8)
        env = Sandboxed(pool_url=pool.url)
        runner = RolloutRunner(
            server.url,
            [(env, Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=16,
            num_workers=1,
        )
        stats = await finish(runner.run(max_groups=2))  # both start at once
        seen = pool.stats()
        assert stats.accepted == 2 and not stats.failed
        assert seen["sandbox_acquired"] == 2 * 8 and seen["sandbox_held"] == 0


async def test_a_group_that_still_waits_for_part_of_a_pool_is_named_in_a_warning_with_the_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What turns cannot fix: a blocking pool of 6 for groups of 8 (or one another producer holds). The group
    holding 6 waits for the rest; once it has waited too long a warning names the env, what keeps the units
    and the fix (max_resources)."""
    monkeypatch.setattr(resources, "HOLD_WARN_S", 1.0)
    resources._warned_pools.clear()
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as pool:
        pool.control(sandboxes=6)
        start_trainer(server.url, batch_size=8)
        env = Sandboxed(pool_url=pool.url)
        runner = RolloutRunner(
            server.url,
            [(env, Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=16,
            timeouts=Timeouts(release=1.0),
        )
        run = asyncio.create_task(runner.run())
        try:
            await until(lambda: "max_resources" in caplog.text, "the warning")
        finally:
            runner.stop()
            await finish(run)
        [record] = [r for r in caplog.records if "max_resources" in r.getMessage()]
        assert record.levelname == "WARNING"
        message = record.getMessage()
        assert "env 'sandboxed': a group has held 6 of its 8 resources" in message
        assert "a pool of fewer than 8 units" in message and "another producer" in message
        assert "Set max_resources = <the pool's capacity> on Sandboxed" in message
