"""`rollbuf demo`: the whole loop on one machine in under a minute, no GPU, no internet.

It starts the service in-process (a temporary SQLite store, a free loopback port), registers a small
trainer through `trainer_client`, and runs four environments through `rollout_client.RolloutRunner`:
single-turn sums (G=4, weight 2), single-turn products (G=8, weight 1), a two-turn calculator-tool env
(G=8, weight 1), all played by a scripted policy with a byte-level tokenizer (one token per UTF-8 byte; a
stand-in for a real model and tokenizer), and a tool-calling chat env (G=4, weight 1: Qwen2.5's chat template
on a tokenizer built locally, Hermes tool calls, `rollout_client.chat`), played by a scripted chat model; it
is left out where `transformers` is not installed. Each "training step" pauses generation, swaps the (pretend)
weights and resumes, so groups carry the policy step that produced them and the staleness is visible.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import tempfile
import time
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np

from demos.service import serve_in_thread
from rollout_client import Completion, Environment, RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.chat.examples import SPECIAL_ID, ByteChatCodec, ToolChat, chat_script
from rollout_client.examples import Arithmetic, Calculator, arithmetic_script, arithmetic_task
from trainer_client import AsyncTrainerClient, Batch

BATCH_SIZE = 32
MAX_TOKEN_LEN = 2048
"""Room for the chat env: Qwen2.5's tool prompt alone is ~850 byte-level tokens."""
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
    chat: Counter[str] = field(default_factory=Counter)
    """The chat env's rollouts trained on: turns, tool calls, malformed calls, template mismatches."""
    tools: Counter[str] = field(default_factory=Counter)
    """Per tool: calls, failures, malformed (from each sequence's `tools` record)."""


def _envs() -> list[tuple[Environment, Tasks]]:
    envs: list[tuple[Environment, Tasks]] = [
        (Arithmetic(name="add", group_size=4, weight=2.0), Tasks(partial(arithmetic_task, digits=2, op="+"))),
        (Arithmetic(name="mul", group_size=8, weight=1.0), Tasks(partial(arithmetic_task, digits=2, op="*"))),
        (Calculator(name="calculator", group_size=8, weight=1.0), Tasks(partial(arithmetic_task, digits=3, op="*"))),
    ]
    if _chat_available():
        chat = ToolChat(name="tool_chat", group_size=4, weight=1.0)
        envs.append((chat, Tasks(partial(arithmetic_task, digits=3, op="*"))))
    return envs


def _chat_available() -> bool:
    """The tool-calling chat env needs `tokenizers`, `transformers` and `jinja2` (the chat extra) for its
    template."""
    return all(importlib.util.find_spec(m) is not None for m in ("tokenizers", "transformers", "jinja2"))


class DemoPolicy:
    """The scripted policy of the text envs and, for the chat env, a scripted chat model on its tokenizer's ids
    (Hermes tool calls in Qwen2.5's template): one policy, as one inference server serves every env."""

    def __init__(self) -> None:
        self.text = ScriptedPolicy(arithmetic_script)
        self.chat = ScriptedPolicy(chat_script, tokenizer=ByteChatCodec()) if _chat_available() else None

    async def tokenize(self, text: str) -> list[int]:
        return await self.text.tokenize(text)

    async def generate(
        self, prompt_ids: list[int], *, max_tokens: int, token_limit: int | None = None, seed: int | None = None
    ) -> Completion:
        chatty = self.chat is not None and prompt_ids[:1] == [SPECIAL_ID["<|im_start|>"]]
        policy = self.chat if chatty and self.chat is not None else self.text
        return await policy.generate(prompt_ids, max_tokens=max_tokens, token_limit=token_limit, seed=seed)


async def _train(url: str, runner: RolloutRunner, steps: int, tally: Tally, names: dict[int, str]) -> None:
    async with AsyncTrainerClient(url) as trainer:
        await trainer.register(
            batch_size=BATCH_SIZE, max_token_len=MAX_TOKEN_LEN, max_staleness=MAX_STALENESS, num_steps=steps
        )
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
    for meta in batch.meta:
        for o in meta.get("overrides") or []:
            _count_chat(o, tally)
    stale = (batch.step or 0) - batch.policy_steps
    tally.staleness.update(int(s) for s in np.asarray(stale))


