"""What observability costs on the hot path: ingest and `/batch` with `metrics` on against off, as an A/B.

The same SQLite server is started with `--metrics` and `--no-metrics` in alternating order, `REPS`
times (interleaved, so both sides see the same background load on a shared machine); each start runs
ingest at 8 clients (groups/s, server CPU ms per group) and `/batch` 256 x 2048 tokens (p50 ms). The
figures are medians over the repetitions. `--base DIR` adds a third side: another checkout of rollbuf (a
commit from before the metrics existed) served by this environment, run in the same rounds.

    python -m bench.metrics_ab [--reps 3] [--base /tmp/base-checkout]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.http import run_harness, run_ingest
from bench.servers import ROOT, Target, rollbuf, serve

REPS = 3
INGEST_ARGS = ["--ingest-requests", "480"]
BATCH_ARGS = ["--batch-sizes", "256", "--batch-reps", "256:5"]
TOLERANCE = 0.05


def _side(name: str, metrics: bool | None, tmp: Path, base: Path | None) -> tuple[str, list[str], int, Path]:
    label, cmd, port = rollbuf(f"sqlite:///{tmp}/{name}.db", tmp / f"{name}.log")
    if metrics is not None:
        cmd.append("--metrics" if metrics else "--no-metrics")
    return name, cmd, port, base or ROOT


def _measure(target: Target) -> dict[str, Any]:
    ingest = run_ingest(target, [8], INGEST_ARGS)
    batch = run_harness(target, "batch", BATCH_ARGS)
    lat = [r["latency"]["p50_ms"] for r in batch if r.get("phase") == "batch" and "latency" in r]
    return {
        "groups_per_s": ingest[0].get("groups_per_s") if ingest else None,
        "cpu_ms_per_group": ingest[0].get("server_cpu_ms_per_group") if ingest else None,
        "batch_p50_ms": lat[0] if lat else None,
    }


def run(reps: int = REPS, base: Path | None = None) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            sides = [("metrics on", True), ("metrics off", False)]
            if base is not None:
                sides.append(("base", None))
            if rep % 2:
                sides.reverse()  # interleaved: neither side always runs first
            for name, metrics in sides:
                key = name.replace(" ", "-") + f"-{rep}"
                label, cmd, port, cwd = _side(key, metrics, Path(tmp), base if metrics is None else None)
                with serve(label, cmd, port, Path(tmp) / f"{key}.out", cwd=cwd) as target:
                    row = {"bench": "metrics_ab", "side": name, "rep": rep, **_measure(target)}
                print(json.dumps(row), flush=True)
                results.append(row)
    return results


def _median(rows: list[dict[str, Any]], side: str, key: str) -> float | None:
    values = [r[key] for r in rows if r["side"] == side and r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report(results: list[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("bench") == "metrics_ab"]
    if not rows:
        return ""
    sides = sorted({r["side"] for r in rows}, key=["metrics off", "metrics on", "base"].index)
    n = max(r["rep"] for r in rows) + 1
    lines = [f"metrics on vs off, SQLite, interleaved, medians of {n} (ingest at 8 clients; /batch 256 x 2048):"]
    for side in sides:
        g, c, b = (_median(rows, side, k) for k in ("groups_per_s", "cpu_ms_per_group", "batch_p50_ms"))
        lines.append(
            f"  {side:12} ingest {_fmt(g)} groups/s, {_fmt(c, 2)} server CPU ms/group; /batch p50 {_fmt(b)} ms"
        )
    on, off = "metrics on", "metrics off"
    for key, better in (("groups_per_s", "higher"), ("cpu_ms_per_group", "lower"), ("batch_p50_ms", "lower")):
        a, b = _median(rows, on, key), _median(rows, off, key)
        if a and b:
            cost = (b - a) / b if better == "higher" else (a - b) / b
            verdict = "within" if cost <= TOLERANCE else "BEYOND"
            lines.append(f"  {key}: on costs {cost:+.1%} against off ({verdict} {TOLERANCE:.0%})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=REPS)
    ap.add_argument("--base", type=Path, default=None, help="another rollbuf checkout to run as a third side")
    args = ap.parse_args()
    results = run(args.reps, args.base)
    print(report(results))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
