"""The docs' runnable examples (docs/examples/) run as written, against a real rollbuf server and the stand-in
inference process's capped sandbox pool, and the pages that show them show them whole (they cannot drift)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.wire.records import MSGPACK, encode_submission, encode_submission_list
from demos.standin_inference import MODEL
from tests.factories import group
from tests.runs import finish, start_trainer
from tests.servers import running_server
from tests.standin import running_standin
from trainer_client.protocol import registration

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "read_ahead_trainer.py": "training.md",
    "sandboxed_pool.py": "rollout-client-pools.md",
    "submit_groups.py": "rollout-client.md",
    "sums.py": "rollout-client.md",
    "sync_trainer.py": "rollout-client-runner.md",
    "vllm_sampling.py": "training.md",
    "weight_sync_trainer.py": "trainer-client.md",
}
"""Each example, and the page that shows it in a python block."""


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_page_shows_the_example_whole(example: str) -> None:
    code = (ROOT / "docs" / "examples" / example).read_text()
    assert f"```python\n{code}```" in (ROOT / "docs" / EXAMPLES[example]).read_text()


def test_the_sandboxed_pool_example_runs_as_written(tmp_path: Path) -> None:
    """Two worker processes, G=8 on a pool of 8, 16 in flight: no deadlock, every sandbox given back."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as pool:
        start_trainer(server.url, batch_size=8)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "ROLLBUF_URL": server.url,
            "SANDBOX_URL": pool.url + "/sandbox",
            "MAX_GROUPS": "4",
        }
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "docs" / "examples" / "sandboxed_pool.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env,
            cwd=tmp_path,
        )
        code, out, err = finish(proc, 120)
        assert code == 0, err[-3000:]
        assert out.strip() == "4 groups accepted, 0 failed"
        seen = pool.stats()
        assert seen["sandbox_acquired"] == 32 and seen["sandbox_held"] == 0 and seen["sandbox_max_held"] <= 8


def run_example(example: str, tmp_path: Path, **env: str) -> str:
    """Run docs/examples/<example> as a user would (its own process, env vars for the URLs); its stdout."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "docs" / "examples" / example)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env=environ,
        cwd=tmp_path,
    )
    code, out, err = finish(proc, 120)
    assert code == 0, err[-3000:]
    return out


def test_the_rollout_client_example_submits_a_group_as_written(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "s.log") as server:
        start_trainer(server.url, batch_size=8)
        assert run_example("submit_groups.py", tmp_path, ROLLBUF_URL=server.url).strip() == "received 1"


def test_the_environment_example_runs_with_its_workers_as_written(tmp_path: Path) -> None:
    """docs/rollout-client.md's `Sums` and its runner (2 worker processes, an OpenAI-compatible policy) against
    the stand-in inference server: every group accepted."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=8)
        out = run_example(
            "sums.py", tmp_path, ROLLBUF_URL=server.url, INFERENCE_URL=vllm.url, MODEL=MODEL, MAX_GROUPS="4"
        )
        assert out.strip() == "4 groups accepted, 0 failed"
        assert vllm.stats()["200"] >= 16  # 4 groups of G=4, each a completion


def test_the_synchronous_trainer_example_trains_and_syncs_as_written(tmp_path: Path) -> None:
    """docs/rollout-client-runner.md's synchronous trainer: its producer in a thread, paused around each of two
    weight syncs (announced through rollbuf), 4 batches of 8 sequences, nothing failed; the lag back to 0 each
    sync."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        out = run_example("sync_trainer.py", tmp_path, ROLLBUF_URL=server.url, INFERENCE_URL=vllm.url, MODEL=MODEL)
    lines = out.strip().splitlines()
    assert [line.split()[:3] for line in lines[:4]] == [[str(s), "8", "0"] for s in range(4)], out
    assert lines[4].endswith("groups accepted") and int(lines[4].split()[0]) >= 8


def test_bring_your_environment_sums_runs_as_written(tmp_path: Path) -> None:
    """docs/bring-your-environment.md's own-Environment block, as written but for its two addresses and the
    model's name, builds a runner that produces groups against a real server and the stand-in inference."""
    page = (ROOT / "docs" / "bring-your-environment.md").read_text()
    section = page.split("## 3. rollbuf's own Environment", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert block is not None
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=8)
        code = (
            block.group(1)
            .replace("http://127.0.0.1:8000", server.url)
            .replace("http://127.0.0.1:9000", vllm.url)
            .replace('"my-model"', repr(MODEL))
        )
        scope: dict[str, Any] = {"__name__": "docs_byo_env"}
        exec(compile(code, "bring-your-environment.md", "exec"), scope)
        runner = scope["runner"]

        async def produce() -> Any:
            try:
                return await asyncio.wait_for(runner.run(max_groups=2), 60)
            finally:  # the page's policy is the caller's to close (the runner closes only what it built)
                await runner.policy_spec.aclose()

        stats = asyncio.run(produce())
    assert stats.accepted == 2 and stats.failed_total == 0


