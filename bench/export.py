"""Export throughput: `rollbuf export` of a 100k-group run (docs/ledger.md, "Export").

The run is written into a store directly (no HTTP, no formation: the ledger rows, retained payloads and step
rows a run with retention would hold): `--groups` groups of `--seqs` sequences of `--tokens` tokens with
float32 inference logprobs, 4 envs, one batch per 16 groups, one group in ten dropped as stale. Then
`rollbuf export DIR --store URL` runs as its own process, once per table set, and reports rows/s, MB/s
(of Parquet written, and of stored payload read) and the process's peak RSS: the export holds a page and a
row group, never the run, so its RSS stays flat however large the run.

    python -m bench.export [--groups 100000] [--seqs 4] [--tokens 128] [--store sqlite|postgresql]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from api.ledger import rules as ledger
from api.run import state, stats
from api.run.state import EnvRecord
from api.store import make_store
from api.store.base import DROPPED, SERVED, LedgerGroup, Txn
from api.wire.records import encode_submission
from api.wire.schema import Registration
from bench import pg
from bench.servers import ROOT

ENVS = ("math", "code", "chat", "tools")
CHUNK = 2000
"""Groups written per transaction while building the run."""
PER_STEP = 16


def _setup(txn: Txn, groups: int) -> None:
    reg = Registration.model_validate(
        {
            "wandb_group": "g",
            "wandb_project": "p",
            "batch_size": PER_STEP * 4,
            "max_token_len": 4096,
            "checkpoint_dir": "c",
            "save_checkpoint_interval": 0,
            "starting_step": 0,
            "num_steps": 10**9,
        }
    )
    state.save_run(txn, reg, started=True)
    run = state.load(txn)
    for i, name in enumerate(ENVS):
        run = state.save_env(txn, run, EnvRecord(i, name, f"{name}_0", 1.0, 4, 4096, None))
    state.save_step(txn, groups // PER_STEP)
    stats.count_received(txn, {f"{name}_0": groups // len(ENVS) for name in ENVS})


def _chunk(txn: Txn, start: int, n: int, seqs: int, tokens: int, rng: np.random.Generator) -> int:
    """Groups start..start+n: their ledger rows, retained payloads and the steps they complete; payload bytes."""
    toks = rng.integers(0, 150_000, size=(n, seqs, tokens), dtype=np.int32)
    lps = -rng.exponential(0.5, size=(n, seqs, tokens)).astype(np.float32)
    rows: list[LedgerGroup] = []
    payloads: list[tuple[int, bytes]] = []
    now = time.time()
    size = 0
    for k in range(n):
        gid = start + k
        step = gid // PER_STEP
        masks = toks[k].copy()
        masks[:, : tokens // 2] = -100
        policy = max(0, step - 1)
        payload = encode_submission(
            toks[k],
            masks,
            [float(gid % 2)] * seqs,
            env_id=gid % len(ENVS),
            policy_step=policy,
            group_id=f"g{gid}",
            inference_logprobs=lps[k],
        )
        dropped = gid % 10 == 9
        rows.append(
            LedgerGroup(
                id=gid,
                env_id=gid % len(ENVS),
                group_id=f"g{gid}",
                handler=None,
                acked_at=now,
                policy_step=policy,
                seqs=seqs,
                tokens=seqs * tokens,
                bytes=len(payload),
                score_mean=float(gid % 2),
                score_min=float(gid % 2),
                score_max=float(gid % 2),
                score_std=0.0,
                fate=DROPPED if dropped else SERVED,
                step=step,
                reason="stale" if dropped else None,
                decided_at=now,
                kept=True,
            )
        )
        payloads.append((gid, payload))
        size += len(payload)
    txn.ledger.add(rows)
    txn.ledger.keep_payloads(payloads)
    for step in range(start // PER_STEP, (start + n) // PER_STEP):
        ids = [i for i in range(step * PER_STEP, (step + 1) * PER_STEP) if i % 10 != 9]
        by_env: dict[str, int] = {}
        for i in ids:
            name = f"{ENVS[i % len(ENVS)]}_0"
            by_env[name] = by_env.get(name, 0) + 1
        by_seqs = {e: g * seqs for e, g in by_env.items()}
        n_seqs = len(ids) * seqs
        row = ledger.step_row(
            step, now, 0.001, ids, n_seqs, n_seqs * tokens, by_env, by_seqs, {1: len(ids)}, committed=True
        )
        txn.ledger.put_step(row)
    return size


async def build(url: str, groups: int, seqs: int, tokens: int) -> int:
    store = make_store(url)
    rng = np.random.default_rng(0)
    size = 0
    try:
        await store.transact(lambda txn: _setup(txn, groups))
        for start in range(0, groups, CHUNK):
            n = min(CHUNK, groups - start)
            size += await store.transact(lambda txn, s=start, n=n: _chunk(txn, s, n, seqs, tokens, rng))  # type: ignore[misc]
    finally:
        await store.close()
    return size


def export(url: str, out: Path, tables: str) -> dict[str, Any]:
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api", "export", str(out), "--store", url, "--tables", tables],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        _, status, usage = os.wait4(proc.pid, 0)  # this process's own peak RSS and CPU, not its siblings'
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        err.seek(0)
        lines = err.read().strip().splitlines()
    if proc.returncode:
        raise RuntimeError(f"rollbuf export failed ({proc.returncode}): {lines}")
    written = sum(p.stat().st_size for p in out.glob("*.parquet"))
    inside = sum(float(line.split(" in ")[1].split(" s")[0]) for line in lines)  # the command's own timing
    return {
        "tables": tables,
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "parquet_mb": round(written / 1e6, 1),
        "export_s": round(inside, 2),
        "parquet_mb_per_s": round(written / 1e6 / inside, 1),
        "log": lines,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=100_000)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--store", choices=["sqlite", "postgresql"], default="sqlite")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as dbs:
        url = str(dbs.enter_context(pg.database())) if args.store == "postgresql" else f"sqlite:///{tmp}/run.db"
        t0 = time.perf_counter()
        payload = asyncio.run(build(url, args.groups, args.seqs, args.tokens))
        built = time.perf_counter() - t0
        rows = args.groups * args.seqs
        results: dict[str, Any] = {
            "bench": "export",
            "store": args.store,
            "groups": args.groups,
            "sequences": rows,
            "tokens": rows * args.tokens,
            "payload_mb": round(payload / 1e6, 1),
            "build_s": round(built, 1),
        }
        seq = export(url, Path(tmp) / "seq", "sequences")
        seq["rows_per_s"] = round(rows / seq["export_s"])
        seq["payload_mb_per_s"] = round(payload / 1e6 / seq["export_s"], 1)
        ledger_only = export(url, Path(tmp) / "ledger", "groups,steps")
        ledger_only["rows_per_s"] = round((args.groups + args.groups // PER_STEP) / ledger_only["export_s"])
        results["sequences"] = seq
        results["ledger"] = ledger_only
    print(json.dumps(results, indent=2))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    with (out / "export.jsonl").open("a") as f:
        f.write(json.dumps({"at": time.time(), **results}) + "\n")


if __name__ == "__main__":
    main()
