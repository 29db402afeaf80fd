"""CPU per ingested group, thread by thread, in process: where a store's cost lands.

`bench.limit` gives the whole server process's CPU per group; this splits it. rollbuf's app runs in this
process, called through a bare ASGI call (as `bench.instructions` calls it: no sockets, no uvicorn), with
`--in-flight` requests at a time so a SQL store's group commit gathers them as it does under 8 clients. Around
the posts, each thread's user and system time is read from `/proc/self/task/TID/stat` and divided by the
groups posted: the event loop (`MainThread`) against the store's writer thread and its helpers (a thread that
ends before the posts do is not counted).

    python -m bench.threads [--store memory,sqlite] [--workload small] [--groups 20000] [--in-flight 8]
                            [--rounds 2]

Linux only (`/proc`). A fresh app and store per round; JSON to `bench/results/threads-*.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.instructions import _asgi, registered
from bench.limit import WORKLOADS, _regroup

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def thread_times() -> dict[int, tuple[float, float]]:
    """User and system seconds of each live thread of this process, by native thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


async def measure(store: str, workload: str, groups: int, in_flight: int) -> list[dict[str, Any]]:
    """Post `groups` groups to a fresh app, `in_flight` at a time; each thread's CPU per group."""
    from api.app import create_app
    from api.config.settings import Settings
    from api.wire.records import MSGPACK

    w = next(x for x in WORKLOADS if x.name == workload)
    if w.per_request != 1:
        raise SystemExit(f"--workload {workload}: one group per request only (small, large)")
    app = create_app(Settings(store=store))
    async with app.router.lifespan_context(app):
        templates = await registered(app, workload)
        bodies = [_regroup(templates[i % 16]) for i in range(groups)]  # made before the count starts

        async def poster(k: int) -> None:
            for body in bodies[k::in_flight]:
                status, reply = await _asgi(app, "POST", "/scored_data", body, MSGPACK)
                if status != 200:
                    raise SystemExit(f"POST /scored_data: {status} {reply[:200]!r}")

        before = thread_times()
        await asyncio.gather(*(poster(k) for k in range(in_flight)))
        after = thread_times()
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    rows = []
    for tid, (user, system) in after.items():
        user0, system0 = before.get(tid, (0.0, 0.0))
        du, ds = (user - user0) / groups * 1e6, (system - system0) / groups * 1e6
        if du + ds > 0:
            rows.append(
                {
                    "thread": names.get(tid, f"tid {tid}"),
                    "user_us_per_group": round(du, 1),
                    "system_us_per_group": round(ds, 1),
                    "us_per_group": round(du + ds, 1),
                }
            )
    return sorted(rows, key=lambda r: -r["us_per_group"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default="memory,sqlite", help="stores, comma-separated: memory, sqlite")
    ap.add_argument("--workload", default="small", help="small or large (bench/limit.py's)")
    ap.add_argument("--groups", type=int, default=20_000)
    ap.add_argument("--in-flight", type=int, default=8, help="requests posted at a time")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    stores = args.store.split(",")
    if unknown := [s for s in stores if s not in ("memory", "sqlite")]:
        ap.error(f"--store: {', '.join(unknown)}: memory and sqlite only (the app runs in this process)")
    if args.groups < 1 or args.in_flight < 1 or args.rounds < 1:
        ap.error("--groups, --in-flight and --rounds must be at least 1")
    results = []
    print(f"{'store':8s} {'round':>5s}  {'thread':28s} {'user':>8s} {'system':>8s} {'µs/group':>9s}")
    for rnd in range(args.rounds):
        for store in stores:
            with tempfile.TemporaryDirectory() as tmp:
                url = "memory://" if store == "memory" else f"sqlite:///{tmp}/rollbuf.db"
                rows = asyncio.run(measure(url, args.workload, args.groups, args.in_flight))
            for row in rows:
                row.update(bench="threads", store=store, round=rnd, workload=args.workload, in_flight=args.in_flight)
                results.append(row)
                print(
                    f"{store:8s} {rnd:5d}  {row['thread']:28s} {row['user_us_per_group']:8.1f} "
                    f"{row['system_us_per_group']:8.1f} {row['us_per_group']:9.1f}"
                )
            total = sum(r["us_per_group"] for r in rows)
            print(f"{store:8s} {rnd:5d}  {'(process)':28s} {'':8s} {'':8s} {total:9.1f}", flush=True)
    out = ROOT / "bench" / "results" / time.strftime("threads-%Y%m%dT%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"JSON: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
