"""The trainer client's pure parts: retry predicate, error mapping, timeouts, backoff, reply parsing."""

from __future__ import annotations

import logging
import random

import httpx
import pytest
from pydantic import ValidationError

from api.wire.producers import WeightSyncReply
from api.wire.records import MSGPACK, encode_submission, encode_submission_list
from api.wire.schema import Info
from trainer_client.arrays import Batch, from_json
from trainer_client.errors import (
    BatchGone,
    NoProgress,
    NotRegistered,
    Rejected,
    ServerUnreachable,
    Unavailable,
    error_for,
    is_retryable,
)
from trainer_client.protocol import (
    BatchQuery,
    Cursor,
    DrainWait,
    Endpoint,
    Progress,
    Server,
    Waiting,
    batch_read_timeout,
    parse_batch_reply,
    poll_delay,
    registration,
)

ROLLBUF = Server(batch_size=1024, max_token_len=2048, rollbuf=True, binary=True)
ATROPOS = Server.from_info(Info(batch_size=1024, max_token_len=2048))


def reply(status: int, **kw: object) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("GET", "http://x/batch"), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (httpx.ConnectError("refused"), True),
        (httpx.ReadTimeout("slow"), True),
        (httpx.RemoteProtocolError("peer closed"), True),
        (httpx.UnsupportedProtocol("ftp://"), False),
        (error_for(reply(503, headers={"Retry-After": "2"})), True),
        (error_for(reply(429)), True),
        (error_for(reply(500)), True),
        (error_for(reply(422, json={"detail": [{"loc": ["body"], "msg": "bad"}]})), False),
        (error_for(reply(410, json={"detail": "gone"}), step=3), False),
        (NotRegistered("register"), False),
        (ServerUnreachable("http://x", 3, httpx.ConnectError("refused")), False),
        (ValueError("bug"), False),
    ],
)
def test_is_retryable(exc: BaseException, retry: bool) -> None:
    assert is_retryable(exc) is retry


def test_error_for_maps_status_and_keeps_the_detail() -> None:
    gone = error_for(reply(410, json={"detail": "batch 3 is no longer available", "code": "gone"}), step=3)
    assert isinstance(gone, BatchGone) and gone.step == 3 and gone.code == "gone" and "no longer" in str(gone)
    busy = error_for(reply(503, json={"detail": "queue full"}, headers={"Retry-After": "4"}))
    assert isinstance(busy, Unavailable) and busy.retry_after == 4.0 and busy.status == 503
    bad = error_for(reply(409, text="not json"))
    assert isinstance(bad, Rejected) and bad.detail == "not json" and bad.retry_after is None


def test_read_timeout_is_sized_to_the_batch_and_the_wait() -> None:
    small = Server(batch_size=8, max_token_len=512, rollbuf=True, binary=True)
    assert batch_read_timeout(small, wait=0, binary=True) < batch_read_timeout(ROLLBUF, wait=0, binary=True)
    assert batch_read_timeout(ROLLBUF, wait=30, binary=True) == pytest.approx(
        batch_read_timeout(ROLLBUF, wait=0, binary=True) + 30
    )
    json_s = batch_read_timeout(ATROPOS, wait=0, binary=False)
    assert json_s > 40  # Atropos needs ~19 s for 1024 x 2048 tokens: never the example trainer's 10 s


def test_poll_delay_grows_with_jitter_and_a_cap() -> None:
    rng = random.Random(0)
    delays = [[poll_delay(a, base=0.5, cap=8.0, rng=rng) for _ in range(200)] for a in range(8)]
    for attempt, ds in enumerate(delays):
        ceiling = min(8.0, 0.5 * 2**attempt)
        assert all(ceiling / 2 <= d <= ceiling for d in ds)
        assert len(set(ds)) > 100  # jittered: trainers do not poll in step
    assert poll_delay(10_000) <= 10.0


