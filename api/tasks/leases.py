"""Tasks leased from rollbuf (docs/tasks.md): a dataset registered and its tasks stored in pages, the cursor over
it, and leases that expire unless heartbeated, as synchronous functions over a store transaction (`txn.tasks`,
`txn.get_value`).

A task has a row from its first lease on, keyed by (epoch, index), whose state only api/tasks/states.py's moves
write, through the dataset's record (api/tasks/records.py). The cursor enters the next epoch only when the current
one has nothing leased or waiting, so a task is in at most one lease at a time. What follows a lease (its group's
fate moving its task) is api/tasks/fates.py; the tokens a lease is named by, api/tasks/tokens.py; a key's bounds,
api/tasks/totals.py.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from api.errors import Conflict, InvalidData, NotFound, RollbufError
from api.owners import ANYONE, Actor
from api.store.base import Txn
from api.store.tasks import TaskRow
from api.tasks import states
from api.tasks.order import SEQUENTIAL, WEIGHTED, task_at, weighted_at
from api.tasks.records import ANY_KEY, Dataset, Moves, count, dataset, moved
from api.tasks.states import LEASED, NEW, WAITING
from api.tasks.tokens import NONCE_BYTES, TOKEN_PREFIX, parse_token, same_lease, token_of
from api.tasks.totals import NO_BOUNDS, TASK_ROW_BYTES, Bounds, key_totals, put_totals

RECLAIM_LIMIT = 256
"""Expired leases returned to the front per lease call (the rest on the next ones)."""


READING = "tasks:reading:"
"""Named values, one per dataset whose file a registration reads (its name after the colon): who reads it and
until when the claim holds unless renewed (`claim_reading`)."""


READ_CLAIM_S = 60.0
"""Seconds a registration's claim on reading a dataset's file holds without a page stored: a reader that died
(its server killed) lets another registration take over after this long; a live one renews it every page."""


@dataclass(frozen=True, slots=True)
class Lease:
    token: str
    epoch: int
    index: int
    data: str
    """The task as registered (JSON text)."""
    expires_at: float


def level_store(name: str, level: str) -> str:
    """Where a weighted dataset keeps a level's task indices by rank, as task data (`#` is not in a dataset's
    name, so no dataset is stored there)."""
    return f"{name}#{level}"


def level_of(d: Dataset, index: int, text: str, where: tuple[str, ...]) -> str:
    """A task's level in a weighted dataset, or 422 naming the task."""
    task = json.loads(text)
    value = task.get(d.level_key) if isinstance(task, dict) else None
    level = str(value).lower() if isinstance(value, bool) else str(value)
    if value is None or isinstance(value, (dict, list)) or level not in (d.levels or {}):
        raise InvalidData(where, f"task {index}: its {d.level_key!r} ({value!r}) is not one of the levels")
    return level


def _index_levels(txn: Txn, d: Dataset, first: int, data: Sequence[str], where: tuple[str, ...]) -> None:
    """Store the new tasks' indices under their levels, by rank (the tasks from `d.size` on are new)."""
    by_level: dict[str, list[str]] = {}
    for k in range(max(0, d.size - first), len(data)):
        by_level.setdefault(level_of(d, first + k, data[k], where), []).append(str(first + k))
    for level, indices in by_level.items():
        txn.tasks.add_tasks(level_store(d.name, level), d.level_sizes.get(level, 0), indices)
        d.level_sizes[level] = d.level_sizes.get(level, 0) + len(indices)


def register(txn: Txn, d: Dataset, max_datasets: int | None = None) -> Dataset:
    """Register a dataset (its tasks are added by `add_tasks`); Conflict if the name is taken, or if its key holds
    `max_datasets` (`task_max_datasets_per_key`) already."""
    if txn.tasks.get_dataset(d.name) is not None:
        raise Conflict(f"dataset {d.name!r} is registered already")
    held = key_totals(txn, d.owner)
    if max_datasets is not None and held.datasets >= max_datasets:
        raise Conflict(
            f"this key holds {held.datasets} datasets, the most one key may (task_max_datasets_per_key); "
            "datasets are kept until the run is reset",
            loc=("body", "name"),
        )
    txn.tasks.put_dataset(d.name, d.to_json())
    txn.set_value(ANY_KEY, "1")
    put_totals(txn, d.owner, replace(held, datasets=held.datasets + 1))
    return d


