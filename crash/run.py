"""One run of the crash matrix: every side at once against one store, one fault, then every unit counted.

The processes are real and each its own process group: `rollbuf serve` (one on SQLite; two replicas of one
PostgreSQL database), the stand-in inference server (demos/standin_inference.py), a trainer through
`trainer_client` (tests/resuming_trainer.py: commit mode reading 2 batches ahead with a checkpoint every 2 steps, or
next mode with a checkpoint every step) and two producers of each side through `rollout_client`'s `RolloutRunner`:
whole groups and tasks leased from a 2-epoch dataset (crash/producer.py: the example producer, through the
inference server), per-rollout groups (tests/per_rollout_producer.py), multi-turn episodes posted turn by turn
and resumed from their acknowledged turns (crash/episode_producer.py). Once every side has acknowledged and
trained something the fault is made; the run then goes on until every side has finished its work (a fixed
number of groups per whole-groups producer, every task of both epochs, every per-rollout group sealed), the last
batch is completed with filler groups, and the trainer has trained it. Then `crash.count` counts from the
records.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from crash.count import FILLER, count
from crash.episodes import ENVS, Expected, reference
from crash.records import SIDES, Producer, read_producer, read_trainer
from tests import pg
from tests.relay import Relay, hang_up
from tests.servers import ServerProcess, free_port, start_server

ROOT = Path(__file__).resolve().parents[1]

FAULTS: dict[str, str] = {
    "server": "kill -9 of the server (SQLite: its process; PostgreSQL: both replicas), started again",
    "replica": "kill -9 of one of two PostgreSQL replicas, started again",
    "trainer": "kill -9 of the trainer, resumed from its last checkpoint",
    "producer": "kill -9 of a producer (one of each side), a new one started",
    "sigterm": "SIGTERM to a producer (one of each side), a new one started",
    "sigstop": "a producer (one of each side) paused past its leases (SIGSTOP), then continued (SIGCONT)",
    "worker": "kill -9 of a pool worker (one rollout process of one producer of each side)",
    "cut": "every database connection cut (a TCP relay between the replicas and PostgreSQL hangs them up)",
    "disk": "a full disk (the store on a small tmpfs, filled until the server refuses writes, then freed)",
}
STORES = ("sqlite", "postgresql")
MODES = ("commit", "next")
"""The trainer's acknowledgement: `commit` reads 2 batches ahead and commits at its checkpoints (every 2 steps);
`next` (Atropos's) acknowledges batch N by asking for N + 1, so it checkpoints every step before asking."""
PER_ROLLOUT = ("rollouts", "episodes")
"""The sides whose producers open per-rollout groups, then take sibling slots until stopped."""

NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("replica", "sqlite"): "one process writes the SQLite file: there is no second replica (`--workers N` are "
    "processes of one server on one host)",
    ("cut", "sqlite"): "SQLite is a file in the server's own process: there is no connection to cut",
    ("disk", "postgresql"): "not covered yet: PostgreSQL's disk is the database server's (it needs a tablespace "
    "on a small tmpfs, and the cluster's WAL stays on its own disk)",
}
"""Cells that do not apply, or are not covered, and why (the page prints the reason)."""

BATCH = 8
MAX_TOKEN_LEN = 256
"""The trainer's `max_token_len`: an episode of 10 turns (about 170 tokens) fits whole."""
TASK_LEASE_S = 3.0
ROLLOUT_LEASE_S = 1.0
EXTRA = (
    "--task-lease-s",
    str(TASK_LEASE_S),
    "--rollout-lease-s",
    str(ROLLOUT_LEASE_S),
    "--ledger-max-groups",
    "100000",
)
DISK = "32m"
HANG_GUARD_S = 300.0
"""Bound on each wait of a run: a hang guard for a loaded machine, never a speed check."""
POLL_S = 0.1
LATENCY_S = 0.2
"""Each completion's time at the stand-in inference server: every side is still at work when the fault comes."""
EPISODE_GEN_S = 0.1
"""Each completion's time in the episodes producers (their scripted policy runs in process): 6 to 10 turns an
episode, so that episodes are mid-way when the fault comes."""


