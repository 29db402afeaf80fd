"""The end of a run fed by datasets (api/tasks/ending.py): when nothing more can arrive, and when the run is
finished. Pure judgements, checked as properties over generated datasets and envs (hypothesis)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from api.tasks.ending import DatasetEnd, Ending, Source, is_finished, judge

datasets = st.lists(
    st.builds(DatasetEnd, st.sampled_from(["a", "b", "c"]), st.booleans(), st.booleans()).map(
        lambda d: DatasetEnd(d.name, d.exhausted, d.done and d.exhausted)  # done implies exhausted
    ),
    max_size=4,
)
sources = st.lists(
    st.builds(Source, st.sampled_from(["math", "code", "free"]), st.booleans(), st.booleans(), st.booleans()).map(
        lambda s: Source(s.name, s.fed, s.watched, s.live and s.watched)
    ),
    max_size=4,
)
"""A live source is watched: liveness is that of the producers heartbeating for it."""


def can_send(s: Source) -> bool:
    """A free env may send while a producer for it is live, or when none heartbeats for it (unknown)."""
    return not s.fed and (s.live or not s.watched)


@given(datasets, sources)
def test_the_run_is_final_exactly_when_every_dataset_is_exhausted_and_no_free_env_can_send(
    ds: list[DatasetEnd], srcs: list[Source]
) -> None:
    end = judge(ds, srcs)
    assert end.final == (bool(ds) and all(d.exhausted for d in ds) and not any(map(can_send, srcs)))
    assert (end.why_not is None) == (end.final or not ds), "what may still arrive is said, but for no dataset"


@given(datasets, sources, sources)
def test_envs_fed_by_datasets_never_hold_the_end_and_a_free_env_that_may_send_always_does(
    ds: list[DatasetEnd], srcs: list[Source], more: list[Source]
) -> None:
    """Adding envs fed by datasets (live or not) never changes the judgement; adding a free env that may send ends
    finality; a run without datasets is never final (its trainer ends by its own step count)."""
    base = judge(ds, srcs)
    fed = [Source(s.name, True, s.watched, s.live) for s in more]
    assert judge(ds, srcs + fed).final == base.final
    if any(map(can_send, more)):
        assert not judge(ds, srcs + more).final
    assert not judge([], srcs).final


@given(datasets, sources, st.integers(0, 3), st.integers(0, 3))
def test_a_run_is_finished_only_when_final_every_dataset_done_and_nothing_queued_or_held(
    ds: list[DatasetEnd], srcs: list[Source], queued: int, held: int
) -> None:
    end = judge(ds, srcs)
    done = is_finished(end, ds, queued, held)
    assert done == (end.final and all(d.done for d in ds) and queued == 0 and held == 0)
    assert not is_finished(Ending(False), ds, 0, 0)


def test_what_may_still_arrive_is_named() -> None:
    exhausted = [DatasetEnd("a", True, False)]
    going = judge([*exhausted, DatasetEnd("b", False, False)], [])
    assert going.why_not is not None and "'b'" in going.why_not and "'a'" not in going.why_not
    free = judge(exhausted, [Source("free_0", False, True, True), Source("h_0", False, False, False)])
    assert free.why_not is not None
    assert "'free_0' (a live producer)" in free.why_not and "'h_0' (no producer heartbeats for it)" in free.why_not
    gone = judge(exhausted, [Source("free_0", False, True, False), Source("m", True, False, False)])
    assert gone == Ending(True), "a free env whose producers are all gone cannot send"