def add_tasks(
    txn: Txn,
    name: str,
    first: int,
    data: Sequence[str],
    *,
    last: bool,
    where: tuple[str, ...] = ("body", "tasks"),
    actor: Actor = ANYONE,
    bounds: Bounds = NO_BOUNDS,
    reading: tuple[str, float] | None = None,
) -> Dataset:
    """Store a page of tasks at `first` (the dataset's size so far: pages come in order; of a page sent again only
    the tasks past those stored are stored, so a retry is a no-op); `last` seals the dataset. `where`: the field a
    task that breaks a rule is reported at. A page starting past the tasks stored is a 409 (at `first`), as is one
    past the key's bytes (`bounds.key_bytes`); past `bounds.dataset_size` tasks, a 422. `reading`: (reader, now)
    of a registration reading the dataset's file, whose claim (`claim_reading`) it renews, or ends with the last
    page; a page of a reader whose claim another took over is a 409."""
    moves = Moves(txn)
    d = dataset(moves, name, actor)
    if reading is not None:
        _renew(txn, d, *reading, last=last)
    if d.sealed and first + len(data) <= d.size:
        return d  # a retried page of a sealed dataset
    if first > d.size:
        raise Conflict(
            f"dataset {name!r} holds {d.size} tasks: a page must start at or before {d.size}",
            loc=(*where[:-1], "first") if where[-1] == "tasks" else where,
        )
    new = data[max(0, d.size - first) :]
    if bounds.dataset_size is not None and d.size + len(new) > bounds.dataset_size:
        raise InvalidData(where, f"more than {bounds.dataset_size} tasks (task_max_dataset_size)")
    held = key_totals(txn, d.owner)
    cost = sum(len(t.encode()) for t in new) + TASK_ROW_BYTES * len(new)
    if bounds.key_bytes is not None and cost and held.bytes + cost > bounds.key_bytes:
        raise Conflict(
            f"this key's datasets hold {held.bytes} bytes of tasks; {cost} more would pass "
            f"{bounds.key_bytes} (task_max_bytes_per_key)",
            loc=where,
        )
    if d.order == WEIGHTED:
        _index_levels(txn, d, d.size, new, where)
    if new:
        txn.tasks.add_tasks(name, d.size, new)
        put_totals(txn, d.owner, replace(held, bytes=held.bytes + cost))
    d.size += len(new)
    d.sealed = last
    moves.write()
    return d


def claim_reading(txn: Txn, name: str, reader: str, now: float, actor: Actor = ANYONE) -> Dataset:
    """Registration `reader` starts reading the file of dataset `name`, or takes over from one whose claim lapsed
    (`READ_CLAIM_S` without a page): tasks are stored once however often a registration is sent. While another's
    claim holds, a 409 saying how far it got."""
    moves = Moves(txn)
    d = dataset(moves, name, actor, loc=("body", "name"))
    if d.sealed:
        return d
    claim = _claim(txn, name)
    if claim is not None and claim[0] != reader and claim[1] > now:
        raise Conflict(
            f"dataset {name!r} is being read from its file by an earlier registration: {d.size} tasks "
            "stored so far; send this registration again once that one ends (GET /tasks shows the "
            "size; it is answered as the first once the file is read)",
            loc=("body", "path"),
        )
    txn.set_value(READING + name, json.dumps([reader, now + READ_CLAIM_S]))
    return d


def release_reading(txn: Txn, name: str, reader: str) -> None:
    """Registration `reader` stopped reading (its file broke a rule, or it was cut off): another may start now."""
    claim = _claim(txn, name)
    if claim is not None and claim[0] == reader:
        txn.delete_value(READING + name)


def _claim(txn: Txn, name: str) -> tuple[str, float] | None:
    raw = txn.get_value(READING + name)
    if raw is None:
        return None
    reader, until = json.loads(raw)
    return str(reader), float(until)


def _renew(txn: Txn, d: Dataset, reader: str, now: float, *, last: bool) -> None:
    claim = _claim(txn, d.name)
    if claim is None or claim[0] != reader:
        raise Conflict(
            f"another registration took over reading dataset {d.name!r}'s file (this one paused longer "
            f"than {READ_CLAIM_S:g} s): it goes on from task {d.size}",
            loc=("body", "path"),
        )
    if last:
        txn.delete_value(READING + d.name)
    else:
        txn.set_value(READING + d.name, json.dumps([reader, now + READ_CLAIM_S]))


