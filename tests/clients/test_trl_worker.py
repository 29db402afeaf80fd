"""`RollbufRolloutWorker` (TRL's rollout-worker protocol over trainer_client) against a real rollbuf server in a
thread, with its own sample type (no TRL needed): fields and dtypes, versions from the policy step, health when
the reader dies or nothing comes, a bounded stop; and `rollout_samples` and `async_grpo.align` alone."""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest

from api.config.settings import Settings
from tests.clients.test_trainer_client import serve_in_thread
from tests.factories import env, group
from trainer_client import TrainerClient
from trainer_client.rollout_samples import GROUP_ID_STRIDE, Sample, UnusableBatch, samples_of
from trainer_client.trl_worker import RollbufRolloutWorker, RolloutWorkerDied, RolloutWorkerStale


def SAMPLE(sample: Sample, enqueued_at: float) -> Sample:
    """The worker's own sample type: these tests need no TRL."""
    return sample


@pytest.fixture
def url(settings: Settings) -> Iterator[str]:
    with serve_in_thread(settings) as u:
        yield u
        for client in OPEN:
            client.close()
        OPEN.clear()


OPEN: list[TrainerClient] = []


def start(url: str, *, groups: int, policy_steps: list[int] | None = None, **reg: Any) -> TrainerClient:
    """A commit-mode run of batches of one group of 4 (8 tokens, half trained), `groups` of them queued."""
    rb = TrainerClient(url)
    OPEN.append(rb)
    rb.register(batch_size=4, max_token_len=64, acknowledge="commit", **reg)
    with httpx.Client(base_url=url) as c:
        c.get("/batch", params={"step": reg.get("starting_step", 0)})
        assert c.post("/register-env", json=env(group_size=4)).status_code == 200
        for g in range(groups):
            extra = {} if policy_steps is None else {"policy_step": policy_steps[g]}
            assert c.post("/scored_data", json=group(4, seed=g, group_id=f"g{g}", **extra)).status_code == 200
    return rb


def take(worker: RollbufRolloutWorker, n: int) -> list[Any]:
    return [worker.rollout_buffer.get(timeout=30) for _ in range(n)]


def test_samples_hold_the_sequences_trained_positions_logprobs_and_advantages(url: str) -> None:
    rb = start(url, groups=2)
    worker = RollbufRolloutWorker(rb, wait=1.0, convert=SAMPLE)
    worker.update_model_version(1)  # TRL's first weight sync
    worker.start()
    try:
        samples = take(worker, 8)
    finally:
        worker.stop()
    sent = group(4, seed=0)
    first = samples[0]
    assert first.input_ids.dtype == np.int64 and first.input_ids.tolist() == sent["tokens"][0]
    assert first.completion_mask.dtype == np.bool_ and first.completion_mask.tolist() == [False] * 4 + [True] * 4
    assert first.old_log_probs.dtype == np.float32
    assert first.old_log_probs[4:].tolist() == pytest.approx(sent["inference_logprobs"][0][4:], rel=1e-6)
    assert first.old_log_probs[:4].tolist() == [0.0] * 4
    scores = np.array(sent["scores"])
    assert [s.advantage for s in samples[:4]] == pytest.approx((scores - scores.mean()) / (scores.std() + 1e-6))
    assert [s.group_id for s in samples] == [0] * 4 + [GROUP_ID_STRIDE] * 4  # step 0 group 0, step 1 group 0
    assert {s.model_version for s in samples} == {1}  # the weights of step 0 are TRL's version 1
    assert first.metrics == {"rollbuf/staleness": 0.0, "rollbuf/env_id": 0.0, "reward": scores[0]}
    assert list(worker.steps_read) == [0, 1]
    assert worker.first_step_read == 0
    metrics = worker.metrics_queue.get_nowait()
    assert metrics["rollbuf/step"] == 0.0 and metrics["rollbuf/groups"] == 1.0


