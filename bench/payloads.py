"""The blob tier (docs/payloads.md): groups of 8 x 2,048 tokens whose 8 siblings share one large image, posted to
a real server on SQLite with the tier and without it, next to text groups of the same shape. Per group: the
server's CPU (user + system, `/proc`), the bytes the store's files grew by (the database, its WAL, the payload
segments and the blob directory) and the wall time of the post, one client posting one group at a time.

Each group has an image of its own (a prompt's picture), shared by its siblings: with the tier it is stored once,
without it 8 times. The image is `--image-mb` MB of base64 text, as a handler sends it in `images`.

Run: `python -m bench.payloads [--groups 6] [--image-mb 10]`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from api.wire.records import MSGPACK, encode_submission
from bench.http import cpu_seconds
from bench.servers import rollbuf, save_rows, serve

SEQS, TOKENS = 8, 2048
SIDES = ("text", "image, no tier", "image, tier")


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def body(i: int, image: str | None) -> bytes:
    rng = np.random.default_rng(i)
    tokens = rng.integers(0, 150_000, (SEQS, TOKENS)).tolist()
    masks = [[-100] * 512 + row[512:] for row in tokens]
    images = None if image is None else [image] * SEQS
    return encode_submission(
        tokens, masks, [float(k % 2) for k in range(SEQS)], env_id=0, policy_step=0, group_id=f"g{i}", images=images
    )


def run_side(side: str, groups: int, image_mb: float, tmp: Path) -> dict[str, Any]:
    data = tmp / side.replace(", ", "-").replace(" ", "_")
    data.mkdir()
    name, cmd, port = rollbuf(f"sqlite:///{data}/rollbuf.db", tmp / f"{data.name}.log")
    if side == "image, no tier":
        cmd.append("--no-blobs")
    raw = int(image_mb * 1e6 * 3 / 4)
    bodies = [
        body(i, None if side == "text" else base64.b64encode(np.random.default_rng(1000 + i).bytes(raw)).decode())
        for i in range(groups)
    ]
    with contextlib.ExitStack() as stack:
        target = stack.enter_context(serve(name, cmd, port, tmp / f"{data.name}.log"))
        c = stack.enter_context(httpx.Client(base_url=target.url, timeout=600))
        registration = {
            "wandb_group": "bench",
            "wandb_project": "payloads",
            "batch_size": 4096,
            "max_token_len": TOKENS,
            "checkpoint_dir": "ckpt",
            "save_checkpoint_interval": 10,
            "starting_step": 0,
            "num_steps": 100,
        }
        assert c.post("/register", json=registration).status_code == 200
        c.get("/batch", params={"step": 0})
        reply = c.post("/register-env", json={"desired_name": "e", "group_size": SEQS, "max_token_length": TOKENS})
        assert reply.json()["status"] == "success", reply.text
        before_bytes, before_cpu = dir_bytes(data), cpu_seconds(target.pid)
        walls = []
        for b in bodies:
            start = time.perf_counter()
            r = c.post("/scored_data", content=b, headers={"Content-Type": MSGPACK})
            walls.append(time.perf_counter() - start)
            assert r.status_code == 200, r.text
        cpu = cpu_seconds(target.pid) - before_cpu
        grown = dir_bytes(data) - before_bytes
    return {
        "side": side,
        "groups": groups,
        "request_mb": round(len(bodies[0]) / 1e6, 1),
        "cpu_ms_per_group": round(1000 * cpu / groups, 1),
        "mb_written_per_group": round(grown / groups / 1e6, 2),
        "wall_ms_per_group": round(1000 * statistics.median(walls), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--image-mb", type=float, default=10.0)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for side in SIDES:
            rows.append(run_side(side, args.groups, args.image_mb, Path(tmp)))
            print(
                f"{side:16} request {rows[-1]['request_mb']:7.1f} MB  server CPU {rows[-1]['cpu_ms_per_group']:8.1f} ms"
                f"/group  written {rows[-1]['mb_written_per_group']:7.2f} MB/group  "
                f"post {rows[-1]['wall_ms_per_group']:8.1f} ms (median)",
                flush=True,
            )
    print(f"cpus: {os.cpu_count()}; results: {save_rows('payloads', rows)}")


if __name__ == "__main__":
    main()
