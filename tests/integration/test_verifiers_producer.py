"""The verifiers producer end to end, offline: a real verifiers v1 environment (`tests/verifiers_tiny.py`, its
chat harness run by `uv` from the local index `make install` builds) on the stand-in `/inference/v1/generate`
(`demos/standin_inference.py`), run by `RolloutRunner` in process and through verifiers' `serve_env(max_workers=2)`,
submitted to a real rollbuf server and read back from /batch: exact tokens, masks, sentinels, scores, group
ids and the counts of what was dropped; and its taskset leased from rollbuf by two producers."""

from __future__ import annotations

import asyncio
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from demos.standin_inference import generate_logprob, generate_reply
from rollout_client import RolloutRunner, RunnerStats
from rollout_client.verifiers import ExternalInference, VerifiersEnvironment, verifiers_tasks
from rollout_client.verifiers.pool import POOL_START_S, children
from rollout_client.verifiers.tasks import register_verifiers_dataset, verifiers_leased_tasks, verifiers_task_rows
from tests.factories import group
from tests.runs import HANG_GUARD_S, drain, start_trainer, until
from tests.servers import running_server
from tests.standin import running_standin
from tests.verifiers_tiny import ENVS_DIR, build_tokenizer, client_config, env_config_data, offline_environ, prompt_ids

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

RUN_S = 150.0
"""Bound on one run (a harness `uv` set-up per process, then a few seconds a group): a hang fails, never stalls."""
SCRIPT_RUN_S = 300.0
"""Bound on the docs producer's first group: a script that imports verifiers, then its pool's 4 workers that do."""
G = 4
POOLS = pytest.mark.xdist_group("verifiers_pool")
"""On one worker, one after another: each pool starts 2-4 processes that import transformers, and each rollout is
a harness subprocess; two such tests at once on 2 cores beside the rest ran past `RUN_S`."""


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The harness's offline set-up in this process's environment; the tokenizer directory."""
    for k, v in offline_environ().items():
        monkeypatch.setenv(k, v)
    monkeypatch.syspath_prepend(str(ENVS_DIR))
    return build_tokenizer(tmp_path / "tokenizer")


async def produce(url: str, vllm_url: str, tokenizer: Path, *, workers: int, words: int, **kw: Any) -> RunnerStats:
    """Run the tiny env's first `words` tasks once each through the runner."""
    config = env_config_data()
    env = VerifiersEnvironment(
        config,
        client=client_config(vllm_url, tokenizer),
        model="fake",
        group_size=G,
        workers=workers,
        pool={"elastic": False},
        **kw,
    )
    async with env:
        runner = RolloutRunner(
            url, [(env, verifiers_tasks(config, cycle=False, limit=words))], ExternalInference(), max_in_flight=2 * G
        )
        return await asyncio.wait_for(runner.run(), RUN_S)


def expected_sequences(word: str) -> list[tuple[list[int], list[int], list[float], float]]:
    """What G rollouts of "Say <word>." must give, sorted: the stand-in says the word on every other request."""
    prompt = prompt_ids(f"Say {word}.")
    out = []
    for nth in range(1, G + 1):
        completion = generate_reply(f"Say {word}.", nth)
        tokens = prompt + completion
        masks = [-100] * len(prompt) + completion
        logprobs = [1.0] * len(prompt) + [generate_logprob(i) for i in range(len(completion))]
        out.append((tokens, masks, logprobs, 1.0 if nth % 2 else 0.0))
    return sorted(out)


def check_group(group: dict[str, Any], word: str) -> None:
    got = sorted(zip(group["tokens"], group["masks"], group["inference_logprobs"], group["scores"], strict=True))
    assert [list(map(list, g[:3])) + [g[3]] for g in got] == [list(e[:3]) + [e[3]] for e in expected_sequences(word)]
    traces = [o["trace_id"] for o in group["overrides"]]
    assert len(set(traces)) == G and all(len(t) == 32 for t in traces)
    records = {
        (o["stop_condition"], o["num_turns"], o["branch"], o["agent"], o["truncated"]) for o in group["overrides"]
    }
    assert records == {("agent_completed", 1, 0, "agent", False)}
    assert "left_out" not in (group["group_overrides"] or {})


