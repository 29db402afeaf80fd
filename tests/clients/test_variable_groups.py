"""A group that kept the survivors of its failed rollouts (`min_group_size`) reaches the trainer as
submitted: the server queues it whole and `trainer_client` normalises GRPO advantages over exactly its
sequences, not over `group_size` nor over another prompt's group."""

from __future__ import annotations

import httpx
import numpy as np

from api.config.settings import Settings
from tests.clients.test_trainer_client import serve_in_thread
from tests.factories import env, group
from trainer_client import TrainerClient
from trainer_client.arrays import GRPO_EPS


def test_grpo_advantages_are_computed_over_each_group_as_submitted() -> None:
    with serve_in_thread(Settings(store="memory://")) as url, httpx.Client(base_url=url) as http:
        rb = TrainerClient(http_client=http)
        rb.register(batch_size=8, max_token_len=64)
        http.get("/batch")
        env_id = http.post("/register-env", json=env("tools", group_size=8, variable_group_size=True)).json()["env_id"]
        survivors = [[1.0, 0.0, 0.0], [2.0, 0.0, 1.0, 1.0, 0.0]]  # groups of 8 that lost 5 and 3 rollouts
        for i, scores in enumerate(survivors):
            body = group(len(scores), length=6, env_id=env_id, seed=i, scores=scores, group_id=f"g{i}")
            assert http.post("/scored_data", json=body).status_code == 200
        batch = next(iter(rb.batches(wait=5)))
        assert batch.group_ids == ["g0", "g1"] and batch.n_seqs == 8
        expected = np.concatenate([(s - s.mean()) / (s.std() + GRPO_EPS) for s in map(np.array, survivors)])
        assert np.allclose(batch.grpo_advantages(), expected, atol=1e-4)
