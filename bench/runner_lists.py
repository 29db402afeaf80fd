"""The rollout runner's ingest with its submits coalesced into /scored_data_list
(`Timeouts.submit_linger`, 2 ms: an env's groups that finish together go in one request) against every group
sent alone (`submit_linger=0`), against a SQLite server, small groups.

A synthetic environment (G=2, one step of 10 ms waiting, no CPU of its own: a group is a few dozen tokens),
RolloutRunner in process with 32 and 256 rollouts at once (16 and 128 groups): what the runner and the
server cost per group is all there is to measure. Each side runs on a fresh server per round, the sides in
turns (the order alternates by round); medians. Per side: groups/s acknowledged, the server's CPU ms per
group, the runner process's CPU ms per group, and the requests per group (from the server's /metrics).

    .venv/bin/python -m bench.runner_lists [--rounds 3] [--seconds 5] [--in-flight 32 256]

Not part of `make bench` (about 10 s per side per level per round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.http import cpu_seconds
from bench.servers import Target, register_trainer, rollbuf, save_rows, serve
from rollout_client import RolloutRunner, ScriptedPolicy, Tasks, Timeouts
from rollout_client.examples import Synthetic, arithmetic_script, arithmetic_task
from rollout_client.runner.coalescing import LINGER_S

GROUP_SIZE = 2
WAIT_S = 0.01
IN_FLIGHT = [32, 256]
SIDES = {"lists": LINGER_S, "alone": 0.0}
"""Side -> submit_linger."""
ROUTES = ("/scored_data", "/scored_data_list")


def _requests(url: str) -> dict[str, float]:
    """POST requests answered 200 so far, per submit route (the server's /metrics)."""
    out = dict.fromkeys(ROUTES, 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            route = s.labels.get("route")
            if s.name == "rollbuf_request_duration_seconds_count" and route in out and s.labels.get("status") == "200":
                out[route] += s.value
    return out


async def _measure(target: Target, linger: float, seconds: float, in_flight: int) -> dict[str, Any]:
    env = Synthetic(group_size=GROUP_SIZE, steps=1, wait_s=WAIT_S, cpu_s=0.0)
    runner = RolloutRunner(
        target.url,
        [(env, Tasks(arithmetic_task))],
        ScriptedPolicy(arithmetic_script),
        max_in_flight=in_flight,
        timeouts=Timeouts(submit_linger=linger),
    )
    run = asyncio.create_task(runner.run())
    while runner.stats.accepted < 100 and not run.done():  # registered, warmed up
        await asyncio.sleep(0.05)
    a0, t0, s0, c0, r0 = (
        runner.stats.accepted,
        time.perf_counter(),
        cpu_seconds(target.pid),
        time.process_time(),
        _requests(target.url),
    )
    await asyncio.sleep(seconds)
    a1, t1, s1, c1, r1 = (
        runner.stats.accepted,
        time.perf_counter(),
        cpu_seconds(target.pid),
        time.process_time(),
        _requests(target.url),
    )
    runner.stop()
    await run
    groups = a1 - a0
    requests = {route: r1[route] - r0[route] for route in ROUTES}
    return {
        "groups_per_s": round(groups / (t1 - t0), 1),
        "server_cpu_ms_per_group": round((s1 - s0) * 1e3 / groups, 3),
        "runner_cpu_ms_per_group": round((c1 - c0) * 1e3 / groups, 3),
        "requests_per_group": round(sum(requests.values()) / groups, 3),
        "lists": requests["/scored_data_list"],
    }


def _side(linger: float, seconds: float, in_flight: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        name, cmd, port = rollbuf(f"sqlite:///{tmp}/r.db", Path(tmp) / "r.log")
        with serve(name, cmd, port, Path(tmp) / "r.log") as target:
            register_trainer(target.url)
            return asyncio.run(_measure(target, linger, seconds, in_flight))


KEYS = ["groups_per_s", "server_cpu_ms_per_group", "runner_cpu_ms_per_group", "requests_per_group"]


def run(rounds: int, seconds: float, levels: list[int]) -> list[dict[str, Any]]:
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {(n, side): [] for n in levels for side in SIDES}
    for r in range(rounds):
        for n in levels:
            for side in SIDES if r % 2 == 0 else reversed(SIDES):
                result = _side(SIDES[side], seconds, n)
                runs[n, side].append(result)
                print(f"  round {r + 1}, {n} in flight, {side}: {json.dumps(result)}", flush=True)
    return [
        {
            "bench": "runner_lists",
            "side": side,
            "submit_linger": SIDES[side],
            "rounds": rounds,
            "in_flight": n,
            "group_size": GROUP_SIZE,
            **{k: statistics.median(x[k] for x in results) for k in KEYS},
        }
        for (n, side), results in runs.items()
    ]


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"\nrunner ingest, SQLite, G={GROUP_SIZE} (medians of {rows[0]['rounds']}):"]
    for n in sorted({r["in_flight"] for r in rows}):
        by = {r["side"]: r for r in rows if r["in_flight"] == n}
        lines.append(f"  {n} rollouts in flight {'':>14}" + "".join(f"{s:>10}" for s in by) + "  lists/alone")
        for key in KEYS:
            ratio = by["lists"][key] / by["alone"][key] if by["alone"][key] else float("nan")
            lines.append(f"  {key:>35}" + "".join(f"{by[s][key]:>10}" for s in by) + f"  {ratio:>11.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured per side per round")
    ap.add_argument("--in-flight", type=int, nargs="+", default=IN_FLIGHT, help="rollouts at once, per level")
    args = ap.parse_args()
    rows = run(args.rounds, args.seconds, args.in_flight)
    out = save_rows("runner-lists", rows)
    print(report(rows))
    print(f"\nJSON lines: {out}")


if __name__ == "__main__":
    main()
