"""A group's lineage as pure functions (api/rollouts/lineage.py): leases counted as resumes (with the tokens they
carried) or restarts; a slot's turns as runs of one producer, covering its tokens end to end."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from api.rollouts import lineage
from api.store.rollouts import TurnKey

turn_lists = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["p1", "p2", "p3"]), st.integers(0, 5)), max_size=20)


def keys_of(drawn: list[tuple[int, str, int]]) -> list[TurnKey]:
    """Turn keys as `turn_keys` reads them: by slot, then turn."""
    counts: dict[int, int] = {}
    out = []
    for slot, producer, tokens in sorted(drawn, key=lambda t: t[0]):
        out.append(TurnKey(slot, counts.get(slot, 0), producer, 10, tokens))
        counts[slot] = counts.get(slot, 0) + 1
    return out


@given(turn_lists)
def test_a_slots_runs_cover_its_turns_and_tokens_in_order_one_producer_each(drawn: list[tuple[int, str, int]]) -> None:
    keys = keys_of(drawn)
    made = lineage.runs(keys)
    assert set(made) == {str(k.slot) for k in keys}
    for slot, runs in made.items():
        mine = [k for k in keys if str(k.slot) == slot]
        assert sum(r[1] for r in runs) == len(mine), "every turn in one run"
        assert runs[0][2] == 0 and runs[-1][3] == sum(k.tokens for k in mine), "the slot's tokens end to end"
        assert all(a[3] == b[2] for a, b in zip(runs, runs[1:], strict=False)), "no gap, no overlap"
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:], strict=False)), "a run per change of producer"
        producers = [r[0] for r in runs for _ in range(r[1])]
        assert producers == [k.producer for k in mine]


@given(st.lists(st.tuples(st.integers(0, 3), st.one_of(st.none(), st.integers(0, 100))), max_size=12), turn_lists)
def test_leases_count_resumes_restarts_and_the_tokens_saved(
    leases: list[tuple[int, int | None]], drawn: list[tuple[int, str, int]]
) -> None:
    record: lineage.Lineage = {}
    for slot, carried in leases:
        lineage.leased(record, slot, carried)
    for slot in range(4):
        mine = [c for s, c in leases if s == slot]
        entry = record.get(str(slot), {})
        assert entry.get("resumes", 0) == sum(1 for c in mine if c is not None)
        assert entry.get("restarts", 0) == sum(1 for c in mine if c is None)
        assert entry.get("saved", 0) == sum(c for c in mine if c is not None)
    kept = lineage.with_runs(record, keys_of(drawn))
    assert {s: {k: v for k, v in e.items() if k != "turns"} for s, e in kept.items() if s in record} == record
    assert all(kept[s]["turns"] == r for s, r in lineage.runs(keys_of(drawn)).items())


@given(
    st.lists(st.tuples(st.integers(0, 5), st.one_of(st.none(), st.integers(0, 100))), max_size=12),
    st.sets(st.integers(0, 5)),
)
def test_a_sealed_groups_resumes_are_its_sealed_slots_resumed_and_their_tokens(
    leases: list[tuple[int, int | None]], sealed: set[int]
) -> None:
    """The ledger's `resumed`: the sealed slots with a resume (a restart alone is not one), ascending, and the
    tokens all of their resumes carried; None when there is none (never an empty list)."""
    record: lineage.Lineage = {}
    for slot, carried in leases:
        lineage.leased(record, slot, carried)
    got = lineage.resumes(record, sealed)
    want = sorted({s for s, c in leases if c is not None and s in sealed})
    if not want:
        assert got is None
        return
    assert got is not None
    assert list(got.slots) == want
    assert got.tokens == sum(c for s, c in leases if c is not None and s in sealed)