@POOLS
@pytest.mark.parametrize("workers", [0, 2], ids=["in_process", "serve_env_pool"])
async def test_groups_reach_the_batch_exactly(tmp_path: Path, offline: Path, workers: int) -> None:
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=G)
        httpx.post(server.url + "/weights", json={"step": 0}).raise_for_status()  # the trainer's weights announced
        deltas: list[tuple[str, dict[str, Any]]] = []
        stats = await produce(
            server.url,
            vllm.url,
            offline,
            workers=workers,
            words=2,
            on_delta=lambda task, delta: deltas.append((task, delta)),
        )
        assert stats.accepted == 2 and stats.duplicates == 0 and not stats.failed and not stats.skipped
        served = drain(server.url)
    assert len(served) == 2
    by_word = {g["group_overrides"]["task_id"]: g for g in served}
    assert len(by_word) == 2
    words = sorted(bytes(t for t in g["tokens"][0] if t < 256).decode().split("Say ")[1].split(".")[0] for g in served)
    assert words == ["apple", "river"]
    for g in served:
        word = bytes(t for t in g["tokens"][0] if t < 256).decode().split("Say ")[1].split(".")[0]
        check_group(g, word)
    ids = [g["group_id"] for g in served]
    assert len(set(ids)) == 2 and all(ids)
    assert {g["policy_step"] for g in served} == {0}
    assert all(g["generation_params"]["weight_versions"] == [0, 0] for g in served)  # following the announcement
    if workers:  # the pool streams each trace turn by turn: relayed, one `open` per trace
        assert sum("open" in d for _, d in deltas) == 2 * G and {t for t, _ in deltas} == set(by_word)
    else:
        assert deltas == []


SYNCS = 20
"""Weight syncs the pool producer follows (20 of them, in process and through verifiers' pool)."""
SYNC_G = 2
"""Its groups' size: each rollout is a harness subprocess (about 2 s of CPU), and 4 a group took 3 CPU-minutes."""


@POOLS
async def test_through_the_pool_groups_carry_the_weights_that_generated_them_across_20_syncs(
    tmp_path: Path, offline: Path
) -> None:
    """Weights followed across syncs through verifiers' pool, with `max_staleness` 1. First the weights of step 1
    are announced while a group's episodes are in flight at the pool's workers (`on_new_weights` "continue", the
    default): that group keeps the stamp it started with and carries [0, 1]. Then the trainer takes a batch and
    announces its weights, 20 times: every group carries the weights that generated it (never newer than
    announced when it was served, within the staleness bound of the batch that trains it), and the run never
    stalls."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=SYNC_G, max_staleness=1)
        httpx.post(server.url + "/weights", json={"step": 0}).raise_for_status()
        config = env_config_data()
        env = VerifiersEnvironment(
            config, client=client_config(vllm.url, offline), model="fake", group_size=SYNC_G, workers=2
        )
        vllm.control(hang_all=True)  # the first group's episodes stay in flight at the pool's workers
        async with env:
            runner = RolloutRunner(
                server.url, [(env, verifiers_tasks(config))], ExternalInference(), max_in_flight=SYNC_G, max_staleness=1
            )
            run = asyncio.create_task(runner.run())
            at_workers = until_run_s(lambda: [r.traces for r in env.live.values()] == [1] * SYNC_G)
            await asyncio.wait_for(at_workers, RUN_S)  # the worker sets its harness up first
            # the trainer takes batch 0 (a group of the env posted directly) and announces the weights of step 1
            filler = group(SYNC_G, env_id=0, group_id="filler", seed=1)
            httpx.post(server.url + "/scored_data", json=filler).raise_for_status()
            assert httpx.get(server.url + "/batch", params={"step": 0}).json()["batch"] is not None
            httpx.post(server.url + "/weights", json={"step": 1}).raise_for_status()
            await until(lambda: runner.policy_step == 1, "the runner to follow the announced weights")
            vllm.control(hang_all=False)
            served: list[tuple[int, dict[str, Any]]] = []
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
                for step in range(1, SYNCS + 1):  # batch `step` trained, then the weights of step + 1 announced
                    deadline = time.monotonic() + RUN_S  # the first waits for the hung episodes to finish
                    while not (batch := (await c.get("/batch", params={"step": step, "wait": 30})).json()["batch"]):
                        assert time.monotonic() < deadline, f"no batch {step}: the run stalled ({runner.health()})"
                    served += [(step, g) for g in batch]
                    (await c.post("/weights", json={"step": step + 1})).raise_for_status()
            runner.stop()
            await asyncio.wait_for(run, RUN_S)
    assert not runner.stats.failed
    assert len(served) == SYNCS
    first_step, first = served[0]
    assert (first["policy_step"], first["generation_params"]["weight_versions"]) == (0, [0, 1])
    for step, g in served:
        low, high = g["generation_params"]["weight_versions"]
        assert g["policy_step"] == low <= high <= step, (step, g["policy_step"], low, high)  # announced by then
        assert step - g["policy_step"] <= 1, (step, g["policy_step"])  # max_staleness
    assert {g["policy_step"] for _, g in served[1:]} >= set(range(2, SYNCS - 1)), "each sync's weights were used"


async def test_failed_episodes_and_flat_groups_are_counted_not_submitted(tmp_path: Path, offline: Path) -> None:
    """An episode the inference server refuses fails its group (counted by reason); with
    `require_reward_variance`, a group whose rollouts all score the same is counted, not submitted."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=G)
        vllm.control(reject_marker="river", generate_echo=True)
        stats = await produce(server.url, vllm.url, offline, workers=0, words=3, require_reward_variance=True)
        served = drain(server.url)
    assert served == []
    assert stats.accepted == 0
    assert dict(stats.failed["verifiers"]) == {"episode_error:ProviderError": 1}, stats.failed
    assert dict(stats.skipped) == {"no_reward_variance": 2}