def scored_groups(url: str, groups: int, **register: Any) -> None:
    """The run registered as the example registers it, and `groups` scored groups of 4 queued for its batches."""
    body = encode_submission_list(encode_submission(**group(4, env_id=None, seed=g)) for g in range(groups))
    with httpx.Client(base_url=url) as http:
        assert http.post("/register", json=registration(starting_step=0, **register)).status_code == 200
        assert http.post("/scored_data_list", content=body, headers={"Content-Type": MSGPACK}).status_code == 200


def test_the_read_ahead_trainer_resumes_at_its_checkpoint_as_written(tmp_path: Path) -> None:
    """docs/training.md's trainer that reads ahead: a first run trains 3 steps (its loader read past them) and
    checkpoints and commits only step 2; run again, it resumes at 2 and gets batch 2 again, the same batch, then
    3 to 5: nothing skipped for the read-ahead, nothing the checkpoint holds trained twice."""
    # The second run ends with its loader long-polling for batch 6; the server waits out such a request (its
    # client gone) for shutdown_timeout when it stops: 1 s, not 5, for this test.
    with running_server("memory://", tmp_path / "s.log", "--shutdown-timeout", "1") as server:
        scored_groups(server.url, 12, batch_size=8, max_token_len=64, acknowledge="commit")
        first = run_example("read_ahead_trainer.py", tmp_path, ROLLBUF_URL=server.url, NUM_STEPS="3").splitlines()
        again = run_example("read_ahead_trainer.py", tmp_path, ROLLBUF_URL=server.url, NUM_STEPS="6").splitlines()
    assert [line.split(":")[0] for line in first] == ["step 0", "step 1", "step 2"], first
    assert [line.split(":")[0] for line in again] == ["step 2", "step 3", "step 4", "step 5"], again
    assert again[0] == first[2] and all(" 8 sequences" in line for line in first + again)


def test_the_weight_sync_trainer_announces_each_sync_as_written(tmp_path: Path) -> None:
    """docs/trainer-client.md's weight sync: two batches, each followed by a sync that begins, finds no drain
    producer to wait for, pushes and announces; the server then has the weights of step 2 live."""
    with running_server("memory://", tmp_path / "s.log") as server:
        scored_groups(server.url, 4, batch_size=8, max_token_len=64)
        out = run_example("weight_sync_trainer.py", tmp_path, ROLLBUF_URL=server.url)
        assert httpx.get(server.url + "/status").json()["weights_step"] == 2
    assert out.splitlines() == [
        "pushed the weights for step 1",
        "step 0: drained True, weights of step 1 live",
        "pushed the weights for step 2",
        "step 1: drained True, weights of step 2 live",
    ]


def test_the_vllm_sampling_example_produces_as_written(tmp_path: Path) -> None:
    """docs/training.md's sampling through `OpenAIPolicy` with worker processes, against the stand-in inference
    server: every group accepted (as the page had it, an OpenAIPolicy given to a runner with workers failed
    the run as it started: "cannot pickle '_thread.RLock' object")."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=8)
        out = run_example(
            "vllm_sampling.py", tmp_path, ROLLBUF_URL=server.url, INFERENCE_URL=vllm.url, MODEL=MODEL, MAX_GROUPS="2"
        )
        assert out.strip() == "2 groups accepted, 0 failed"


def test_the_read_ahead_trainer_finishes_fed_by_the_sums_producer(tmp_path: Path) -> None:
    """docs/training.md's read-ahead trainer fed by docs/rollout-client.md's sums.py producer, both as written,
    run together to the trainer's last step."""
    with (
        running_server("memory://", tmp_path / "s.log", "--shutdown-timeout", "1") as server,
        running_standin(tmp_path / "v.log") as vllm,
    ):
        environ = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "ROLLBUF_URL": server.url,
            "INFERENCE_URL": vllm.url,
            "MODEL": MODEL,
        }
        producer = subprocess.Popen(
            [sys.executable, str(ROOT / "docs" / "examples" / "sums.py")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=environ,
            cwd=tmp_path,
        )
        try:
            out = run_example("read_ahead_trainer.py", tmp_path, ROLLBUF_URL=server.url, NUM_STEPS="6")
        finally:
            os.killpg(producer.pid, signal.SIGINT)
            finish(producer, 60)
    assert [line.split(":")[0] for line in out.splitlines()] == [f"step {s}" for s in range(6)], out
