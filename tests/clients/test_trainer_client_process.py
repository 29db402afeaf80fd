"""TrainerClient against a real `rollbuf serve` process: long-poll over TCP, a restart of the trainer
and of the server mid-run, rank shares, BatchGone; and what a long-poll does when its client goes away."""

from __future__ import annotations

import itertools
import socket
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest

from api.wire.records import MSGPACK, encode_submission, encode_submission_list
from tests.factories import env, group, registration
from tests.servers import running_server, start_server
from trainer_client import Batch, BatchGone, TrainerClient

pytestmark = pytest.mark.integration

BIN = {"Content-Type": MSGPACK}


def submit(c: httpx.Client, ids: range, env_id: int = 0) -> None:
    body = encode_submission_list(
        encode_submission(**group(4, length=[6, 9, 12, 15], env_id=env_id, seed=g), group_id=f"g{g}") for g in ids
    )
    assert c.post("/scored_data_list", content=body, headers=BIN).status_code == 200


def wait_until_trainer_polls(c: httpx.Client) -> int:
    """Environments are told to wait until the trainer's first /batch arrives: a success means it did."""
    while True:
        reply = c.post("/register-env", json=env(group_size=4)).json()
        if reply["status"] == "success":
            return int(reply["env_id"])


def test_trainer_over_tcp_restarts_and_shares(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'buffer.db'}"
    server = start_server(store, tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=10) as c, TrainerClient(server.url) as rb:
            rb.register(batch_size=8, max_token_len=64)
            got: list[Batch] = []
            it = rb.batches(wait=20)
            consumer = threading.Thread(target=lambda: got.extend(itertools.islice(it, 2)))
            consumer.start()  # long-polls for batch 0 before any data exists
            env_id = wait_until_trainer_polls(c)
            submit(c, range(5), env_id)
            consumer.join(timeout=60)
            assert [b.step for b in got] == [0, 1] and got[1].group_ids == ["g2", "g3"]

        server.kill()  # kill -9 the server while batch 1 is being trained on, and the trainer restarts too
        server = start_server(store, tmp_path / "server.log", server.port)
        with httpx.Client(base_url=server.url, timeout=10) as c, TrainerClient(server.url) as rb:
            [again] = itertools.islice(rb.batches(start_step=1, wait=5), 1)
            assert again.group_ids == ["g2", "g3"] and again.tokens.tolist() == got[1].tokens.tolist()
            submit(c, range(5, 8), env_id)
            seen: Counter[tuple[int, ...]] = Counter()
            for rank in range(2):
                [share] = itertools.islice(rb.batches(start_step=2, rank=rank, world_size=2), 1)
                seen.update(tuple(s.tolist()) for s in share.sequences())
            [whole] = itertools.islice(rb.batches(start_step=2, encoding="json"), 1)
            assert whole.group_ids == ["g4", "g5"]
            assert seen == Counter(tuple(s.tolist()) for s in whole.sequences())
            with pytest.raises(BatchGone):
                next(rb.batches(start_step=0))
    finally:
        server.kill()


def test_long_poll_holds_nothing_up_and_a_gone_client_takes_no_batch(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log") as server, httpx.Client(base_url=server.url) as c:
        c.post("/register", json=registration(batch_size=8))
        held = socket.create_connection(("127.0.0.1", server.port))
        held.sendall(b"GET /batch?wait=50 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # plain /batch, as Atropos asks
        env_id = wait_until_trainer_polls(c)
        assert c.get("/status").json()["current_step"] == 0  # answered while the long-poll is held
        held.setblocking(False)
        with pytest.raises(BlockingIOError):
            held.recv(1)  # still held: no reply yet
        held.close()  # the trainer goes away
        submit(c, range(2), env_id)  # the held request wakes up here: it must not form a batch nobody reads
        batch = c.get("/batch").json()["batch"]
        assert [g["group_id"] for g in batch] == ["g0", "g1"]
