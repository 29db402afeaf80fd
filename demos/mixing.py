"""`rollbuf demo`: the whole loop on one machine in under a minute, no GPU, no internet.

It starts the service in-process (a temporary SQLite store, a free loopback port), registers a small
trainer through `trainer_client`, and runs three environments through `rollout_client.RolloutRunner`:
single-turn sums (G=4, weight 2), single-turn products (G=8, weight 1) and a two-turn calculator-tool env
(G=8, weight 1), all played by a scripted policy with a byte-level tokenizer (one token per UTF-8 byte; a
stand-in for a real model and tokenizer). Each "training step" pauses generation, swaps the (pretend)
weights and resumes, so groups carry the policy step that produced them and the staleness is visible.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import cast

import httpx
import numpy as np

from demos.service import serve_in_thread
from rollout_client import RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import Arithmetic, Calculator, arithmetic_script, arithmetic_task
from trainer_client import AsyncTrainerClient, Batch

BATCH_SIZE = 32
MAX_TOKEN_LEN = 256
MAX_STALENESS = 2
"""Groups more than 2 steps older than the batch they would join are dropped by the server, and the runner
holds back rather than produce them."""
TRAIN_STEP_S = 0.15
"""Pretend optimizer step: long enough that producers run ahead and backpressure shows."""


@dataclass
class Tally:
    batches: int = 0
    groups: int = 0
    seqs_by_env: Counter[str] = field(default_factory=Counter)
    staleness: Counter[int] = field(default_factory=Counter)
    last_mix: str = ""


def _envs() -> list[tuple[Arithmetic | Calculator, Tasks]]:
    return [
        (Arithmetic(name="add", group_size=4, weight=2.0), Tasks(partial(arithmetic_task, digits=2, op="+"))),
        (Arithmetic(name="mul", group_size=8, weight=1.0), Tasks(partial(arithmetic_task, digits=2, op="*"))),
        (Calculator(name="calculator", group_size=8, weight=1.0), Tasks(partial(arithmetic_task, digits=3, op="*"))),
    ]


async def _train(url: str, runner: RolloutRunner, steps: int, tally: Tally, names: dict[int, str]) -> None:
    async with AsyncTrainerClient(url) as trainer:
        await trainer.register(batch_size=BATCH_SIZE, max_token_len=MAX_TOKEN_LEN, max_staleness=MAX_STALENESS,
                               num_steps=steps)  # fmt: skip
        batches = cast(AsyncGenerator[Batch, None], trainer.batches(start_step=0, wait=5.0))
        async with contextlib.aclosing(batches):
            async for batch in batches:
                _count(batch, tally, names)
                await asyncio.sleep(TRAIN_STEP_S)  # the optimizer step
                await runner.pause()  # no generation request in flight from here ...
                runner.resume(policy_step=(batch.step or 0) + 1)  # ... until the new weights are in place
                if tally.batches >= steps:
                    break


def _count(batch: Batch, tally: Tally, names: dict[int, str]) -> None:
    tally.batches += 1
    tally.groups += batch.n_groups
    envs = [names.get(int(e), "?") for e in batch.env_ids]
    tally.seqs_by_env.update(envs)
    share = Counter(envs)
    tally.last_mix = " ".join(f"{n} {100 * c / batch.n_seqs:.0f}%" for n, c in sorted(share.items()))
    stale = (batch.step or 0) - batch.policy_steps
    tally.staleness.update(int(s) for s in np.asarray(stale))


async def _progress(runner: RolloutRunner, tally: Tally, started: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        s = runner.stats
        per_env = " ".join(f"{k} {v}" for k, v in sorted(s.accepted_by_env.items()))
        held = ", ".join(f"{k}: {v}" for k, v in sorted(s.paused.items())) or "-"
        stale = tally.staleness
        mean = sum(k * v for k, v in stale.items()) / max(1, sum(stale.values()))
        print(f"[{time.monotonic() - started:4.1f}s] step {s.trainer_step:3d} | groups {s.accepted:4d} ({per_env}) | "
              f"batches {tally.batches:3d} | last mix {tally.last_mix or '-'} | staleness {mean:.2f} | held: {held}",
              flush=True)  # fmt: skip


async def run_demo(steps: int, workers: int, export: Path | None = None) -> int:
    started = time.monotonic()
    keep = {"retain_steps": steps + 1} if export else {}  # every group's data kept, for the export
    with tempfile.TemporaryDirectory(prefix="rollbuf-demo-") as tmp, serve_in_thread(f"sqlite:///{tmp}/demo.db",
                                                                                      **keep) as url:  # fmt: skip
        print(f"rollbuf demo: service on {url} (SQLite in {tmp}); {steps} training steps of {BATCH_SIZE} sequences")
        print("  envs: add (G=4, weight 2), mul (G=8, weight 1), calculator (two turns with a tool, G=8, weight 1)")
        print("  policy: scripted, byte-level tokenizer (1 token per byte); trainer: trainer_client, pause/resume\n")
        envs = _envs()
        runner = RolloutRunner(url, envs, ScriptedPolicy(arithmetic_script), max_in_flight=64, num_workers=workers,
                               max_staleness=MAX_STALENESS, poll_interval=0.1)  # fmt: skip
        tally = Tally()
        names: dict[int, str] = {}
        run = asyncio.create_task(runner.run())
        train = asyncio.create_task(_train(url, runner, steps, tally, names))
        await runner.ready.wait()
        names.update({c.env_id: e.name for c, (e, _) in zip(runner.clients, envs, strict=True) if c.env_id is not None})
        progress = asyncio.create_task(_progress(runner, tally, started))
        done, _ = await asyncio.wait([run, train], return_when=asyncio.FIRST_COMPLETED)
        runner.stop()
        await run
        if train in done:
            await train
        else:
            train.cancel()
        progress.cancel()
        with httpx.Client(base_url=url) as http:
            status = http.get("/status").json()
        print("\n" + "\n".join(summary(runner, tally, status, time.monotonic() - started)))
        if export is not None:
            print(f"\nexporting the run (rollbuf export {export} --url {url}):", flush=True)
            from api.export.cli import write_from_server  # pyarrow: only with --export

            await write_from_server(url, None, export)
        return 0


def summary(runner: RolloutRunner, tally: Tally, status: dict[str, object], elapsed: float) -> list[str]:
    s = runner.stats
    total_seqs = sum(tally.seqs_by_env.values()) or 1
    weights = {e.name: e.weight for e in runner.envs}
    wsum = sum(weights.values())
    dropped = status.get("dropped") or {}
    n_dropped = sum(n for reasons in dropped.values() for n in reasons.values()) if isinstance(dropped, dict) else 0
    stale_n = sum(tally.staleness.values()) or 1
    lines = [
        f"done in {elapsed:.1f} s: {tally.batches} batches of {BATCH_SIZE} sequences trained on",
        f"groups: {s.produced} produced, {s.accepted} accepted by the server, {s.duplicates} duplicates, "
        f"skipped {dict(s.skipped) or 'none'}; most rollouts in flight at once: {s.max_in_flight}",
        "mix by env (sequences trained on; target share from the weights):",
    ]
    for name in weights:
        got = tally.seqs_by_env.get(name, 0)
        share, target = 100 * got / total_seqs, 100 * weights[name] / wsum
        score = s.mean_score.get(name, float("nan"))
        lines.append(f"  {name:11} {got:5d} seqs  {share:5.1f}%  (target {target:.0f}%)  mean score {score:.2f}")
    hist = ", ".join(f"{k}: {100 * v / stale_n:.0f}%" for k, v in sorted(tally.staleness.items()))
    lines.append(f"staleness (batch step - policy step) of sequences trained on: {hist or '-'}")
    queued = status.get("queue_size")
    lines.append(f"server: {queued} groups still queued, {n_dropped} dropped {dropped or ''}")
    balanced = s.accepted == tally.groups + (queued if isinstance(queued, int) else 0) + n_dropped
    lines.append(f"accounting: {s.accepted} accepted = {tally.groups} trained on + {queued} queued + {n_dropped} "
                 f"dropped: {'ok' if balanced else 'MISMATCH'}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="rollbuf demo",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="rollbuf demo --learn [--help]: a small torch policy learns a toy task through the service instead.",
    )
    ap.add_argument("--steps", type=int, default=40, help="training steps to run (default 40)")
    ap.add_argument("--workers", type=int, default=0, help="rollout worker processes (default 0: in-process)")
    ap.add_argument("--export", type=Path, metavar="DIR",
                    help="keep every group's data, and write the run as Parquet into DIR when it ends (rollbuf "
                    "export: the ledger and the groups, docs/ledger.md; needs pip install -e '.[export]')")  # fmt: skip
    args = ap.parse_args(argv)
    if args.export is not None:
        from api import export

        if not export.available():
            ap.error(export.MISSING)
    raise SystemExit(asyncio.run(run_demo(args.steps, args.workers, args.export)))
