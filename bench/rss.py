"""Server memory against queue depth: RSS of a real server process at 1k, 10k and 100k queued groups.

With the SQLite store payloads live in the file, so RSS should stay flat; with the memory store it grows
with the payload, and the figure to watch is bytes of RSS per queued token position against the raw
payload (int32 token + int32 mask + float32 logprob = 12 bytes).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from bench.servers import rollbuf, serve

DEPTHS = (1_000, 10_000, 100_000)
SEQS, LEN = 4, 32
CHUNK = 1_000
RAW_BYTES_PER_POSITION = 12


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _chunk_body(env_id: int, n: int, rng: np.random.Generator) -> bytes:
    tokens = rng.integers(0, 150_000, (n, SEQS, LEN))
    masks = tokens.copy()
    masks[:, :, : LEN // 2] = -100
    lps = -rng.exponential(0.5, (n, SEQS, LEN)).astype(np.float32).astype(np.float64)
    groups = [
        {
            "env_id": env_id,
            "tokens": tokens[i].tolist(),
            "masks": masks[i].tolist(),
            "inference_logprobs": lps[i].tolist(),
            "scores": [0.0, 1.0] * (SEQS // 2),
        }
        for i in range(n)
    ]
    return orjson.dumps(groups)


def measure(store: str, log: Path) -> list[dict[str, Any]]:
    out = []
    rng = np.random.default_rng(0)
    with serve(*rollbuf(store, log), log) as target, httpx.Client(base_url=target.url, timeout=120) as c:
        c.post(
            "/register",
            json={
                "wandb_group": "b",
                "wandb_project": "b",
                "batch_size": 1 << 20,
                "max_token_len": LEN,
                "checkpoint_dir": "c",
                "save_checkpoint_interval": 0,
                "starting_step": 0,
                "num_steps": 1,
            },
        )
        c.get("/batch")
        env_id = c.post(
            "/register-env", json={"max_token_length": LEN, "desired_name": "rss", "weight": 1.0, "group_size": SEQS}
        ).json()["env_id"]
        body = _chunk_body(env_id, CHUNK, rng)  # the same chunk over and over: encoding is not measured
        base = _rss_kb(target.pid)
        queued = 0
        for depth in DEPTHS:
            while queued < depth:
                r = c.post("/scored_data_list", content=body, headers={"Content-Type": "application/json"})
                r.raise_for_status()
                queued += CHUNK
            assert c.get("/status").json()["queue_size"] == queued
            rss = _rss_kb(target.pid)
            positions = queued * SEQS * LEN
            out.append(
                {
                    "bench": "rss",
                    "store": store.split(":")[0],
                    "queued_groups": queued,
                    "rss_mb": rss // 1024,
                    "growth_bytes_per_position": round((rss - base) * 1024 / positions, 2),
                }
            )
    return out


def run() -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        results += measure("memory://", Path(tmp) / "m.log")
        results += measure(f"sqlite:///{tmp}/rss.db", Path(tmp) / "s.log")
    return results


def report(results: list[dict[str, Any]]) -> list[str]:
    rows = [r for r in results if r.get("bench") == "rss"]
    if not rows:
        return []
    lines = [
        f"\nserver RSS vs queue depth ({SEQS} x {LEN}-token groups; growth per token position, raw payload "
        f"= {RAW_BYTES_PER_POSITION} bytes):"
    ]
    for store in ("memory", "sqlite"):
        cells = [
            f"{r['queued_groups']:>7}: {r['rss_mb']:5} MB ({r['growth_bytes_per_position']:6} B/pos)"
            for r in rows
            if r["store"] == store
        ]
        lines.append(f"  {store:7} " + " | ".join(cells))
    return lines


if __name__ == "__main__":
    for line in report(run()):
        print(line)