@dataclass(frozen=True)
class Scale:
    """How much work each side does in a run."""

    tasks: int = 16
    """Tasks of the dataset (2 epochs); its groups are of 2."""
    groups: int = 12
    """Whole groups (of 2) each whole-groups producer makes (a new one started after a fault makes as many)."""
    rollout_groups: int = 3
    """Per-rollout groups (of 4) each per-rollout producer opens."""
    episode_groups: int = 2
    """Groups (of 4) each episodes producer opens, of its two envs in turn (resumed by replay; from snapshots),
    starting with one or the other by the producer's number (with 1, two producers open one of each)."""
    epochs: int = 2


FULL = Scale()
SMALL = Scale(tasks=8, groups=6, rollout_groups=2, episode_groups=1)
"""The tier in `make test` (tests/integration/test_crash_matrix.py)."""


@dataclass
class Proc:
    name: str
    side: str
    argv: list[str]
    record: Path
    popen: subprocess.Popen[bytes]
    signalled: bool = False
    """The run stopped it (the fault, or the end): its exit status says nothing about it."""

    def acked(self) -> bool:
        """Told of an acknowledgement; an episodes producer: of a turn's (it is mid-episode: its first whole
        rollout's would come when its episodes are nearly done), its own or a pool worker's (the runner posts the
        turns its workers end)."""
        record = read_producer(self.record, self.side)
        if self.side == "episodes":
            return bool(record.turns)
        return bool(record.acks)


@dataclass
class Run:
    """One run's processes and files."""

    fault: str
    store: str
    mode: str
    scale: Scale
    workdir: Path
    servers: list[ServerProcess] = field(default_factory=list)
    stores: list[str] = field(default_factory=list)
    producers: list[Proc] = field(default_factory=list)
    trainer: subprocess.Popen[bytes] | None = None
    trainer_argv: list[str] = field(default_factory=list)
    started: int = 0
    relay: Relay | None = None
    disk: Path | None = None
    inference: str = ""

    # -------------------------------------------------------------------------------------------- processes

    def spawn(self, name: str, module: str, *args: str) -> subprocess.Popen[bytes]:
        with (self.workdir / f"{name}.log").open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=ROOT,
            )

    def url(self, n: int) -> str:
        return self.servers[n % len(self.servers)].url

    def producer(self, side: str, workers: int = 0) -> Proc:
        """A producer of `side`, on the next server in turn (PostgreSQL: both replicas take producers)."""
        k = self.started
        self.started += 1
        name = f"producer-{side}-{k}"
        record = self.workdir / f"{name}.jsonl"
        url = self.url(k)
        if side == "episodes":
            argv = [
                "crash.episode_producer",
                "--server",
                url,
                "--record",
                str(record),
                "--idle",
                str(self.workdir / f"{name}.idle"),
                "--tasks",
                str(self.scale.episode_groups),
                "--first-env",
                str(k % 2),
                "--offset",
                str(1000 * k),
                "--gen-s",
                str(EPISODE_GEN_S),
            ]
        elif side == "rollouts":
            argv = [
                "tests.per_rollout_producer",
                "--server",
                url,
                "--events",
                str(record),
                "--idle",
                str(self.workdir / f"{name}.idle"),
                "--tasks",
                str(self.scale.rollout_groups),
                "--offset",
                str(1000 * k),
                "--group-size",
                "4",
                "--min-s",
                "0.3",
                "--max-s",
                "0.9",
            ]
        else:
            argv = [
                "crash.producer",
                "--server",
                url,
                "--inference",
                self.inference,
                "--name",
                side,
                "--max-in-flight",
                "2",
                "--record",
                str(record),
            ]
            argv += ["--dataset", "arith"] if side == "tasks" else ["--groups", str(self.scale.groups)]
        if workers:
            argv += ["--workers", str(workers)]
        proc = Proc(name, side, argv, record, self.spawn(name, *argv))
        self.producers.append(proc)
        return proc

    def start_trainer(self) -> None:
        self.trainer = self.spawn("trainer", *self.trainer_argv)

    def victims(self) -> list[Proc] | None:
        """Per side, the first producer that is running and has been told of an acknowledgement (so it has work
        in flight when the fault comes); None until every side has one."""
        out = []
        for side in SIDES:
            found = [p for p in self.producers if p.side == side and p.popen.poll() is None and p.acked()]
            if not found:
                return None
            out.append(found[0])
        return out

    def close(self) -> None:
        for popen in [p.popen for p in self.producers] + ([self.trainer] if self.trainer else []):
            kill(popen)
        for server in self.servers:
            server.kill()

    # -------------------------------------------------------------------------------------------- views

    def get(self, path: str, **params: Any) -> Any:
        """GET from the first server that answers (another may be down: the fault)."""
        for server in self.servers:
            try:
                reply = httpx.get(server.url + path, params=params, timeout=10)
            except httpx.TransportError:
                continue
            if reply.status_code == 200:
                return reply.json()
        return None

    def checkpoint_step(self) -> int:
        steps = read_trainer(self.workdir / "checkpoint.json")
        return len(steps)

    def tasks_settled(self) -> bool:
        """Every task of every epoch acknowledged or decided: nothing leased, waiting or still to hand out."""
        view = self.get("/tasks")
        if not view:
            return False
        counts = view[0]["counts"]
        decided = sum(counts.get(k, 0) for k in ("submitted", "served", "trained", "dropped", "failed"))
        return bool(decided == self.scale.tasks * self.scale.epochs)

    def rollouts_settled(self) -> bool:
        """Every live per-rollout and episodes producer has nothing of its own in flight, and no group is open."""
        live = [p for p in self.producers if p.side in PER_ROLLOUT and p.popen.poll() is None]
        idle = all(p.record.with_name(p.name + ".idle").exists() for p in live)
        view = self.get("/rollouts")
        return idle and view is not None and view.get("open", 1) == 0

    def settled(self) -> bool:
        """Every side has done its work (and no producer ended with an error: `exits` raises then)."""
        exits(self)
        return self.groups_settled() and self.tasks_settled() and self.rollouts_settled()

    def groups_settled(self) -> bool:
        return all(p.popen.poll() is not None for p in self.producers if p.side == "groups")


