"""Ingest per store, measured in turns: SQLite (default and `synchronous=FULL`), PostgreSQL with one and two
replica processes, at 1 / 8 / 32 clients, JSON or msgpack.

Each round starts every server anew on an empty store, after a `CHECKPOINT` (a checkpoint that falls inside one
side's minute would charge it the full-page writes that follow), and rounds alternate the order, so the
sides share the machine's moods: compare them within a round, as ratios. Next to groups/s it reads the
server's CPU and the database's (every PostgreSQL process), per group: on one host both come out of the same
cores. `synchronous=FULL` is SQLite with PostgreSQL's promise (`synchronous_commit = on`: a commit survives the
loss of the host), the default `NORMAL` survives `kill -9` of the server.

Run: `python -m bench.stores_ingest [--rounds 3] [--transport msgpack]`.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path
from typing import Any

import psycopg

from bench import pg
from bench.http import MSGPACK_TRANSPORT, cpu_seconds, run_ingest
from bench.servers import Target, rollbuf, serve

CLIENTS = [1, 8, 32]
SIDES = ["sqlite", "sqlite-full", "postgresql", "postgresql x2"]


def _postmaster() -> int | None:
    """The local PostgreSQL server's pid (its processes' CPU is the database's), when it runs here."""
    with psycopg.connect(pg.ADMIN_URL) as conn:
        row = conn.execute("SELECT pg_postmaster_start_time(), current_setting('data_directory')").fetchone()
    pid_file = Path(row[1]) / "postmaster.pid" if row else None
    try:
        return int(pid_file.read_text().split()[0]) if pid_file else None
    except OSError:  # another host, or not readable: the database's CPU is not counted
        return None


def _side(side: str, tmp: str, stack: contextlib.ExitStack) -> tuple[str, list[str], int]:
    if side.startswith("sqlite"):
        query = "?synchronous=FULL" if side == "sqlite-full" else ""
        return rollbuf(f"sqlite:///{tmp}/{side}.db{query}", Path(tmp) / f"{side}.log")
    return rollbuf(stack.enter_context(pg.database()), Path(tmp) / "pg.log", workers=2 if "x2" in side else 1)


def _level(target: Target, clients: int, transport: str, database_pid: int | None) -> dict[str, Any]:
    """One harness call at `clients` clients; the database's CPU per group when it runs here."""
    before = cpu_seconds(database_pid) if database_pid else 0.0
    plug = MSGPACK_TRANSPORT if transport == "msgpack" else "json"
    [r] = run_ingest(target, [clients], ["--ingest-requests", "480"], transport=plug)
    used = (cpu_seconds(database_pid) - before) if database_pid else 0.0
    ok = r.get("requests_ok") or 0
    shared = "postgresql" in target.name
    return {
        "bench": "stores-ingest",
        "transport": transport,
        "clients": clients,
        "groups_per_s": r.get("groups_per_s"),
        "server_cpu_ms_per_group": r.get("server_cpu_ms_per_group"),
        "database_cpu_ms_per_group": round(used * 1e3 / ok, 2) if ok and shared else None,
    }


def run(rounds: int = 3, transport: str = "json", sides: list[str] = SIDES) -> list[dict[str, Any]]:
    if not pg.available():
        sides = [s for s in sides if not s.startswith("postgresql")]
    database_pid = _postmaster() if any(s.startswith("postgresql") for s in sides) else None
    out: list[dict[str, Any]] = []
    for n in range(rounds):
        order = sides if n % 2 == 0 else sides[::-1]
        for side in order:
            with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
                if database_pid is not None:
                    with psycopg.connect(pg.ADMIN_URL, autocommit=True) as conn:
                        conn.execute("CHECKPOINT")
                name, cmd, port = _side(side, tmp, stack)
                with serve(name, cmd, port, Path(tmp) / "server.log") as target:
                    out += [{"side": side, "round": n, **_level(target, k, transport, database_pid)} for k in CLIENTS]
    return out


def report(results: list[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("bench") == "stores-ingest"]
    if not rows:
        return ""
    lines = []
    for transport in sorted({r["transport"] for r in rows}):
        lines.append(
            f"ingest per store, {transport}, medians over rounds in turns: groups/s at "
            f"{' / '.join(map(str, CLIENTS))} clients (server | database CPU ms per group)"
        )
        median: dict[tuple[str, int], float] = {}
        for side in SIDES:
            cells = []
            for k in CLIENTS:
                got = [r for r in rows if r["transport"] == transport and r["side"] == side and r["clients"] == k]
                rates = [r["groups_per_s"] for r in got if r["groups_per_s"]]
                if not rates:
                    continue
                median[side, k] = statistics.median(rates)
                srv = statistics.median(r["server_cpu_ms_per_group"] or 0 for r in got)
                db = [r["database_cpu_ms_per_group"] for r in got if r["database_cpu_ms_per_group"] is not None]
                cells.append(f"{median[side, k]:6.0f} ({srv:.2f}" + (f" | {statistics.median(db):.2f})" if db else ")"))
            if cells:
                lines.append(f"  {side:14} " + " / ".join(cells))
        for num, den in (("postgresql", "sqlite"), ("postgresql", "sqlite-full"), ("postgresql x2", "postgresql")):
            ratios = [
                f"{median[num, k] / median[den, k]:.2f}" for k in CLIENTS if (num, k) in median and (den, k) in median
            ]
            if ratios:
                lines.append(f"  {num} / {den}: {' / '.join(ratios)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transport", choices=["json", "msgpack"], default="json")
    args = ap.parse_args()
    print(report(run(args.rounds, args.transport)))


if __name__ == "__main__":
    main()
