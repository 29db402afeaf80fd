"""The figure of docs/benchmarks.md, drawn from a `python -m bench.limit` run's JSON with matplotlib:

    python -m bench.limit_plot bench/results/limit-<time>.json docs/img/limit.png

Three panels, one per question the page answers:
- what a group costs the server, as a multiple of the do-nothing endpoint's CPU for the same request (the steady
  figure on a shared machine), per workload and side, with the goal of each store marked;
- how many groups per second one server process takes (8 keep-alive clients), per workload and side;
- large groups in MB/s against what the disk takes durably (appends with an fsync per MiB; loopback TCP, ten
  times that on these machines, is in the table, not the panel, whose axis is linear).

Only this checkout's rows are drawn (`checkout` "after", and the sinks' "-"); a `--base` run's "before" rows
are left out. Needs matplotlib (the `plot` extra; the dev extra has it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

WORKLOADS = ("small", "large", "list16")
WORKLOAD_LABELS = {
    "small": "small\n8 x 64 tokens",
    "large": "large\n8 x 2048 tokens",
    "list16": "lists of 16\nsmall groups",
}
SIDES = ("sink", "keep", "memory", "sqlite", "postgresql")
SIDE_LABELS = {
    "sink": "do-nothing endpoint",
    "keep": "do-nothing, keeps bodies",
    "memory": "rollbuf, memory",
    "sqlite": "rollbuf, SQLite",
    "postgresql": "rollbuf, PostgreSQL",
}
COLORS = {"sink": "#9e9e9e", "keep": "#cfcfcf", "memory": "tab:green", "sqlite": "tab:blue", "postgresql": "tab:purple"}
GOALS = {("memory", "small"): 2.0, ("memory", "large"): 1.5, ("sqlite", "small"): 3.0, ("sqlite", "large"): 2.0}
"""The goals for server CPU per group, as a multiple of the do-nothing endpoint's (docs/benchmarks.md)."""
LIST_GOAL = ("sqlite", "list16", 5000.0)
"""...and for groups/s through SQLite in lists of 16."""


def rows_of(run: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """This checkout's summary rows by (side, workload); the machine's rows (disk, loopback) by (side, "bytes")."""
    return {(r["side"], r["workload"]): r for r in run["summary"] if r.get("checkout") in ("after", "-")}


def plot(run: dict[str, Any], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = rows_of(run)
    sides = [s for s in SIDES if any((s, w) in rows for w in WORKLOADS)]
    fig, (cost, rate, mbs) = plt.subplots(1, 3, figsize=(14, 4.4), dpi=110, gridspec_kw={"width_ratios": [3, 3, 2]})
    width = 0.8 / max(len(sides), 1)
    for i, side in enumerate(sides):
        xs = [k + (i - (len(sides) - 1) / 2) * width for k in range(len(WORKLOADS))]
        for ax, field in ((cost, "cpu_x_sink"), (rate, "groups_per_s")):
            vals = [rows.get((side, w), {}).get(field) for w in WORKLOADS]
            ax.bar(
                [x for x, v in zip(xs, vals, strict=True) if v],
                [v for v in vals if v],
                width,
                color=COLORS[side],
                label=SIDE_LABELS[side],
                edgecolor="black",
                linewidth=0.4,
            )
        for k, w in enumerate(WORKLOADS):
            goal = GOALS.get((side, w))
            if goal is not None:
                cost.plot([xs[k] - width / 2, xs[k] + width / 2], [goal, goal], color="red", lw=2)
            if (side, w) == LIST_GOAL[:2]:
                rate.plot([xs[k] - width / 2, xs[k] + width / 2], [LIST_GOAL[2]] * 2, color="red", lw=2)
    cost.plot([], [], color="red", lw=2, label="goal")
    for ax, ylabel in ((cost, "server CPU per group, x the do-nothing endpoint"), (rate, "groups/s")):
        ax.set_xticks(range(len(WORKLOADS)), [WORKLOAD_LABELS[w] for w in WORKLOADS], fontsize=8)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    cost.axhline(1, color="black", lw=0.6)
    cost.set_title("what a group costs the server", fontsize=10)
    rate.set_yscale("log")
    rate.set_title("groups per second, one process, 8 clients", fontsize=10)
    cost.legend(fontsize=7, loc="upper left")

    bars = [(SIDE_LABELS[s], rows[(s, "large")]["MB_per_s"], COLORS[s]) for s in sides if (s, "large") in rows]
    if ("disk", "bytes") in rows:
        bars.append(("disk: append + fsync per MiB", rows[("disk", "bytes")]["MB_per_s"], "#f0c060"))
    mbs.barh(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars], edgecolor="black", linewidth=0.4)
    mbs.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    mbs.invert_yaxis()
    mbs.set_xlabel("MB/s", fontsize=9)
    mbs.set_title("large groups against the machine", fontsize=10)
    mbs.grid(axis="x", alpha=0.3)
    for y, (_, value, _) in enumerate(bars):
        mbs.text(value, y, f" {value:,.0f}", va="center", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.limit_plot", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("run", type=Path, help="JSON written by `python -m bench.limit`")
    ap.add_argument("out", type=Path, help="image to write (.png, .svg, ...)")
    ap.add_argument("--title", default="", help="a line over the panels (the machine, the date)")
    args = ap.parse_args(argv)
    plot(json.loads(args.run.read_text()), args.out, args.title)


if __name__ == "__main__":
    main()
