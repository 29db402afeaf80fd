"""How the verifiers producer sees its pool's processes (rollout_client/verifiers/pool.py): a child killed -9
stops counting at once, while it is still an unreaped zombie (verifiers' broker never reaps a dead worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from rollout_client.verifiers.pool import children


def test_a_child_killed_is_no_longer_a_live_child_even_unreaped() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert proc.pid in (children(os.getpid()) or set())
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while proc.pid in (children(os.getpid()) or set()):  # a zombie now: we have not reaped it
            assert time.monotonic() < deadline, "the killed child still reads as live"
            time.sleep(0.01)
        assert proc.poll() is not None  # reaped only now
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_is_gone_has_no_children() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert children(proc.pid) is None
