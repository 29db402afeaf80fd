"""The turn requests a worker sends the runner (rollout_client/workers/turns.py) are read totally: any message
either is a well-formed request or raises ProtocolError (the pool then kills the worker), never anything else."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from rollout_client.episodes import TurnPiece
from rollout_client.workers.turns import CLOSE, FLUSH, TURN, ProtocolError, request

PIECE = TurnPiece(0, [1], [1], [-0.5], None, [], None)
fields = st.one_of(
    st.integers(), st.booleans(), st.text(max_size=4), st.none(), st.just(PIECE), st.floats(), st.binary(max_size=4)
)


@given(st.sampled_from([TURN, FLUSH, CLOSE]), st.lists(fields, max_size=4))
def test_a_turn_request_parses_or_is_refused_as_out_of_protocol(kind: str, rest: list[Any]) -> None:
    msg = (kind, *rest)
    try:
        got_kind, job, piece = request(msg)
    except ProtocolError:
        return
    assert got_kind == kind and type(job) is int
    assert (piece is PIECE) == (kind == TURN) and msg == (kind, job, *([piece] if kind == TURN else []))


def test_what_a_worker_sends_for_its_turns_parses() -> None:
    assert request((TURN, 3, PIECE)) == (TURN, 3, PIECE)
    assert request((FLUSH, 3)) == (FLUSH, 3, None)
    assert request((CLOSE, 0)) == (CLOSE, 0, None)
    for bad in [(TURN, True, PIECE), (TURN, 3), (FLUSH, "3"), (CLOSE, 1, 2), (TURN, 3, {"tokens": []})]:
        try:
            request(bad)
        except ProtocolError:
            continue
        raise AssertionError(f"{bad!r} was taken")