async def test_pause_waits_for_running_episodes_and_cancels_those_that_outlive_it(
    tmp_path: Path, offline: Path
) -> None:
    """verifiers' harness calls inference itself: `pause()` returns once no episode runs (none starts until
    `resume()`); episodes still running at its timeout are cancelled, their groups counted `pause_timeout`."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=G)
        config = env_config_data()
        env = VerifiersEnvironment(config, client=client_config(vllm.url, offline), model="fake", group_size=G)
        async with env:
            runner = RolloutRunner(server.url, [(env, verifiers_tasks(config))], ExternalInference(), max_in_flight=G)
            run = asyncio.create_task(runner.run())
            await until(lambda: runner.stats.accepted >= 1, "a first group")
            assert await runner.pause(timeout=math.inf)
            assert env.running == 0 and runner.paused
            runner.resume()
            vllm.control(hang_all=True)
            await until(lambda: env.running == G, "episodes at a hung inference server")
            await until(lambda: [r.traces for r in env.live.values()] == [1] * G, "their traces, live")
            assert all(r.turns() == 0 for r in env.live.values())  # no turn committed: the model never answered
            assert not await runner.pause(timeout=0.5)
            assert env.running == 0 and env.live == {} and runner.stats.skipped["pause_timeout"] == 1
            runner.stop()
            stats = await asyncio.wait_for(run, RUN_S)
    assert stats.accepted >= 1 and not stats.failed


async def test_tasks_from_a_finite_taskset_cycle_an_endless_one_streams_and_producers_can_lease_them(
    offline: Path,
) -> None:
    """`verifiers_tasks` walks the taskset; registered with rollbuf (rollout_client/verifiers/tasks.py, a page at a
    time, safe to run again), two producers lease it: each task once in the epoch, as `verifiers_tasks` makes it.
    One test, so that verifiers' import (seconds) is paid once."""
    finite = verifiers_tasks(env_config_data(), limit=2)
    got = [finite.next_task() for _ in range(5)]
    assert [t.prompt for t in got if t] == ["Say apple.", "Say river.", "Say apple.", "Say river.", "Say apple."]
    assert got[0] is not None and got[0].meta["verifiers_task"]["answer"] == "apple"
    endless = verifiers_tasks({**env_config_data(), "taskset": {"id": "rollbuf_endless_vf"}})
    assert [t.prompt for t in (endless.next_task() for _ in range(3)) if t] == ["Say w0.", "Say w1.", "Say w2."]
    await leased_from_rollbuf(env_config_data())


