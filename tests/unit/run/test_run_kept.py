"""api.run.kept' pure rules: the acknowledged mark only moves forward and frees what is before it, a commit
cannot pass what was served, and the read-ahead bound counts batches and bytes past the mark."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.errors import Conflict
from api.run.kept import Kept, ReadAhead, check_commit, read_ahead_full


@given(st.integers(0, 50), st.dictionaries(st.integers(0, 100), st.integers(1, 10**6)), st.lists(st.integers(0, 120)))
def test_the_mark_only_moves_forward_and_frees_what_is_before_it(
    start: int, sizes: dict[int, int], commits: list[int]
) -> None:
    kept = Kept(start, {s: n for s, n in sizes.items() if s >= start})
    for step in commits:
        before = kept
        kept = kept.acknowledge(step)
        assert kept.committed == max(before.committed, step)
        assert kept.sizes == {s: n for s, n in before.sizes.items() if s >= kept.committed}
        assert Kept.from_json(kept.to_json()) == kept


def test_a_commit_past_what_was_served_is_refused() -> None:
    check_commit(5, 5)  # every batch before 5: all of those served
    with pytest.raises(Conflict, match="batches up to 4 were served, so at most 5 can be committed"):
        check_commit(6, 5)


@given(
    st.integers(0, 20), st.integers(0, 20), st.integers(1, 10), st.none() | st.integers(1, 1000), st.integers(0, 2000)
)
def test_the_bound_holds_batches_and_bytes_past_the_mark(
    committed: int, ahead: int, max_batches: int, max_bytes: int | None, held: int
) -> None:
    kept = Kept(committed, {committed: held} if ahead else {})
    why = read_ahead_full(kept, committed + ahead, ReadAhead(max_batches, max_bytes))
    over = ahead >= max_batches or (max_bytes is not None and kept.bytes >= max_bytes)
    assert (why is not None) == over
    if why is not None:
        assert "POST /commit" in why and "max_read_ahead_" in why
