"""api/store/overlay.py against a model: a table's stored rows with the pending ones applied, then read whole."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import example, given, settings
from hypothesis import strategies as st

from api.store import overlay

Row = tuple[int, int]
"""(key, value)."""

keys = st.integers(0, 5)  # few keys: pending rows often replace stored ones
stored_tables = st.dictionaries(keys, st.integers(0, 5))
pending_tables = st.dictionaries(keys, st.none() | st.integers(0, 5))
"""A pending table: a row by key, None where it is gone."""


def applied(stored: dict[int, int], pending: dict[int, int | None]) -> list[Row]:
    """The table as the COMMIT would leave it, in key order."""
    table = {**stored, **pending}
    return sorted((k, v) for k, v in table.items() if v is not None)


def as_rows(pending: dict[int, int | None]) -> dict[int, Row | None]:
    return {k: None if v is None else (k, v) for k, v in pending.items()}


def _key(r: Row) -> int:
    return r[0]


def _order(r: Row) -> tuple[int, int]:
    return r[1], r[0]


@given(stored=stored_tables, pending=pending_tables, below=st.integers(0, 6), limit=st.none() | st.integers(0, 5))
@settings(max_examples=400)
@example(stored={1: 0, 2: 1}, pending={1: 5}, below=3, limit=1)  # the first stored row moved out: ask for one more
def test_lay_answers_as_the_table_after_the_commit(
    stored: dict[int, int], pending: dict[int, int | None], below: int, limit: int | None
) -> None:
    """A read by value, sorted by value: the database is asked for `wanted` rows of its own filter and order,
    and the overlay's answer is what the same read returns once the pending rows are stored."""
    where: Callable[[Row], bool] = lambda r: r[1] < below  # noqa: E731
    stored_read = sorted(((k, v) for k, v in stored.items() if v < below), key=_order)
    if limit is not None:
        stored_read = stored_read[: overlay.wanted(limit, pending)]
    truth = sorted(filter(where, applied(stored, pending)), key=_order)
    got = overlay.lay(stored_read, as_rows(pending), _key, where=where, order=_order, limit=limit)
    assert got == (truth if limit is None else truth[:limit])


@given(stored=stored_tables, pending=pending_tables, asked=st.lists(keys, max_size=10, unique=True))
def test_point_answers_the_rows_that_exist_and_fetches_only_what_is_not_pending(
    stored: dict[int, int], pending: dict[int, int | None], asked: list[int]
) -> None:
    fetched: list[list[int]] = []

    def fetch(ks: list[int]) -> list[tuple[int, int]]:
        fetched.append(ks)
        return [(k, stored[k]) for k in ks if k in stored]

    got = overlay.point(asked, pending, fetch)
    assert sorted(got.items()) == [r for r in applied(stored, pending) if r[0] in asked]
    assert fetched == ([[k for k in asked if k not in pending]] if any(k not in pending for k in asked) else [])
    for k in asked:
        assert overlay.one(k, pending, stored.get) == got.get(k)


@given(stored=stored_tables, pending=pending_tables, sizes=st.lists(st.integers(1, 5), min_size=1, max_size=4))
def test_paged_reads_every_row_in_key_order(
    stored: dict[int, int], pending: dict[int, int | None], sizes: list[int]
) -> None:
    def read(after: int | None, n: int) -> list[Row]:
        return [(k, v) for k, v in sorted(stored.items()) if after is None or k > after][:n]

    def page_sizes() -> list[int]:
        return sizes + [sizes[-1]] * (len(stored) + 1)  # never runs out before the rows

    rows = as_rows(pending)
    got = list(overlay.paged(read, lambda: rows, lambda r: r, _key, page_sizes()))
    assert got == applied(stored, pending)


def test_paged_leaves_out_a_pending_row_deleted_before_it_is_reached() -> None:
    """A pending row taken out of its table between two reads of the iterator is not yielded; one written
    after the read of its page is, from the next page on."""
    stored = {1: 10, 2: 20, 3: 30}
    pending: dict[int, Row] = {4: (4, 40), 5: (5, 50)}

    def read(after: int | None, n: int) -> list[Row]:
        return [(k, v) for k, v in sorted(stored.items()) if after is None or k > after][:n]

    rows = overlay.paged(read, lambda: pending, lambda r: r, _key, [2, 2, 2])
    assert next(rows) == (1, 10)
    pending[6] = (6, 60)  # its page is not read yet
    assert next(rows) == (2, 20)
    assert next(rows) == (3, 30)
    del pending[5]
    assert list(rows) == [(4, 40), (6, 60)]