def test_query_against_rollbuf_and_atropos() -> None:
    timeout = httpx.Timeout(5.0)
    q = BatchQuery.make(ROLLBUF, wait=30, rank=1, world_size=4, encoding="msgpack", balance="tokens", timeout=timeout)
    assert q.params(7) == {"wait": 30, "step": 7, "rank": 1, "world_size": 4, "balance": "tokens"}
    assert q.headers() == {"Accept": MSGPACK} and q.long_poll and q.timeout.read == pytest.approx(30 + 15 + 0.42, 0.01)
    a = BatchQuery.make(
        ATROPOS, wait=30, rank=None, world_size=None, encoding="msgpack", balance="tokens", timeout=timeout
    )
    assert a.params(7) == {} and a.headers() == {"Accept": "application/json"} and not a.long_poll
    with pytest.raises(ValueError, match="rank shares need a rollbuf server"):
        BatchQuery.make(ATROPOS, wait=0, rank=0, world_size=2, encoding="json", balance="tokens", timeout=timeout)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        BatchQuery.make(ROLLBUF, wait=0, rank=2, world_size=2, encoding="json", balance="tokens", timeout=timeout)


def test_parse_batch_reply() -> None:
    body = encode_submission_list([encode_submission([[1, 2], [3]], [[-100, 2], [3]], [1.0, 0.0], policy_step=4)])
    got = parse_batch_reply(reply(200, content=body, headers={"Content-Type": MSGPACK, "X-Rollbuf-Step": "9"}), 9)
    assert isinstance(got, Batch) and got.step == 9 and got.tokens.tolist() == [1, 2, 3]
    assert parse_batch_reply(reply(200, json={"batch": None, "blocked_reason": "x"}), 9) == Waiting("x")
    assert parse_batch_reply(reply(200, json={"batch": None}), None) == Waiting(None)
    with pytest.raises(NotRegistered, match="Call /register"):
        parse_batch_reply(reply(200, json={"status": "error", "message": "Call /register first.", "batch": []}), 0)
    with pytest.raises(BatchGone):
        parse_batch_reply(reply(410, json={"detail": "gone"}), 2)


def test_registration_defaults_and_unknown_fields() -> None:
    body = registration(batch_size=8, max_token_len=64, starting_step=0, max_staleness=2)
    assert body["max_staleness"] == 2 and body["wandb_group"] == "rollbuf" and "min_batch_fill" not in body
    with pytest.raises(TypeError, match="unknown registration fields"):
        registration(batch_size=8, max_token_len=64, starting_step=0, bach_size=3)


def test_a_reuse_policy_is_sent_as_given_and_none_is_sent_without_one() -> None:
    """A trainer that asks for no reuse sends nothing new (an Atropos server sees only its own fields)."""
    assert "reuse" not in registration(batch_size=8, max_token_len=64, starting_step=0)
    body = registration(batch_size=8, max_token_len=64, starting_step=0, reuse={"max_served": 2, "order": "spread"})
    assert body["reuse"] == {"max_served": 2, "order": "spread"}
    with pytest.raises(ValidationError, match="reuse.max_served"):
        registration(batch_size=8, max_token_len=64, starting_step=0, reuse={"max_served": 0})


