"""Rollout runner throughput (groups/s) against a real rollbuf server process.

A synthetic environment (rollout_client.examples.Synthetic): each rollout takes STEPS steps of ~50 ms
waiting (a tool, an inference call) plus ~5 ms of CPU (parsing, verifying) that holds the GIL, G=8.
Measured: the serial figure (one rollout at a time), then RolloutRunner at 8, 64 and 256 concurrent
rollouts, in-process and with 1 and 2 worker processes. Bounded: about a minute and a half.

    .venv/bin/python -m bench.runner          (or: make bench, part "runner")

`--scheduling [--base DIR] [--rounds N]`: slot use with long-tail rollouts (G=8, 32 slots) and worker
balance at G=64 on 2 workers (`bench/scheduling.py`), this checkout and DIR (another checkout, e.g. `git
worktree add /tmp/base main`) in turns, N rounds each (default 3); medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.servers import ROOT, register_trainer, rollbuf, save_rows, serve
from rollout_client import RolloutClient, RolloutRunner, ScriptedPolicy, Session, Tasks, build_group
from rollout_client.examples import Synthetic, arithmetic_script, arithmetic_task

GROUP_SIZE = 8
STEPS = 2
WAIT_S = 0.05
CPU_S = 0.005
CONCURRENCY = (8, 64, 256)
WORKERS = (0, 1, 2)
MEASURE_S = 4.0
"""Per configuration, after the first group is acknowledged (workers started, env registered)."""
SERIAL_S = 3.0


def _env() -> Synthetic:
    return Synthetic(group_size=GROUP_SIZE, steps=STEPS, wait_s=WAIT_S, cpu_s=CPU_S)


async def serial(url: str) -> dict[str, Any]:
    """One rollout at a time, then the group's submit: what a plain loop over an environment gets."""
    env, policy = _env(), ScriptedPolicy(arithmetic_script)
    async with RolloutClient(url) as client:
        await client.register("serial", GROUP_SIZE)
        groups, i = 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < SERIAL_S:
            task = arithmetic_task(i)
            sessions = []
            for k in range(GROUP_SIZE):
                session = Session(policy, seed=k, max_tokens=env.max_tokens)
                await env.rollout(task, session)
                sessions.append(session)
            scores = [env.score(task, s) for s in sessions]
            await client.submit(build_group(task, sessions, scores, [0.0] * GROUP_SIZE, 0.0))
            groups, i = groups + 1, i + 1
        elapsed = time.perf_counter() - t0
    return {
        "bench": "runner",
        "mode": "serial",
        "concurrency": 1,
        "workers": 0,
        "groups_per_s": round(groups / elapsed, 2),
    }


async def with_runner(url: str, concurrency: int, workers: int) -> dict[str, Any]:
    runner = RolloutRunner(
        url,
        [(_env(), Tasks(arithmetic_task))],
        ScriptedPolicy(arithmetic_script),
        max_in_flight=concurrency,
        num_workers=workers,
    )
    run = asyncio.create_task(runner.run())
    while runner.stats.accepted == 0 and not run.done():
        await asyncio.sleep(0.05)
    a0, t0 = runner.stats.accepted, time.perf_counter()
    await asyncio.sleep(MEASURE_S)
    a1, t1 = runner.stats.accepted, time.perf_counter()
    runner.stop()
    stats = await run
    return {
        "bench": "runner",
        "mode": "runner",
        "concurrency": concurrency,
        "workers": workers,
        "groups_per_s": round((a1 - a0) / (t1 - t0), 2),
        "max_in_flight": stats.max_in_flight,
    }


async def _all(url: str) -> list[dict[str, Any]]:
    register_trainer(url)
    results = [await serial(url)]
    print(f"  serial: {results[0]['groups_per_s']} groups/s", flush=True)
    for concurrency in CONCURRENCY:
        for workers in WORKERS:
            r = await with_runner(url, concurrency, workers)
            print(f"  {concurrency:3d} in flight, {_where(workers)}: {r['groups_per_s']} groups/s", flush=True)
            results.append(r)
    return results


def _where(workers: int) -> str:
    return "in-process" if workers == 0 else f"{workers} worker{'s' if workers > 1 else ''}"


