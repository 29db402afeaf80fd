"""rollout_client.verifiers without running anything: verifiers stays out until an environment starts, the
runner's policy refuses to generate, the environment refuses to pickle (it would be sent to workers)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from rollout_client.verifiers import ExternalInference, VerifiersEnvironment

pytestmark = pytest.mark.anyio


def test_importing_the_producer_does_not_import_verifiers() -> None:
    code = "import sys, rollout_client, rollout_client.verifiers; print('verifiers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


async def test_external_inference_refuses_to_generate() -> None:
    with pytest.raises(RuntimeError, match="harness tokenizes and generates itself"):
        await ExternalInference().generate([1], max_tokens=4)
    with pytest.raises(RuntimeError, match="harness tokenizes and generates itself"):
        await ExternalInference().tokenize("x")


def test_the_environment_does_not_pickle_and_says_what_to_do() -> None:
    env = VerifiersEnvironment({"taskset": {"id": "x"}}, client={}, model="m")
    assert env.variable_group_size and env.skip_reason(1, [1.0]) == "too_few_sequences"
    with pytest.raises(TypeError, match="num_workers=0"):
        pickle.dumps(env)
