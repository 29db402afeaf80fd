"""2,000 `GET /batch?wait=N` long-polls reaching their deadline together, against a real `rollbuf
serve` from a given checkout: the slowest answer of a probe (`GET /`, back to back) while they expire, how long
until every long-poll is answered, and the store transactions their expiry ran (the server's /metrics).
`--change` posts one group while they wait (a change none of them can form a batch of 64 from).

    python -m bench.deadline_storm [--root DIR] [--polls 2000] [--store sqlite|postgresql://...] [--change]

Not a test: figures, not asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import httpx

from bench.edges import ROOT, group, server

WAIT_S = 25.0


async def storm(url: str, polls: int, change: bool) -> str:
    port = int(url.rsplit(":", 1)[1])
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        reg = {
            "wandb_group": "b",
            "wandb_project": "b",
            "batch_size": 64,
            "max_token_len": 4096,
            "checkpoint_dir": "c",
            "save_checkpoint_interval": 10,
            "starting_step": 0,
            "num_steps": 10,
        }
        (await c.post("/register", json=reg)).raise_for_status()
        await c.get("/batch")
        await c.post(
            "/register-env", json={"max_token_length": 4096, "desired_name": "e", "weight": 1.0, "group_size": 4}
        )
        opened = time.monotonic()
        conns = []
        for _ in range(polls):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET /batch?wait={WAIT_S} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            conns.append((reader, writer))
        first = opened + WAIT_S  # no poll's deadline is earlier
        deadline = first  # the last one's, at most: once all of them wait (made their first try)
        while time.monotonic() < first - 3:
            line = next(x for x in (await c.get("/metrics")).text.splitlines() if x.startswith("rollbuf_waiting_long"))
            if float(line.split()[1]) >= polls:
                deadline = time.monotonic() + WAIT_S  # not the time a loaded machine took to take them all in
                break
            await asyncio.sleep(0.2)
        if change:
            (await c.post("/scored_data", json=group(0))).raise_for_status()
        await asyncio.sleep(max(0.0, first - 2 - time.monotonic()))
        before = await transactions(c)
        answered = 0

        async def answer(reader: asyncio.StreamReader) -> None:
            nonlocal answered
            await reader.readline()
            answered += 1

        waits = asyncio.gather(*(answer(r) for r, _ in conns))
        worst = 0.0
        while answered < polls:
            t = time.monotonic()
            await c.get("/")
            worst = max(worst, time.monotonic() - t)
        await waits
        all_done = time.monotonic() - deadline
        txns = await transactions(c) - before
        for _, w in conns:
            w.close()
        return (
            f"{polls} long-polls, change={change}: all answered {all_done:.1f} s past the last deadline; probe max "
            f"{worst * 1000:.0f} ms; {txns:.0f} store transactions while they expired"
        )


async def transactions(c: httpx.AsyncClient) -> float:
    """Store transactions so far (/metrics' rollbuf_store_transaction_seconds count)."""
    text = (await c.get("/metrics")).text
    return sum(
        float(x.split()[-1]) for x in text.splitlines() if x.startswith("rollbuf_store_transaction_seconds_count")
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--store", default="sqlite")
    parser.add_argument("--change", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"sqlite:///{tmp}/rb.db" if args.store == "sqlite" else args.store
        with server(args.root.resolve(), "--store", store, "--log-level", "warning") as (url, _, _):
            print(asyncio.run(storm(url, args.polls, args.change)), flush=True)


if __name__ == "__main__":
    main()
