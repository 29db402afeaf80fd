"""Staleness pacing across processes: a trainer that syncs its weights every K steps at the least bound that
allows it (`max_staleness` K - 1), one producer process running three envs (or two, one of groups larger than
the others' whole share of a batch), a real server and the stand-in inference server. The runner's pacing
holds an env back only when what it would start would arrive stale; a batch short of sequences is never left
waiting on envs it holds back, so every run trains all its batches (rollout_client/runner/pacing.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runs import example_producer, example_trainer, poll_until, result
from tests.servers import running_server
from tests.standin import running_standin

pytestmark = pytest.mark.integration

STEPS = 12
"""Batches per run: at least four weight syncs at every interval tried (1, 2, 3), and what fits the suite's
time: the 7 runs take about 60 s on 2 busy cores, most of it spent starting their 4 processes each."""
NO_PROGRESS_S = 15.0
"""How long the trainer waits on a run every producer of which is held back before it gives up (exit 3)."""
HANG_GUARD_S = 240.0

CASES = (
    [pytest.param(32, ["4:1", "8:1", "4:1"], interval, id=f"G4-8-4-w1:1:1-sync{interval}") for interval in (1, 2, 3)]
    + [pytest.param(32, ["4:2", "8:1", "4:1"], interval, id=f"G4-8-4-w2:1:1-sync{interval}") for interval in (1, 2, 3)]
    + [pytest.param(64, ["8:1", "64:1"], 3, id="G8-64-w1:1-sync3")]
)


@pytest.mark.parametrize(("batch_size", "envs", "interval"), CASES)
def test_a_run_of_several_envs_at_the_least_staleness_bound_never_stalls(
    tmp_path: Path, batch_size: int, envs: list[str], interval: int
) -> None:
    bound = interval - 1
    out = tmp_path / "trainer.json"
    env_args = [a for spec in envs for a in ("--env", spec)]
    in_flight = str(max(int(spec.split(":")[0]) for spec in envs) * 2)
    with (
        running_server("memory://", tmp_path / "server.log") as server,
        running_standin(tmp_path / "vllm.log") as vllm,
        example_trainer(
            server.url,
            vllm.url,
            tmp_path / "trainer.log",
            out,
            steps=STEPS,
            batch_size=batch_size,
            max_staleness=bound,
            sync_every=interval,
            no_progress_timeout=NO_PROGRESS_S,
        ) as trainer,
        example_producer(
            server.url, vllm.url, tmp_path / "producer.log", *env_args, max_staleness=bound, max_in_flight=in_flight
        ),
    ):
        poll_until(lambda: trainer.poll() is not None, f"the trainer's {STEPS} steps", HANG_GUARD_S)
    run = result(out)
    trained = [s["step"] for s in run["steps"]]
    assert run["error"] is None, f"stalled after {len(trained)} batches: {run['error']}"
    assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    assert trained == list(range(STEPS))
    for s in run["steps"]:
        for g in s["groups"]:
            assert s["step"] - g["policy_step"] <= bound, g
