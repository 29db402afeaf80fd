"""`make bench`: every hot-path benchmark in one bounded run, rollbuf next to Atropos when it is installed.

Figures are noisy on a shared machine: compare ratios within one run, not across runs.
Results are appended as JSON lines to bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path
from typing import Any

from bench import arrays, formation, ipc, limit, metrics_ab, pg, replicas, rss, runner, transport
from bench.http import GZIP_TRANSPORT, HARNESSES, MSGPACK_TRANSPORT, run_harness, run_ingest, use_harness
from bench.servers import atropos, ceiling, rollbuf, save_rows, serve

INGEST_CLIENTS = [1, 8, 32]
# The harness default (96) is three rounds at 32 clients: ramp-up and the tail dominate. 480 steadies it.
INGEST_ARGS = ["--ingest-requests", "480"]
HTTP_ARGS = ["--batch-sizes", "256,1024", "--batch-reps", "256:3,1024:2", "--memory-groups", "120"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skip-atropos", action="store_true", help="do not run the Atropos server side by side")
    ap.add_argument(
        "--only",
        choices=["arrays", "formation", "http", "ipc", "limit", "metrics", "replicas", "rss", "runner", "transport"],
        help="run one part",
    )
    ap.add_argument(
        "--harness",
        choices=HARNESSES,
        default="rollbuf",
        help="the HTTP load harness: rollbuf's (bench/harness.py), or the shared buffer_bench.py beside "
        "the checkout, as an outside cross-check",
    )
    args = ap.parse_args()
    use_harness(args.harness)
    results: list[dict[str, Any]] = []
    if args.only in (None, "formation"):
        results += formation.run()
    if args.only in (None, "rss"):
        results += rss.run()
    if args.only in (None, "http"):
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as dbs:
            targets = [
                rollbuf("memory://", Path(tmp) / "m.log"),
                rollbuf(f"sqlite:///{tmp}/b.db", Path(tmp) / "s.log"),
                rollbuf(f"sqlite:///{tmp}/w.db", Path(tmp) / "w.log", workers=2),
            ]
            if pg.available():  # one replica, and two replicas (processes) sharing the database
                targets.append(rollbuf(dbs.enter_context(pg.database()), Path(tmp) / "p.log"))
                targets.append(rollbuf(dbs.enter_context(pg.database()), Path(tmp) / "p2.log", workers=2))
            side = None if args.skip_atropos else atropos(Path(tmp) / "a.log")
            if side is None and not args.skip_atropos:
                print("Atropos not installed in .bench-venv (see bench/README.md): measuring rollbuf alone")
            for name, cmd, port in [t for t in [*targets, side] if t is not None]:
                with serve(name, cmd, port, Path(tmp) / f"{port}.log") as target:
                    # RSS is read from one pid: meaningless for a supervisor of worker processes.
                    phases = "batch" if " x" in name else "memory,batch"
                    results += run_harness(target, phases, HTTP_ARGS)
                    results += run_ingest(target, INGEST_CLIENTS, INGEST_ARGS)
                    # Stock Atropos clients gzip their posts and accept gzip on /batch
                    gzipped = run_harness(target, "batch", HTTP_ARGS, transport=GZIP_TRANSPORT)
                    gzipped += run_ingest(target, INGEST_CLIENTS, INGEST_ARGS, transport=GZIP_TRANSPORT)
                    results += [{**r, "target": f"{name} gzip"} for r in gzipped]
                    if name.startswith("rollbuf"):  # the binary ingest path, as rollout_client submits
                        binary = run_ingest(target, INGEST_CLIENTS, INGEST_ARGS, transport=MSGPACK_TRANSPORT)
                        results += [{**r, "target": f"{name} msgpack"} for r in binary]
            with serve(*ceiling(Path(tmp) / "c.log"), Path(tmp) / "c.log", ready_path="/ping") as target:
                results += run_ingest(target, INGEST_CLIENTS, INGEST_ARGS)
    limits: list[dict[str, Any]] = []
    if args.only in (None, "limit"):  # ingest against the machine's limit (bench/limit.py), one round
        limits = limit.summary(limit.run(limit.SIDES, rounds=1, seconds=3.0, base=None))
        results += [{"bench": "limit-summary", **r} for r in limits]
    if args.only in (None, "arrays"):
        results += arrays.run()
    if args.only in (None, "metrics"):
        results += metrics_ab.run()
    if args.only in (None, "replicas"):
        results += replicas.run()
    if args.only in (None, "runner"):
        results += runner.run()
    if args.only in (None, "ipc"):
        results += ipc.run()
    if args.only in (None, "transport"):
        results += transport.run([256, 1024], with_atropos=not args.skip_atropos)
        results += transport.compare_stores(1024)  # the default store against the memory store, in turns
        results += transport.run([1024], with_atropos=False, with_json=False, store="postgresql", with_ingest=False)
    out = save_rows("bench", results)
    print(
        report(results)
        + runner.report(results)
        + ipc.report(results)
        + "\n"
        + transport.report(results)
        + "\n"
        + arrays.report(results)
    )
    print(metrics_ab.report(results))
    print(replicas.report(results))
    if limits:
        print("\ningest against the machine's limit (bench/limit.py):\n" + limit.report(limits))
    print(f"\nJSON lines: {out}")


def report(results: list[dict[str, Any]]) -> str:
    lines = []
    form = [r for r in results if r.get("bench") == "formation"]
    if form:
        lines.append("batch formation, batch_size 256 (median ms per call; formed/exact of the calls):")
        for scenario in sorted({r.get("scenario", "mixed") for r in form}):
            lines.append(f"  {scenario}:")
            for store in ("memory", "sqlite", "postgresql"):
                row = [
                    f"{r['queued_groups']:>7} queued: {r['median_ms']:6.2f} ({r['formed']}/{r['exact']})"
                    for r in form
                    if r["store"] == store and r.get("scenario", "mixed") == scenario
                ]
                if row:
                    lines.append(f"    {store:10} " + " | ".join(row))
    targets = sorted({r["target"] for r in results if "target" in r})
    if targets:
        lines.append("\ningest at 1 / 8 / 32 clients, 8 x 512-4096 tokens per group (JSON; gzip: as stock Atropos")
        lines.append("clients send it, gzip-9 posts and gzip accepted on /batch; msgpack: rollbuf's binary encoding):")
        lines.append(f"  {'':24} {'groups/s':28} server CPU ms per group")
        for t in targets:
            rows = [r for r in results if r.get("target") == t and r.get("phase") == "ingest"]
            rate = " / ".join(f"{r.get('groups_per_s', r.get('error'))}" for r in rows)
            cpu = " / ".join(f"{r.get('server_cpu_ms_per_group')}" for r in rows)
            if rows:
                lines.append(f"  {t:24} {rate:28} {cpu}")
        lines.append("\n/batch latency p50 (ms; JSON, gzipped where marked; sequences of 2048 tokens):")
        for t in targets:
            row = [
                f"B={r['batch_size']}: {r['latency'].get('p50_ms')}"
                for r in results
                if r.get("target") == t and r.get("phase") == "batch" and "latency" in r
            ]
            row += [
                f"B={r.get('batch_size')}: {r['error']}"
                for r in results
                if r.get("target") == t and r.get("phase") == "batch" and "error" in r
            ]
            if row:
                lines.append(f"  {t:24} " + "  ".join(row))
        lines.append("\nserver RSS per queued token position (bytes; raw int32+int32+float32 = 12):")
        for t in targets:
            row = [
                f"{r.get('bytes_per_token_position')}"
                for r in results
                if r.get("target") == t and r.get("phase") == "memory"
            ]
            if row:
                lines.append(f"  {t:24} " + " ".join(row))
    lines += rss.report(results)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
