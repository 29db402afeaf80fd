"""The open group's pure logic (api/rollouts/groups.py), property-tested: whatever order rollouts arrive in and
whoever sends them, each slot keeps its first acknowledged rollout, a seal covers every slot exactly once (in the
group or left out with why), never seals fewer than `min_group_size`, waits before the deadline only while
incomplete, and only missing slots are leased out. Then the service's transactions over it (api/rollouts/txns.py)
in any order: the views' counters stay true through lapses, sweeps and pruning."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from api.config.settings import Settings
from api.errors import RollbufError
from api.owners import ANYONE
from api.rollouts import groups as rg
from api.rollouts import rows as rr
from api.rollouts import txns as rs
from api.run import state
from api.store.memory import MemoryTxn, State
from api.store.rollouts import LIVE, GroupRow, SlotRow
from api.wire.rollouts import OpenRequest, RolloutPost
from api.wire.schema import Registration
from tests.factories import registration

events = st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["p1", "p2", "p3"]), st.integers(0, 2)), max_size=40)


def group(size: int, least: int, scores_at_seal: bool = False) -> rg.OpenGroup:
    return rg.OpenGroup(
        key="g",
        env_id=0,
        group_size=size,
        min_group_size=least,
        deadline=100.0,
        producer="p1",
        expires_at=10.0,
        scores_at_seal=scores_at_seal,
    )


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
        outcome = rg.post(producer, known, f"c{content}")
        if known is None:
            assert outcome == rg.ACCEPTED
            acked[slot] = (producer, f"c{content}")
        elif known[1] == f"c{content}":
            assert outcome == rg.DUPLICATE
        else:
            assert outcome == (rg.CONFLICT if known[0] == producer else rg.REDONE)
    decision = rg.seal_decision(g, set(acked), now, scored)
    if decision.wait:
        assert now < g.deadline and not (len(acked) == size and not at_seal and scored >= set(acked))
    elif decision.expired is None:
        assert set(decision.slots) <= set(acked) and len(decision.slots) >= least
        assert set(decision.slots) | set(decision.left_out) == set(range(size))
        assert not set(decision.slots) & set(decision.left_out)
        assert set(decision.slots) <= scored and not at_seal
    else:
        assert now >= g.deadline
    by_producer = rg.seal_decision(g, set(acked), now, set(), by_producer=True)
    assert by_producer.wait == (len(acked) < least)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.sets(st.integers(0, 7)), st.floats(0, 30), st.floats(0, 30))
def test_only_missing_slots_are_leased_and_only_once_the_holder_lapsed(
    size: int, done: set[int], now: float, lease_until: float
) -> None:
    g = group(size, 1)
    done = {s for s in done if s < size}
    m = rg.missing(g, done, now)
    if now < g.expires_at:
        assert m == []
        return
    assert set(m) == set(range(size)) - done
    rg.lease_slots(g, "p2", m, lease_until)
    assert g.redispatched == len(m)
    again = rg.missing(g, done, now)
    assert again == ([] if lease_until > now else m), "a live sibling lease is not handed out twice"
    assert rg.next_check(g, len(done)) >= g.expires_at
    rg.settle(g, set(m[:1]))  # a leased slot in since (a post leaves the record): its lease ends
    assert set(g.leases) == {str(s) for s in m[1:]}


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.integers(0, 2), st.floats(0.5, 6)),
        st.tuples(st.just("post"), st.integers(0, 2), st.integers(0, 2), st.sampled_from(["p1", "p2", "p3"])),
        st.tuples(st.just("lease"), st.sampled_from(["p2", "p3"]), st.integers(1, 4)),
        st.tuples(st.just("beat"), st.sampled_from(["p1", "p2", "p3"]), st.sets(st.integers(0, 2))),
        st.tuples(st.just("tick"), st.floats(0, 2)),
        st.tuples(st.just("tick"), st.floats(0, 2)),
        st.tuples(st.just("sweep"), st.integers(1, 3)),
        st.tuples(st.just("walk"), st.integers(1, 3)),
        st.tuples(st.just("prune"), st.integers(1, 3)),
    ),
    min_size=10,
    max_size=60,
)
LEASE_S, KEEP_S = 1.0, 2.0


@settings(max_examples=300, deadline=None)
@given(OPS)
# The holder lapses, a sibling leases two slots and the holder posts the third: the group's next check moves to the
# leases' end, after the walk had passed it.
@example([("open", 2, 1.0), ("tick", 1.0), ("lease", "p2", 1), ("lease", "p2", 1), ("walk", 1), ("post", 2, 2, "p1")])
def test_the_open_slot_counters_stay_true_through_lapses_sweeps_and_pruning(ops: list[tuple[Any, ...]]) -> None:
    """The service's transactions over a memory store, in any order and at any times: the views' counters (open
    groups, slots done and leased) always equal what the live groups hold; once the sweep's walk caught up, no
    lapsed sibling lease of a group whose holder lapsed is counted; once pruning caught up, no group decided
    `KEEP_S` ago is kept, and the counters read as before."""
    txn = MemoryTxn(State())
    state.save_run(txn, Registration(**registration(batch_size=8)), started=True)  # groups are checked against it
    config = Settings(store="memory://", rollout_lease_s=LEASE_S)
    now, cursor = 1000.0, (-math.inf, "")

    def walk(limit: int) -> bool:
        nonlocal cursor
        rows = txn.rollouts.lapsed_since(cursor, now, limit)
        if rs.unlease_txn(txn, [r.key for r in rows], now):
            event("a lapsed sibling lease dropped")
        if rows:
            cursor = (rows[-1].expires_at, rows[-1].key)
        return len(rows) >= limit

    def check() -> None:
        rows = [r for r in txn.rollouts.scan("", 100) if r.state in LIVE]
        done = {r.key: txn.rollouts.done(r.key) for r in rows}
        groups = [rg.OpenGroup.of(r.record) for r in rows]
        counts = rs.totals_txn(txn)
        assert counts["open"] == len(groups)
        assert [r.done for r in rows] == [len(done[r.key]) for r in rows], "a group's counter counts its slots"
        assert counts.get(rr.OPEN_DONE, 0) == sum(len(done[g.key]) for g in groups)
        assert counts.get(rr.OPEN_LEASED, 0) == sum(1 for g in groups for k in g.leases if int(k) not in done[g.key])

    for op in ops:
        kind = op[0]
        try:
            if kind == "open":
                req = OpenRequest(
                    group_id=f"g{op[1]}", producer_id="p1", group_size=3, min_group_size=1, deadline_s=op[2]
                )
                rs.open_txn(txn, req, now, config, ANYONE)
            elif kind == "post":
                body = {
                    "group_id": f"g{op[1]}",
                    "slot": op[2],
                    "producer_id": op[3],
                    "tokens": [1],
                    "masks": [1],
                    "score": 1.0,
                }
                _, sealing = rs.post_txn(txn, RolloutPost.model_validate(body), now, config)
                if sealing:
                    rs.mark_txn(txn, f"g{op[1]}", None, now)
            elif kind == "lease":
                if rs.lease_txn(txn, op[1], op[2], now, config):
                    event("sibling slots leased")
            elif kind == "beat":
                rs.heartbeat_txn(txn, op[1], [f"g{k}" for k in op[2]], now, LEASE_S)
            elif kind == "tick":
                now += op[1]
            elif kind == "sweep":
                for key in rs.sweep_txn(txn, now, op[1]).sealing:
                    rs.mark_txn(txn, key, None, now)
            elif kind == "walk":
                walk(op[1])
            elif rs.prune_txn(txn, now - KEEP_S, op[1]):
                event("decided groups pruned")
        except RollbufError:  # a post to a group never opened or pruned, a conflict: refused, nothing changed
            pass
        check()
    now += LEASE_S  # every sibling lease lapses, unless heartbeated again
    while walk(2):
        pass

    def lapsed_counted(only_walked: bool) -> bool:
        """A lapsed sibling lease still counted in an open group whose holder lapsed (`only_walked`: of groups
        the walk looks at, those whose every missing slot is leased; one with a slot nobody leases stays due for
        the next taker, which drops them)."""
        for r in txn.rollouts.scan("", 100):
            g = rg.OpenGroup.of(r.record)
            done = txn.rollouts.done(r.key)
            missing = [str(s) for s in range(g.group_size) if s not in done]
            if r.state != "open" or g.expires_at > now or (only_walked and any(k not in g.leases for k in missing)):
                continue
            if any(float(g.leases[k][1]) <= now for k in missing if k in g.leases):
                return True
        return False

    assert not lapsed_counted(only_walked=True), "a lapsed lease counted in a group the walk looks at"
    rs.lease_txn(txn, "p9", 100, now, config)  # the next taker: every due group is leased from
    check()
    assert not lapsed_counted(only_walked=False), "a lapsed lease counted after a taker leased from its group"
    now += 10.0  # past every deadline and every decision's retention
    while (swept := rs.sweep_txn(txn, now, 2)).decided or swept.sealing:
        for key in swept.sealing:
            rs.mark_txn(txn, key, None, now)
    now += KEEP_S + 1.0
    while rs.prune_txn(txn, now - KEEP_S, 2):
        event("decided groups pruned")
    assert txn.rollouts.decided(math.inf, 100) == [], "every group was decided, then pruned"
    check()


def unreadable_rows(txn: MemoryTxn, now: float) -> None:
    """Two due groups this release cannot finish, due before any other: a record of a later release (a field it
    does not know) and an open group whose acknowledged rollout is not a record (its seal cannot assemble it)."""
    later = rg.OpenGroup(
        key="later",
        env_id=None,
        group_size=2,
        min_group_size=1,
        deadline=now - 100,
        producer="p1",
        expires_at=now - 100,
    )
    record = {**json.loads(later.to_json()), "from_a_later_release": 1}
    txn.rollouts.put(GroupRow("later", -1, "open", now - 100, now - 100, 0, json.dumps(record)))
    broken = rg.OpenGroup(
        key="broken", env_id=None, group_size=2, min_group_size=1, deadline=now - 99, producer="p1", expires_at=now - 99
    )
    txn.rollouts.put(GroupRow("broken", -1, "open", now - 99, now - 99, 0, broken.to_json()))
    txn.rollouts.add_slot(SlotRow("broken", 0, "p1", "d", b"{not a record", 1, 1.0, None), 1)


def test_what_touches_many_groups_passes_over_one_it_cannot_read() -> None:
    """The sweep decides the due groups behind ones it cannot read, and says which it could not (`unreadable`);
    given them to skip, it reads past them (they stay due); sibling leases, their walk and heartbeats pass them by.
    Before, the first unreadable group failed the whole sweep (and each lease request) at every try."""
    txn = MemoryTxn(State())
    state.save_run(txn, Registration(**registration(batch_size=8)), started=True)
    config = Settings(store="memory://", rollout_lease_s=LEASE_S)
    now = 1000.0
    for k in range(3):
        req = OpenRequest(group_id=f"due{k}", producer_id="p1", group_size=2, min_group_size=1, deadline_s=1.0)
        rs.open_txn(txn, req, now - 10, config, ANYONE)
        post = {"group_id": f"due{k}", "slot": 0, "producer_id": "p1", "tokens": [1], "masks": [1], "score": 1.0}
        rs.post_txn(txn, RolloutPost.model_validate(post), now - 10, config)
    unreadable_rows(txn, now)
    swept = rs.sweep_txn(txn, now, 3)
    assert swept.decided == len(swept.sealing) == 2, "the groups behind it are decided"
    assert sorted(swept.unreadable) == ["later"] and "TypeError" in swept.unreadable["later"]
    assert swept.sealing[0] == "broken", "its rollouts are read at its seal: the service's finish meets it"
    with pytest.raises(rr.UNREADABLE):
        rs.group_body(txn, "broken")
    rs.mark_txn(txn, swept.sealing[1], None, now)
    skipped = rs.sweep_txn(txn, now, 2, skip={"later", "broken"})
    assert (skipped.decided, skipped.unreadable) == (2, {}), "read past the skipped ones, within its limit"
    assert sorted(swept.sealing[1:] + skipped.sealing) == ["due0", "due1", "due2"]
    for key in skipped.sealing:
        rs.mark_txn(txn, key, None, now)
    assert [r.key for r in txn.rollouts.due(now, 10)] == ["later", "broken"], "left as they are"
    leased = rs.lease_txn(txn, "sibling", 10, now, config)
    assert leased == [], "nothing of the one it cannot read; the other is sealing"
    assert rs.unlease_txn(txn, ["later", "broken"], now) == 0
    beat = rs.heartbeat_txn(txn, "p1", ["later", "broken"], now, LEASE_S)
    assert beat == {"later": None, "broken": None}, "the unreadable one holds nothing, nor a sealing one"