def lease(
    txn: Txn,
    name: str,
    producer: str,
    n: int,
    now: float,
    duration: float,
    max_held: int,
    actor: Actor = ANYONE,
    max_bytes: int | None = None,
) -> list[Lease]:
    """Up to `n` tasks for `producer` (fewer past `max_held` leases held, past `max_bytes` of task data in the
    reply (one task at least), or when none is left now): expired leases back to the front first, then the front,
    then the cursor. Each lease is bound to `actor`'s key and `producer`, and its token has a random part of its
    own. Tasks that do not fit the reply stay where they were (the cursor is not moved past them)."""
    moves = Moves(txn)
    d = dataset(moves, name, actor)
    tasks = txn.tasks
    n = max(0, min(n, max_held - d.held.get(producer, 0)))
    expired, front = tasks.reclaimable(name, now, RECLAIM_LIMIT, n)
    if expired:
        count(d, "expired", len(expired))
    # Expired leases join the front behind what waits there already (their seq is the next), and are taken after.
    back = [moved(d, row, states.expire(row, d.next_seq)) for row in expired]
    again = (front + back)[:n]
    cursors: list[tuple[int, int, dict[str, int]]] = []  # the cursor before each pick, to step back to
    fresh: list[tuple[str, int]] = []  # from the cursor: (level, rank) in a weighted order, else ("", index)
    while len(again) + len(fresh) < n and (d.sealed or d.order == SEQUENTIAL):  # others need the final size
        cursors.append((d.epoch, d.position, dict(d.taken)))
        if d.position >= d.size:
            more = d.epochs is None or d.epoch + 1 < d.epochs
            quiet = not d.counts.get(LEASED) and not d.counts.get(WAITING) and not again and not fresh
            if not (d.sealed and more and quiet and d.size):
                break  # wait: the epoch's last tasks are out, or pages are still coming, or the dataset is done
            d.epoch, d.position, d.taken = d.epoch + 1, 0, {}
        if d.order == WEIGHTED:
            level, rank = weighted_at(d.seed, d.epoch, d.position, d.levels or {}, d.level_sizes, d.taken)
            d.taken[level] = d.taken.get(level, 0) + 1
            fresh.append((level, rank))
        else:
            fresh.append(("", task_at(d.order, d.seed, d.epoch, d.position, d.size)))
        d.position += 1
    indices = [r.index for r in again] + _indices(txn, name, fresh)
    fits, data = tasks.tasks_within(name, indices, max_bytes)
    if fits < len(indices):  # the rest stay: the front's rows where they wait, the cursor before its picks
        if cursors:
            d.epoch, d.position, d.taken = cursors[max(0, fits - len(again))]
        again, indices = again[:fits], indices[:fits]
    until = now + duration
    holder = actor.owner
    rows = again + [TaskRow(name, d.epoch, index, NEW, updated_at=now) for index in indices[len(again) :]]
    taken: list[TaskRow] = []
    for row in rows:
        nonce = secrets.token_hex(NONCE_BYTES)  # each lease's token has a random part of its own
        taken.append(
            moved(d, row, states.lease(row, producer=producer, until=until, holder=holder, nonce=nonce, now=now))
        )
    written = {(r.epoch, r.index): r for r in back + taken}  # one write per row, the last state
    tasks.put_rows(list(written.values()))
    moves.write()
    return [
        Lease(token_of(name, r.epoch, r.index, r.leases, r.nonce), r.epoch, r.index, data.get(r.index, "null"), until)
        for r in taken
    ]


def _indices(txn: Txn, name: str, fresh: list[tuple[str, int]]) -> list[int]:
    """The task indices of the cursor's picks: a weighted pick's (level, rank) looked up, one read per level."""
    ranks: dict[str, list[int]] = {}
    for level, rank in fresh:
        if level:
            ranks.setdefault(level, []).append(rank)
    found = {level: txn.tasks.task_data(level_store(name, level), r) for level, r in ranks.items()}
    try:
        return [int(found[level][rank]) if level else rank for level, rank in fresh]
    except KeyError:
        raise RollbufError(f"dataset {name!r}: a level's task index is missing from the store") from None