async def leased_from_rollbuf(config: dict[str, Any]) -> None:
    expected = {t.id: t for t in iter(verifiers_tasks(config, cycle=False).next_task, None)}
    assert len(expected) >= 3
    with pytest.raises(ValueError, match="give limit"):
        next(verifiers_task_rows({**config, "taskset": {"id": "rollbuf_endless_vf"}}))
    app = create_app(Settings(store="memory://"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)  # the server in process, as the producers' transport
        spec = {"page": 2, "epochs": 2, "order": "shuffled", "seed": 3, "transport": transport}
        view = await register_verifiers_dataset("http://localhost", "vf", config, **spec)
        again = await register_verifiers_dataset("http://localhost", "vf", config, **spec)
        assert view.size == again.size == len(expected) and view.sealed, "a second run is a no-op"
        sources = [verifiers_leased_tasks("vf", "http://localhost", transport=transport, batch=2) for _ in range(2)]
        got = []
        while len(got) < len(expected):  # the first epoch, the two producers in turn
            task = await sources[len(got) % 2].anext_task()
            assert task is not None
            got.append(task)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            [dataset] = (await c.get("/tasks")).json()
        for source in sources:
            await source.aclose()
    assert sorted(t.id for t in got) == sorted(expected), "each task once in the epoch"
    for t in got:
        assert (t.prompt, t.meta["verifiers_task"]) == (expected[t.id].prompt, expected[t.id].meta["verifiers_task"])
    assert dataset["counts"] == {"leased": len(expected)} and dataset["epoch"] == 0


async def test_a_group_left_short_is_submitted_whole_with_its_left_out_counts(tmp_path: Path, offline: Path) -> None:
    """A trainer's max_token_len between the two answers' lengths leaves the long answers out (`too_long`): each
    group holds the G/2 short ones, submitted as a complete group (`variable_group_size`), not held."""
    prompt = len(prompt_ids("Say apple."))
    short, long = prompt + len(generate_reply("Say apple.", 2)), prompt + len(generate_reply("Say apple.", 1))
    assert short < long
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=G, max_token_len=short)
        stats = await produce(server.url, vllm.url, offline, workers=0, words=2)
        served = drain(server.url)
    assert stats.accepted == 2 and not stats.failed and not stats.skipped
    assert sorted(len(g["tokens"]) for g in served) == [G // 2, G // 2]
    for g in served:
        assert g["scores"] == [0.0] * (G // 2) and all(len(t) == short for t in g["tokens"])
        assert g["group_overrides"]["left_out"] == {"too_long": G // 2}


async def until_run_s(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.05)


def pool_workers(broker: int) -> set[int]:
    """The broker's worker processes (verifiers' spawned `serve_env`s, not its resource tracker)."""
    return {p for p in children(broker) or set() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()}


@POOLS
async def test_a_pool_worker_killed_fails_its_episodes_at_once_and_the_pool_restarts(
    tmp_path: Path, offline: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool worker killed -9 (verifiers' broker neither notices nor replaces it: its episodes hung until a
    pause or a rollout timeout, counted as skipped): it is logged, its group's episodes fail at once and are
    counted as failures (`pool_worker_died`, in stats and health), and the pool is restarted and serves."""
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=G)
        config = env_config_data()
        env = VerifiersEnvironment(
            config, client=client_config(vllm.url, offline), model="fake", group_size=G, workers=2
        )
        # elastic, verifiers' default: the pool starts one worker (cheaper here than two)
        vllm.control(hang_all=True)  # the episodes stay in flight at the pool's workers
        async with env:
            assert env._pool is not None and env._pool.life is not None
            broker = env._pool.life.proc.pid
            runner = RolloutRunner(server.url, [(env, verifiers_tasks(config))], ExternalInference(), max_in_flight=G)
            run = asyncio.create_task(runner.run())
            # the pool's first worker imports verifiers and builds the env first: bounded as the pool bounds it
            await until(
                lambda: [r.traces for r in env.live.values()] == [1] * G,
                "a group's episodes at the workers",
                POOL_START_S + HANG_GUARD_S,
            )
            victim = min(pool_workers(broker))
            os.kill(victim, signal.SIGKILL)
            await until(lambda: runner.stats.failed["verifiers"]["pool_worker_died"] == 1, "the group failed")
            assert runner.health().rollouts_failed["verifiers"] == {"pool_worker_died": G}
            assert runner.health().failed["verifiers"] == {"pool_worker_died": 1} and not runner.stats.skipped
            assert f"pool worker pid {victim} died" in caplog.text
            vllm.control(hang_all=False)
            served = asyncio.create_task(until_run_s(lambda: runner.stats.accepted >= 1))
            await asyncio.wait_for(served, RUN_S)  # a fresh worker sets its harness up again: not HANG_GUARD_S
            assert env.pool_worker_deaths == 1 and env.pool_restarts == 1
            assert env._pool.life.proc.pid != broker and len(pool_workers(env._pool.life.proc.pid)) == 1
            runner.stop()
            stats = await asyncio.wait_for(run, RUN_S)
    assert stats.accepted >= 1 and dict(stats.failed["verifiers"]) == {"pool_worker_died": 1}


@POOLS
def test_the_docs_producer_runs_as_written_with_its_pool(tmp_path: Path, offline: Path) -> None:
    """docs/bring-your-environment.md's verifiers producer (section 2), as written but for its two addresses, the
    model (the stand-in's tokenizer directory) and one group of 2 in flight rather than eight of 8 (each rollout is
    a harness subprocess: 64 at once took 2 cores 125 s alone, and 8 ran past `RUN_S` beside the other
    tests in CI), run as a script beside the page's taskset module: with `workers=4` verifiers' pool spawns workers
    that import the script again, which only its `__main__` guard makes work. It
    produces groups until stopped."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "bring-your-environment.md").read_text()
    section = page.split("## 2. A verifiers environment", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    [taskset] = [b for b in blocks if b.startswith("# my_taskset.py")]
    (tmp_path / "my_taskset.py").write_text(taskset)
    with running_server("memory://", tmp_path / "s.log") as server, running_standin(tmp_path / "v.log") as vllm:
        start_trainer(server.url, batch_size=2)
        script = blocks[0]
        for written, here in {
            "http://127.0.0.1:9000": vllm.url,
            "http://127.0.0.1:8000": server.url,
            "Qwen/Qwen3-0.6B": str(offline),
            "group_size=8": "group_size=2",
            "max_in_flight=64": "max_in_flight=2",
        }.items():
            assert written in script, f"the page no longer says {written}: change it here too"
            script = script.replace(written, here)
        (tmp_path / "produce.py").write_text(script)
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ['PYTHONPATH']}"}
        with (tmp_path / "produce.log").open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(tmp_path / "produce.py")],
                cwd=tmp_path,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            deadline = time.monotonic() + SCRIPT_RUN_S
            while httpx.get(server.url + "/status").json()["queue_size"] < 1:
                assert proc.poll() is None, (tmp_path / "produce.log").read_text()[-3000:]
                assert time.monotonic() < deadline, (tmp_path / "produce.log").read_text()[-3000:]
                time.sleep(0.2)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        served = drain(server.url)
    assert len(served) >= 1 and all(len(g["tokens"]) == 2 for g in served)
    assert "Error" not in (tmp_path / "produce.log").read_text()


def test_the_docs_taskset_is_found_by_its_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/bring-your-environment.md's taskset module, as written, is found by the id `my-taskset` once its
    directory is importable (`my_taskset`, its one `Taskset` in `__all__`)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "bring-your-environment.md").read_text()
    [module] = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if b.startswith("# my_taskset.py")]
    (tmp_path / "my_taskset.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"taskset": {"id": "my-taskset"}, "agent": {"harness": {"id": "null"}}}
    tasks = verifiers_tasks(config, cycle=False)
    task = tasks.next_task()
    assert task is not None and task.prompt == "Say apple." and tasks.next_task() is None
