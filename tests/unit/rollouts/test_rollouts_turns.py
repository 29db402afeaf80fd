"""A slot's turns as pure rules (api/rollouts/turns.py): a rollout cut into turns and a tail concatenates back to
itself; a turn's outcome against the slot's acknowledged ones (idempotent, in order); who holds a slot's turns;
what a turn stores reads back as itself."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.errors import InvalidData
from api.rollouts import groups as rg
from api.rollouts import turns as tn

ROLLOUT = st.integers(0, 40).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n),
        st.lists(st.sampled_from([-100, 1, 7]), min_size=n, max_size=n),
        st.one_of(st.none(), st.lists(st.floats(-20, 0), min_size=n, max_size=n)),
        st.one_of(st.none(), st.lists(st.integers(0, 9), min_size=n, max_size=n)),
        st.lists(st.integers(0, n), max_size=6),
    )
)


@given(ROLLOUT)
def test_a_rollout_cut_into_turns_concatenates_back_to_itself(rollout: tuple[Any, ...]) -> None:
    tokens, masks, logprobs, versions, cuts = rollout
    bounds = [0, *sorted(cuts), len(tokens)]
    pieces = [
        tn.TurnData(
            tokens[a:b],
            masks[a:b],
            None if logprobs is None else logprobs[a:b],
            None if versions is None else versions[a:b],
        )
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    whole = tn.concatenate(pieces)
    assert whole == tn.Joined(tokens, masks, logprobs if tokens else None, versions if tokens else None)
    assert all(tn.TurnData.decode(p.encode()) == p for p in pieces), "a turn reads back as itself"


def test_a_field_some_turns_sent_and_others_not_is_refused_naming_it() -> None:
    with_them = tn.TurnData([1], [1], [-0.5], None)
    without = tn.TurnData([2], [2], None, None)
    with pytest.raises(InvalidData) as refused:
        tn.concatenate([with_them, without])
    assert refused.value.loc == ("body", "inference_logprobs")
    empty = tn.TurnData([], [], None, None)
    assert tn.concatenate([with_them, empty]).inference_logprobs == [-0.5], "a turn without tokens has no say"


@given(st.lists(st.sampled_from("abc"), max_size=6), st.integers(0, 8), st.sampled_from("abcz"))
def test_a_turns_outcome_is_idempotent_and_in_order(stored: list[str], turn: int, digest: str) -> None:
    def outcome(digests: list[str]) -> str:  # as the turn route asks: the count, and that one turn's digest
        return tn.outcome(len(digests), digests[turn] if turn < len(digests) else None, turn, digest)

    got = outcome(stored)
    if turn < len(stored):
        assert got == (tn.DUPLICATE if stored[turn] == digest else tn.CONFLICT)
    else:
        assert got == (tn.ACCEPTED if turn == len(stored) else tn.GAP)
    if got == tn.ACCEPTED:
        assert outcome([*stored, digest]) == tn.DUPLICATE, "the same turn again, once in"


piece = st.builds(
    lambda n, lp, wv: tn.TurnData(list(range(n)), [1] * n, [-0.5] * n if lp else None, [0] * n if wv else None),
    st.integers(0, 3),
    st.booleans(),
    st.booleans(),
)


@given(st.lists(piece, min_size=1, max_size=6))
def test_the_fields_kept_as_turns_come_refuse_what_joining_them_refuses(pieces: list[tn.TurnData]) -> None:
    """`joined_fields`, turn by turn from the slot's summary, refuses a turn exactly where `concatenate` of the
    turns so far refuses them (naming the same field), and keeps the fields of the first turn with tokens."""
    fields = 0
    for i, p in enumerate(pieces):
        try:
            tn.concatenate(pieces[: i + 1])
        except InvalidData as joined:
            with pytest.raises(InvalidData) as kept:
                tn.joined_fields(fields, p)
            assert kept.value.loc == joined.loc
            return
        fields = tn.joined_fields(fields, p)
    first = next((p for p in pieces if p.tokens), None)
    assert (fields == 0) == (first is None)
    if first is not None:
        assert bool(fields & 2) == (first.inference_logprobs is not None)
        assert bool(fields & 4) == (first.token_weight_versions is not None)


def test_a_slots_turns_are_its_lease_holders_else_the_openers() -> None:
    g = rg.OpenGroup(key="g", env_id=0, group_size=2, min_group_size=2, deadline=10.0, producer="p1", expires_at=1.0)
    assert tn.holder(g, 0) == "p1"
    g.leases["0"] = ["p2", 5.0]
    assert (tn.holder(g, 0), tn.holder(g, 1)) == ("p2", "p1")


def test_a_turns_digest_is_of_its_content() -> None:
    a = tn.TurnData([1, 2], [1, 2], tool_results=[{"x": 1}], snapshot={"uri": "s3://x"})
    assert a.digest() == tn.TurnData([1, 2], [1, 2], None, None, [{"x": 1}], {"uri": "s3://x"}).digest()
    assert a.digest() != tn.TurnData([1, 2], [1, 2], tool_results=[{"x": 2}], snapshot={"uri": "s3://x"}).digest()
