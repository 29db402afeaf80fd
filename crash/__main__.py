"""`python -m crash` (`make crash-matrix`): every fault on every durable store, each side in every run, one run
after another (the machine's cores go to the run's processes); writes the run's JSON and the page from it.

    python -m crash [--small] [--only FAULT ...] [--stores sqlite postgresql]
        [--json docs/crash-matrix.json] [--page docs/crash-matrix.md] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from crash.count import failed as cell_failed
from crash.page import render
from crash.run import (
    BATCH,
    EPISODE_GEN_S,
    FAULTS,
    FULL,
    LATENCY_S,
    MAX_TOKEN_LEN,
    MODES,
    ROLLOUT_LEASE_S,
    SMALL,
    STORES,
    TASK_LEASE_S,
    run_cell,
)
from tests import pg

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    """The kind of machine, as `nproc`, /proc/cpuinfo and /proc/meminfo say."""
    cores = os.cpu_count()
    model = "unknown CPU"
    memory = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f", {int(line.split()[1]) / 2**20:.0f} GiB of memory"
                break
    except OSError:
        pass
    return f"a {cores}-vCPU VM ({model}{memory}; `nproc`, /proc/cpuinfo)"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()


def postgres_down() -> str | None:
    try:
        with psycopg.connect(pg.ADMIN_URL, connect_timeout=5):
            return None
    except psycopg.OperationalError as exc:
        return f"PostgreSQL not reachable at {pg.ADMIN_URL} ({str(exc).strip()[:200]})"


def failed(run: dict[str, Any]) -> bool:
    """A run that did not finish, or whose counts say data was lost or trained twice, or an episode was not
    token-exact."""
    return bool(run.get("error")) or any(map(cell_failed, run.get("cells", {}).values()))


def cells(only: list[str] | None, stores: list[str]) -> list[tuple[str, str, str]]:
    """(fault, store, trainer mode) of every run: each fault with the trainer in commit mode, reading ahead; the
    trainer's own kill in next mode too."""
    out = []
    for fault in FAULTS:
        if only and fault not in only:
            continue
        for store in stores:
            for mode in MODES if fault == "trainer" else ("commit",):
                out.append((fault, store, mode))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the scale of the tier in make test")
    ap.add_argument("--only", nargs="*", choices=list(FAULTS), default=None)
    ap.add_argument("--stores", nargs="*", choices=list(STORES), default=list(STORES))
    ap.add_argument("--json", type=Path, default=ROOT / "docs" / "crash-matrix.json")
    ap.add_argument("--page", type=Path, default=ROOT / "docs" / "crash-matrix.md")
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's files (logs, records) here")
    args = ap.parse_args()
    # SIGTERM ends the matrix as Ctrl-C does: the run's processes (each its own process group) are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    scale = SMALL if args.small else FULL
    down = postgres_down() if "postgresql" in args.stores else None
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="crash-matrix-") as tmp:
        base = args.keep or Path(tmp)
        for fault, store, mode in cells(args.only, args.stores):
            name = f"{fault}-{store}-{mode}"
            if store == "postgresql" and down is not None:
                result: dict[str, Any] = {"fault": fault, "store": store, "mode": mode, "not_run": down}
            else:
                result = run_cell(fault, store, mode, scale, base / name)
            runs.append(result)
            summary = (
                result.get("not_run")
                or result.get("error")
                or {side: (c["acknowledged"], c["lost"], c["trained_twice"]) for side, c in result["cells"].items()}
            )
            exact = result.get("cells", {}).get("episodes")
            summary = (
                summary
                if exact is None
                else f"{summary}; episodes turns lost {exact['turns_lost']}, not token-exact {exact['not_token_exact']}"
            )
            print(f"{name}: {summary} ({result.get('seconds', 0)} s)", flush=True)
    command = (
        "make crash-matrix"
        if not (args.small or args.only or args.stores != list(STORES))
        else " ".join(["python -m crash", *sys.argv[1:]])
    )
    matrix = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(),
        "command": command,
        "seconds": round(time.monotonic() - started),
        "scale": scale.__dict__,
        "batch": BATCH,
        "task_lease_s": TASK_LEASE_S,
        "rollout_lease_s": ROLLOUT_LEASE_S,
        "latency_s": LATENCY_S,
        "episode_gen_s": EPISODE_GEN_S,
        "max_token_len": MAX_TOKEN_LEN,
        "runs": runs,
    }
    args.json.write_text(json.dumps(matrix, indent=1) + "\n")
    args.page.write_text(render(matrix))
    bad = [r for r in runs if failed(r)]
    print(f"wrote {args.json} and {args.page}; {len(bad)} of {len(runs)} runs lost data, trained it twice or failed")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
