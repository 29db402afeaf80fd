"""The trainers that read Atropos's /batch today, replayed over HTTP against a real `rollbuf serve`.

Each test does what one consumer does, in its order and with its assumptions, on our own fixtures, so that a
change that would break one of them fails here. Sources read for the replays (the search index's copies):

- Atropos's example trainer: NousResearch/atropos `example_trainer/api.py` (`check_atropos_api`,
  `register_trainer`, `get_batch`) and `example_trainer/data.py` (`get_data`, `pad_data_to_good_offset`).
- Tinker-Atropos: arvindcr4/tinker-atropos `tinker_atropos/trainer.py` (`get_batch`,
  `_validate_distil_field`, advantages zeroed where `inference_logprobs == 1.0`) and
  `tinker_atropos/training/data_processing.py` (`item["overrides"]`, `set_advantage_to_zero`).
- verl's Atropos recipe: volcengine/verl `recipe/atropos/main_atropos.py` (`_test_api_connectivity`: GET /status
  must be 200; `_register_with_atropos_api`: `response.json()["uuid"]`; `_retrieve_batch_with_retry`:
  `batch_data.get("batch", [])`, `"advantages" in item`).
- The Axolotl Atropos plugin and Nous's torchtitan GRPO trainer: their batch-reading code was not in the
  index; these replays follow their reported behaviour (Axolotl indexes `item["overrides"]` and takes
  the prompt length as the common prefix of a group's tokens; torchtitan trains on masks with -100 as the
  ignore index, and one rank fetches each batch and broadcasts it).

Shared promises: every batch item carries all 14 ScoredData keys (null when not sent), and `/batch` answers
`{"batch": null}` when nothing is ready.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from api.wire.schema import SCORED_DATA_KEYS
from tests.servers import ServerProcess, running_server

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("consumers")]  # one worker: one module-scoped server

MASK_IGNORE = -100


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("consumers") / "server.log"
    with running_server("memory://", log) as server:
        yield server


@pytest.fixture
def url(server: ServerProcess) -> Iterator[str]:
    httpx.get(server.url + "/reset_data").raise_for_status()
    yield server.url
    httpx.get(server.url + "/reset_data").raise_for_status()


def atropos_registration(batch_size: int, max_token_len: int = 256) -> dict[str, Any]:
    """The body Atropos-style trainers post (all eight fields, as Atropos requires)."""
    return {
        "wandb_group": "",
        "wandb_project": "",
        "batch_size": batch_size,
        "max_token_len": max_token_len,
        "starting_step": 0,
        "checkpoint_dir": "ckpt",
        "save_checkpoint_interval": 10,
        "num_steps": 100,
    }


class Handler:
    """An Atropos rollout handler: registers once the trainer has started, posts groups (gzipped at 1 KiB
    and more, as Atropos's BaseEnv does), with -100 over the prompt and the token ids over the completion."""

    def __init__(self, url: str, name: str, group_size: int) -> None:
        self.client = httpx.Client(base_url=url)
        reply = self.client.post(
            "/register-env",
            json={"max_token_length": 256, "desired_name": name, "weight": 1.0, "group_size": group_size},
        ).json()
        assert reply["status"] == "success", reply
        self.env_id: int = reply["env_id"]

    def __enter__(self) -> Handler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()

    def post(self, group: dict[str, Any]) -> None:
        body = json.dumps({**group, "env_id": self.env_id}).encode()
        headers = {"Content-Type": "application/json"}
        if len(body) >= 1024:
            body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
        r = self.client.post("/scored_data", content=body, headers=headers)
        assert r.status_code == 200, r.text


def make_group(prompt: list[int], completions: list[list[int]], **fields: Any) -> dict[str, Any]:
    """G sequences sharing one prompt; inference_logprobs has Atropos's 1.0 sentinel on the prompt."""
    tokens = [prompt + c for c in completions]
    masks = [[MASK_IGNORE] * len(prompt) + c for c in completions]
    logprobs = [[1.0] * len(prompt) + [-0.25 - 0.5 * j for j in range(len(c))] for c in completions]
    scores = [float(i % 2) for i in range(len(completions))]
    return {"tokens": tokens, "masks": masks, "scores": scores, "inference_logprobs": logprobs, **fields}


def poll_until_batch(client: httpx.Client, tries: int = 50) -> dict[str, Any]:
    """The consumers' loop: GET /batch until `batch` is not null (bounded here; each answer is immediate)."""
    for _ in range(tries):
        data: dict[str, Any] = client.get("/batch", timeout=10).json()
        assert data.get("status") != "error", data
        if data["batch"] is not None:
            return data
    raise AssertionError("no batch")


def assert_atropos_items(batch: list[dict[str, Any]]) -> None:
    for item in batch:
        assert set(SCORED_DATA_KEYS) <= set(item), sorted(set(SCORED_DATA_KEYS) - set(item))


def test_atropos_example_trainer(url: str) -> None:
    """NousResearch/atropos example_trainer: GET /info until 200, POST /register (batch_size = per-device
    batch x gradient accumulation; `raise_for_status`, then `"uuid" in data`), GET /batch raising on
    `status == "error"` and polling until `batch` is not null; then `pad_data_to_good_offset` reads `scores`,
    `overrides` (`is not None`, `set_advantage_to_zero`), `masks[i]`, `"inference_logprobs" in item`, and the
    temperature from `overrides[i]`, else `generation_params`, else `group_overrides`, else 1.0."""
    with httpx.Client(base_url=url) as trainer:
        assert trainer.get("/info").status_code == 200  # check_atropos_api, before anything
        # get_batch before /register: the in-band error the example trainer raises on
        early = trainer.get("/batch").json()
        assert early["status"] == "error" and "message" in early
        r = trainer.post("/register", json=atropos_registration(batch_size=4 * 2))
        r.raise_for_status()
        assert "uuid" in r.json() and isinstance(r.json()["uuid"], int)
        assert trainer.get("/batch").json() == {"batch": None}  # nothing ready: null, not an error

        prompt = [11, 12, 13]
        with Handler(url, "math", group_size=4) as env:
            env.post(
                make_group(
                    prompt,
                    [[20], [21, 22], [23], [24, 25]],
                    overrides=[{"temperature": 0.5}, {}, {}, {}],
                    generation_params={"temperature": 0.7},
                )
            )
            env.post(
                make_group(
                    prompt,
                    [[30], [31], [32], [33]],
                    group_overrides={"temperature": 0.9},
                    overrides=[{"set_advantage_to_zero": True}, {}, {}, {}],
                )
            )

        data = poll_until_batch(trainer)
    batch = data["batch"]
    assert_atropos_items(batch)
    assert sum(len(item["tokens"]) for item in batch) == 8
    temperatures, zeroed = [], []
    for item in batch:  # pad_data_to_good_offset, as far as it touches the wire format
        scores = np.array(item["scores"])
        if len(scores) > 1:
            scores = (scores - scores.mean()) / max(scores.std(), 1e-8)
        if item["overrides"] is not None:
            for i in range(len(item["overrides"])):
                if item["overrides"][i].get("set_advantage_to_zero", False):
                    scores[i] = 0
                    zeroed.append(i)
        for i in range(len(item["tokens"])):
            labels = np.array(item["masks"][i])
            assert labels.shape == (len(item["tokens"][i]),)
            assert "inference_logprobs" in item and len(item["inference_logprobs"][i]) == len(item["tokens"][i])
            t = 1.0
            if item.get("overrides") and i < len(item["overrides"]) and "temperature" in item["overrides"][i]:
                t = float(item["overrides"][i]["temperature"])
            elif item.get("generation_params") and "temperature" in item["generation_params"]:
                t = float(item["generation_params"]["temperature"])
            elif item.get("group_overrides") and "temperature" in item["group_overrides"]:
                t = float(item["group_overrides"]["temperature"])
            temperatures.append(t)
    assert sorted(temperatures) == sorted([0.5, 0.7, 0.7, 0.7, 0.9, 0.9, 0.9, 0.9])
    assert zeroed == [0]


def test_axolotl_atropos_plugin(url: str) -> None:
    """Axolotl's Atropos plugin (as reported): `item["overrides"]` indexed directly, so the key must
    be there even when a handler sent none, and the prompt length taken as the common prefix of the group's
    token lists: the server must keep each group whole and each sequence's tokens in order."""
    with httpx.Client(base_url=url) as trainer:
        trainer.post("/register", json=atropos_registration(batch_size=6)).raise_for_status()
        assert trainer.get("/batch").json() == {"batch": None}
        with Handler(url, "code", group_size=3) as env:
            env.post(make_group([5, 6, 7, 8], [[40, 41], [42], [43, 44, 45]]))  # no overrides sent
            env.post(make_group([9, 9], [[50], [51], [52]], overrides=[{"a": 1}, {"a": 2}, {"a": 3}]))
        data = poll_until_batch(trainer)
    assert_atropos_items(data["batch"])
    seen = {}
    for item in data["batch"]:
        overrides = item["overrides"]  # a KeyError here would crash the plugin
        prefix = os.path.commonprefix(item["tokens"])
        seen[len(prefix)] = overrides
    assert seen == {4: None, 2: [{"a": 1}, {"a": 2}, {"a": 3}]}


def test_tinker_atropos(url: str) -> None:
    """Tinker-Atropos: `item["inference_logprobs"][i]` indexed directly (required), 1.0 marking prompt
    positions whose advantage it zeroes; `distill_token_ids` / `distill_logprobs` shaped [seq][pos][K]
    (`_validate_distil_field`: one [K] list per position); `overrides` checked with `is not None`."""
    k = 2
    prompt, completions = [1, 2], [[3, 4], [5, 6, 7]]
    lengths = [len(prompt) + len(c) for c in completions]
    distill_ids = [[[t, t + 1] for t in range(n)] for n in lengths]
    distill_lps = [[[-0.5, -1.5] for _ in range(n)] for n in lengths]
    with httpx.Client(base_url=url) as trainer:
        trainer.post("/register", json=atropos_registration(batch_size=2)).raise_for_status()
        trainer.get("/batch")
        with Handler(url, "distill", group_size=2) as env:
            sent = make_group(prompt, completions, distill_token_ids=distill_ids, distill_logprobs=distill_lps)
            env.post(sent)
        [item] = poll_until_batch(trainer)["batch"]
    assert_atropos_items([item])
    assert item["overrides"] is None
    for i, tokens in enumerate(item["tokens"]):
        logprobs = item["inference_logprobs"][i]
        assert len(logprobs) == len(tokens)
        advantages = [0.0 if lp == 1.0 else 1.0 for lp in logprobs]
        assert advantages == [0.0] * len(prompt) + [1.0] * len(completions[i])  # the sentinel survives exactly
        for field in ("distill_token_ids", "distill_logprobs"):
            rows = item[field][i]
            assert len(rows) == len(tokens) and all(len(pos) == k for pos in rows)
    assert item["distill_token_ids"] == distill_ids and item["distill_logprobs"] == distill_lps
    assert item["inference_logprobs"] == sent["inference_logprobs"]


def test_torchtitan_grpo_one_rank_fetches_and_broadcasts(url: str) -> None:
    """Nous's torchtitan GRPO (as reported): rank 0 alone polls /batch and broadcasts the reply
    (a pickled object, as `broadcast_object_list` sends it) to the other ranks, each of which trains on its
    part with -100 as the loss's ignore index. So the server must hand out each batch once, to one poller,
    advance the step once per batch, and serve masks with -100 exactly where the handler put them."""
    world = 4
    with httpx.Client(base_url=url) as rank0:
        rank0.post("/register", json=atropos_registration(batch_size=8)).raise_for_status()
        rank0.get("/batch")
        with Handler(url, "titan", group_size=4) as env:
            for g in range(4):
                env.post(make_group([100 + g, 101], [[1], [2, 3], [4], [5, 6]]))
        steps = []
        broadcast = []
        for _ in range(2):
            reply = rank0.get("/batch")
            data = reply.json()
            assert data["batch"] is not None
            steps.append(int(reply.headers["X-Rollbuf-Step"]))
            broadcast.append(pickle.loads(pickle.dumps(data)))  # what every rank receives
        assert rank0.get("/batch").json() == {"batch": None}  # nothing served twice
        assert rank0.get("/status").json()["current_step"] == 2
    assert steps == [0, 1]
    for data in broadcast:
        sequences = [(t, m) for item in data["batch"] for t, m in zip(item["tokens"], item["masks"], strict=True)]
        assert len(sequences) == 8
        for rank in range(world):
            for tokens, masks in sequences[rank::world]:
                labels = np.array(masks)
                trained = labels != MASK_IGNORE
                assert (labels[:2] == MASK_IGNORE).all() and trained.sum() == len(tokens) - 2
                assert (labels[trained] == np.array(tokens)[trained]).all()


def test_verl_atropos_recipe(url: str, tmp_path: Path) -> None:
    """verl's Atropos recipe: GET /status must answer 200 before any data or registration; /register's reply
    is read as `response.json()["uuid"]`; `/batch` is read as `batch_data.get("batch", [])` (a null batch is
    falsy: poll again), and `"advantages" in item` decides whether token advantages are present."""
    with httpx.Client(base_url=url) as trainer:
        status = trainer.get("/status")
        assert status.status_code == 200
        assert status.json()["current_step"] == 0 and status.json()["queue_size"] == 0
        # The recipe's own body leaves out fields Atropos requires; it posts what Atropos needs here.
        uuid = trainer.post("/register", json=atropos_registration(batch_size=2)).json()["uuid"]
        assert isinstance(uuid, int)
        assert not trainer.get("/batch").json().get("batch", [])
        with Handler(url, "verl", group_size=2) as env:
            group = make_group([7, 8], [[9, 10], [11, 12]])
            group["advantages"] = [[0.0, 0.0, 0.5, 0.5], [0.0, 0.0, -0.5, -0.5]]
            env.post(group)
        batch = poll_until_batch(trainer).get("batch", [])
    assert_atropos_items(batch)
    advantages = [item["advantages"] for item in batch if "advantages" in item]
    assert advantages == [group["advantages"]]


def test_boolean_masks_as_verl_sends_them(url: str) -> None:
    """verl's recipe posts `masks` as booleans (`[True] * n`); Atropos's lax validation takes them as 1/0, and
    so does rollbuf (the one coercion a known client relies on; docs/atropos-differences.md)."""
    with httpx.Client(base_url=url) as trainer:
        trainer.post("/register", json=atropos_registration(batch_size=2)).raise_for_status()
        trainer.get("/batch")
        with Handler(url, "bools", group_size=2) as env:
            env.post({"tokens": [[1, 2], [3, 4]], "masks": [[False, True], [False, True]], "scores": [1.0, 0.0]})
        [item] = poll_until_batch(trainer)["batch"]
    assert item["masks"] == [[0, 1], [0, 1]]
