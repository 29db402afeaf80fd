"""Rollouts paid twice when producers die (docs/rollouts.md): the same fault schedule run twice, with
whole-group submission and with per-rollout posts (`Environment.posts_each_rollout`).

4 producer processes (tests/per_rollout_producer.py: `RolloutRunner`, G rollouts a group, each rollout
`--min-s`..`--max-s` s of seeded waiting, scored alone) against a server on SQLite; at fixed times (seeded,
counted from when every first producer has finished a rollout) a producer rolling out is killed -9 and
replaced. A rollout is *paid twice* when it finished but its data never reached the buffer: a deployment pays it
again to get that group (a leased task is handed out again, docs/tasks.md). Whole groups: every finished rollout
of a group in flight at the kill. Per rollout: only rollouts that finished but were not yet acknowledged (the
missing slots are finished by the other producers).

    python -m bench.rollouts_paid_twice [--kills 6] [--tasks 4] [--group-size 16] [--seed 40]

Prints, per mode: rollouts finished, kept (served in sealed or stored groups), paid twice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.factories import registration
from tests.servers import start_server

LIMIT_S = 300.0


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(what: str, ok: Any) -> None:
    deadline = time.monotonic() + LIMIT_S
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited too long for {what}")
        time.sleep(0.05)


def run(whole: bool, args: argparse.Namespace, schedule: list[tuple[float, int]], tmp: Path) -> dict[str, int]:
    server = start_server(f"sqlite:///{tmp / 'rollbuf.db'}", tmp / "server.log", None, "--rollout-lease-s", "1")
    procs: dict[int, subprocess.Popen[bytes]] = {}
    everyone: list[subprocess.Popen[bytes]] = []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            c.post("/register", json=registration(batch_size=args.group_size)).raise_for_status()
            c.get("/batch")

            def start(n: int) -> None:
                cmd = [
                    sys.executable,
                    "-m",
                    "tests.per_rollout_producer",
                    "--server",
                    server.url,
                    "--events",
                    str(tmp / f"events-{n}.jsonl"),
                    "--idle",
                    str(tmp / f"idle-{n}"),
                    "--tasks",
                    str(args.tasks),
                    "--offset",
                    str(100 * n),
                    "--group-size",
                    str(args.group_size),
                    "--min-s",
                    str(args.min_s),
                    "--max-s",
                    str(args.max_s),
                ]
                cmd += ["--whole"] if whole else []
                with (tmp / f"producer-{n}.log").open("ab") as out:
                    procs[n] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                everyone.append(procs[n])

            for n in range(args.producers):
                start(n)
            wait_for("every producer rolling out", lambda: all(events(tmp / f"events-{n}.jsonl") for n in procs))
            t0 = time.monotonic()  # the schedule's times count from here, in both modes
            for k, (at, pick) in enumerate(schedule):
                wait_for(f"kill {k}", lambda at=at: time.monotonic() - t0 >= at)  # the schedule's own clock
                busy = [n for n in sorted(procs) if events(tmp / f"events-{n}.jsonl")] or sorted(procs)
                victim = busy[pick % len(busy)]  # one rolling out (a replacement still starting has nothing)
                os.killpg(procs.pop(victim).pid, signal.SIGKILL)
                start(args.producers + k)

            def settled() -> bool:
                idle = all((tmp / f"idle-{n}").exists() for n in procs)
                return idle and (whole or c.get("/rollouts").json().get("open", 1) == 0)

            wait_for("every live producer idle", settled)
    finally:
        for p in everyone:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        server.kill()
    seen = [e for n in range(args.producers + len(schedule)) for e in events(tmp / f"events-{n}.jsonl")]
    finished = sum("done" in e for e in seen)
    if whole:
        kept = sum(len(e["group"][1]) for e in seen if "group" in e)
    else:
        kept = len({(e["ack"][0], e["ack"][1]) for e in seen if "ack" in e})
    return {"finished": finished, "kept": kept, "paid_twice": finished - kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--tasks", type=int, default=4, help="groups each producer opens of its own")
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--min-s", type=float, default=0.2)
    ap.add_argument("--max-s", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=40)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    schedule = sorted((round(rng.uniform(0.2, 5.0), 2), rng.randrange(1000)) for _ in range(args.kills))
    print(
        f"kills at (s, victim pick): {schedule}; G={args.group_size}, {args.producers} producers, "
        f"{args.tasks} groups each, rollouts {args.min_s}-{args.max_s} s"
    )
    for whole in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            r = run(whole, args, schedule, Path(tmp))
        mode = "whole groups" if whole else "per rollout "
        print(f"{mode}: finished {r['finished']}, kept {r['kept']}, paid twice {r['paid_twice']}", flush=True)


if __name__ == "__main__":
    main()