def test_versions_follow_the_policy_step_absolutely_across_a_resume(url: str) -> None:
    policy_steps = [6, 7, 8, 9, 10, 10]  # a run resumed at step 10, with groups of older weights still queued
    rb = start(url, groups=6, policy_steps=policy_steps, starting_step=10)
    for resume_at, batches in ((10, 4), (12, 4)):
        worker = RollbufRolloutWorker(rb, start_step=resume_at, sync_every=2, wait=1.0, convert=SAMPLE)
        worker.update_model_version(1)  # TRL counts its syncs from 0 in every process: 1 after the first
        worker.start()
        try:
            samples = take(worker, 4 * batches)
        finally:
            worker.stop()
        # version = policy_step // sync_every, shifted so that the weights of `resume_at` are TRL's version 1
        expected = [p // 2 - resume_at // 2 + 1 for p in policy_steps[resume_at - 10 :][:batches]]
        assert [s.model_version for s in samples[::4]] == expected
        assert list(worker.steps_read)[:batches] == list(range(resume_at, resume_at + batches))
        rb.commit(12)  # the checkpoint after two steps


def test_health_raises_with_the_cause_when_the_reader_dies_on_a_committed_step(url: str) -> None:
    rb = start(url, groups=3)
    assert len(list(itertools.islice(rb.batches(start_step=0, wait=0), 2))) == 2
    rb.commit(2)
    worker = RollbufRolloutWorker(rb, start_step=0, wait=1.0, convert=SAMPLE)  # a checkpoint older than the commit
    worker.start()
    deadline = time.monotonic() + 30
    while True:  # polling TRL's way: check_health until the reader's end shows
        try:
            worker.check_health(300)
        except RolloutWorkerDied as died:
            assert "no longer available" in str(died) and type(died.__cause__).__name__ == "BatchGone"
            break
        assert time.monotonic() < deadline, "the reader never stopped"
        time.sleep(0.02)
    worker.stop()


def test_health_raises_when_no_batch_comes_and_stop_returns_mid_long_poll(url: str) -> None:
    rb = start(url, groups=0)
    worker = RollbufRolloutWorker(rb, wait=2.0, convert=SAMPLE)
    worker.start()
    with pytest.raises(queue.Empty):
        worker.rollout_buffer.get(timeout=0.5)
    worker.check_health(300)  # waiting, not stale yet
    with pytest.raises(RolloutWorkerStale, match="no rollbuf batch for"):
        worker.check_health(0.0)
    worker.stop()  # the reader is inside a 2 s long-poll: stop waits for it, within the bound
    assert worker._thread is not None and not worker._thread.is_alive()


def test_a_batch_without_logprobs_is_refused_by_name() -> None:
    from trainer_client.arrays import from_json

    batch = from_json([group(2, seed=1, logprobs=False)], 7)
    with pytest.raises(UnusableBatch, match="batch 7 has trained tokens without inference_logprobs"):
        samples_of(batch)


def test_align_refuses_what_cannot_line_up() -> None:
    from trainer_client.async_grpo import Misaligned, align

    def config(**over: Any) -> Any:
        base = {
            "token_budget": 0,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "max_steps": 10,
            "save_strategy": "steps",
            "save_steps": 2,
            "weight_sync_steps": 2,
            "max_staleness": 4,
        }
        return SimpleNamespace(**(base | over))

    args = config()
    align(args, batch_size=8, max_staleness=5, read_ahead_bound=8)
    assert args.max_staleness == 4  # ceil(5 / 2) syncs, plus one: TRL drops nothing rollbuf let through
    with pytest.raises(Misaligned, match="batch_size is 16"):
        align(config(), batch_size=16)
    with pytest.raises(Misaligned, match="token_budget=4096"):
        align(config(token_budget=4096), batch_size=8)
    with pytest.raises(Misaligned, match="token-budgeted"):
        align(config(), batch_size=8, max_batch_tokens=4096)
    with pytest.raises(Misaligned, match="save at least every 5 steps"):
        align(config(save_steps=6), batch_size=8, read_ahead_bound=8)
    with pytest.raises(Misaligned, match="set max_steps"):
        align(config(max_steps=-1), batch_size=8)


def test_each_weight_sync_is_announced_to_rollbuf_at_its_step(url: str) -> None:
    rb = start(url, groups=6, starting_step=10)
    assert len(list(itertools.islice(rb.batches(start_step=10, wait=0), 5))) == 5  # the trainer is at step 15
    worker = RollbufRolloutWorker(rb, start_step=10, sync_every=2, wait=1.0, convert=SAMPLE)
    with httpx.Client(base_url=url) as c:
        worker.update_model_version(1)  # the cold sync: the weights of start_step
        assert c.get("/weights").json() == {"weights_step": 10}
        worker.update_model_version(3)  # two syncs later, every 2 steps
        assert c.get("/weights").json() == {"weights_step": 14} and worker.weights_step == 14
    quiet = RollbufRolloutWorker(rb, start_step=10, announce_weights=False, convert=SAMPLE)
    quiet.update_model_version(9)
    assert rb.status().weights_step == 14


def test_align_names_the_supported_trl_releases() -> None:
    """TRL 1.18 removed the rollout_worker= / weight_transfer= seam; align() says so by name."""
    from trainer_client.async_grpo import Misaligned, check_trl_version

    check_trl_version("1.16.0")
    check_trl_version("1.17.2")  # in the pinned range, not the tested release: a warning only
    for too_new in ("1.18.0", "2.0.1"):
        with pytest.raises(
            Misaligned, match=r"TRL 1\.18 removed .*rollout_worker= / weight_transfer=.*trl>=1\.16,<1\.18"
        ):
            check_trl_version(too_new)
    with pytest.raises(Misaligned, match="predates"):
        check_trl_version("1.15.3")


def test_the_weight_sync_hook_with_drain_waits_for_drain_producers_then_announces(url: str) -> None:
    from trainer_client.async_grpo import RollbufWeightSync

    rb = start(url, groups=2)
    assert len(list(itertools.islice(rb.batches(start_step=0, wait=0), 1))) == 1  # the trainer is at step 1
    with httpx.Client(base_url=url) as c:
        env_id = 0  # the one env start() registered
        beat = {"producer_id": "p", "host": "h", "env_ids": [env_id], "drains": True}
        c.post("/producers/heartbeat", json=beat).raise_for_status()
        hook = RollbufWeightSync(client=rb, step=lambda: 1, drain=True, drain_timeout=0.2)
        hook.pause()  # not drained within 0.2 s: the sync goes on
        assert c.get("/weights/pending").json()["waiting_on"] == ["p on h"]
        c.post("/producers/heartbeat", json={**beat, "drained_for": 1}).raise_for_status()
        assert c.get("/weights/pending").json()["drained"] is True
        hook.send_weights(iter([]))
        hook.resume()
        assert c.get("/weights/pending").json() == {
            "weights_step": 1,
            "pending_step": None,
            "waiting_on": [],
            "drained": False,
        }
    with pytest.raises(ValueError, match="drain=True needs client and step"):
        RollbufWeightSync(drain=True)
