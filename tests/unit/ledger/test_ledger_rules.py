"""The ledger's pure decisions: a group's score summary, and which retained payloads retention lets go."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from api.ledger.rules import LedgerSettings, ledger_bounds, payloads_to_prune, score_summary
from api.store.base import KeptPayload

finite = st.floats(-1e6, 1e6, allow_nan=False)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=16))
@example([-1.7976931348623157e308] * 14)  # schemathesis found it: fsum of 14 x (-max/14) overflowed
@example([1.7976931348623157e308, -1.7976931348623157e308])
def test_score_summary_is_finite_for_any_finite_scores(scores: list[float]) -> None:
    assert all(math.isfinite(x) for x in score_summary(scores))  # scores of 1e300 once made it overflow


@given(st.lists(finite, max_size=64))
def test_score_summary_is_numpys(scores: list[float]) -> None:
    got = score_summary(scores)
    if not scores:
        assert got == (0.0, 0.0, 0.0, 0.0)
        return
    a = np.asarray(scores)
    want = (float(a.mean()), float(a.min()), float(a.max()), float(a.std()))
    assert all(math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-6) for g, w in zip(got, want, strict=True))


kept_lists = st.lists(st.tuples(st.integers(0, 50), st.integers(1, 1000)), max_size=40).map(
    lambda rows: [KeptPayload(i, step, size) for i, (step, size) in enumerate(sorted(rows))]
)


@given(
    kept_lists,
    st.integers(0, 60),
    st.integers(0, 60),
    st.one_of(st.none(), st.integers(0, 20)),
    st.one_of(st.none(), st.integers(0, 20_000)),
)
def test_retention_prunes_what_its_bounds_say_and_nothing_else(
    kept: list[KeptPayload], step: int, committed: int, steps: int | None, budget: int | None
) -> None:
    settings = LedgerSettings(retain_steps=steps, retain_bytes=budget)
    total = sum(k.bytes for k in kept)
    pruned = payloads_to_prune(kept, total, step, committed, settings)
    assert pruned == [k.id for k in kept[: len(pruned)]]  # the oldest first, none skipped
    left = kept[len(pruned) :]
    for k in kept[: len(pruned)]:
        assert k.step < committed  # never a payload of a batch still kept
        too_old = steps is not None and k.step < step - steps
        assert too_old or budget is not None
    if left and left[0].step < committed:  # it stopped before a prunable one: that one is within every bound
        assert steps is None or left[0].step >= step - steps
        assert budget is None or sum(k.bytes for k in left) <= budget


def test_ledger_bounds_prune_at_most_a_chunk_past_the_oldest_row() -> None:
    settings = LedgerSettings(max_groups=100, max_steps=10)
    assert ledger_bounds(1_000_000, 5, 50, settings) == (5 + 10_000, 40)
    assert ledger_bounds(150, 5, 50, settings) == (50, 40)
    assert ledger_bounds(150, 5, 50, LedgerSettings(max_groups=None, max_steps=None)) == (-1, -1)
