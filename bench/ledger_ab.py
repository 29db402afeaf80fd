"""What the ledger and retention cost on the hot path, as an A/B on one store (docs/ledger.md).

Part 1, the served path: the same server started with the ledger off (`--no-ledger`), on (the default) and on
with retention (`--retain-steps 1000`), in alternating order, `--reps` times; each start runs ingest at 8
clients (groups/s, server CPU ms per group) and `/batch` 256 x 2048 tokens (p50 ms). Medians, and each side
against "ledger off" (the budget is 5%).

Part 2, the dropped path: groups the trainer's filter drops (`drop_zero_variance`, every score equal) posted
one after another in process (the app behind httpx, no socket), 8 x 2048 tokens each, with retention off and
on, alternately: groups/s. Retention writes a dropped group's payload that today is never written, so this is
where it costs most.

Part 3, CPU in process: the app behind httpx (no socket, no load generator), ledger off / on / retention in
turns: process CPU ms per group ingested (8 x 512 tokens, one per request) and per `/batch?step=` of 64
sequences, the store's writer thread included (PostgreSQL's server is not). CPU time is what a shared
machine disturbs least, so this is the steadiest of the three figures.

Part 4, the store alone: median µs of the ledger's own writes inside a transaction, per group ingested and per
batch (no HTTP, no load generator: the most precise figure, and what the ledger adds to each transaction).

    python -m bench.ledger_ab [--reps 3] [--store sqlite|postgresql] [--dropped 300] [--only served|dropped|cpu|store]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import pg
from bench.http import run_harness, run_ingest
from bench.servers import ROOT, Target, rollbuf, serve

INGEST_ARGS = ["--ingest-requests", "480"]
BATCH_ARGS = ["--batch-sizes", "256", "--batch-reps", "256:5"]
SIDES = {"ledger off": ["--no-ledger"], "ledger on": [], "retention on": ["--retain-steps", "1000"]}


def _store(kind: str, tmp: Path, key: str, dbs: contextlib.ExitStack) -> str:
    if kind == "postgresql":
        return str(dbs.enter_context(pg.database()))
    return f"sqlite:///{tmp}/{key}.db"


def _measure(target: Target) -> dict[str, Any]:
    ingest = run_ingest(target, [8], INGEST_ARGS)
    batch = run_harness(target, "batch", BATCH_ARGS)
    lat = [r["latency"]["p50_ms"] for r in batch if r.get("phase") == "batch" and "latency" in r]
    return {
        "groups_per_s": ingest[0].get("groups_per_s") if ingest else None,
        "cpu_ms_per_group": ingest[0].get("server_cpu_ms_per_group") if ingest else None,
        "batch_p50_ms": lat[0] if lat else None,
    }


def served_path(reps: int, store: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            sides = list(SIDES.items())
            if rep % 2:
                sides.reverse()
            for name, extra in sides:
                key = name.replace(" ", "-") + f"-{rep}"
                with contextlib.ExitStack() as dbs:
                    label, cmd, port = rollbuf(_store(store, Path(tmp), key, dbs), Path(tmp) / f"{key}.log")
                    with serve(label, [*cmd, *extra], port, Path(tmp) / f"{key}.out", cwd=ROOT) as target:
                        row = {
                            "bench": "ledger_ab",
                            "part": "served",
                            "store": store,
                            "side": name,
                            "rep": rep,
                            **_measure(target),
                        }
                print(json.dumps(row), flush=True)
                results.append(row)
    return results


async def _dropped_rate(url: str, retain: bool, n: int) -> float:
    from api.app import create_app  # the service in process: only part 2 imports it
    from api.config.settings import Settings
    from api.wire.schema import REGISTRATION_EXAMPLE

    app = create_app(Settings(store=url, retain_steps=1000 if retain else None))
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, 150_000, 2048).tolist() for _ in range(8)]
    body = {"tokens": tokens, "masks": tokens, "scores": [1.0] * 8, "env_id": 0}  # zero variance: dropped
    env = {"max_token_length": 4096, "desired_name": "math", "weight": 1.0, "group_size": 8}
    reg = REGISTRATION_EXAMPLE | {"batch_size": 64, "max_token_len": 4096, "drop_zero_variance": True}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            assert (await c.post("/register", json=reg)).status_code == 200
            await c.get("/batch")
            assert (await c.post("/register-env", json=env)).status_code == 200
            raw = json.dumps(body).encode()
            headers = {"Content-Type": "application/json"}
            start = time.perf_counter()
            for _ in range(n):
                reply = await c.post("/scored_data", content=raw, headers=headers)
                assert reply.status_code == 200, reply.text
            return n / (time.perf_counter() - start)


def dropped_path(reps: int, store: str, n: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            sides = [("retention off", False), ("retention on", True)]
            if rep % 2:
                sides.reverse()
            for name, retain in sides:
                key = name.replace(" ", "-") + f"-d{rep}"
                with contextlib.ExitStack() as dbs:
                    rate = asyncio.run(_dropped_rate(_store(store, Path(tmp), key, dbs), retain, n))
                row = {
                    "bench": "ledger_ab",
                    "part": "dropped",
                    "store": store,
                    "side": name,
                    "rep": rep,
                    "dropped_groups_per_s": rate,
                }
                print(json.dumps(row), flush=True)
                results.append(row)
    return results


async def _cpu(url: str, extra: dict[str, Any], n: int) -> tuple[float, float]:
    from api.app import create_app
    from api.config.settings import Settings
    from api.wire.schema import REGISTRATION_EXAMPLE

    app = create_app(Settings(store=url, **extra))
    rng = np.random.default_rng(2)
    env = {"max_token_length": 1024, "desired_name": "math", "weight": 1.0, "group_size": 8}
    reg = REGISTRATION_EXAMPLE | {"batch_size": 64, "max_token_len": 1024}
    bodies = []
    for i in range(n):
        tokens = [rng.integers(0, 150_000, 512).tolist() for _ in range(8)]
        bodies.append(
            json.dumps(
                {"tokens": tokens, "masks": tokens, "scores": [float(i % 2), 1.0] * 4, "env_id": 0, "group_id": f"g{i}"}
            ).encode()
        )
    headers = {"Content-Type": "application/json"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            assert (await c.post("/register", json=reg)).status_code == 200
            await c.get("/batch", params={"step": 0})
            assert (await c.post("/register-env", json=env)).status_code == 200
            start = time.process_time()
            for body in bodies:
                assert (await c.post("/scored_data", content=body, headers=headers)).status_code == 200
            ingest = (time.process_time() - start) / n * 1000
            batches = n // 8
            start = time.process_time()
            for step in range(batches):
                reply = await c.get("/batch", params={"step": step}, headers={"Accept": "application/msgpack"})
                assert reply.status_code == 200 and reply.content
            return ingest, (time.process_time() - start) / batches * 1000


def cpu_path(reps: int, store: str, n: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    sides = {"ledger off": {"ledger": False}, "ledger on": {}, "retention on": {"retain_steps": 1000}}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            order = list(sides.items())
            if rep % 2:
                order.reverse()
            for name, extra in order:
                key = name.replace(" ", "-") + f"-c{rep}"
                with contextlib.ExitStack() as dbs:
                    ingest, batch = asyncio.run(_cpu(_store(store, Path(tmp), key, dbs), extra, n))
                row = {
                    "bench": "ledger_ab",
                    "part": "cpu",
                    "store": store,
                    "side": name,
                    "rep": rep,
                    "ingest_cpu_ms_per_group": ingest,
                    "batch_cpu_ms": batch,
                }
                print(json.dumps(row), flush=True)
                results.append(row)
    return results


async def _store_costs(url: str, n: int = 400) -> dict[str, float]:
    """Median µs the ledger's own writes take inside a transaction: a group's row as one /scored_data writes it
    (its summary included), and a batch's (8 groups served, the step's row, a commit mark)."""
    from api.ledger.rules import group_row, step_row
    from api.store import make_store
    from api.store.base import SERVED, ItemMeta, QueuedItem, Txn
    from api.wire.records import GroupRecord

    store = make_store(url)
    rec = GroupRecord(
        0,
        np.full(8, 512, np.int32),
        np.zeros(4096, np.int32),
        np.zeros(4096, np.int32),
        np.arange(8, dtype=np.float64),
        0,
        "g",
    )
    ingest: list[float] = []
    batch: list[float] = []
    ids: list[int] = []
    try:
        for _ in range(n):

            def add(t: Txn) -> float:
                item_id = t.next_item_id()
                t.append(0, QueuedItem(ItemMeta(item_id, 8, 4096, 0), 1, b"x" * 100))
                start = time.perf_counter()
                t.ledger.add([group_row(item_id, 0, rec, 100, None, "queued", 1.0)])
                ids.append(item_id)
                return time.perf_counter() - start

            ingest.append(await store.transact(add))
        for k in range(n // 8):
            chunk = ids[k * 8 : (k + 1) * 8]

            def serve(t: Txn, chunk: list[int] = chunk, k: int = k) -> float:
                start = time.perf_counter()
                t.ledger.decide(chunk, SERVED, step=k, at=1.0)
                t.ledger.put_step(
                    step_row(k, 1.0, 0.001, chunk, 64, 32768, {"a": 8}, {"a": 64}, {0: 8}, committed=False)
                )
                t.ledger.committed(k, k + 1, 2.0)
                return time.perf_counter() - start

            batch.append(await store.transact(serve))
    finally:
        await store.close()
    return {
        "ledger_us_per_group": statistics.median(ingest) * 1e6,
        "ledger_us_per_batch": statistics.median(batch) * 1e6,
    }


def store_path(store: str) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as dbs:
        costs = asyncio.run(_store_costs(_store(store, Path(tmp), "store-costs", dbs)))
    row = {"bench": "ledger_ab", "part": "store", "store": store, "side": "ledger on", "rep": 0, **costs}
    print(json.dumps(row), flush=True)
    return [row]


def _median(rows: list[dict[str, Any]], part: str, side: str, key: str) -> float | None:
    vals = [r[key] for r in rows if r["part"] == part and r["side"] == side and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'served path':28} {'ingest 8 cl g/s':>16} {'CPU ms/group':>13} {'/batch 256 p50 ms':>18}"]
    off = {k: _median(rows, "served", "ledger off", k) for k in ("groups_per_s", "cpu_ms_per_group", "batch_p50_ms")}
    for side in SIDES:
        vals = {k: _median(rows, "served", side, k) for k in off}
        cells = []
        for k, v in vals.items():
            base = off[k]
            ratio = f" ({v / base:.2f})" if v and base and side != "ledger off" else ""
            cells.append(("-" if v is None else f"{v:.2f}") + ratio)
        lines.append(f"{side:28} {cells[0]:>16} {cells[1]:>13} {cells[2]:>18}")
    lines.append("")
    lines.append(f"{'CPU in process':28} {'ingest ms/group':>16} {'/batch 64 ms':>13}")
    base = {k: _median(rows, "cpu", "ledger off", k) for k in ("ingest_cpu_ms_per_group", "batch_cpu_ms")}
    for side in SIDES:
        cells = []
        for k, b in base.items():
            v = _median(rows, "cpu", side, k)
            ratio = f" ({v / b:.2f})" if v and b and side != "ledger off" else ""
            cells.append(("-" if v is None else f"{v:.3f}") + ratio)
        lines.append(f"{side:28} {cells[0]:>16} {cells[1]:>13}")
    for r in rows:
        if r["part"] == "store":
            lines.append(
                f"\nthe ledger's writes in a transaction: {r['ledger_us_per_group']:.1f} us per group "
                f"ingested, {r['ledger_us_per_batch']:.1f} us per batch of 8 groups"
            )
    lines.append("")
    lines.append(f"{'dropped path (in process)':28} {'dropped groups/s':>16}")
    for side in ("retention off", "retention on"):
        v = _median(rows, "dropped", side, "dropped_groups_per_s")
        lines.append(f"{side:28} {'-' if v is None else f'{v:.1f}':>16}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--store", choices=["sqlite", "postgresql"], default="sqlite")
    ap.add_argument("--dropped", type=int, default=300, help="dropped groups posted per side and rep (part 2)")
    ap.add_argument("--cpu-groups", type=int, default=400, help="groups ingested per side and rep (part 3)")
    ap.add_argument("--only", choices=["served", "dropped", "cpu", "store"], action="append", help="only these parts")
    args = ap.parse_args()
    parts = args.only or ["served", "dropped", "cpu", "store"]
    rows = served_path(args.reps, args.store) if "served" in parts else []
    rows += dropped_path(args.reps, args.store, args.dropped) if "dropped" in parts else []
    rows += cpu_path(args.reps, args.store, args.cpu_groups) if "cpu" in parts else []
    rows += store_path(args.store) if "store" in parts else []
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    with (out / "ledger_ab.jsonl").open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(report(rows))


if __name__ == "__main__":
    main()