def run() -> list[dict[str, Any]]:
    print(
        f"runner throughput: G={GROUP_SIZE}, {STEPS} steps of {WAIT_S * 1000:.0f} ms wait + {CPU_S * 1000:.0f} ms "
        "CPU per rollout",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        name, cmd, port = rollbuf("memory://", Path(tmp) / "r.log")
        with serve(name, cmd, port, Path(tmp) / "r.log") as target:
            return asyncio.run(_all(target.url))


def report(results: list[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("bench") == "runner"]
    if not rows:
        return ""
    serial_rate = next((r["groups_per_s"] for r in rows if r["mode"] == "serial"), None)
    lines = [
        f"\nrollout runner (groups/s; G={GROUP_SIZE}, {STEPS} x ({WAIT_S * 1000:.0f} ms wait + "
        f"{CPU_S * 1000:.0f} ms CPU) per rollout; serial: {serial_rate}):",
        "  in flight   " + "".join(f"{_where(w):>14}" for w in WORKERS),
    ]
    for c in CONCURRENCY:
        cells = [
            next(
                (
                    r["groups_per_s"]
                    for r in rows
                    if r["mode"] == "runner" and r["concurrency"] == c and r["workers"] == w
                ),
                "-",
            )
            for w in WORKERS
        ]
        lines.append(f"  {c:9d}   " + "".join(f"{cell:>14}" for cell in cells))
    return "\n".join(lines)


def _side(root: Path) -> dict[str, Any]:
    """One run of bench/scheduling.py (this checkout's script) against `root`'s rollout_client."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    with tempfile.TemporaryDirectory() as tmp:  # run from a folder of its own: bench/http.py would shadow http
        script = shutil.copy(ROOT / "bench" / "scheduling.py", tmp)
        out = subprocess.run(
            [sys.executable, script, "--json"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def scheduling(base: Path | None, rounds: int) -> list[dict[str, Any]]:
    """This checkout and `base` in turns, `rounds` runs each; one row per side with the medians."""
    sides = [("after", ROOT)] + ([("before", base)] if base is not None else [])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in sides}
    for r in range(rounds):
        for name, root in sides if r % 2 == 0 else reversed(sides):
            runs[name].append(_side(root))
            print(f"  round {r + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    rows = []
    for name, results in runs.items():
        tail = [x["long_tail"] for x in results]
        grouped = [x["long_tail_group"] for x in results]
        g64 = [x["g64_2_workers"] for x in results]
        rows.append(
            {
                "bench": "runner_scheduling",
                "side": name,
                "rounds": rounds,
                "long_tail_rollouts_per_s": statistics.median(t["rollouts_per_s"] for t in tail),
                "long_tail_running_of_held": statistics.median(t["running_of_held"] for t in tail),
                "long_tail_running_of_slots": statistics.median(t["running_of_slots"] for t in tail),
                "grouped_rollouts_per_s": statistics.median(t["rollouts_per_s"] for t in grouped),
                "grouped_running_of_held": statistics.median(t["running_of_held"] for t in grouped),
                "grouped_running_of_slots": statistics.median(t["running_of_slots"] for t in grouped),
                "g64_rollouts_per_s": statistics.median(g["rollouts_per_s"] for g in g64),
                "g64_mean_worker_idle": statistics.median(g["mean_idle"] for g in g64),
                "g64_most_idle_worker": statistics.median(g["worker_idle"][-1] for g in g64),
            }
        )
    return rows


def scheduling_report(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("grouped_rollouts_per_s", "tail, per group: rollouts/s"),
        ("grouped_running_of_held", "running/held"),
        ("grouped_running_of_slots", "running/32 slots"),
        ("long_tail_rollouts_per_s", "tail, per rollout: rollouts/s"),
        ("long_tail_running_of_held", "running/held"),
        ("long_tail_running_of_slots", "running/32 slots"),
        ("g64_rollouts_per_s", "G=64 2w rollouts/s"),
        ("g64_mean_worker_idle", "mean worker idle"),
        ("g64_most_idle_worker", "most idle worker"),
    ]
    lines = ["\nrollout scheduling (medians): " + "".join(f"{r['side']:>10}" for r in rows)]
    for key, label in cols:
        lines.append(f"  {label:>30}: " + "".join(f"{r[key]:>10}" for r in rows))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scheduling", action="store_true", help="slot use and worker balance (bench/scheduling.py)")
    ap.add_argument("--base", type=Path, help="with --scheduling: another checkout, run in turns")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.scheduling:
        rows = scheduling(args.base, args.rounds)
        out = save_rows("runner-scheduling", rows)
        print(scheduling_report(rows))
        print(f"\nJSON lines: {out}")
        return
    results = run()
    out = save_rows("runner", results)
    print(report(results))
    print(f"\nJSON lines: {out}")


if __name__ == "__main__":
    main()
