"""Bad input must not hurt anyone else: a gzip bomb and a large JSON list against a real `rollbuf serve`.

`python -m bench.bad_input` starts the server (memory store), then
1. posts gzip bombs (about 13 MB that inflate to 3 GB of JSON whitespace) to /scored_data_list, four at
   once, while a prober sends `GET /status` every 20 ms: the bombs' statuses and times, the prober's worst
   and p99 latency, and the server's peak RSS (VmHWM) over its RSS before;
2. posts a 30 MB JSON list of valid groups while the prober sends `GET /`: the post's time and the
   prober's worst latency.
Timing only: the figures go in bench/README.md, never in a test assert.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from isal import isal_zlib

from bench.servers import rollbuf, serve

GiB = 1 << 30
PROBE_EVERY_S = 0.02


def bomb(path: Path, inflated: int) -> bytes:
    """A JSON list of whitespace, gzipped: built once and cached (3 GB take a few seconds to compress)."""
    if not path.exists():
        # Runs of spaces broken by a few bytes that change, so that deflate cannot reach its 1032:1 ceiling:
        # about 230:1, the ratio of the bomb in the issue.
        block = b"".join(b" " * 200 + bytes([48 + i % 10]) * 2 + b"\n" for i in range(4096))
        comp = isal_zlib.compressobj(1, isal_zlib.DEFLATED, 16 + isal_zlib.MAX_WBITS)
        parts = [comp.compress(b"[")]
        for _ in range(inflated // len(block)):
            parts.append(comp.compress(block))
        parts += [comp.compress(b"]"), comp.flush()]
        path.write_bytes(b"".join(parts))
    return path.read_bytes()


def json_list(target_bytes: int) -> bytes:
    """Valid groups (8 sequences of 2048 tokens, -100 / token-id masks, float32 logprobs) up to the size."""
    groups: list[dict[str, Any]] = []
    size = 2
    i = 0
    while size < target_bytes:
        tokens = [[(i * 7919 + j * 31 + k) % 150_000 for k in range(2048)] for j in range(8)]
        g = {
            "tokens": tokens,
            "masks": [[-100] * 512 + t[512:] for t in tokens],
            "scores": [float(j % 2) for j in range(8)],
            "inference_logprobs": [[1.0] * 512 + [-0.6931471824645996] * 1536 for _ in range(8)],
            "env_id": 0,
        }
        groups.append(g)
        size += len(json.dumps(g)) + 2
        i += 1
    return json.dumps(groups).encode()


def rss_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


class Prober:
    """GET `path` every 20 ms on its own connection; the latencies of the requests."""

    def __init__(self, url: str, path: str) -> None:
        self.url, self.path = url, path
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                c.get(self.path)
                self.latencies.append(time.perf_counter() - t0)
                self._stop.wait(PROBE_EVERY_S)

    def __enter__(self) -> Prober:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        ms = sorted(x * 1e3 for x in self.latencies)
        return {
            "probes": len(ms),
            "max_ms": round(ms[-1], 1),
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 1),
            "p50_ms": round(statistics.median(ms), 1),
        }


def post(url: str, path: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=300) as c:
        r = c.post(path, content=body, headers={"Content-Type": "application/json", **headers})
    return {"status": r.status_code, "s": round(time.perf_counter() - t0, 2), "detail": r.text[:120]}


def run(bomb_gb: float, n_bombs: int, list_mb: int, store: str) -> dict[str, Any]:
    cache = Path(tempfile.gettempdir()) / f"rollbuf-bomb-{bomb_gb}g.gz"
    data = bomb(cache, int(bomb_gb * GiB))
    big = json_list(list_mb << 20)
    out: dict[str, Any] = {
        "bomb_gzip_mb": round(len(data) / 1e6, 1),
        "bomb_inflated_gb": bomb_gb,
        "list_mb": round(len(big) / 1e6, 1),
    }
    with tempfile.TemporaryDirectory() as tmp, serve(*rollbuf(store, Path(tmp) / "s.log"), Path(tmp) / "s.log") as t:
        with httpx.Client(base_url=t.url) as c:
            c.post(
                "/register",
                json={
                    "wandb_group": "g",
                    "wandb_project": "p",
                    "batch_size": 64,
                    "max_token_len": 4096,
                    "checkpoint_dir": "c",
                    "save_checkpoint_interval": 1,
                    "starting_step": 0,
                    "num_steps": 10,
                },
            )
            c.get("/batch")
            c.post("/register-env", json={"max_token_length": 4096, "desired_name": "e", "group_size": 8})
        out["rss_before_mb"] = round(rss_kb(t.pid, "VmRSS") / 1024)
        with Prober(t.url, "/status") as prober, ThreadPoolExecutor(n_bombs) as pool:
            gz = {"Content-Encoding": "gzip"}
            posts = list(pool.map(lambda _: post(t.url, "/scored_data_list", data, gz), range(n_bombs)))
        out["bombs"] = posts
        out["bomb_peak_rss_mb"] = round(rss_kb(t.pid, "VmHWM") / 1024)
        out["status_during_bombs"] = prober.summary()
        with Prober(t.url, "/") as prober:
            time.sleep(0.2)
            out["list_post"] = post(t.url, "/scored_data_list", big, {})
            time.sleep(0.2)
        out["root_during_list"] = prober.summary()
        out["peak_rss_mb"] = round(rss_kb(t.pid, "VmHWM") / 1024)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bomb-gb", type=float, default=3.0)
    ap.add_argument("--bombs", type=int, default=4, help="bombs posted at once")
    ap.add_argument("--list-mb", type=int, default=30)
    ap.add_argument("--store", default="memory://")
    args = ap.parse_args()
    print(json.dumps(run(args.bomb_gb, args.bombs, args.list_mb, args.store), indent=1))


if __name__ == "__main__":
    main()
