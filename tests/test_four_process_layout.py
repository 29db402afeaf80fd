"""docs/bring-your-environment.md's four-process layout, run as the page writes it from an installed wheel: rollbuf
built into a wheel and installed by pip in a new virtualenv (`wheels.py`), the page's four command lines run each
as its own process from an empty directory with that virtualenv's `bin` first on PATH (free ports in place of 8000
and 9000). The run ends on its own: the trainer trains its 20 steps, every group stamped with weights at most
`max_staleness` behind and never newer than those that sampled its tokens, and exits 0 once the run is finished;
the producer exits 0 once its dataset is done; the server, stopped with SIGTERM, shuts down cleanly."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.servers import free_port
from tests.wheels import ROOT, alone_environ, build_wheel, install, rollbuf_sources, run_alone

pytestmark = pytest.mark.integration

HANG_GUARD_S = 180.0
"""Bounds on waits for processes and the run: hang guards for a loaded machine, never speed checks."""
STEPS = 20
"""The page's run: 40 tasks of groups of 2 into batches of 4."""


def page_lines() -> list[str]:
    """The four command lines of the page's "The four-process layout" (its first bash block)."""
    page = (ROOT / "docs" / "bring-your-environment.md").read_text()
    section = page.split("## The four-process layout", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert block is not None
    lines = block.group(1).strip().splitlines()
    assert [shlex.split(line)[:2] for line in lines] == [
        ["rollbuf", "serve"],
        ["rollbuf", "standin-inference"],
        ["rollbuf", "example-trainer"],
        ["rollbuf", "example-producer"],
    ]
    return lines


def until(cond: Callable[[], bool], what: str) -> None:
    """Poll `cond` (never a fixed sleep as a wait); fail after the hang guard."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling interval, not a wait for something to happen


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def started(line: str, cwd: Path, bin_dir: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`line` as its own process group, from `cwd`, the virtualenv's `bin` first on PATH; killed by its group if
    still running at the end."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            shlex.split(line),
            cwd=cwd,
            env=alone_environ(bin_dir),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_the_documented_four_process_layout_runs_from_an_installed_wheel_and_ends(tmp_path: Path) -> None:
    python = install(tmp_path, [build_wheel(tmp_path, rollbuf_sources(tmp_path / "src"), "rollbuf")], tmp_path / "venv")
    bin_dir = python.parent
    work = tmp_path / "work"  # an empty directory, not the checkout
    work.mkdir()
    found = run_alone(work, python, "-c", "import demos, rollout_client as r; print(demos.__file__, r.__file__)")
    assert all(Path(f).is_relative_to(tmp_path / "venv") for f in found.split()), found

    server_port, inference_port = free_port(), free_port()
    lines = [line.replace("8000", str(server_port)).replace("9000", str(inference_port)) for line in page_lines()]
    url, inference = f"http://127.0.0.1:{server_port}", f"http://127.0.0.1:{inference_port}"
    logs = {name: tmp_path / f"{name}.log" for name in ("server", "standin", "trainer", "producer")}
    with ExitStack() as stack:
        server = stack.enter_context(started(lines[0], work, bin_dir, logs["server"]))
        stack.enter_context(started(lines[1], work, bin_dir, logs["standin"]))
        until(lambda: answers(url + "/") and answers(inference + "/v1/models"), "the server and the stand-in")
        trainer = stack.enter_context(started(lines[2], work, bin_dir, logs["trainer"]))
        producer = stack.enter_context(started(lines[3], work, bin_dir, logs["producer"]))
        until(lambda: trainer.poll() is not None and producer.poll() is not None, "the trainer and the producer")
        assert trainer.returncode == 0, logs["trainer"].read_text()[-3000:]
        assert producer.returncode == 0, logs["producer"].read_text()[-3000:]
        status = httpx.get(url + "/status", timeout=10).json()
        os.killpg(server.pid, signal.SIGTERM)
        stopped = server.wait(timeout=HANG_GUARD_S)
    # A clean stop: uvicorn shuts down, then raises the signal it caught again, so outside a container (where the
    # server is not PID 1) its status is SIGTERM's.
    assert stopped in (0, -signal.SIGTERM), logs["server"].read_text()[-3000:]
    assert "Application shutdown complete." in logs["server"].read_text()

    assert "example-producer: 40 groups accepted, dataset sums is done" in logs["producer"].read_text()
    run: dict[str, Any] = orjson.loads((work / "trainer.json").read_bytes())
    assert run["finished"] and run["error"] is None
    steps = run["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS))
    groups = [(s["step"], g) for s in steps for g in s["groups"]]
    for step, g in groups:
        lo, hi = g["weight_versions"]
        assert lo == g["policy_step"] <= hi <= step, g
        assert g["policy_step"] <= min(g["generated_with"]), g  # never newer than the weights that sampled it
        assert step - g["policy_step"] <= 1, g  # max_staleness held
    assert len({g["policy_step"] for _, g in groups}) >= STEPS // 2  # the producer followed the syncs
    assert status["weights_step"] == STEPS  # a sync after each step, the last before the run was finished
    [dataset] = status["tasks"]
    assert (dataset["name"], dataset["done"], dataset["counts"]) == ("sums", True, {"trained": 40}), dataset
