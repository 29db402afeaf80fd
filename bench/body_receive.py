"""Receiving a request body (`api.http.body.read_body`), apart from the rest of ingest.

Bodies arrive as the ASGI messages uvicorn makes of them (64 KiB reads): an 8.4 KB small group in one, a 262 KB
large group in five, a 4 MiB list in 64. Each size is read through `read_body` `--repeat` times; the best of
`--rounds` runs, in microseconds per body. Copied into another checkout's bench/ it measures that checkout's
`read_body` (`cp bench/body_receive.py /tmp/base/bench/ && cd /tmp/base && python -m bench.body_receive`):
before and after from one machine, in turns.

    python -m bench.body_receive [--rounds 5] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from starlette.requests import Request

from api.http.body import read_body

CHUNK = 64 << 10
SIZES = {"small": 8_400, "large": 262_406, "list": 4 << 20}


def _request(chunks: list[bytes]) -> Request:
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    feed = iter(messages)

    async def receive() -> dict[str, Any]:
        return next(feed)

    headers = [(b"content-length", str(sum(map(len, chunks))).encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


async def _per_body(size: int, repeat: int) -> float:
    data = os.urandom(size)
    chunks = [data[i : i + CHUNK] for i in range(0, size, CHUNK)]
    start = time.perf_counter()
    for _ in range(repeat):
        body = await read_body(_request(chunks), max_bytes=64 << 20, max_decompressed=64 << 20)
        assert len(body) == size
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    out = {}
    for name, size in SIZES.items():
        repeat = max(10, args.repeat * SIZES["large"] // max(size, SIZES["large"]))
        out[name] = round(min(asyncio.run(_per_body(size, repeat)) for _ in range(args.rounds)), 1)
    print(json.dumps({"bench": "body_receive", "us_per_body": out}))


if __name__ == "__main__":
    main()
