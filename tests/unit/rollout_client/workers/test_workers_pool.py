"""With `num_workers > 0` the envs and the policy are sent to spawned worker processes: what does not pickle is
refused when the runner is built, naming it and the fix (the spawn's own error, "cannot pickle '_thread.RLock'
object", came at the first group and named neither)."""

from __future__ import annotations

import functools
import threading

import pytest

from rollout_client import RolloutRunner, ScriptedPolicy, Tasks
from rollout_client.examples import Arithmetic, arithmetic_script, arithmetic_task


class LivePolicy(ScriptedPolicy):
    """A policy holding a live client (a lock here), as an OpenAIPolicy holds its HTTP client."""

    def __init__(self) -> None:
        super().__init__(arithmetic_script)
        self.lock = threading.RLock()


class LiveEnv(Arithmetic):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.RLock()


def build(env: Arithmetic, policy: object, workers: int) -> RolloutRunner:
    return RolloutRunner("http://127.0.0.1:9", [(env, Tasks(arithmetic_task))], policy, num_workers=workers)  # type: ignore[arg-type]


def test_a_policy_that_does_not_pickle_is_refused_with_the_factory_to_pass() -> None:
    with pytest.raises(TypeError, match=r"the policy .* must pickle.*functools.partial\(OpenAIPolicy"):
        build(Arithmetic(), LivePolicy(), workers=2)
    build(Arithmetic(), LivePolicy, workers=2)  # a factory: each worker builds its own
    build(Arithmetic(), functools.partial(ScriptedPolicy, arithmetic_script), workers=2)
    build(Arithmetic(), LivePolicy(), workers=0)  # in process: nothing is sent


def test_an_env_that_does_not_pickle_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"env 'arithmetic' is sent to each worker.*worker_setup"):
        build(LiveEnv(), ScriptedPolicy(arithmetic_script), workers=1)
