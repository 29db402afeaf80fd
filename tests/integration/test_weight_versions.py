"""The weight versions a group states, against the weights that sampled its tokens, in the four-process layout
(a trainer process, the rollbuf server, the stand-in inference server, a producer process). The trainer syncs
inside `weight_sync` (POST /weights/pending, then the push, then POST /weights) after every step; the stand-in
server marks each token's logprob with the weights that sampled it (`demos.standin_inference.weights_logprob`), and
the trainer reads them back from its batches. Under every `on_new_weights` policy, each trained group's
`policy_step` and `generation_params["weight_versions"]` are the versions its tokens came from, and say so
(`weight_versions_exact`), and every trained token's served version (`token_weight_versions`, stamped by the
runner from its turns) is the one that sampled it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.runs import example_producer, example_trainer, poll_until, result
from tests.servers import running_server
from tests.standin import running_standin

pytestmark = pytest.mark.integration

STEPS = 8


@pytest.mark.parametrize("policy", ["continue", "restart", "drain"])
def test_every_trained_group_states_the_weights_its_tokens_came_from(tmp_path: Path, policy: str) -> None:
    out = tmp_path / "trainer.json"
    with (
        running_server("memory://", tmp_path / "server.log") as server,
        running_standin(tmp_path / "vllm.log") as vllm,
    ):
        httpx.post(vllm.url + "/control", json={"latency": 0.02}).raise_for_status()
        with (
            example_trainer(
                server.url, vllm.url, tmp_path / "trainer.log", out, steps=STEPS, drain=True, max_staleness=1
            ) as trainer,
            example_producer(
                server.url,
                vllm.url,
                tmp_path / "producer.log",
                on_new_weights=policy,
                turns=3,
                max_in_flight=16,
                max_staleness=1,
            ),
        ):
            poll_until(lambda: trainer.poll() is not None, f"the trainer's {STEPS} steps")
            assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    run = result(out)
    assert run["undrained_syncs"] == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    groups = [g for s in run["steps"] for g in s["groups"]]
    wrong = [
        g
        for g in groups
        if g["weight_versions"] != [min(g["generated_with"]), max(g["generated_with"])]
        or g["policy_step"] != min(g["generated_with"])
    ]
    assert not wrong, f"{len(wrong)} of {len(groups)} groups state other weights than their tokens': {wrong[:5]}"
    per_token = [g for g in groups if g["token_mismatches"] != 0]  # None: served without per-token versions
    assert not per_token, (
        f"{len(per_token)} of {len(groups)} groups' tokens served with other versions: {per_token[:5]}"
    )
    if policy != "continue":  # no episode spans a sync
        assert all(len(g["generated_with"]) == 1 for g in groups), groups
    # after the first sync the producer has taken part in, every group's versions are exact, and say so
    assert all(g["exact"] for g in groups if g["policy_step"] >= 2), groups
    assert len({g["policy_step"] for g in groups}) >= 3  # the producer followed the syncs
