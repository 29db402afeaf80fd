"""TRL 1.16's `AsyncGRPOTrainer` trained on rollbuf batches, on CPU, against a real server process: a tiny Llama
(tests/trl_trainer.py) trains 3 steps with a finite loss and changed parameters, one rollbuf batch per optimizer
step; then a run killed -9 after a checkpoint resumes from it and trains every batch exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.servers import ServerProcess, start_server
from tests.trl_trainer import BATCH_SIZE, REGISTRATION, VOCAB
from trainer_client.protocol import registration

pytest.importorskip("trl", reason="the trl extra (make test installs it)")

GROUP = 4
RUN_S = 600.0
"""A generous bound on one trainer process: importing torch and TRL, then a few steps on 2 busy cores."""


def groups(url: str, n: int) -> None:
    """Register the run and an env, then post `n` groups of 4 (two per batch), tokens within the tiny vocab."""
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/register", json=registration(**REGISTRATION)).status_code == 200
        c.get("/batch", params={"step": 0})
        env = {"max_token_length": 32, "desired_name": "tiny", "weight": 1.0, "group_size": GROUP}
        assert c.post("/register-env", json=env).status_code == 200
        for g in range(n):
            tokens = rng.integers(3, VOCAB, (GROUP, 12))
            masks = tokens.copy()
            masks[:, :4] = -100
            logprobs = np.where(masks == -100, 0.0, -rng.exponential(1.0, tokens.shape))
            body = {
                "tokens": tokens.tolist(),
                "masks": masks.tolist(),
                "scores": rng.random(GROUP).tolist(),
                "inference_logprobs": logprobs.tolist(),
                "env_id": 0,
                "group_id": f"g{g}",
            }
            assert c.post("/scored_data", json=body).status_code == 200


def trainer(url: str, out: Path, max_steps: int, *, resume: bool = False) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests.trl_trainer", url, str(out), str(max_steps), *(["--resume"] if resume else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    with (out / "trainer.log").open("ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def finish(proc: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    try:
        code = proc.wait(timeout=RUN_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 0, (out / "trainer.log").read_text()[-6000:]
    return dict(json.loads((out / "result.json").read_text()))


def one_batch_per_step(taken: list[int], start: int, steps: int) -> None:
    """The samples taken, in order, are whole rollbuf batches from `start` on, one per optimizer step (beyond
    them, at most the data loader's look-ahead of the next one)."""
    whole = [start + k for k in range(steps) for _ in range(BATCH_SIZE)]
    assert taken[: len(whole)] == whole
    assert set(taken[len(whole) :]) <= {start + steps} and len(taken) - len(whole) < BATCH_SIZE


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(f"sqlite:///{tmp_path / 'rollbuf.db'}", tmp_path / "server.log")
    try:
        yield proc
    finally:
        proc.kill(signal.SIGTERM)


def test_async_grpo_trains_one_rollbuf_batch_per_step(server: ServerProcess, tmp_path: Path) -> None:
    groups(server.url, 2 * 3 + 4)
    result = finish(trainer(server.url, tmp_path, 3), tmp_path)
    assert result["global_step"] == 3 and result["changed"] and result["finite"] and len(result["losses"]) == 3
    assert result["start_step"] == 0 and result["syncs"] == 4  # the first sync, then one per step
    one_batch_per_step(result["taken"], 0, 3)
    assert result["committed"] == [2, 3]  # the checkpoints at global steps 2 and 3 (the end)
    status = httpx.get(server.url + "/status").json()
    assert status["committed_step"] == 3


def test_a_killed_trainer_resumes_from_its_checkpoint_and_trains_every_batch_once(
    server: ServerProcess, tmp_path: Path
) -> None:
    groups(server.url, 2 * 6 + 4)
    first = trainer(server.url, tmp_path, 6)
    deadline = time.monotonic() + RUN_S
    state = tmp_path / "run" / "checkpoint-2" / "rollbuf_state.json"
    while not state.exists():  # polling for the first checkpoint, then kill -9 at once
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()[-6000:]
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    checkpoints = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*"))
    resumed_at = checkpoints[-1]
    assert not (tmp_path / "result.json").exists(), "the first run ended before it was killed"
    result = finish(trainer(server.url, tmp_path, 6, resume=True), tmp_path)
    assert result["resumed_from"].endswith(f"checkpoint-{resumed_at}") and result["global_step"] == 6
    assert result["start_step"] == resumed_at  # exactly the batch after the checkpoint, served again
    one_batch_per_step(result["taken"], resumed_at, 6 - resumed_at)
    status = httpx.get(server.url + "/status").json()
    assert (status["committed_step"], status["kept_batches"]) == (6, status["current_step"] - 6)
