"""How long one POST /scored_data_list of many tiny groups stalls the event loop, against a real
`rollbuf serve` from a given checkout. While the list is sent and stored, a probe GETs / back to back; the figure
is the probe's slowest answer (the loop's longest stall) and the list's own time:

    python -m bench.big_list [--root /path/to/checkout] [--groups 100000] [--store sqlite|memory]

Not a test: figures, not asserts (tests/integration/test_big_list.py holds the behaviour).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson

from api.wire.records import encode_submission, encode_submission_list
from bench.edges import ROOT, group, server, start_run


def body(transport: str, n: int, env_id: int) -> tuple[bytes, str]:
    if transport == "json":
        return orjson.dumps([group(env_id, n=2, length=2) for _ in range(n)]), "application/json"
    one = encode_submission([[1, 1]] * 2, [[1, 1]] * 2, [0.0, 1.0], env_id=env_id)
    return encode_submission_list([one] * n), "application/msgpack"


def attack(root: Path, store: str, transport: str, n: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        url_arg = f"sqlite:///{tmp}/rb.db" if store == "sqlite" else "memory://"
        with server(root, "--store", url_arg) as (url, _, _), httpx.Client(base_url=url, timeout=600) as c:
            env_id = start_run(c)
            raw, ctype = body(transport, n, env_id)
            worst = [0.0]
            probes = [0]
            done = threading.Event()

            def probe() -> None:
                with httpx.Client(base_url=url, timeout=600) as p:
                    while not done.is_set():
                        t = time.perf_counter()
                        p.get("/")
                        worst[0] = max(worst[0], time.perf_counter() - t)
                        probes[0] += 1

            prober = threading.Thread(target=probe)
            prober.start()
            t0 = time.perf_counter()
            r = c.post("/scored_data_list", content=raw, headers={"content-type": ctype})
            took = time.perf_counter() - t0
            done.set()
            prober.join()
            size = f"{len(raw) / 1e6:.1f} MB"
            return (
                f"{store} {transport}: {n:,} groups ({size}) -> {r.status_code} {r.text[:40]} in {took:.2f} s; "
                f"probe max {worst[0] * 1000:.0f} ms over {probes[0]} probes"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--groups", type=int, default=100_000)
    parser.add_argument("--store", default="sqlite")
    parser.add_argument("--transport", nargs="*", default=["json", "msgpack"])
    args = parser.parse_args()
    for transport in args.transport:
        print(attack(args.root.resolve(), args.store, transport, args.groups), flush=True)


if __name__ == "__main__":
    main()
