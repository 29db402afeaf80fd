"""Production during weight syncs: groups/s with a sync after every trainer step, for each way
in-flight episodes meet new weights.

A real rollbuf server process, the tests' stand-in inference server (`demos.standin_inference`, each completion taking
LATENCY_S) and a `RolloutRunner` of long-tail multi-turn episodes (1 to MAX_TURNS turns, G=4, 32 rollouts in
flight). The trainer loop takes batch N (8 sequences), trains TRAIN_S, then syncs: it pushes the weights of
step N+1 to the inference server and
- `drain`: `runner.pause()` before the push, `resume()` after (in the trainer's process: no episode spans a sync);
- `drain_handshake`: the env's `on_new_weights="drain"`, across processes: the trainer begins the sync (POST
  /weights/pending), waits until the producer heartbeats drained (GET /weights/pending), pushes, announces;
- `continue`: announces them through rollbuf (POST /weights); episodes in flight go on, spanning versions;
- `restart`: announces them; episodes in flight of older weights are cancelled and run again.
Reported per policy: groups accepted per second over STEPS steps, the trainer's steps/s, the mean staleness
of the groups trained, and groups restarted. About 40 s.

    .venv/bin/python -m bench.syncs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.servers import rollbuf, serve
from rollout_client import RolloutRunner, Session, Task, Tasks
from rollout_client.examples import Arithmetic, arithmetic_task
from rollout_client.policy import OpenAIPolicy, stable_unit
from rollout_client.runner.following import RESTARTED
from tests.factories import registration
from tests.standin import running_standin

LATENCY_S = 0.1
MAX_TURNS = 12
GROUP_SIZE = 4
BATCH_SIZE = 8
TRAIN_S = 0.05
STEPS = 15
POLICIES = ("drain", "drain_handshake", "continue", "restart")


@dataclass
class LongTail(Arithmetic):
    """An episode of 1 to MAX_TURNS turns, by task: most are short, a few long (the tail a drain waits for)."""

    name: str = "long_tail"
    group_size: int = GROUP_SIZE
    max_tokens: int = 4

    async def rollout(self, task: Task, session: Session) -> None:
        turns = 1 + int(stable_unit(task.id) ** 2 * MAX_TURNS)
        await session.observe(task.prompt)
        for _ in range(turns - 1):
            await session.generate()
            await session.observe(" Again:")
        await session.generate()


async def one(policy: str, url: str, inference: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        await http.get("/reset_data")
        (await http.post("/register", json=registration(batch_size=BATCH_SIZE, max_token_len=512))).raise_for_status()
        await http.post(inference + "/control", json={"weights": 0, "latency": LATENCY_S})
        await http.get("/batch", params={"step": 0})
        env = LongTail()
        env.on_new_weights = {"restart": "restart", "drain_handshake": "drain"}.get(policy, "continue")  # type: ignore[assignment]
        runner = RolloutRunner(
            url,
            [(env, Tasks(arithmetic_task))],
            lambda: OpenAIPolicy(inference, "fake"),
            max_in_flight=32,
            poll_interval=0.1,
        )
        running = asyncio.create_task(runner.run())
        await runner.ready.wait()
        staleness: list[int] = []
        t0 = time.perf_counter()
        accepted0 = runner.stats.accepted
        for step in range(STEPS):
            reply = (await http.get("/batch", params={"step": step, "wait": 60})).json()
            staleness += [step - (g["policy_step"] or 0) for g in reply["batch"]]
            await asyncio.sleep(TRAIN_S)  # training
            if policy == "drain":
                await runner.pause()
            if policy == "drain_handshake":
                (await http.post("/weights/pending", json={"step": step + 1})).raise_for_status()
                deadline = time.monotonic() + 60
                while not (await http.get("/weights/pending")).json()["drained"] and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)  # the trainer's poll, as TrainerClient.wait_drained
            await http.post(inference + "/control", json={"weights": step + 1})
            if policy == "drain":
                runner.resume(policy_step=step + 1)
            else:
                (await http.post("/weights", json={"step": step + 1})).raise_for_status()
        elapsed = time.perf_counter() - t0
        groups = runner.stats.accepted - accepted0
        runner.stop()
        stats = await running
    return {
        "bench": "syncs",
        "policy": policy,
        "steps": STEPS,
        "seconds": round(elapsed, 2),
        "groups": groups,
        "groups_per_s": round(groups / elapsed, 2),
        "steps_per_s": round(STEPS / elapsed, 2),
        "mean_staleness": round(sum(staleness) / max(1, len(staleness)), 2),
        "restarted": stats.skipped.get(RESTARTED, 0),
        "latency_s": LATENCY_S,
        "max_turns": MAX_TURNS,
    }


def run(policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        name, cmd, port = rollbuf("memory://", Path(tmp) / "rollbuf.log")
        with (
            serve(name, cmd, port, Path(tmp) / "rollbuf.log") as target,
            running_standin(Path(tmp) / "vllm.log") as vllm,
        ):
            for policy in policies:
                r = asyncio.run(one(policy, target.url, vllm.url))
                print(
                    f"  {policy}: {r['groups_per_s']} groups/s, {r['steps_per_s']} steps/s, "
                    f"staleness {r['mean_staleness']}, restarted {r['restarted']}",
                    flush=True,
                )
                out.append(r)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", choices=POLICIES, action="append")
    args = ap.parse_args()
    for r in run(tuple(args.policy or POLICIES)):
        print(json.dumps(r))


if __name__ == "__main__":
    main()