def kill(popen: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Signal a process's own group (never by name) and, for SIGKILL, reap it."""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, sig)
    if sig == signal.SIGKILL:
        popen.wait(timeout=60)


def until(cond: Callable[[], bool], what: str, guard_s: float = HANG_GUARD_S) -> None:
    """Poll `cond`; raise after `guard_s`, naming what never came."""
    deadline = time.monotonic() + guard_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {guard_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)  # polling interval, not a wait for something to happen


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended while we looked
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def pool_workers(pid: int) -> list[int]:
    """The runner's worker processes among `pid`'s children (multiprocessing's spawned children, not its
    resource tracker)."""
    out = []
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"multiprocessing.spawn" in cmdline or b"spawn_main" in cmdline:
            out.append(child)
    return out


def fill_up(path: Path) -> None:
    """Write `path` until its disk has no byte left."""
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


@contextmanager
def small_disk(workdir: Path) -> Iterator[Path]:
    disk = workdir / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@contextmanager
def inference_server(run: Run) -> Iterator[str]:
    """The stand-in inference server (demos/standin_inference.py) as a process on a free port, each completion
    taking `LATENCY_S` (a model that takes time, so that groups are in flight when the fault comes); its URL once
    it answers."""
    port = free_port()
    proc = run.spawn("vllm", "demos.standin_inference", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the inference server exited with {proc.returncode}")
            try:
                return httpx.post(url + "/control", json={"latency": LATENCY_S}, timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        until(ready, "the inference server", 60)
        yield url
    finally:
        kill(proc)


def applies(fault: str, store: str) -> str | None:
    """Why the cell does not run, or None."""
    if (why := NOT_APPLICABLE.get((fault, store))) is not None:
        return why
    if fault == "disk" and os.geteuid() != 0:
        return "skipped: a small tmpfs needs root (run as root to cover it)"
    return None


# -------------------------------------------------------------------------------------------------- faults


def make_fault(run: Run, victims: list[Proc]) -> tuple[float, float]:
    """Make the run's fault and what recovers from it (a process started again); (began, ended), wall clock."""
    began = time.time()
    if run.fault in ("server", "replica"):
        for k in range(len(run.servers)) if run.fault == "server" else [1]:
            run.servers[k].kill(signal.SIGKILL)
        for k in range(len(run.servers)) if run.fault == "server" else [1]:
            old = run.servers[k]
            run.servers[k] = start_server(run.stores[k], old.log, old.port, *EXTRA)
    elif run.fault == "trainer":
        assert run.trainer is not None
        kill(run.trainer)
        run.start_trainer()
    elif run.fault in ("producer", "sigterm"):
        for p in victims:
            p.signalled = True
            kill(p.popen, signal.SIGKILL if run.fault == "producer" else signal.SIGTERM)
        for p in victims:
            p.popen.wait(timeout=HANG_GUARD_S)
            run.producer(p.side)
    elif run.fault == "sigstop":
        for p in victims:
            kill(p.popen, signal.SIGSTOP)
        try:  # paused past its leases: the task lease and a per-rollout holder's, twice over and more
            pause_until = time.monotonic() + 2 * TASK_LEASE_S + 1.0
            until(lambda: time.monotonic() >= pause_until, "the pause")
        finally:
            for p in victims:
                kill(p.popen, signal.SIGCONT)
    elif run.fault == "worker":
        for p in victims:
            workers = pool_workers(p.popen.pid)
            if not workers:
                raise RuntimeError(f"{p.name} has no worker process to kill")
            os.kill(workers[0], signal.SIGKILL)
    elif run.fault == "cut":
        assert run.relay is not None
        hang_up(*run.relay.sockets)
    elif run.fault == "disk":
        assert run.disk is not None
        filler = run.disk / "filler"
        fill_up(filler)
        try:
            with contextlib.suppress(TimeoutError):  # a write refused shows in /readyz; bounded, then freed anyway
                until(
                    lambda: httpx.get(run.servers[0].url + "/readyz", timeout=10).status_code == 503,
                    "the server to find the disk full",
                    30,
                )
            hold_until = time.monotonic() + 2.0
            until(lambda: time.monotonic() >= hold_until, "the disk to stay full a while")
        finally:
            filler.unlink()
    else:
        raise ValueError(f"unknown fault {run.fault}")
    return began, time.time()


# -------------------------------------------------------------------------------------------------- a run


def finish(run: Run) -> None:
    """Once every side finished its work: stop the idle per-rollout producers, complete the last batch with
    filler groups, tell the trainer how many batches there are, and wait for it."""
    for p in run.producers:
        if p.side in PER_ROLLOUT and p.popen.poll() is None:
            p.signalled = True
            kill(p.popen, signal.SIGTERM)
    for p in run.producers:
        if p.side in PER_ROLLOUT:
            p.popen.wait(timeout=HANG_GUARD_S)
    url = run.servers[0].url
    with httpx.Client(base_url=url, timeout=30) as c:
        body = {"max_token_length": 64, "desired_name": "filler", "weight": 1.0, "group_size": 2}
        env_id = c.post("/register-env", json=body).json()["env_id"]
        fillers = 0
        deadline = time.monotonic() + HANG_GUARD_S
        while (queued := c.get("/status").json()["queued_sequences"]) > 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the queue never emptied: {queued} sequences left")
            if queued % BATCH:
                fillers += 1
                group = {
                    "tokens": [[1, 2, 3, 4], [1, 2, 3, 5]],
                    "masks": [[-100, -100, 3, 4], [-100, -100, 3, 5]],
                    "scores": [1.0, 0.0],
                    "env_id": env_id,
                    "group_id": f"{FILLER}{fillers}",
                }
                assert c.post("/scored_data", json=group).status_code == 200
            settle = time.monotonic() + 1.0

            def moved(q: int = queued, s: float = settle) -> bool:  # or a second passed: the next look decides
                return bool(c.get("/status").json()["queued_sequences"] != q or time.monotonic() > s)

            until(moved, "the queue to move")
        final = c.get("/status").json()["current_step"]
    (run.workdir / "until.txt").write_text(str(final))
    assert run.trainer is not None
    trainer = run.trainer
    until(lambda: trainer.poll() is not None, "the trainer to train the last batch")
    for p in run.producers:
        if p.side == "tasks" and p.popen.poll() is None:  # the dataset is done now: they end on their own
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=30)


def exits(run: Run) -> None:
    """A producer or the trainer that ended on its own with an error (it could not start, it crashed) makes the
    run's counts meaningless: raise, naming it and the end of its log."""
    for name, popen, signalled in [(p.name, p.popen, p.signalled) for p in run.producers] + [
        ("trainer", run.trainer, False)
    ]:
        if popen is None or signalled or popen.poll() in (None, 0, -signal.SIGKILL):
            continue
        tail = (run.workdir / f"{name}.log").read_text()[-2000:]
        raise RuntimeError(f"{name} exited with status {popen.returncode}:\n{tail}")


def references(producers: list[Producer]) -> dict[str, list[Expected]]:
    """Per episodes group some producer opened, each slot as an uninterrupted run makes it (no server). A group
    of an env or task the episodes side does not have gets none: its rollouts count as not token-exact. The
    token limit is the run's, as the producers' runners have it from the server."""
    opens = {g: o for p in producers if p.side == "episodes" for g, o in p.opens.items()}
    return {g: reference(g, env, task_id, MAX_TOKEN_LEN) for g, (env, task_id) in opens.items() if env in ENVS}


def run_cell(fault: str, store: str, mode: str, scale: Scale, workdir: Path) -> dict[str, Any]:
    """One run; its result as the matrix stores it (JSON)."""
    result: dict[str, Any] = {"fault": fault, "store": store, "mode": mode, "scale": scale.__dict__}
    if (why := applies(fault, store)) is not None:
        return {**result, "not_run": why}
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    run = Run(fault, store, mode, scale, workdir)
    with ExitStack() as stack:
        if store == "sqlite":
            where = stack.enter_context(small_disk(workdir)) if fault == "disk" else workdir
            run.disk = where
            run.stores = [f"sqlite:///{where / 'rollbuf.db'}"]
        else:
            url = pg.url_of(stack.enter_context(pg.database()))
            if fault == "cut":
                run.relay = Relay(("127.0.0.1", 5432))
                stack.callback(run.relay.close)
                url = url.replace("127.0.0.1:5432", f"127.0.0.1:{run.relay.port}")
            run.stores = [url, url]
        stack.callback(run.close)  # the servers as they are at the end (a fault replaces them)
        run.servers = [start_server(s, workdir / f"server-{k}.log", None, *EXTRA) for k, s in enumerate(run.stores)]
        run.inference = stack.enter_context(inference_server(run))
        with httpx.Client(base_url=run.servers[0].url, timeout=30) as c:
            tasks = [
                {"id": f"t{i}", "prompt": f"Q: {100 + i} + {7 * i} =", "answer": str(100 + 8 * i)}
                for i in range(scale.tasks)
            ]
            spec = {
                "name": "arith",
                "tasks": tasks,
                "epochs": scale.epochs,
                "order": "shuffled",
                "seed": 3,
                "max_retries": 5,
            }
            reply = c.post("/tasks/datasets", json=spec)
            assert reply.status_code == 200, reply.text
        checkpoint = workdir / "checkpoint.json"
        run.trainer_argv = [
            "tests.resuming_trainer",
            run.url(0),
            str(checkpoint),
            str(10**6),
            "--commit-url",
            run.url(1),
            "--train-s",
            "0.05",
            "--acknowledge",
            mode,
            "--batch-size",
            str(BATCH),
            "--max-token-len",
            str(MAX_TOKEN_LEN),
            "--until",
            str(workdir / "until.txt"),
        ]
        run.start_trainer()
        for side in SIDES:  # for the pool worker's kill, each with worker processes: any may be the victim
            run.producer(side, workers=2 if fault == "worker" else 0)
            run.producer(side, workers=2 if fault == "worker" else 0)
        fault_at: float | None = None
        fault_end: float | None = None
        try:
            trained = 2 if fault == "trainer" else 0  # the trainer killed between checkpoints, reading ahead

            def ready() -> bool:
                exits(run)  # a producer that could not start never acknowledges anything
                return run.victims() is not None and run.checkpoint_step() >= trained

            until(ready, "a running producer of every side told of an acknowledgement (and a trainer checkpoint)")
            victims = run.victims()
            assert victims is not None
            fault_at, fault_end = make_fault(run, victims)
            until(lambda: run.settled(), "every side to finish its work")
            finish(run)
            exits(run)
        except (TimeoutError, RuntimeError, AssertionError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        producers = [read_producer(p.record, p.side) for p in run.producers]
        steps = read_trainer(checkpoint)
        cells = count(producers, steps, fault_at, references(producers))
        result.update(
            cells={side: cells[side].as_dict() for side in SIDES},
            fault_at=fault_at,
            fault_end=fault_end,
            steps=len(steps),
            seconds=round(time.monotonic() - began, 1),
            producers=len(run.producers),
        )
    return result


def main() -> None:
    """`python -m crash.run FAULT STORE [MODE]`: one run at the small scale, its result printed (for a look)."""
    import json
    import tempfile

    fault, store = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "commit"
    with tempfile.TemporaryDirectory(prefix="crash-") as tmp:
        result = run_cell(fault, store, mode, SMALL, Path(tmp))
        if os.environ.get("CRASH_KEEP"):
            shutil.copytree(tmp, os.environ["CRASH_KEEP"], dirs_exist_ok=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
