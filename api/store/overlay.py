"""Rows a transaction wrote that are not stored yet, laid over the rows a read gets from the database: the one
way every read of a write-back backend sees its own pending writes (PostgreSQL's group cache,
api/store/postgres/cache.py `Pending`, and the SQL ledger over it, api/store/sql/ledger.py).

A pending table is a mapping of rows by key: what the group wrote, as its COMMIT will write it (an insert or an
upsert), or None where the row is gone from what a read returns (deleted, or no longer one of the rows the read
is about). A row the group deletes is taken out of its pending table if it was only pending there; a stored row
it deletes is deleted in the database at once (under the function's savepoint), so no read of the database
returns it. Tables written through (held groups, open groups and their slots, envs, batches, task data) have no
pending rows: the database read inside the group's transaction already sees them.
Two kinds of cached state are not laid over anything: the small tables read whole at BEGIN (named values, queue
and side-buffer counts, task datasets), which reads answer from alone, and the counters' deltas, which are added
to what is stored.

Pure logic, no I/O: the caller reads the database and hands the rows over.

- `lay`: a filtered, ordered, limited read. Each stored row is replaced by the pending row of its key, the
  pending rows are added, and the result is filtered, sorted and cut to `limit` again. A pending row may replace
  a stored row that the database's filter took and move it out of the filter, so a read with a limit asks the
  database for `wanted(limit, pending)` rows: the first `limit` of the result are then among them.
- `point`, `one`: rows by key: the pending ones, then the rest fetched.
- `paged`: every row in key order, through keyset pages of the database, for an iterator read between writes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
V = TypeVar("V")


def wanted(limit: int, pending: Sized) -> int:
    """How many rows a read with `limit` asks the database for: one more per pending row, each of which may
    have replaced a stored row that the database's filter still takes."""
    return limit + len(pending)


def lay(
    stored: Iterable[R],
    pending: Mapping[K, R | None],
    key: Callable[[R], K],
    *,
    where: Callable[[R], bool] | None = None,
    order: Callable[[R], Any] | None = None,
    limit: int | None = None,
) -> list[R]:
    """`stored` (what the database returned for the read, asked for `wanted(limit, pending)` rows where there is a
    limit) with `pending` laid over it: the rows that `where` takes (the read's whole filter: a pending table
    holds rows outside the read's scope too), sorted by `order` (as the database sorted them; without it,
    stored rows first, as they came, then pending ones), at most `limit` of them."""
    rows: dict[K, R | None] = {key(r): r for r in stored}
    rows.update(pending)
    out = [r for r in rows.values() if r is not None and (where is None or where(r))]
    if order is not None:
        out.sort(key=order)
    return out if limit is None else out[:limit]


def point(
    keys: Iterable[K], pending: Mapping[K, R | None], fetch: Callable[[list[K]], Iterable[tuple[K, R]]]
) -> dict[K, R]:
    """The rows of `keys` that exist: pending ones as they are, the others as `fetch` (given the keys no pending
    row answers, in the order asked) finds them stored."""
    out: dict[K, R] = {}
    stored = []
    for k in keys:
        if k in pending:
            row = pending[k]
            if row is not None:
                out[k] = row
        else:
            stored.append(k)
    if stored:
        out.update(fetch(stored))
    return out


def one(key: K, pending: Mapping[K, R | None], fetch: Callable[[K], R | None]) -> R | None:
    """The row of `key`: the pending one (None: gone), else what `fetch` finds stored (None: none)."""
    return pending[key] if key in pending else fetch(key)


def paged(
    read: Callable[[int | None, int], Sequence[R]],
    pending: Callable[[], Mapping[int, V]],
    row: Callable[[V], R | None],
    key: Callable[[R], int],
    sizes: Iterable[int],
) -> Iterator[R]:
    """Every row in key order: keyset pages of stored rows (`read(after, n)`: the first n stored rows with keys
    after `after`, all of them for None; n from `sizes`, which must not run out before the rows do), each with
    the pending rows of the keys it spans laid over it, then the pending rows after the last stored one. The
    pending table (`pending()`, its rows as `row` makes them) is looked at again for each page and for each
    pending row before it is yielded: rows written or deleted between two reads of the iterator count from
    there on, and one deleted before it is reached is not yielded."""
    after: int | None = None
    for n in sizes:
        page = read(after, n)
        last = key(page[-1]) if len(page) == n else None  # None: the last page
        table = pending()
        spanned = {k: row(v) for k, v in table.items() if (after is None or k > after) and (last is None or k <= last)}
        if not spanned:  # the common case: nothing pending among these keys
            yield from page
        for r in lay(page, spanned, key, order=key) if spanned else ():
            k = key(r)
            if k not in spanned or k in pending():
                yield r
        if last is None:
            return
        after = last
