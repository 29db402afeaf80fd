"""TrainerClient against the app served by uvicorn in a thread on loopback (both stores), AsyncTrainerClient
against the app in-process, and the Atropos fallback and retries against httpx.MockTransport fakes."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from api.app import create_app
from api.config.settings import Settings
from api.wire.records import MSGPACK, encode_submission, encode_submission_list
from client_core import outage
from tests.factories import env, group
from tests.servers import free_port
from trainer_client import (
    AsyncTrainerClient,
    Batch,
    BatchGone,
    NoProgress,
    NotRegistered,
    Rejected,
    ServerUnreachable,
    TrainerClient,
)

BIN = {"Content-Type": MSGPACK}


@contextmanager
def serve_in_thread(settings: Settings) -> Iterator[str]:
    """The app behind a real uvicorn server in a thread on a free loopback port; yields its URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)  # polling interval while waiting for readiness
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def http(settings: Settings) -> Iterator[httpx.Client]:
    """An httpx.Client (httpx's own transport) on the app served in a thread."""
    with serve_in_thread(settings) as url, httpx.Client(base_url=url) as c:
        yield c


def submit(http: httpx.Client, n_groups: int, *, first: int = 0, size: int = 4) -> None:
    """Groups of `size` sequences without an env (accepted as soon as a trainer registered)."""
    body = encode_submission_list(
        encode_submission(
            **group(size, length=[5 + i % 7 for i in range(size)], env_id=None, seed=g), group_id=f"g{g}", policy_step=0
        )
        for g in range(first, first + n_groups)
    )
    assert http.post("/scored_data_list", content=body, headers=BIN).status_code == 200


def take(client: TrainerClient, n: int, **kw: Any) -> list[Batch]:
    return list(itertools.islice(client.batches(wait=0, **kw), n))


def test_register_and_iterate(http: httpx.Client) -> None:
    rb = TrainerClient(http_client=http)
    rb.register(batch_size=8, max_token_len=64)
    assert rb.info().batch_size == 8 and MSGPACK in (rb.info().content_types or [])
    submit(http, 4)
    b0, b1 = take(rb, 2)
    assert (b0.step, b1.step) == (0, 1)
    assert b0.group_ids + b1.group_ids == ["g0", "g1", "g2", "g3"]
    assert b0.n_seqs == 8 and b0.lengths.tolist() == [5, 6, 7, 8] * 2
    assert rb.status().current_step == 2


def test_json_and_binary_batches_are_equal(http: httpx.Client) -> None:
    rb = TrainerClient(http_client=http)
    rb.register(batch_size=8, max_token_len=64)
    submit(http, 2)
    [binary] = take(rb, 1, start_step=0, encoding="msgpack")
    [json] = take(rb, 1, start_step=0, encoding="json")  # batch 0 again: 1 was not asked for
    for name in ("tokens", "masks", "offsets", "scores", "group_index", "env_ids", "policy_steps", "advantages"):
        assert getattr(binary, name).tolist() == getattr(json, name).tolist(), name
    assert binary.floats["inference_logprobs"].tolist() == json.floats["inference_logprobs"].tolist()


def test_restart_at_step_n_gets_n_again_then_earlier_steps_are_gone(http: httpx.Client) -> None:
    rb = TrainerClient(http_client=http)
    rb.register(batch_size=8, max_token_len=64)
    submit(http, 6)
    first_run = take(rb, 2)  # trained on 0, crashed while training 1
    restarted = TrainerClient(http_client=http)
    again, following = take(restarted, 2, start_step=1)
    assert again.step == 1 and again.group_ids == first_run[1].group_ids
    assert following.step == 2 and following.group_ids == ["g4", "g5"]
    with pytest.raises(BatchGone) as gone:
        take(restarted, 1, start_step=1)  # asking for 2 acknowledged 1
    assert gone.value.step == 1 and gone.value.status == 410
    with pytest.raises(Rejected, match="next batch to form is 3"):
        take(restarted, 1, start_step=9)


