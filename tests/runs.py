"""What the integration tests share to drive a run across real processes: waits that poll (never a fixed sleep),
a module or script started in its own process group and stopped by it, the trainer's side of a run done with
plain HTTP (register, drain, status), and the example trainer and producer that rollbuf ships
(`demos/example_trainer.py`, `demos/example_producer.py`) started with their flags as keywords."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.factories import registration

ROOT = Path(__file__).resolve().parents[1]

HANG_GUARD_S = 120.0
"""Upper bound on waits that should take well under a second: a hang fails the test instead of stalling CI. Far
above them: on CI's loaded 2 cores one such wait saw its loopback server unanswered for over 36 s."""


async def until(cond: Callable[[], bool], what: str, guard_s: float = HANG_GUARD_S) -> None:
    """Poll `cond` from a test's event loop; fail after `guard_s`."""
    deadline = time.monotonic() + guard_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def poll_until(cond: Callable[[], bool], what: str, limit: float = HANG_GUARD_S) -> float:
    """Poll `cond` from a synchronous test; the seconds it took (a test may bound them). Fails after `limit`."""
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > limit:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - started


@contextmanager
def process(module: str, log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m module args` in its own process group, output to `log`, killed by its group at the end."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def flags(**options: str | int | float | bool) -> list[str]:
    """Command-line flags from keywords: `max_staleness=1` is `--max-staleness 1`, `drain=True` is `--drain`
    (False leaves it out)."""
    out: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False:
            out += [flag, str(value)]
    return out


def example_trainer(
    server: str, inference: str, log: Path, out: Path, *extra: str, **options: str | int | float | bool
) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """The example trainer (`demos/example_trainer.py`) against `server`, syncing its weights to `inference`; it
    writes what it trained to `out` (read it with `result`)."""
    args = ["--server", server, "--inference", inference, "--out", str(out), *flags(**options), *extra]
    return process("demos.example_trainer", log, *args)


def example_producer(
    server: str, inference: str, log: Path, *extra: str, **options: str | int | float | bool
) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """The example producer (`demos/example_producer.py`) against `server`, sampling from `inference`."""
    return process(
        "demos.example_producer", log, "--server", server, "--inference", inference, *flags(**options), *extra
    )


def run_script(path: Path, *args: str) -> subprocess.Popen[bytes]:
    """A Python script of a test's own, run with this checkout's code (whatever is installed) in its own process
    group, its output piped (read it with `finish`)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        cwd=ROOT,
        env=env,
    )


def finish(proc: subprocess.Popen[bytes], timeout: float) -> tuple[int, str, str]:
    """Wait for a script; a hang fails the test (its whole process group is killed), it never stalls CI."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout} s:\n{err.decode()[-3000:]}") from None
    return proc.returncode, out.decode(), err.decode()


def exited(pid: int) -> bool:
    """Whether process `pid` has exited (gone, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def start_trainer(url: str, **kw: Any) -> None:
    """Register a trainer with plain HTTP (`tests.factories.registration`) and poll once, so producers start."""
    with httpx.Client(base_url=url) as http:
        assert http.post("/register", json=registration(**kw)).status_code == 200
        http.get("/batch")


def drain(url: str) -> list[dict[str, Any]]:
    """Every batch the server can still form, through `?step=`, as group dicts."""
    out: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=30) as http:
        step = http.get("/status").json()["current_step"]
        while batch := http.get("/batch", params={"step": step}).json()["batch"]:
            out.extend(batch)
            step += 1
    return out


def status(url: str) -> dict[str, Any]:
    return httpx.get(url + "/status", timeout=10).json()  # type: ignore[no-any-return]


def result(path: Path) -> dict[str, Any]:
    """What the example trainer wrote to its `--out` file."""
    return orjson.loads(path.read_bytes())  # type: ignore[no-any-return]
