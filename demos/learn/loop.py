"""`rollbuf demo --learn`: on-policy RL through the real service, on a CPU, in a few minutes.

The service runs in-process on a temporary SQLite store. A `RolloutRunner` plays the `Reverse` task with
the sampler (`TorchPolicy`), submitting scored groups stamped with the policy step that generated them.
The trainer reads batches through `AsyncTrainerClient`, takes one PPO-clip step on them (GRPO advantages
from the batch, the sampler's logprobs as the old policy) in a worker thread while sampling goes on, then
pauses the runner, copies the new weights into the sampler and resumes it at the next policy step. The
server's staleness bound (`max_staleness`) keeps every batch within one step of the weights being trained.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import tempfile
import time
from collections.abc import AsyncGenerator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from demos.learn.grpo import Stats, ppo_clip_loss
from demos.learn.model import TinyGPT
from demos.learn.policy import TorchPolicy
from demos.learn.task import Reverse, reverse_task
from demos.service import serve_in_thread
from rollout_client import RolloutRunner, Tasks
from trainer_client import AsyncTrainerClient, Batch

WINDOW = 5
"""Steps averaged for `initial_reward` and `final_reward`."""


@dataclass(frozen=True)
class Config:
    steps: int = 150
    digits: int = 4
    group_size: int = 8
    groups_per_step: int = 8
    lr: float = 3e-3
    max_staleness: int = 1
    device: str = "cpu"
    seed: int = 0
    threads: int = 1
    """torch threads per process: the sampler (event loop) and the update (a worker thread) each use one."""

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_step


def update(model: TinyGPT, opt: torch.optim.Optimizer, t: dict[str, torch.Tensor]) -> Stats:
    """One PPO-clip step on a padded batch's tensors."""
    model.train()
    logits = model(t["tokens"])
    loss, stats = ppo_clip_loss(logits, t["labels"], t["trained"], t["inference_logprobs"], t["advantages"])
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return stats


class Run:
    """Per-step rows, printed as they come."""

    def __init__(self, cfg: Config, runner: RolloutRunner, quiet: bool) -> None:
        self.cfg, self.runner, self.quiet = cfg, runner, quiet
        self.rows: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def record(self, batch: Batch, stats: Stats) -> None:
        elapsed = time.monotonic() - self.started
        staleness = (batch.step or 0) - batch.policy_steps
        row = {
            "step": batch.step,
            "reward": round(float(batch.scores.mean()), 4),
            "staleness": round(float(staleness.mean()), 3),
            "max_staleness": int(staleness.max()),
            "loss": round(stats.loss, 5),
            "clip_fraction": round(stats.clip_fraction, 4),
            "groups_per_s": round(self.runner.stats.accepted / elapsed, 2),
            "seconds": round(elapsed, 2),
        }
        self.rows.append(row)
        if not self.quiet:
            recent = np.mean([r["reward"] for r in self.rows[-WINDOW:]])
            print(
                f"[{elapsed:6.1f}s] step {row['step']:4d} | reward {row['reward']:.3f} (last {WINDOW}: {recent:.3f})"
                f" | staleness {row['staleness']:.2f} (max {row['max_staleness']})"
                f" | clipped {row['clip_fraction']:.3f} | {row['groups_per_s']:.1f} groups/s",
                flush=True,
            )

    def report(self) -> dict[str, Any]:
        rewards = [r["reward"] for r in self.rows]
        return {
            "initial_reward": round(float(np.mean(rewards[:WINDOW])), 4) if rewards else None,
            "final_reward": round(float(np.mean(rewards[-WINDOW:])), 4) if rewards else None,
            "steps": len(self.rows),
            "seconds": round(time.monotonic() - self.started, 2),
            "config": asdict(self.cfg),
            "rows": self.rows,
        }