def test_commit_mode_reads_ahead_resumes_from_the_commit_and_waits_at_the_bound(settings: Settings) -> None:
    with (
        serve_in_thread(settings.model_copy(update={"max_read_ahead_batches": 3})) as url,
        httpx.Client(base_url=url) as http,
    ):
        rb = TrainerClient(http_client=http)
        rb.register(batch_size=8, max_token_len=64, acknowledge="commit")
        submit(http, 10)
        first = take(rb, 3)  # a loader that read three ahead of training
        assert rb.commit(1).committed_step == 1  # the checkpoint after batch 0
        restarted = take(TrainerClient(http_client=http), 3, start_step=1)  # a crash: resume at the checkpoint
        assert [b.group_ids for b in restarted[:2]] == [b.group_ids for b in first[1:]]  # served again
        assert restarted[2].step == 3
        with pytest.raises(BatchGone):
            take(rb, 1, start_step=0)
        batches = TrainerClient(http_client=http).batches(start_step=4, wait=0.5)
        got: list[Batch] = []
        reader = threading.Thread(target=lambda: got.append(next(batches)), daemon=True)
        reader.start()  # at the bound (steps 1-3 served, not committed): it waits, as for data
        reader.join(timeout=1.5)
        assert reader.is_alive() and not got
        reply = rb.commit(3)
        assert (reply.committed_step, reply.next_step, reply.kept_batches) == (3, 4, 1)
        reader.join(timeout=30)
        assert got and got[0].step == 4


def test_rank_shares_cover_every_sequence_once(http: httpx.Client) -> None:
    rb = TrainerClient(http_client=http)
    rb.register(batch_size=16, max_token_len=64)
    submit(http, 4)
    [whole] = take(rb, 1, start_step=0)
    seen: Counter[tuple[int, ...]] = Counter()
    for rank in range(3):
        [share] = take(TrainerClient(http_client=http), 1, start_step=0, rank=rank, world_size=3)
        seen.update(tuple(s.tolist()) for s in share.sequences())
        assert share.advantages.shape == share.tokens.shape
    assert seen == Counter(tuple(s.tolist()) for s in whole.sequences())


def test_not_registered(http: httpx.Client) -> None:
    with pytest.raises(NotRegistered):
        take(TrainerClient(http_client=http), 1)


def test_registration_conflict_is_rejected(http: httpx.Client) -> None:
    rb = TrainerClient(http_client=http)
    rb.register(batch_size=8, max_token_len=64)
    rb.register(batch_size=8, max_token_len=64)  # same run again: fine
    with pytest.raises(Rejected, match="batch_size") as exc:
        rb.register(batch_size=16, max_token_len=64)
    assert exc.value.status == 409


def test_a_trainer_told_nothing_can_arrive_logs_it_at_once_and_raises_after_no_progress_timeout(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    settings.producer_gone_after = 0.2  # a run nothing joined within it: a stall
    with serve_in_thread(settings) as url, httpx.Client(base_url=url) as http, TrainerClient(url) as rb:
        rb.register(batch_size=4, max_token_len=64)
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="trainer_client"), pytest.raises(NoProgress) as exc:
            take(rb, 1, no_progress_timeout=1.0)
        assert time.monotonic() - started < 10
        assert "no environment is registered and no producer has reported" in str(exc.value)
        warned = [r.getMessage() for r in caplog.records if "nothing can arrive" in r.getMessage()]
        assert len(warned) == 1 and "raising after 1 s" in warned[0]
        submit(http, 1)
        assert len(take(rb, 1, no_progress_timeout=0.0)) == 1  # data queued: no stall, whatever the bound


@pytest.mark.anyio
async def test_async_client_long_polls_until_data_arrives(settings: Settings) -> None:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            async with AsyncTrainerClient(http_client=http) as rb:
                await rb.register(batch_size=8, max_token_len=64)
                batches = rb.batches(wait=20)
                pending = asyncio.ensure_future(anext(batches))
                # environments may register once the trainer's first /batch arrived: then the poll is held
                while (await http.post("/register-env", json=env())).json()["status"] != "success":
                    await asyncio.sleep(0.01)  # polling interval
                assert not pending.done()
                for g in range(2):
                    body = encode_submission(**group(4, env_id=None, seed=g), group_id=f"a{g}")
                    assert (await http.post("/scored_data", content=body, headers=BIN)).status_code == 200
                batch = await pending
                assert batch.step == 0 and batch.group_ids == ["a0", "a1"]
                await batches.aclose()


