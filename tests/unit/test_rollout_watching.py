"""The runner's watch on the server's reasons (rollout_client/watching.py): told once per kind of block."""

from __future__ import annotations

import logging

import pytest

from api.schema import EnvStatus
from rollout_client import RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task


def _status(reason: str | None) -> EnvStatus:
    return EnvStatus.model_construct(blocked_reason=reason)


def test_the_same_block_with_new_numbers_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A commit-mode trainer at its read-ahead bound names a new step every episode: one warning, not one per
    episode; a different block, and the end of the block, are told again."""
    runner = RolloutRunner(
        "http://127.0.0.1:9", [(Arithmetic(), Tasks(arithmetic_task))], ScriptedPolicy(arithmetic_script)
    )
    caplog.set_level(logging.INFO, "rollout_client.runner")
    for step in range(5):
        runner._check_server([_status(f"the trainer read ahead to step {step + 3} without committing {step}")])
    assert runner.health().server_blocked == "the trainer read ahead to step 7 without committing 4"
    runner._check_server([_status("env 'odd' queues sizes [63] that cannot add up")])
    runner._check_server([_status(None)])
    told = [r.getMessage() for r in caplog.records]
    assert sum("can form no batch" in m for m in told) == 2, told
    assert sum("forms batches again" in m for m in told) == 1, told
    assert runner.health().server_blocked is None
