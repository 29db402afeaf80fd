"""Exactly-once for a trainer that reads ahead (the commit protocol), against real server processes: a trainer
that prefetches two batches and commits at every second step (tests/resuming_trainer.py) is killed -9 at 20
random points and resumed from its last checkpoint each time; every acknowledged group is trained exactly
once, none twice, none lost. On SQLite the server is killed -9 as well now and then; on PostgreSQL two replicas
serve the run, batches read through one and commits sent through the other, and one replica is killed -9."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import pg
from tests.factories import env, group
from tests.resuming_trainer import REGISTRATION
from tests.servers import ServerProcess, start_server
from trainer_client.protocol import registration

KILLS = 20
STEPS = 60
"""Batches of two groups of 4 sequences: 120 groups acknowledged."""
TRAIN_S = "0.1"
"""Seconds a training step takes: the kills land all along the run, not after it ended."""
DONE_S = 120.0
"""A trainer run without a kill trains what is left in well under this."""


def fill(url: str) -> list[str]:
    """Register the run and an env, post every group (each acknowledged before the trainer starts)."""
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/register", json=registration(starting_step=0, **REGISTRATION)).status_code == 200
        c.get("/batch", params={"step": 0})
        assert c.post("/register-env", json=env(group_size=4, max_token_length=64)).status_code == 200
        ids = [f"g{i}" for i in range(2 * STEPS)]
        for i, gid in enumerate(ids):
            reply = c.post("/scored_data", json=group(4, seed=i, group_id=gid))
            assert reply.status_code == 200, reply.text
    return ids


def trainer(url: str, checkpoint: Path, log: Path, commit_url: str | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tests.resuming_trainer", url, str(checkpoint), str(STEPS), "--train-s", TRAIN_S]
    if commit_url:
        cmd += ["--commit-url", commit_url]
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def check(checkpoint: Path, acknowledged: list[str]) -> None:
    saved = json.loads(checkpoint.read_text())
    assert saved["step"] == STEPS
    assert [step for step, _ in saved["trained"]] == list(range(STEPS)), "a step skipped or trained twice"
    trained = [gid for _, ids in saved["trained"] for gid in ids]
    assert len(trained) == len(set(trained)), "a group trained twice"
    assert sorted(trained) == sorted(acknowledged), "an acknowledged group was never trained"


def crash_and_resume(
    seed: int, checkpoint: Path, log: Path, urls: list[str], restart: list[ServerProcess], every: int
) -> int:
    """Kill the trainer -9 at KILLS random points (and, every `every` kills, a server), resuming it each time;
    then let it finish. The kills that landed before it finished."""
    rng = random.Random(seed)
    landed = 0
    for k in range(KILLS):
        proc = trainer(urls[k % len(urls)], checkpoint, log, commit_url=urls[(k + 1) % len(urls)])
        ready = checkpoint.with_suffix(f".ready-{proc.pid}")
        while not ready.exists() and proc.poll() is None:  # started (imports take a while on a busy machine)
            time.sleep(0.02)
        try:
            proc.wait(timeout=rng.uniform(0.0, 0.6))  # a random point: reading ahead, training, checkpointing
        except subprocess.TimeoutExpired:
            landed += 1
        kill(proc)
        if restart and k % every == every - 1:
            server = restart[k % len(restart)]
            server.kill()
            restart[k % len(restart)] = start_server(server.store, server.log, server.port)
    proc = trainer(urls[0], checkpoint, log, commit_url=urls[-1])
    try:
        assert proc.wait(timeout=DONE_S) == 0, log.read_text()[-4000:]
    finally:
        kill(proc)
    return landed


@pytest.fixture
def dbname() -> Iterator[str]:
    with pg.database() as name:
        yield name


def test_a_trainer_killed_anywhere_trains_every_group_once_on_sqlite(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    servers = [start_server(f"sqlite:///{tmp_path / 'rollbuf.db'}", log)]
    try:
        acknowledged = fill(servers[0].url)
        checkpoint = tmp_path / "checkpoint.json"
        landed = crash_and_resume(1, checkpoint, tmp_path / "trainer.log", [servers[0].url], servers, every=5)
        check(checkpoint, acknowledged)
        assert landed >= KILLS // 2, f"only {landed} kills landed mid-run"
        print(f"sqlite: {KILLS + 1} runs, {landed} kills mid-run, {len(acknowledged)} groups trained once")
        status = httpx.get(servers[0].url + "/status").json()
        assert (status["committed_step"], status["kept_batches"], status["queue_size"]) == (STEPS, 0, 0)
    finally:
        for server in servers:
            server.kill(signal.SIGTERM)


def test_a_trainer_killed_anywhere_trains_every_group_once_on_two_postgres_replicas(
    dbname: str, tmp_path: Path
) -> None:
    url = pg.url_of(dbname)
    log = tmp_path / "server.log"
    servers = [start_server(url, log), start_server(url, log)]
    try:
        acknowledged = fill(servers[0].url)
        checkpoint = tmp_path / "checkpoint.json"
        urls = [s.url for s in servers]
        landed = crash_and_resume(2, checkpoint, tmp_path / "trainer.log", urls, servers, every=10)
        check(checkpoint, acknowledged)
        assert landed >= KILLS // 2, f"only {landed} kills landed mid-run"
        print(f"postgresql x2: {KILLS + 1} runs, {landed} kills mid-run, {len(acknowledged)} groups trained once")
        for server in servers:  # a commit through one replica freed the batches on both
            status = httpx.get(server.url + "/status").json()
            assert (status["committed_step"], status["kept_batches"]) == (STEPS, 0)
    finally:
        for server in servers:
            server.kill(signal.SIGTERM)