@pytest.mark.anyio
async def test_the_async_iterator_ends_once_a_run_over_a_dataset_is_finished(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Three tasks of groups of 4 towards batches of 8: a batch of 8, the last smaller one of 4, then the server
    says the run is finished and `async for` ends on its own (docs/tasks.md, "The end of a dataset")."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            async with AsyncTrainerClient(http_client=http) as rb:
                await rb.register(batch_size=8, max_token_len=64)
                assert (await http.get("/batch")).json() == {"batch": None}
                assert (await http.post("/register-env", json=env())).json()["status"] == "success"
                tasks = {"name": "d", "tasks": [0, 1, 2]}
                assert (await http.post("/tasks/datasets", json=tasks)).status_code == 200
                leased = await http.post("/tasks/lease", json={"dataset": "d", "producer_id": "p", "n": 3})
                for i, x in enumerate(leased.json()["leases"]):
                    sent = await http.post("/scored_data", json=group(4, seed=i, group_id=x["token"]))
                    assert sent.status_code == 200, sent.text

                async def sizes() -> list[int]:
                    return [b.n_seqs async for b in rb.batches(start_step=0, wait=0)]

                with caplog.at_level("INFO", logger="trainer_client"):
                    assert await asyncio.wait_for(sizes(), 60) == [8, 4]  # a hang guard, not a speed check
                assert any("the run is finished, batch 2 will not come" in r.getMessage() for r in caplog.records)
                assert (await rb.status()).finished


# ------------------------------------------------------------------ fakes: an Atropos server, failures


def atropos_fake(log: list[httpx.Request], empty_polls: int) -> httpx.MockTransport:
    """A server without rollbuf's extensions: /info has no content_types, /batch ignores everything."""

    def handle(request: httpx.Request) -> httpx.Response:
        log.append(request)
        if request.url.path == "/info":
            return httpx.Response(200, json={"batch_size": 4, "max_token_len": 64})
        polls = sum(1 for r in log if r.url.path == "/batch")
        if polls <= empty_polls:
            return httpx.Response(200, json={"batch": None})
        return httpx.Response(200, json={"batch": [group(4, env_id=None, seed=polls)]})

    return httpx.MockTransport(handle)


def test_against_atropos_polls_plain_batch_over_json_with_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("trainer_client.client.time.sleep", slept.append)
    log: list[httpx.Request] = []
    with TrainerClient("http://atropos", http_client=httpx.Client(transport=atropos_fake(log, 3))) as rb:
        [batch] = list(itertools.islice(rb.batches(), 1))
    assert batch.step is None and batch.n_seqs == 4 and batch.policy_steps.tolist() == [-1] * 4
    polls = [r for r in log if r.url.path == "/batch"]
    assert len(polls) == 4 and all(not r.url.query and r.headers["accept"] == "application/json" for r in polls)
    assert len(slept) == 3 and slept[0] < slept[2]  # backing off between empty polls


def test_unreachable_after_n_tries() -> None:
    calls = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("connection refused", request=request)

    with TrainerClient("http://down", http_client=httpx.Client(transport=httpx.MockTransport(refuse)), tries=2) as rb:
        with pytest.raises(ServerUnreachable, match="unreachable after 2 tries") as exc:
            rb.status()
    assert len(calls) == 2 and exc.value.tries == 2


def flaky(refusals: int) -> Any:
    """A transport that refuses the first `refusals` connections, then answers /status."""
    calls = itertools.count()

    def handle(request: httpx.Request) -> httpx.Response:
        if next(calls) < refusals:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"current_step": 3, "queue_size": 0})

    return handle


