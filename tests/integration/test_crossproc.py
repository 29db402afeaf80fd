"""The run across processes: a trainer process, the rollbuf server, the stand-in inference server and a producer
process, each its own process as in a deployment. The trainer syncs its weights to the inference server and
announces them through rollbuf; the producer follows without pause/resume: with drain, every trained token comes
from the weights its group is stamped with; a producer held back by weights never announced says so, and a
producer killed -9 is marked gone within `producer_gone_after`, after which the trainer is told why nothing comes
and raises. The documented layout itself, from an installed wheel: tests/test_four_process_layout.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_client import RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task
from tests.factories import registration
from tests.runs import HANG_GUARD_S, example_producer, example_trainer, poll_until, result, status
from tests.servers import running_server
from tests.standin import running_standin

pytestmark = pytest.mark.integration

GONE_AFTER = 2.0
ROOT = Path(__file__).resolve().parents[2]


def test_a_producer_killed_is_marked_gone_and_the_waiting_trainer_is_told_why_then_raises(tmp_path: Path) -> None:
    out = tmp_path / "trainer.json"
    no_progress = 3.0
    with (
        running_server("memory://", tmp_path / "server.log", "--producer-gone-after", str(GONE_AFTER)) as server,
        running_standin(tmp_path / "vllm.log") as vllm,
        example_trainer(
            server.url, vllm.url, tmp_path / "trainer.log", out, steps=100000, no_progress_timeout=no_progress
        ) as trainer,
        example_producer(server.url, vllm.url, tmp_path / "producer.log") as producer,
    ):
        poll_until(lambda: status(server.url)["current_step"] >= 3 and bool(status(server.url)["producers"]), "batches")
        assert status(server.url)["stall_reason"] is None
        os.killpg(producer.pid, signal.SIGKILL)
        killed = time.monotonic()
        gone = poll_until(lambda: not status(server.url)["producers"][0]["live"], "the producer marked gone", 30)
        assert gone <= GONE_AFTER + 2.0
        reply = httpx.get(server.url + "/batch", timeout=10).json()
        assert reply["batch"] is None and "no live producer for env(s) turns_0" in reply["stall_reason"]
        poll_until(lambda: trainer.poll() is not None, "the trainer to give up", 60)
        waited = time.monotonic() - killed
    assert trainer.returncode == 3
    error = result(out)["error"]
    assert error.startswith("no batch can come: for ") and "no live producer for env(s) turns_0" in error
    assert waited <= GONE_AFTER + no_progress + 10  # a poll (2 s long-poll) and the process's exit on a busy machine
    log = (tmp_path / "trainer.log").read_text()
    assert "nothing can arrive: no live producer" in log


def test_with_drain_no_token_of_a_group_is_sampled_by_weights_other_than_its_stamp(tmp_path: Path) -> None:
    """on_new_weights="drain" across processes: the trainer syncs inside `weight_sync`, the producer (3-turn
    episodes, several groups in flight) finishes its episodes before each push and starts none until the
    announcement, so every trained token of every group comes from the weights it is stamped with."""
    out = tmp_path / "trainer.json"
    with (
        running_server("memory://", tmp_path / "server.log") as server,
        running_standin(tmp_path / "vllm.log") as vllm,
    ):
        httpx.post(vllm.url + "/control", json={"latency": 0.01}).raise_for_status()
        with (
            example_trainer(
                server.url, vllm.url, tmp_path / "trainer.log", out, steps=8, drain=True, max_staleness=1
            ) as trainer,
            example_producer(
                server.url, vllm.url, tmp_path / "producer.log", on_new_weights="drain", turns=3, max_staleness=1
            ) as producer,
        ):
            poll_until(lambda: trainer.poll() is not None, "the trainer's 8 steps")
            assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
            assert producer.poll() is None
    run = result(out)
    assert run["undrained_syncs"] == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    groups = [g for s in run["steps"] for g in s["groups"]]
    for g in groups:
        assert g["generated_with"] == [g["policy_step"]], g  # one version, the stamp's: no episode spans a sync
        assert g["weight_versions"] == [g["policy_step"]] * 2, g
    assert len({g["policy_step"] for g in groups}) >= 4  # the producer followed the syncs
    assert "drained for the weight sync to step" in (tmp_path / "producer.log").read_text()
    assert "waits for 1 producer(s) to drain" in (tmp_path / "trainer.log").read_text()  # who it waits for


@pytest.mark.anyio
async def test_a_producer_held_back_by_weights_never_announced_says_so_and_so_does_the_trainers_reply(
    tmp_path: Path,
) -> None:
    """The trainer announced step 0 once, then moves on without announcing: with `max_staleness` the producer is
    held back; its health says what is missing, and the trainer's /batch says every live producer is held back."""
    with running_server("memory://", tmp_path / "s.log", "--producer-gone-after", "1.2") as server:
        with httpx.Client(base_url=server.url) as http:
            assert http.post("/register", json=registration(batch_size=8)).status_code == 200
            http.get("/batch")
            http.post("/weights", json={"step": 0}).raise_for_status()
        runner = RolloutRunner(
            server.url,
            [(Arithmetic(), Tasks(arithmetic_task))],
            ScriptedPolicy(arithmetic_script),
            max_in_flight=8,
            max_staleness=1,
            stall_warning=0.5,
            poll_interval=0.05,
        )
        run = asyncio.create_task(runner.run())
        reply: dict[str, Any] = {}
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            deadline = asyncio.get_running_loop().time() + HANG_GUARD_S
            while runner.health().stalled is None or "stall_reason" not in reply:  # the trainer takes what it gets
                assert asyncio.get_running_loop().time() < deadline, ("no stall reported", reply)
                reply = (await http.get("/batch")).json()
                await asyncio.sleep(0.05)  # polling interval
        assert "the trainer announced no weights after step 0 (POST /weights)" in (runner.health().stalled or "")
        assert reply["stall_reason"].startswith("every live producer is held back waiting for the trainer")
        assert "arithmetic_0 held back (ahead_of_trainer)" in reply["stall_reason"]
        runner.stop()
        await asyncio.wait_for(run, HANG_GUARD_S)
