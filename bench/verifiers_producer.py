"""The verifiers producer's throughput (groups/s): a verifiers v1 environment run in process against the same
environment run by verifiers' env-server pool (`serve_env(max_workers=2)`, both workers started up front),
through RolloutRunner to a real rollbuf server. The environment is the tests' tiny one (tests/verifiers_tiny.py:
one turn, verifiers' chat harness as a `uv` script in a subprocess per rollout) on the stand-in
`/inference/v1/generate` (demos/standin_inference.py), which answers at once: what is measured is verifiers'
per-rollout cost (harness process, interception, renderer, scoring) and rollbuf's, not a model's.

Per mode: start-up (env built or pool up), the first group, then groups/s over the next GROUPS groups with
up to IN_FLIGHT rollouts at once. Offline: needs `make install`'s wheelhouse (ROLLBUF_WHEELHOUSE).

    .venv/bin/python -m bench.verifiers_producer
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.servers import rollbuf, save_rows, serve
from rollout_client import RolloutRunner, Tasks
from rollout_client.verifiers import ExternalInference, VerifiersEnvironment, verifiers_tasks
from tests.integration.test_runner import start_trainer
from tests.standin import running_standin
from tests.verifiers_tiny import ENVS_DIR, build_tokenizer, client_config, env_config_data, offline_environ

G = 4
GROUPS = 12
IN_FLIGHT = 16
MODES = (0, 2)


async def one(url: str, vllm_url: str, tokenizer: Path, workers: int) -> dict[str, Any]:
    config = env_config_data()
    env = VerifiersEnvironment(
        config,
        client=client_config(vllm_url, tokenizer),
        model="fake",
        group_size=G,
        workers=workers,
        pool={"elastic": False},
        name=f"vf{workers}",
    )
    t0 = time.perf_counter()
    async with env:
        started = time.perf_counter() - t0
        tasks: Tasks = verifiers_tasks(config, cycle=True)
        runner = RolloutRunner(url, [(env, tasks)], ExternalInference(), max_in_flight=IN_FLIGHT)
        run = asyncio.create_task(runner.run(max_groups=GROUPS + 1))
        t1 = time.perf_counter()
        while runner.stats.accepted < 1 and not run.done():
            await asyncio.sleep(0.01)
        first = time.perf_counter() - t1
        t2 = time.perf_counter()
        stats = await run
        steady = time.perf_counter() - t2
    return {
        "bench": "verifiers_producer",
        "mode": "in_process" if workers == 0 else f"serve_env_{workers}",
        "startup_s": round(started, 2),
        "first_group_s": round(first, 2),
        "groups": stats.accepted - 1,
        "groups_per_s": round((stats.accepted - 1) / steady, 3),
        "rollouts_per_s": round(G * (stats.accepted - 1) / steady, 3),
        "failed": dict(stats.failed),
        "skipped": dict(stats.skipped),
    }


def run() -> list[dict[str, Any]]:
    os.environ.update(offline_environ())
    sys.path.insert(0, str(ENVS_DIR))
    print(f"verifiers producer: G={G}, {GROUPS} groups after the first, {IN_FLIGHT} rollouts in flight", flush=True)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(Path(tmp) / "tokenizer")
        for workers in MODES:
            name, cmd, port = rollbuf("memory://", Path(tmp) / f"r{workers}.log")
            with (
                serve(name, cmd, port, Path(tmp) / f"r{workers}.log") as target,
                running_standin(Path(tmp) / "v.log") as v,
            ):
                start_trainer(target.url, batch_size=G)
                out.append(asyncio.run(one(target.url, v.url, tokenizer, workers)))
                print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    results = run()
    save_rows("verifiers", results)


if __name__ == "__main__":
    main()
