"""This checkout against another, in turns: ingest and `/batch` on the same store, for a change's before/after.

Each round starts a fresh server from each side (alternating which goes first, so both see the same
background load on a shared machine) and runs, against it: ingest at 1 / 8 / 32 clients in JSON and in
msgpack (groups/s and server CPU ms per group), then `/batch` 256 and 1024 x 2048 tokens (p50, the
harness's JSON trainer), all through rollbuf's load harness (`bench/harness.py`; `--harness shared`: the
shared `buffer_bench.py` beside the checkout, when it is there). The report gives medians over the rounds and
the ratio after / before. `--base` is a directory holding another checkout (`git worktree add /tmp/base <rev>`);
its server runs with this environment's Python, from that directory.

    python -m bench.ab --base /tmp/base [--rounds 3] [--store sqlite|memory|postgresql]

`--atropos` puts the Atropos server (from `.bench-venv`, bench/README.md) on the "before" side instead: JSON
only (what Atropos reads), plain and gzipped as its stock clients send, against this checkout on `--store`.
A third side then runs the same ingest against the do-nothing endpoint (`bench/do_nothing.py`): what this
client reaches against a server that reads the body and answers, so "x Atropos" can be read against the most
any server could show with this client on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench import pg
from bench.http import GZIP_TRANSPORT, HARNESSES, MSGPACK_TRANSPORT, run_harness, run_ingest, use_harness
from bench.servers import ROOT, Target, atropos, ceiling, rollbuf, serve

CLIENTS = [1, 8, 32]
INGEST_ARGS = ["--ingest-requests", "480"]
BATCH_ARGS = ["--batch-sizes", "256,1024", "--batch-reps", "256:5,1024:3"]
TRANSPORTS = {"json": "json", "msgpack": MSGPACK_TRANSPORT}
JSON_TRANSPORTS = {"json": "json", "json gzip": GZIP_TRANSPORT}
"""Against Atropos: what it reads, as its stock clients send it."""


def _measure(target: Target, transports: dict[str, str] = TRANSPORTS, batch: bool = True) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, transport in transports.items():
        for r in run_ingest(target, CLIENTS, INGEST_ARGS, transport=transport):
            k = r.get("clients")
            rows.append({"metric": f"ingest {name} {k} clients groups/s", "value": r.get("groups_per_s")})
            rows.append(
                {"metric": f"ingest {name} {k} clients server CPU ms/group", "value": r.get("server_cpu_ms_per_group")}
            )
    for r in run_harness(target, "batch", BATCH_ARGS) if batch else []:
        if r.get("phase") == "batch" and "latency" in r:
            rows.append({"metric": f"/batch {r.get('batch_size')} x 2048 p50 ms", "value": r["latency"]["p50_ms"]})
    return rows


def _store(kind: str, tmp: Path, key: str, dbs: contextlib.ExitStack, query: str = "") -> str:
    if kind == "memory":
        return "memory://"
    if kind == "postgresql":
        return str(dbs.enter_context(pg.database()))
    return f"sqlite:///{tmp}/{key}.db" + (f"?{query}" if query else "")


def run(base: Path | None, rounds: int, store: str, queries: tuple[str, str] = ("", "")) -> list[dict[str, Any]]:
    """`queries`: the SQLite URL's query on this checkout and on `base` (e.g. another page size on one side).
    Without `base`: the Atropos server is the "before" side."""
    results: list[dict[str, Any]] = []
    transports = TRANSPORTS if base is not None else JSON_TRANSPORTS
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            sides: list[tuple[str, Path | None, str]] = [("after", ROOT, queries[0]), ("before", base, queries[1])]
            if base is None:
                sides.append(("ceiling", None, ""))
            if rnd % 2:
                sides.reverse()
            for side, cwd, query in sides:
                key = f"{side}-{rnd}"
                with contextlib.ExitStack() as dbs:
                    if side == "ceiling":
                        label, cmd, port = ceiling(Path(tmp) / f"{key}.log")
                    elif cwd is None:
                        server = atropos(Path(tmp) / f"{key}.log")
                        if server is None:
                            raise SystemExit("Atropos is not installed in .bench-venv: see bench/README.md")
                        label, cmd, port = server
                    else:
                        label, cmd, port = rollbuf(_store(store, Path(tmp), key, dbs, query), Path(tmp) / f"{key}.log")
                    ready = "/ping" if side == "ceiling" else "/"
                    with serve(label, cmd, port, Path(tmp) / f"{key}.out", ready_path=ready, cwd=cwd or ROOT) as target:
                        for row in _measure(target, transports, batch=side != "ceiling"):
                            row.update(bench="ab", side=side, round=rnd, store=store)
                            print(json.dumps(row), flush=True)
                            results.append(row)
    return results


def report(results: list[dict[str, Any]], names: tuple[str, str] = ("before", "after")) -> str:
    """Medians per metric and side, after/before; with a ceiling side, also the ceiling's column, ceiling/before
    (the most "x before" this client could show) and after/ceiling."""
    metrics = list(dict.fromkeys(r["metric"] for r in results))
    rounds = len({r["round"] for r in results})
    has_ceiling = any(r["side"] == "ceiling" for r in results)

    def med(m: str, side: str) -> float | None:
        vals = [r["value"] for r in results if r["metric"] == m and r["side"] == side and r["value"] is not None]
        return statistics.median(vals) if vals else None

    def cell(v: float | None, width: int, ratio: bool = False) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:{width}.2f}" if ratio else f"{round(v, 2):>{width}}"

    head = f"{'':45} {names[0]:>9} {names[1]:>9} {names[1] + '/' + names[0]:>15}"
    if has_ceiling:
        head += f" {'ceiling':>9} {'ceiling/' + names[0]:>16} {names[1] + '/ceiling':>16}"
    lines = [f"{head}   (medians of {rounds} rounds, in turns)"]
    for m in metrics:
        b, a, c = med(m, "before"), med(m, "after"), med(m, "ceiling")
        line = f"{m:45} {cell(b, 9)} {cell(a, 9)} {cell(a / b if a and b else None, 15, True)}"
        if has_ceiling:
            line += (
                f" {cell(c, 9)} {cell(c / b if c and b else None, 16, True)}"
                f" {cell(a / c if a and c else None, 16, True)}"
            )
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sides = ap.add_mutually_exclusive_group(required=True)
    sides.add_argument("--base", type=Path, help="another rollbuf checkout (the 'before' side)")
    sides.add_argument("--atropos", action="store_true", help="the Atropos server as the 'before' side (JSON)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--store", choices=["sqlite", "memory", "postgresql"], default="sqlite")
    ap.add_argument("--sqlite-query", default="", help="this checkout's SQLite URL query, e.g. page_size=4096")
    ap.add_argument("--base-sqlite-query", default="", help="the base checkout's SQLite URL query")
    ap.add_argument(
        "--harness",
        choices=HARNESSES,
        default="rollbuf",
        help="the load harness: rollbuf's (bench/harness.py), or the shared buffer_bench.py",
    )
    args = ap.parse_args()
    use_harness(args.harness)
    base = None if args.atropos else args.base.resolve()
    results = run(base, args.rounds, args.store, (args.sqlite_query, args.base_sqlite_query))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    with (out / "ab.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    print(report(results, ("atropos", "rollbuf") if args.atropos else ("before", "after")))


if __name__ == "__main__":
    main()
