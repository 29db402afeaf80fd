"""Worker IPC throughput for large payloads: the runner's channel (`rollout_client.workers.ipc`) between the runner's
event loop and a worker process, both directions at once, as the runner uses it.

The parent keeps IN_FLIGHT jobs outstanding: each "run" message carries a task with TASK_BYTES of metadata;
the worker answers each with a finished group of G=4 completions of TOKENS tokens (token ids, masks,
logprobs, built once: this measures the channel, not generation). Reported: groups/s and MB/s each way
(pickled bytes), and the longest stall of the parent's event loop while it ran (a ticker every 1 ms), which
shows the loop is never blocked by a send. With the pre-issue-14 blocking `Connection.send` on both ends,
the 100 KB x 16k configuration deadlocked (0 groups).

    .venv/bin/python -m bench.ipc          (or: python -m bench --only ipc)
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import time
from multiprocessing.connection import Connection
from typing import Any

from api.wire.schema import ScoredData
from rollout_client.env import Task
from rollout_client.group import GroupOutcome
from rollout_client.workers.ipc import Channel, ChannelClosed

G = 4
IN_FLIGHT = 16
"""Groups outstanding: 64 rollouts at G=4, as in the issue's reproduction."""
CONFIGS = [(20_000, 1024), (100_000, 16_384), (1_000_000, 16_384), (100_000, 65_536)]
"""(task metadata bytes, tokens per completion)."""
MEASURE_S = 3.0


def _group(tokens: int) -> GroupOutcome:
    ids = [i % 50_000 for i in range(tokens)]
    return GroupOutcome(
        ScoredData(tokens=[ids] * G, masks=[ids] * G, scores=[1.0] * G, inference_logprobs=[[-0.5] * tokens] * G)
    )


def _worker(conn: Connection, tokens: int) -> None:
    asyncio.run(_echo(conn, tokens))


async def _echo(conn: Connection, tokens: int) -> None:
    channel = await Channel.open(conn.fileno())
    conn.close()
    outcome = _group(tokens)
    while True:
        try:
            msg = await channel.recv()
        except ChannelClosed:
            break
        if msg[0] == "stop":
            break
        try:
            await channel.send_large(("done", msg[1], outcome))
        except ChannelClosed:
            break
    await channel.aclose()


async def _measure(task_bytes: int, tokens: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker, args=(child, tokens), daemon=True)
    proc.start()
    child.close()
    channel = await Channel.open(parent.fileno())
    parent.close()
    task = Task("t", "Q: 1 + 1 =", "2", meta={"blob": "x" * task_bytes})
    up = len(pickle.dumps(("run", 0, 0, task, "k"), protocol=pickle.HIGHEST_PROTOCOL))
    down = len(pickle.dumps(("done", 0, _group(tokens)), protocol=pickle.HIGHEST_PROTOCOL))
    loop = asyncio.get_running_loop()
    stall = 0.0
    ticking = True

    async def ticker() -> None:
        nonlocal stall
        last = loop.time()
        while ticking:
            await asyncio.sleep(0.001)
            now = loop.time()
            stall = max(stall, now - last - 0.001)
            last = now

    tick = asyncio.create_task(ticker())
    done = 0
    for job in range(IN_FLIGHT):
        channel.send(("run", job, 0, task, "k"))
    t0 = time.perf_counter()
    warm = False
    while True:
        await channel.recv()
        if not warm:  # the first answer includes the worker's start-up
            warm, t0, done = True, time.perf_counter(), 0
        else:
            done += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= MEASURE_S:
            break
        channel.send(("run", done, 0, task, "k"))
    ticking = False
    await tick
    channel.send(("stop",))
    await channel.aclose()
    await asyncio.to_thread(proc.join, 10)
    return {
        "bench": "ipc",
        "task_bytes": task_bytes,
        "tokens": tokens,
        "up_bytes": up,
        "down_bytes": down,
        "groups_per_s": round(done / elapsed, 1),
        "up_mb_s": round(done * up / elapsed / 1e6, 1),
        "down_mb_s": round(done * down / elapsed / 1e6, 1),
        "max_loop_stall_ms": round(stall * 1000, 1),
    }


def run() -> list[dict[str, Any]]:
    print(f"worker IPC: {IN_FLIGHT} groups of G={G} in flight, both directions at once", flush=True)
    results = []
    for task_bytes, tokens in CONFIGS:
        r = asyncio.run(_measure(task_bytes, tokens))
        print(
            f"  task {task_bytes // 1000} KB, {tokens} tokens: {r['groups_per_s']} groups/s, "
            f"{r['up_mb_s']} MB/s up, {r['down_mb_s']} MB/s down",
            flush=True,
        )
        results.append(r)
    return results


def report(results: list[dict[str, Any]]) -> str:
    rows = [r for r in results if r.get("bench") == "ipc"]
    if not rows:
        return ""
    lines = [
        f"\nworker IPC ({IN_FLIGHT} groups of G={G} in flight, both directions at once):",
        f"  {'task':>8} {'tokens':>7} {'up KB':>8} {'down MB':>8} {'groups/s':>9} {'up MB/s':>8} "
        f"{'down MB/s':>10} {'loop stall ms':>14}",
    ]
    for r in rows:
        lines.append(
            f"  {r['task_bytes'] // 1000:>6}KB {r['tokens']:>7} {r['up_bytes'] / 1e3:>8.0f} "
            f"{r['down_bytes'] / 1e6:>8.2f} {r['groups_per_s']:>9} {r['up_mb_s']:>8} {r['down_mb_s']:>10} "
            f"{r['max_loop_stall_ms']:>14}"
        )
    return "\n".join(lines)


def main() -> None:
    print(report(run()))


if __name__ == "__main__":
    main()