def _held(txn: Txn, token: str, actor: Actor) -> tuple[Dataset, TaskRow, Moves] | None:
    """The dataset and row of a lease that is still held under this token and that `actor` may act on, else None
    (not a token, an unknown dataset, a lease lost, a token that is not the lease's, another key's lease: all
    alike, so a key learns nothing of another's leases)."""
    parsed = parse_token(token)
    if parsed is None:
        return None  # not a token: no lease it could hold
    moves = Moves(txn)
    d = moves.get(parsed.dataset)
    if d is None:
        return None
    key = (parsed.epoch, parsed.index)
    row = txn.tasks.rows(parsed.dataset, [key]).get(key)
    if row is None or row.state != LEASED or not same_lease(row, parsed):
        return None
    if actor.hides(row.holder if row.nonce is not None else d.owner, "task_lease"):
        return None  # a lease taken before tokens had a random part is its dataset owner's
    return d, row, moves


def heartbeat(
    txn: Txn, tokens: Iterable[str], now: float, duration: float, actor: Actor = ANYONE
) -> dict[str, float | None]:
    """Extend these leases to `now + duration`; per token, the new expiry or None where the lease is lost
    (expired and handed out again, the task already submitted) or is not this key's."""
    out: dict[str, float | None] = {}
    for token in tokens:
        found = _held(txn, token, actor)
        if found is None:
            out[token] = None
            continue
        _, row, _ = found
        txn.tasks.put_rows([replace(row, expires_at=now + duration, updated_at=now)])
        out[token] = now + duration
    return out


def give_up(txn: Txn, token: str, reason: str | None, now: float, actor: Actor = ANYONE) -> bool:
    """The producer ends its lease: failed with `reason` (the retry policy applies), or, with None, handed back
    untried (to the front, not a retry). False if the lease was already lost (or is not this key's)."""
    found = _held(txn, token, actor)
    if found is None:
        return False
    d, row, moves = found
    if reason is None:
        txn.tasks.put_rows([moved(d, row, states.hand_back(row, d.next_seq, now))])
    else:
        txn.tasks.put_rows([moved(d, row, states.fail(row, reason, now, max_retries=d.max_retries, seq=d.next_seq))])
    moves.write()
    return True


def check_submission(txn: Txn, group_id: str, actor: Actor, producer: str | None, loc: tuple[str | int, ...]) -> None:
    """A group sent under a lease token is acknowledged only as its lease's submission: from the key holding the
    lease (and the producer, when the group names one), while the lease is still its task's. A lease that lapsed
    and passed to another producer, or whose task was already submitted, is refused (409), so that a producer
    paused past its lease never gets its task trained twice; another key's lease answers as an unknown one."""
    at = (*loc, "group_id")
    parsed = parse_token(group_id)
    if parsed is None:
        raise InvalidData(at, f"a group id starting with {TOKEN_PREFIX!r} is a task lease token, and this is not one")
    unknown = NotFound(f"no task lease {group_id!r}", loc=at)
    if txn.get_value(ANY_KEY) is None:
        raise unknown
    d = Dataset.of(text) if (text := txn.tasks.get_dataset(parsed.dataset)) is not None else None
    key = (parsed.epoch, parsed.index)
    row = txn.tasks.rows(parsed.dataset, [key]).get(key) if d is not None else None
    if d is None or row is None or row.leases < parsed.lease:
        raise unknown
    if row.leases == parsed.lease and not same_lease(row, parsed):
        raise unknown  # a forged random part
    holder = row.holder if row.nonce is not None else d.owner
    if row.leases == parsed.lease and actor.hides(holder, "task_lease"):
        raise unknown
    if row.leases > parsed.lease:
        if actor.hides(d.owner, "task_lease"):
            raise unknown
        raise Conflict(
            f"the lease {group_id!r} lapsed and its task was leased again: this group is not its task's "
            "submission; nothing was stored (docs/tasks.md, 'Leases')",
            loc=at,
        )
    if not states.may("submit", row):
        raise Conflict(f"the task of lease {group_id!r} is {row.state} already: nothing was stored", loc=at)
    if producer is not None and row.producer is not None and producer != row.producer:
        raise Conflict(
            f"the lease {group_id!r} is held by another producer than {producer!r}: nothing was stored",
            loc=(*loc, "producer_id"),
        )