def test_progress_says_what_it_waits_for(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    progress = Progress(clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="trainer_client"):
        for t in (0.0, 10.0, 31.0, 40.0):
            now[0] = t
            progress.waiting(5, "long-poll 30 s", Waiting("env 'math' holds back"))
    assert [r.getMessage() for r in caplog.records] == [
        "waiting for batch 5 (long-poll 30 s): env 'math' holds back",
        "still waiting for batch 5 after 31 s: env 'math' holds back",
    ]


def test_the_no_progress_clock_runs_on_stalls_said_since_the_trainer_last_moved() -> None:
    """A stall in the reply to a request sent before the trainer announced weights was judged before it: it stops
    the clock; the first stall said since starts it again, and a move after the clock started restarts it."""
    now, moves = [0.0], [0]
    cursor = Cursor(
        BatchQuery.make(
            ROLLBUF,
            wait=30,
            rank=None,
            world_size=None,
            encoding="msgpack",
            balance="tokens",
            timeout=httpx.Timeout(30),
        ),
        step=3,
        progress=Progress(clock=lambda: now[0]),
        moves=lambda: moves[0],
    )
    held = Waiting(stall="every live producer is held back waiting for the trainer: p on h: math_0 held back")

    def poll(sent: float, answered: float, move_while_asked: bool = False) -> None:
        now[0] = sent
        cursor.request()
        if move_while_asked:
            moves[0] += 1  # the trainer announced weights (another thread) while this long-poll waited
        now[0] = answered
        cursor.receive(held)

    poll(0.0, 0.0)  # the clock starts
    poll(100.0, 650.0, move_while_asked=True)  # 650 s after the first stall, but said before the move
    poll(700.0, 700.0)  # the clock starts again
    poll(800.0, 800.0)
    moves[0] += 1  # announced after that reply came
    poll(900.0, 900.0)  # the clock starts again
    poll(1450.0, 1450.0)  # 750 s after 700, 550 after 900
    with pytest.raises(NoProgress) as exc:
        poll(1500.0, 1500.0)
    assert exc.value.waited == 600.0


def test_cursor_moves_on_with_each_batch_and_backs_off_only_when_polling() -> None:
    batch = from_json([{"tokens": [[1, 2]], "masks": [[-100, 2]], "scores": [1.0]}], step=4)
    long_poll = Cursor(
        BatchQuery.make(
            ROLLBUF,
            wait=30,
            rank=None,
            world_size=None,
            encoding="msgpack",
            balance="tokens",
            timeout=httpx.Timeout(30),
        ),
        step=4,
    )
    assert long_poll.request()["step"] == 4 and long_poll.request()["params"]["step"] == 4
    assert long_poll.receive(Waiting()) is None and long_poll.pause() == 0.0 and long_poll.step == 4
    assert long_poll.receive(batch) is batch and long_poll.step == 5
    polling = Cursor(
        BatchQuery.make(
            ATROPOS, wait=30, rank=None, world_size=None, encoding="json", balance="tokens", timeout=httpx.Timeout(30)
        ),
        step=None,
    )
    assert polling.request()["params"] == {} and polling.receive(Waiting()) is None
    waits = [polling.pause() for _ in range(6)]
    assert all(w > 0 for w in waits) and max(waits) <= 10.0
    polling.receive(batch)
    assert polling.step is None and polling.pause() <= 0.5  # a batch resets the backoff


def test_a_request_that_used_its_whole_timeout_is_still_retried() -> None:
    """The retry deadline counts from the end of the first try's read timeout: a /batch sized to wait 87 s
    keeps the whole 120 s budget after it, instead of none."""
    endpoint = Endpoint.make(None, "", 30.0, None, retry_deadline=120.0, tries=None)
    read = batch_read_timeout(ROLLBUF, wait=30, binary=False)
    assert read > 60
    assert endpoint.retry_for(httpx.Timeout(30.0, read=read)).deadline == pytest.approx(120.0 + read)
    assert endpoint.retry_for(None).deadline == 120.0


def test_a_drain_wait_says_who_it_waits_for_then_ends_drained_replaced_or_timed_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def reply(pending: int | None, waiting: list[str]) -> WeightSyncReply:
        return WeightSyncReply(weights_step=2, pending_step=pending, waiting_on=waiting, drained=not waiting)

    caplog.set_level(logging.INFO, "trainer_client")
    wait = DrainWait(3, timeout=10.0, started=0.0)
    assert wait.verdict(reply(3, ["p on h"]), 0.0) == "wait"
    assert wait.verdict(reply(3, ["p on h"]), 1.0) == "wait"  # logged at once, then every 5 s
    assert sum("waits for 1 producer(s) to drain" in r.message and "p on h" in r.message for r in caplog.records) == 1
    assert wait.verdict(reply(3, []), 2.0) == "drained"
    assert "every drain producer drained after 2.0 s" in caplog.text
    assert DrainWait(3, 10.0, 0.0).verdict(reply(None, []), 0.0) == "drained"  # announced already: a retry
    assert DrainWait(3, 10.0, 0.0).verdict(reply(4, ["p on h"]), 0.0) == "drained"  # a newer sync replaced it
    assert DrainWait(3, 10.0, 0.0).verdict(reply(3, ["p on h"]), 10.0) == "timeout"
    assert "p on h not drained after 10 s; syncing without them" in caplog.text
    assert DrainWait(3, None, 0.0).verdict(reply(3, ["p on h"]), 1e9) == "wait"
