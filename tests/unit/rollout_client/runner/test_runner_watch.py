"""`rollout_client.runner.watch.Watch` alone: what one pass over the envs' statuses does to the runner's shared state
(announced weights taken as the step generating, stale groups cancelled, envs held back, the run ended when
the server stays unreachable or inference stays down), with a scripted status source in place of the server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from api.wire.schema import EnvStatus
from rollout_client.breaker import Breaker
from rollout_client.env import Gate
from rollout_client.errors import RetriesExhausted
from rollout_client.examples import Arithmetic
from rollout_client.runner.backpressure import Backpressure
from rollout_client.runner.following import Follower
from rollout_client.runner.inflight import Group, InFlight
from rollout_client.runner.pacing import QUEUE_FULL
from rollout_client.runner.stats import RunnerStats
from rollout_client.runner.watch import Watch, Weights
from rollout_client.runner.watching import Monitor

pytestmark = pytest.mark.anyio


def status(
    step: int = 0, *, weights: int | None = None, capacity: int | None = None, pending: int | None = None
) -> EnvStatus:
    return EnvStatus(
        current_step=step,
        queue_size=0,
        unallocated_fraction=1.0,
        self_queue_size=0,
        max_group_size=2,
        env_weight=1.0,
        weights_step=weights,
        queue_capacity_groups=capacity,
        weights_pending=pending,
    )


class Script:
    """The statuses a server would answer, one pass at a time; a pass that is an exception is raised."""

    def __init__(self, passes: list[EnvStatus | Exception]) -> None:
        self._passes: Iterator[EnvStatus | Exception] = iter(passes)
        self.before_read: Callable[[], None] = lambda: None

    async def status(self, i: int) -> EnvStatus:
        self.before_read()
        answer = next(self._passes)
        if isinstance(answer, Exception):
            raise answer
        return answer


class Syncing:
    """A server at step 3, then (once `begun`) during a weight sync to step 4: pending until `announced`, then the
    announcement once, then unreachable (which ends the watch)."""

    def __init__(self) -> None:
        self.begun = self.announced = False
        self._told = False

    async def status(self, i: int) -> EnvStatus:
        if not self.announced:
            return status(weights=3, pending=4 if self.begun else None)
        if self._told:
            raise RetriesExhausted("gone")
        self._told = True
        return status(weights=4)


def watch(
    script: Script | Syncing, *, max_staleness: int | None = None, outage: float | None = None
) -> tuple[Watch, list[str]]:
    stats = RunnerStats()
    ended: list[str] = []
    w = Watch(
        names=["math"],
        statuses=script,
        backpressure=Backpressure([2], max_staleness),
        follow=Follower([Arithmetic()]),
        monitor=Monitor(max_staleness, None, outage),
        in_flight=InFlight(8, stats),
        inference=Breaker(),
        stats=stats,
        weights=Weights(stats, step=3),
        poll_interval=0.0,
        changed=asyncio.Event(),
        end=lambda reason, exc: ended.append(reason),
        paused=lambda: False,
        pool=lambda: None,
        gate=Gate(),
    )
    return w, ended


async def test_announced_weights_become_the_step_generating_and_never_go_back() -> None:
    w, ended = watch(Script([status(weights=5), status(weights=4), RetriesExhausted("gone")]))
    await w.run()
    assert (w.weights.now, w.weights.resumed, w.stats.policy_step) == (5, True, 5)  # 4, later, is older: kept 5
    assert w.changed.is_set()
    assert ended == ["the rollbuf server stayed unreachable"]


async def test_a_group_too_stale_to_finish_is_cancelled_and_one_submitting_is_left_alone() -> None:
    w, ended = watch(Script([status(step=9), RetriesExhausted("gone")]), max_staleness=2)
    forever = asyncio.Event()
    stale, submitting = (asyncio.create_task(forever.wait()) for _ in range(2))
    w.in_flight.add("stale", Group(stale, 0, 2, policy_step=3))
    w.in_flight.add("submitting", Group(submitting, 0, 2, policy_step=3, submitting=True))
    await w.run()
    await asyncio.sleep(0)
    assert stale.cancelled() and not submitting.done()
    assert w.stats.trainer_step == 9
    forever.set()
    await submitting


async def test_a_full_queue_holds_the_env_back_until_it_drains() -> None:
    script = Script([status(capacity=0), status(capacity=50), RetriesExhausted("gone")])
    w, _ = watch(script)
    w.backpressure.batch_size = 4
    seen: list[str | None] = []
    script.before_read = lambda: seen.append(w.stats.paused.get("math"))
    await w.run()
    assert seen == [None, QUEUE_FULL, None]  # as each read starts: before any, after the full one, after room


async def test_an_inference_outage_past_its_limit_ends_the_run_from_the_monitors_verdict() -> None:
    w, ended = watch(Script([status()]), outage=0.0)
    w.inference.observe(True, 0.0)  # down since the clock's start: longer than the 0 s allowed
    await w.run()
    assert ended == ["the inference server stayed unreachable for 0.0 s"]


async def test_a_bug_in_a_pass_ends_the_run_through_end_never_as_a_bare_error() -> None:
    w, ended = watch(Script([ValueError("a bug")]))
    await w.run()
    assert ended == ["the runner's monitor failed: ValueError"]


async def until(cond: Callable[[], bool]) -> None:
    """Let the loop run until `cond` holds (a hang guard in passes, never a time)."""
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the watch never got there")


async def test_a_pending_sync_holds_generation_until_no_request_is_in_flight_and_the_announcement_lets_it_go() -> None:
    server = Syncing()
    w, ended = watch(server)
    release = asyncio.Event()

    async def request() -> int | None:
        async with w.gate.generation():
            served_by = w.gate.weights
            await release.wait()
        return served_by

    run = asyncio.create_task(w.run())
    await until(lambda: w.gate.weights == 3)  # the first pass: the gates learn the version generating
    in_flight = asyncio.create_task(request())
    await until(lambda: bool(w.gate.holders()))  # a request at the inference server
    server.begun = True
    await until(lambda: not w.gate.is_open)  # the sync is pending: no new request starts
    assert w.holding == 4 and w.drained_for is None  # one is still at the inference server
    release.set()
    assert await in_flight == 3
    await until(lambda: w.drained_for == 4)  # none in flight: drained for the sync, said at once
    assert w.beat_now.is_set() and not w.gate.is_open
    server.announced = True
    await run
    assert w.gate.is_open and w.gate.weights == 4 and w.holding is None  # what passes now is served by step 4
    assert w.follow.handshake and w.follow.acked == {3}
    assert ended == ["the rollbuf server stayed unreachable"]
