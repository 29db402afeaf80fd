"""The reward curve of a `rollbuf demo --learn --report PATH` run, drawn with matplotlib:

    python -m demos.plot report.json docs/img/learn-reward.png

Needs matplotlib (`pip install 'rollbuf[plot]'`; the dev extra has it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

WINDOW = 5


def plot(report: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    rows = report["rows"]
    steps = [r["step"] for r in rows]
    reward = [r["reward"] for r in rows]
    smooth = [
        sum(reward[max(0, i - WINDOW + 1) : i + 1]) / len(reward[max(0, i - WINDOW + 1) : i + 1])
        for i in range(len(reward))
    ]
    cfg = report.get("config", {})
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    ax.plot(steps, reward, ".", color="tab:blue", alpha=0.35, label="batch mean reward")
    ax.plot(steps, smooth, "-", color="tab:blue", label=f"mean of the last {WINDOW} steps")
    ax.axhline(1 / 12, color="grey", ls=":", label="chance (1/12 per position)")
    ax.set_xlabel(
        f"trainer step (one batch of {cfg.get('group_size', '?')} x {cfg.get('groups_per_step', '?')} sequences)"
    )
    ax.set_ylabel("reward (fraction of digits right)")
    ax.set_ylim(0, 1.02)
    ax.set_title(
        f"rollbuf demo --learn: reverse {cfg.get('digits', '?')} digits, "
        f"{report['steps']} steps in {report['seconds']:.0f} s on {cfg.get('device', 'cpu')}"
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m demos.plot", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("report", type=Path, help="JSON written by `rollbuf demo --learn --report`")
    ap.add_argument("out", type=Path, help="image to write (.png, .svg, ...)")
    args = ap.parse_args(argv)
    plot(json.loads(args.report.read_text()), args.out)


if __name__ == "__main__":
    main()