def _count_chat(overrides: dict[str, Any], tally: Tally) -> None:
    """A chat rollout's per-turn and per-tool metrics (rollout_client.chat writes them in each turn)."""
    turns = overrides.get("turns") or []
    if not any("tool_calls" in t for t in turns):
        return
    tally.chat["rollouts"] += 1
    tally.chat["turns"] += len(turns)
    for key in ("tool_calls", "malformed", "template_mismatch"):
        tally.chat[key] += sum(int(t.get(key, 0)) for t in turns)
    for name, rec in (overrides.get("tools") or {}).items():
        for key in ("calls", "failures", "malformed"):
            tally.tools[f"{name}.{key}"] += int(rec.get(key, 0))


async def _progress(runner: RolloutRunner, tally: Tally, started: float) -> None:
    while True:
        await asyncio.sleep(1.0)
        s = runner.stats
        per_env = " ".join(f"{k} {v}" for k, v in sorted(s.accepted_by_env.items()))
        held = ", ".join(f"{k}: {v}" for k, v in sorted(s.paused.items())) or "-"
        stale = tally.staleness
        mean = sum(k * v for k, v in stale.items()) / max(1, sum(stale.values()))
        print(
            f"[{time.monotonic() - started:4.1f}s] step {s.trainer_step:3d} | groups {s.accepted:4d} ({per_env}) | "
            f"batches {tally.batches:3d} | last mix {tally.last_mix or '-'} | staleness {mean:.2f} | held: {held}",
            flush=True,
        )


async def run_demo(steps: int, workers: int, export: Path | None = None) -> int:
    started = time.monotonic()
    keep = {"retain_steps": steps + 1} if export else {}  # every group's data kept, for the export
    with (
        tempfile.TemporaryDirectory(prefix="rollbuf-demo-") as tmp,
        serve_in_thread(f"sqlite:///{tmp}/demo.db", **keep) as url,
    ):
        print(f"rollbuf demo: service on {url} (SQLite in {tmp}); {steps} training steps of {BATCH_SIZE} sequences")
        print("  envs: add (G=4, weight 2), mul (G=8, weight 1), calculator (two turns with a tool, G=8, weight 1)")
        envs = _envs()
        if len(envs) > 3:
            print(
                "        tool_chat (a chat model calling a calculator tool: Qwen2.5's chat template on a tokenizer "
                "built locally, Hermes tool calls, G=4, weight 1)"
            )
        else:
            print("        (tool_chat left out: it needs the chat extra, pip install -e '.[chat]')")
        print("  policy: scripted, byte-level tokenizer (1 token per byte); trainer: trainer_client, pause/resume\n")
        runner = RolloutRunner(
            url,
            envs,
            DemoPolicy(),
            max_in_flight=64,
            num_workers=workers,
            max_staleness=MAX_STALENESS,
            poll_interval=0.1,
        )
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
    if c := tally.chat:
        calc = {k: tally.tools[f"calculate.{k}"] for k in ("calls", "failures")}
        lines.append(
            f"tool_chat: {c['rollouts']} rollouts trained on, {c['turns']} turns, {c['tool_calls']} tool "
            f"calls ({c['malformed']} malformed, answered to the model), calculate ran {calc['calls']} times "
            f"({calc['failures']} failures), template mismatches "
            f"{c['template_mismatch']}"
        )
    queued = status.get("queue_size")
    lines.append(f"server: {queued} groups still queued, {n_dropped} dropped {dropped or ''}")
    balanced = s.accepted == tally.groups + (queued if isinstance(queued, int) else 0) + n_dropped
    lines.append(
        f"accounting: {s.accepted} accepted = {tally.groups} trained on + {queued} queued + {n_dropped} "
        f"dropped: {'ok' if balanced else 'MISMATCH'}"
    )
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="rollbuf demo",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog="rollbuf demo --learn [--help]: a small torch policy learns a toy task through the service instead.",
    )
    ap.add_argument("--steps", type=int, default=40, help="training steps to run (default 40)")
    ap.add_argument("--workers", type=int, default=0, help="rollout worker processes (default 0: in-process)")
    ap.add_argument(
        "--export",
        type=Path,
        metavar="DIR",
        help="keep every group's data, and write the run as Parquet into DIR when it ends (rollbuf "
        "export: the ledger and the groups, docs/ledger.md; needs pip install -e '.[export]')",
    )
    args = ap.parse_args(argv)
    if args.export is not None:
        from api import export

        if not export.available():
            ap.error(export.MISSING)
    raise SystemExit(asyncio.run(run_demo(args.steps, args.workers, args.export)))
