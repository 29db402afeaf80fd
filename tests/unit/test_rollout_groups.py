"""The open group's pure logic (api/rollouts/groups.py), property-tested: whatever order rollouts arrive in and
whoever sends them, each slot keeps its first acknowledged rollout, a seal covers every slot exactly once (in the
group or left out with why), never seals fewer than `min_group_size`, waits before the deadline only while
incomplete, and only missing slots are leased out."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from api.rollouts import groups as rg

events = st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["p1", "p2", "p3"]), st.integers(0, 2)), max_size=40)


def group(size: int, least: int, scores_at_seal: bool = False) -> rg.OpenGroup:
    return rg.OpenGroup(key="g", env_id=0, group_size=size, min_group_size=least, deadline=100.0, producer="p1",
                        expires_at=10.0, scores_at_seal=scores_at_seal)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), st.data(), events, st.floats(0, 200), st.sets(st.integers(0, 7)), st.booleans())
def test_slots_keep_the_first_and_seals_cover_every_slot_once(
    size: int, data: st.DataObject, posts: list[tuple[int, str, int]], now: float, scored: set[int], at_seal: bool
) -> None:
    least = data.draw(st.integers(1, size))
    g = group(size, least, at_seal)
    acked: dict[int, tuple[str, str]] = {}
    for slot, producer, content in posts:
        if slot >= size:
            continue
        known = acked.get(slot)
        outcome = rg.post(g, slot, producer, known, f"c{content}")
        if known is None:
            assert outcome == rg.ACCEPTED
            acked[slot] = (producer, f"c{content}")
        elif known[1] == f"c{content}":
            assert outcome == rg.DUPLICATE
        else:
            assert outcome == (rg.CONFLICT if known[0] == producer else rg.REDONE)
    assert {int(s): p for s, p in g.done.items()} == {s: p for s, (p, _) in acked.items()}, "the first is kept"
    decision = rg.seal_decision(g, now, scored)
    if decision.wait:
        assert now < g.deadline and not (rg.complete(g) and not at_seal and scored >= set(acked))
    elif decision.expired is None:
        assert set(decision.slots) <= set(acked) and len(decision.slots) >= least
        assert set(decision.slots) | set(decision.left_out) == set(range(size))
        assert not set(decision.slots) & set(decision.left_out)
        assert set(decision.slots) <= scored and not at_seal
    else:
        assert now >= g.deadline
    by_producer = rg.seal_decision(g, now, set(), by_producer=True)
    assert by_producer.wait == (len(acked) < least)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.sets(st.integers(0, 7)), st.floats(0, 30), st.floats(0, 30))
def test_only_missing_slots_are_leased_and_only_once_the_holder_lapsed(
    size: int, done: set[int], now: float, lease_until: float
) -> None:
    g = group(size, 1)
    for s in done:
        if s < size:
            rg.post(g, s, "p1", None, "d")
    m = rg.missing(g, now)
    if now < g.expires_at:
        assert m == []
        return
    assert set(m) == set(range(size)) - {int(s) for s in g.done}
    rg.lease_slots(g, "p2", m, lease_until)
    assert g.redispatched == len(m)
    again = rg.missing(g, now)
    assert again == ([] if lease_until > now else m), "a live sibling lease is not handed out twice"
    assert rg.next_check(g) >= g.expires_at