def test_a_server_outage_is_logged_with_its_end(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retries are silent, so a client that did not log while the server does not answer would hide an outage.
    The trainer client tells an outage (here from its first refusal: AFTER_S 0) and its end."""
    monkeypatch.setattr(outage, "AFTER_S", 0.0)
    http = httpx.Client(transport=httpx.MockTransport(flaky(2)))
    with caplog.at_level(logging.WARNING), TrainerClient("http://down", http_client=http, tries=5) as rb:
        assert rb.status().current_step == 3
    lines = [r.getMessage() for r in caplog.records]
    assert sum("rollbuf server http://down unreachable for 0 s, retrying: GET /status" in m for m in lines) == 1
    assert sum("rollbuf server http://down reachable again after" in m for m in lines) == 1


@pytest.mark.anyio
async def test_the_async_client_logs_an_outage_and_its_end(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(outage, "AFTER_S", 0.0)
    http = httpx.AsyncClient(transport=httpx.MockTransport(flaky(2)))
    with caplog.at_level(logging.WARNING):
        async with AsyncTrainerClient("http://down", http_client=http, tries=5) as rb:
            assert (await rb.status()).current_step == 3
    lines = [r.getMessage() for r in caplog.records]
    assert sum("rollbuf server http://down unreachable for 0 s, retrying: GET /status" in m for m in lines) == 1
    assert sum("rollbuf server http://down reachable again after" in m for m in lines) == 1


def test_a_stall_said_before_the_trainer_announced_weights_does_not_raise_no_progress() -> None:
    """A long-poll that began before the trainer announced weights (from another thread) brings back a stall
    judged before the announcement: producers held back for the trainer may start again. Only a stall said of a
    request sent since counts: with no_progress_timeout 0, the second /batch raises, not the first."""
    polls: list[int] = []
    held = "every live producer is held back waiting for the trainer: p on h: math_0 held back (ahead_of_trainer)"

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/info":
            return httpx.Response(
                200, json={"batch_size": 4, "max_token_len": 64, "content_types": ["application/json"]}
            )
        if request.url.path == "/weights":
            return httpx.Response(200, json={"weights_step": 1})
        polls.append(1)
        if len(polls) == 1:
            rb.announce_weights(1)  # the trainer's other thread, while this long-poll waits
        return httpx.Response(200, json={"batch": None, "stall_reason": held})

    with TrainerClient("http://rb", http_client=httpx.Client(transport=httpx.MockTransport(handle))) as rb:
        with pytest.raises(NoProgress, match="held back"):
            next(rb.batches(start_step=0, no_progress_timeout=0.0))
    assert len(polls) == 2


def test_503_is_retried_after_retry_after() -> None:
    answers = iter([httpx.Response(503, json={"detail": "busy"}, headers={"Retry-After": "0"})] * 2)

    def handle(request: httpx.Request) -> httpx.Response:
        return next(answers, httpx.Response(200, json={"current_step": 3, "queue_size": 0}))

    with TrainerClient("http://busy", http_client=httpx.Client(transport=httpx.MockTransport(handle))) as rb:
        assert rb.status().current_step == 3


@pytest.mark.anyio
async def test_async_client_over_its_own_transport(settings: Settings) -> None:
    with serve_in_thread(settings) as url, httpx.Client(base_url=url) as http:
        async with AsyncTrainerClient(url) as rb:
            await rb.register(batch_size=8, max_token_len=64)
            submit(http, 4)
            batches = rb.batches(start_step=0, wait=0)
            first = await anext(batches)
            second = await anext(batches)
            await batches.aclose()
            assert (first.step, first.group_ids, second.step) == (0, ["g0", "g1"], 1)
            with pytest.raises(BatchGone):
                await anext(rb.batches(start_step=0))


def test_api_key_is_sent() -> None:
    with serve_in_thread(Settings(store="memory://", api_key="sekrit")) as url:
        with TrainerClient(url, api_key="sekrit") as rb:
            assert rb.register(batch_size=8, max_token_len=64).uuid >= 0
        with TrainerClient(url) as anonymous, pytest.raises(Rejected) as refused:
            anonymous.status()
        assert refused.value.status == 401 and refused.value.code == "unauthorized"


@pytest.mark.anyio
async def test_async_weight_sync_waits_for_a_live_drain_producer_within_its_bound_then_announces(
    settings: Settings,
) -> None:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            async with AsyncTrainerClient(http_client=http) as rb:
                await rb.register(batch_size=8, max_token_len=64)
                await rb.status()
                await http.get("/batch")
                env_id = (await http.post("/register-env", json=env())).json()["env_id"]
                beat = {"producer_id": "p", "host": "h", "env_ids": [env_id], "drains": True}
                await http.post("/producers/heartbeat", json=beat)
                async with rb.weight_sync(0, timeout=0.2) as drained:
                    assert (await rb.weight_sync_state()).waiting_on == ["p on h"]
                assert drained is False  # never drained: the sync went on after its bound
                state = await rb.weight_sync_state()
                assert (state.weights_step, state.pending_step) == (0, None)  # announced: the hold is over