async def _train(url: str, cfg: Config, model: TinyGPT, policy: TorchPolicy, runner: RolloutRunner, run: Run) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    async with AsyncTrainerClient(url) as trainer:
        await trainer.register(
            batch_size=cfg.batch_size,
            max_token_len=2 * cfg.digits + 1,
            max_staleness=cfg.max_staleness,
            num_steps=cfg.steps,
        )
        batches = cast(AsyncGenerator[Batch, None], trainer.batches(start_step=0, wait=10.0))
        async with contextlib.aclosing(batches):
            async for batch in batches:
                tensors = batch.padded().to_torch(cfg.device)
                stats = await asyncio.to_thread(update, model, opt, tensors)  # sampling goes on meanwhile
                await runner.pause()  # no generation in flight from here ...
                policy.load_weights(model.state_dict())
                runner.resume(policy_step=(batch.step or 0) + 1)  # ... until the new weights are in
                run.record(batch, stats)
                if len(run.rows) >= cfg.steps:
                    return


async def learn(cfg: Config, *, quiet: bool = False) -> dict[str, Any]:
    """Run the loop for `cfg.steps` steps; the report (see `Run.report`)."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    model = TinyGPT(context=2 * cfg.digits + 2).to(cfg.device)
    policy = TorchPolicy(copy.deepcopy(model), seed=cfg.seed)
    env = Reverse(group_size=cfg.group_size, digits=cfg.digits)
    tasks = Tasks(partial(reverse_task, digits=cfg.digits, seed=cfg.seed))
    with (
        tempfile.TemporaryDirectory(prefix="rollbuf-learn-") as tmp,
        serve_in_thread(f"sqlite:///{tmp}/learn.db") as url,
    ):
        if not quiet:
            n_params = sum(p.numel() for p in model.parameters())
            print(f"rollbuf demo --learn: service on {url} (SQLite in {tmp})")
            print(f"  task: reverse {cfg.digits} digits, reward = fraction of positions right (chance 1/12)")
            print(
                f"  policy: a {n_params / 1e3:.0f}k-parameter transformer, random init, on {cfg.device}; "
                f"{cfg.groups_per_step} groups of G={cfg.group_size} per step, PPO-clip on GRPO advantages, "
                f"max_staleness {cfg.max_staleness}\n"
            )
        runner = RolloutRunner(
            url,
            [(env, tasks)],
            policy,
            max_in_flight=2 * cfg.batch_size,
            max_staleness=cfg.max_staleness,
            poll_interval=0.05,
        )
        run = Run(cfg, runner, quiet)
        producing = asyncio.create_task(runner.run())
        training = asyncio.create_task(_train(url, cfg, model, policy, runner, run))
        done, _ = await asyncio.wait([producing, training], return_when=asyncio.FIRST_COMPLETED)
        runner.stop()
        await producing  # re-raises a failed rollout
        await training if training in done else _cancel(training)
    report = run.report()
    if not quiet:
        print(
            f"\ndone: {report['steps']} steps in {report['seconds']:.0f} s; mean reward of the first {WINDOW} "
            f"steps {report['initial_reward']}, of the last {WINDOW} {report['final_reward']}"
        )
    return report


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="rollbuf demo --learn", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--learn", action="store_true", help=argparse.SUPPRESS)
    d = Config()
    ap.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})")
    ap.add_argument("--digits", type=int, default=d.digits, help=f"digits to reverse (default {d.digits})")
    ap.add_argument("--group-size", type=int, default=d.group_size, help=f"G (default {d.group_size})")
    ap.add_argument("--groups-per-step", type=int, default=d.groups_per_step, help=f"default {d.groups_per_step}")
    ap.add_argument("--lr", type=float, default=d.lr, help=f"Adam learning rate (default {d.lr})")
    ap.add_argument("--max-staleness", type=int, default=d.max_staleness, help=f"default {d.max_staleness}")
    ap.add_argument("--device", default=d.device, help="torch device: cpu (default), cuda, cuda:1, ...")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--report", type=Path, help="write the JSON report here (initial/final reward, rows per step)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")
    cfg = Config(
        steps=args.steps,
        digits=args.digits,
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        lr=args.lr,
        max_staleness=args.max_staleness,
        device=args.device,
        seed=args.seed,
    )
    report = asyncio.run(learn(cfg, quiet=args.quiet))
    if args.report:
        args.report.write_text(json.dumps(report, indent=1) + "\n")
