"""Tasks leased from rollbuf (docs/tasks.md): the cursor over a dataset, leases that expire unless heartbeated,
and each task's fate, as synchronous functions over a store transaction (`txn.tasks`, `txn.get_value`).

A dataset's record (its spec, cursor and tallies) is one JSON row, read and rewritten by each function that moves
it; a task has a row from its first lease on, keyed by (epoch, index), whose state only api/tasks/states.py's
moves write (leased -> submitted -> served -> trained, or dropped / failed, offered again while retries last). The
cursor enters the next epoch only when the current one has nothing leased or waiting, so a task is in at most one
lease at a time. Every function costs the tasks it touches, never the dataset: a trainer's acknowledgement costs
the rows of the steps it acknowledges.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace

from api.errors import Conflict, InvalidData, NotFound, RollbufError
from api.owners import ANYONE, Actor
from api.store import base as fates
from api.store.base import LedgerGroup, Txn
from api.store.tasks import TaskRow
from api.tasks import states
from api.tasks.order import SEQUENTIAL, WEIGHTED, task_at, weighted_at
from api.tasks.states import DROPPED, LEASED, NEW, SUBMITTED, WAITING

EVENTS = ("expired", "retried", "late")
"""Counted, not states: leases that ended unheartbeated, tasks offered again under the retry policy, groups that
came on a lease their task no longer had (their task was already submitted)."""
TOKEN_PREFIX = "task:"
"""Lease tokens are group ids: a group sent with one (`group_id`) is its task's submission, idempotent as any. A
group id with this prefix is a lease token or refused."""
_N = "(0|[1-9][0-9]{0,17})"
_TOKEN = re.compile(rf"task:([A-Za-z0-9_.\-]{{1,64}}):{_N}:{_N}:{_N}(?:\.([0-9a-f]{{24}}))?")
"""`task:DATASET:EPOCH:INDEX:LEASE.NONCE`: ASCII digits only (`str.isdigit` takes `²`, which `int` refuses), at
most 18 of them (below 2^63 on every store) and no leading zero (one lease has one token: `token_of`'s), and the
nonce's 24 hex digits (96 random bits; absent only from a lease taken before tokens had one)."""
NONCE_BYTES = 12
ANY_KEY = "tasks:any"
"""A named value set once a dataset exists: the hooks cost nothing in runs without one."""
FED_KEY = "tasks:fed"
"""A named value: the env ids that sent a group under a task lease (a JSON list), so that the end of a run tells an
env fed by datasets from a free one, which may send for as long as it is live (api/tasks/ending.py). A named value,
not a field of the dataset records, which a server of an earlier release reads as it wrote them."""
RECLAIM_LIMIT = 256
"""Expired leases returned to the front per lease call (the rest on the next ones)."""
KEY_TOTALS = "tasks:key:"
"""Named values, one per key (its name after the colon; none after it without keys): the datasets it registered
and the bytes of their tasks (`KeyTotals`), kept as they change, so that a key's bounds cost one read."""
TASK_ROW_BYTES = 64
"""What a task costs the store beside its text (its row and index entry), counted against the key's bytes: a
dataset of empty tasks is not free."""
READING = "tasks:reading:"
"""Named values, one per dataset whose file a registration reads (its name after the colon): who reads it and
until when the claim holds unless renewed (`claim_reading`)."""
READ_CLAIM_S = 60.0
"""Seconds a registration's claim on reading a dataset's file holds without a page stored: a reader that died
(its server killed) lets another registration take over after this long; a live one renews it every page."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """What `add_tasks` may store: a dataset's tasks (`task_max_dataset_size`) and a key's task bytes
    (`task_max_bytes_per_key`); None: no bound."""

    dataset_size: int | None = None
    key_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class KeyTotals:
    """What one key's datasets hold: how many, and the bytes of their tasks (text and `TASK_ROW_BYTES` each)."""

    datasets: int = 0
    bytes: int = 0


def key_totals(txn: Txn, owner: str | None) -> KeyTotals:
    """The totals of the key `owner` (None: a keyless server's datasets). A store from before they were kept
    counts its datasets once, at the first registration or page after (their bytes count from then on)."""
    raw = txn.get_value(KEY_TOTALS + (owner or ""))
    if raw is not None:
        datasets, size = json.loads(raw)
        return KeyTotals(int(datasets), int(size))
    if txn.get_value(ANY_KEY) is None:
        return KeyTotals()
    mine = 0
    for name in txn.tasks.dataset_names():
        record = txn.tasks.get_dataset(name)
        if record is not None and Dataset.of(record).owner == owner:
            mine += 1
    return KeyTotals(datasets=mine)


def _put_totals(txn: Txn, owner: str | None, totals: KeyTotals) -> None:
    txn.set_value(KEY_TOTALS + (owner or ""), json.dumps([totals.datasets, totals.bytes]))


_WEIGHTED_DEFAULTS: dict[str, object] = {"levels": None, "level_key": "level", "level_sizes": {}, "taken": {}}
"""The weighted order's fields, left out of a record while at their defaults (a server that predates them reads
the records of the other orders as it wrote them)."""


@dataclass(slots=True)
class Dataset:
    """A dataset's record: what it was registered with, its cursor and its tallies."""

    name: str
    size: int = 0
    """Tasks stored so far (indices 0..size-1)."""
    sealed: bool = True
    """All its tasks are stored: the cursor may end an epoch. A dataset posted in pages is sealed by its last."""
    epochs: int | None = 1
    """None: forever."""
    seed: int = 0
    order: str = "sequential"
    max_retries: int = 0
    """Times a dropped or failed task is offered again (0: counted and moved on)."""
    env: str | None = None
    levels: dict[str, float] | None = None
    """A weighted order's curriculum: each level's weight (api/tasks/order.py)."""
    level_key: str = "level"
    """A weighted order: the field of a task (a JSON object) that names its level."""
    level_sizes: dict[str, int] = field(default_factory=dict)
    """A weighted order: tasks stored per level (a level's tasks are stored by rank under `level_store`)."""
    epoch: int = 0
    position: int = 0
    """The cursor: the next position of `epoch`'s order to hand out."""
    taken: dict[str, int] = field(default_factory=dict)
    """A weighted order: tasks of each level handed out by the cursor this epoch."""
    next_seq: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    """Tasks per state (STATES) and events (EVENTS)."""
    held: dict[str, int] = field(default_factory=dict)
    """Leases held per producer."""
    owner: str | None = None
    """The key that registered it (None without keys): only that key's env role adds to it, leases from it and
    sees it (`api.owners`)."""

    def to_json(self) -> str:
        out = {f.name: getattr(self, f.name) for f in fields(self)}  # not asdict: no deep copies
        for name, default in _WEIGHTED_DEFAULTS.items():
            if out[name] == default:
                del out[name]  # a dataset of another order keeps the record it had before weighted orders
        return json.dumps(out, separators=(",", ":"))

    @staticmethod
    def of(text: str) -> Dataset:
        return Dataset(**json.loads(text))

    @property
    def exhausted(self) -> bool:
        """Every epoch handed out and nothing leased or waiting: what is left to come is the fate of its submitted
        groups (queued, or held), of which a dropped one may still be offered again under `max_retries`."""
        last = self.epochs is not None and self.epoch >= self.epochs - 1 and self.position >= self.size
        return self.sealed and last and not any(self.counts.get(s) for s in (LEASED, WAITING))

    @property
    def done(self) -> bool:
        """Exhausted, and nothing submitted: every task trained, dropped or failed (docs/tasks.md, "The end of a
        dataset")."""
        return self.exhausted and not self.counts.get(SUBMITTED)


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


def token_of(name: str, epoch: int, index: int, leases: int, nonce: str | None) -> str:
    base = f"{TOKEN_PREFIX}{name}:{epoch}:{index}:{leases}"
    return base if nonce is None else f"{base}.{nonce}"


@dataclass(frozen=True, slots=True)
class Token:
    """A lease token, parsed."""

    dataset: str
    epoch: int
    index: int
    lease: int
    """The task's lease number it was given with (a lease that lapsed is told apart from the one after it)."""
    nonce: str | None


def parse_token(token: str) -> Token | None:
    """The token's parts, or None if `token` is not a lease token. Total: any string parses or is None."""
    found = _TOKEN.fullmatch(token) if token.startswith(TOKEN_PREFIX) else None
    if found is None:
        return None
    name, epoch, index, lease, nonce = found.groups()
    return Token(name, int(epoch), int(index), int(lease), nonce)


def is_token(group_id: str | None) -> bool:
    """Whether a group id claims to be a lease token (it has the prefix): it must then parse and be held."""
    return group_id is not None and group_id.startswith(TOKEN_PREFIX)


def _same_lease(row: TaskRow, token: Token) -> bool:
    """Whether `token` is the token of `row`'s current lease (its number, and its random part, compared in
    constant time; a lease taken before tokens had one matches a token without)."""
    if row.leases != token.lease:
        return False
    if row.nonce is None or token.nonce is None:
        return row.nonce is None and token.nonce is None
    return hmac.compare_digest(row.nonce, token.nonce)


class _Moves:
    """The dataset records one function changed, written once at its end."""

    def __init__(self, txn: Txn) -> None:
        self.txn = txn
        self.sets: dict[str, Dataset] = {}

    def get(self, name: str) -> Dataset | None:
        if name not in self.sets:
            text = self.txn.tasks.get_dataset(name)
            if text is None:
                return None
            self.sets[name] = Dataset.of(text)
        return self.sets[name]

    def write(self) -> None:
        for d in self.sets.values():
            self.txn.tasks.put_dataset(d.name, d.to_json())


def _moved(d: Dataset, row: TaskRow, new: TaskRow) -> TaskRow:
    """`new`, a move of `row` (api/tasks/states.py), with its dataset's tallies and held leases moved along: a
    move to the front takes the place `d.next_seq` gave it, and a task offered again counts as retried."""
    d.counts = states.counted(d.counts, row.state, new.state)
    if row.state == LEASED and row.producer is not None:
        left = d.held.get(row.producer, 0) - 1
        if left > 0:
            d.held[row.producer] = left
        else:
            d.held.pop(row.producer, None)
    if new.state == LEASED and new.producer is not None:
        d.held[new.producer] = d.held.get(new.producer, 0) + 1
    if new.state == WAITING:
        d.next_seq = max(d.next_seq, new.seq + 1)
        if new.retries > row.retries:
            _count(d, "retried")
    return new


def _count(d: Dataset, event: str, n: int = 1) -> None:
    d.counts[event] = d.counts.get(event, 0) + n


def dataset(moves: _Moves, name: str, actor: Actor, loc: tuple[str | int, ...] = ("body", "dataset")) -> Dataset:
    """The dataset `actor` acts on: 404 if there is none of that name, or another key's (answered alike)."""
    d = moves.get(name)
    unknown = NotFound(f"no dataset {name!r}", loc=loc)
    if d is None:
        raise unknown
    actor.check(d.owner, "dataset", unknown)
    return d


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
    _put_totals(txn, d.owner, replace(held, datasets=held.datasets + 1))
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
    bounds: Bounds = Bounds(),
    reading: tuple[str, float] | None = None,
) -> Dataset:
    """Store a page of tasks at `first` (the dataset's size so far: pages come in order; of a page sent again only
    the tasks past those stored are stored, so a retry is a no-op); `last` seals the dataset. `where`: the field a
    task that breaks a rule is reported at. A page starting past the tasks stored is a 409 (at `first`), as is one
    past the key's bytes (`bounds.key_bytes`); past `bounds.dataset_size` tasks, a 422. `reading`: (reader, now)
    of a registration reading the dataset's file, whose claim (`claim_reading`) it renews, or ends with the last
    page; a page of a reader whose claim another took over is a 409."""
    moves = _Moves(txn)
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
        _put_totals(txn, d.owner, replace(held, bytes=held.bytes + cost))
    d.size += len(new)
    d.sealed = last
    moves.write()
    return d


def claim_reading(txn: Txn, name: str, reader: str, now: float, actor: Actor = ANYONE) -> Dataset:
    """Registration `reader` starts reading the file of dataset `name`, or takes over from one whose claim lapsed
    (`READ_CLAIM_S` without a page): tasks are stored once however often a registration is sent. While another's
    claim holds, a 409 saying how far it got."""
    moves = _Moves(txn)
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
    moves = _Moves(txn)
    d = dataset(moves, name, actor)
    tasks = txn.tasks
    n = max(0, min(n, max_held - d.held.get(producer, 0)))
    expired, front = tasks.reclaimable(name, now, RECLAIM_LIMIT, n)
    if expired:
        _count(d, "expired", len(expired))
    # Expired leases join the front behind what waits there already (their seq is the next), and are taken after.
    back = [_moved(d, row, states.expire(row, d.next_seq)) for row in expired]
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
            _moved(d, row, states.lease(row, producer=producer, until=until, holder=holder, nonce=nonce, now=now))
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


def _held(txn: Txn, token: str, actor: Actor) -> tuple[Dataset, TaskRow, _Moves] | None:
    """The dataset and row of a lease that is still held under this token and that `actor` may act on, else None
    (not a token, an unknown dataset, a lease lost, a token that is not the lease's, another key's lease: all
    alike, so a key learns nothing of another's leases)."""
    parsed = parse_token(token)
    if parsed is None:
        return None  # not a token: no lease it could hold
    moves = _Moves(txn)
    d = moves.get(parsed.dataset)
    if d is None:
        return None
    key = (parsed.epoch, parsed.index)
    row = txn.tasks.rows(parsed.dataset, [key]).get(key)
    if row is None or row.state != LEASED or not _same_lease(row, parsed):
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
        txn.tasks.put_rows([_moved(d, row, states.hand_back(row, d.next_seq, now))])
    else:
        txn.tasks.put_rows([_moved(d, row, states.fail(row, reason, now, max_retries=d.max_retries, seq=d.next_seq))])
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
    if row.leases == parsed.lease and not _same_lease(row, parsed):
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


def _dropped(d: Dataset, row: TaskRow, reason: str, step: int | None, now: float) -> TaskRow:
    """A submitted task whose group was dropped: offered again while its retries last, else dropped."""
    return _moved(d, row, states.drop(row, reason, step, now, max_retries=d.max_retries, seq=d.next_seq))


# --- hooks: called where the ledger records a group's fate, in the same transaction ---


def on_acknowledged(txn: Txn, rows: Sequence[LedgerGroup]) -> None:
    """Groups just acknowledged (their ledger rows): those sent under a lease mark their task submitted (or, when
    dropped at once, dropped). A group on a lease that expired takes its task back unless another group has it."""
    leased = [(r, p) for r in rows if r.group_id is not None and (p := parse_token(r.group_id)) is not None]
    if not leased or txn.get_value(ANY_KEY) is None:
        return
    _feeding(txn, {r.env_id for r, _ in leased})
    moves = _Moves(txn)
    now = rows[0].acked_at
    for ledger_row, token in leased:
        name, key = token.dataset, (token.epoch, token.index)
        d = moves.get(name)
        row = txn.tasks.rows(name, [key]).get(key) if d else None
        if d is None or row is None or not states.may("submit", row):
            if d is not None:
                _count(d, "late")
            continue
        row = _moved(d, row, states.submit(row, ledger_row.id, now))
        if ledger_row.fate == fates.DROPPED:
            row = _dropped(d, row, ledger_row.reason or DROPPED, ledger_row.step, now)
        txn.tasks.put_rows([row])
    moves.write()


def fed_envs(txn: Txn) -> set[int]:
    """The env ids that sent a group under a task lease (`FED_KEY`)."""
    raw = txn.get_value(FED_KEY)
    return set() if raw is None else set(json.loads(raw))


def _feeding(txn: Txn, env_ids: set[int]) -> None:
    """Record that these envs sent groups under task leases: written only when one is new (once per env)."""
    known = fed_envs(txn)
    if not env_ids <= known:
        txn.set_value(FED_KEY, json.dumps(sorted(known | env_ids)))


def on_decided(txn: Txn, ids: Sequence[int], fate: str, *, step: int, reason: str | None, now: float) -> None:
    """Groups served in batch `step` or dropped (`reason`) at it: their tasks follow (served until the trainer
    acknowledges the step: `on_trained`)."""
    if not ids or fate not in (fates.SERVED, fates.DROPPED) or txn.get_value(ANY_KEY) is None:
        return
    rows = txn.tasks.by_ledger(ids)
    if not rows:
        return
    moves = _Moves(txn)
    out = []
    for row in rows:
        d = moves.get(row.dataset)
        if d is None or not states.may("serve" if fate == fates.SERVED else "drop", row):
            continue
        if fate == fates.SERVED:
            out.append(_moved(d, row, states.serve(row, step, now)))
        else:
            out.append(_dropped(d, row, reason or DROPPED, step, now))
    txn.tasks.put_rows(out)
    moves.write()


def on_trained(txn: Txn, first: int, before: int, now: float) -> None:
    """The trainer acknowledged the batches of steps `first` to `before - 1` (the committed mark moved): their
    served tasks are trained, in their steps. Costs the ledger's rows of those steps and their tasks' rows: the
    groups of each step come from its ledger row, their tasks by ledger id."""
    if before <= first or txn.get_value(ANY_KEY) is None:
        return
    ids = [i for row in txn.ledger.steps(first, before - 1) for i in row.group_ids]
    rows = txn.tasks.by_ledger(ids) if ids else []
    moves = _Moves(txn)
    out = []
    for row in rows:
        d = moves.get(row.dataset)
        if d is not None and states.may("acknowledge", row) and row.step is not None and first <= row.step < before:
            out.append(_moved(d, row, states.acknowledge(row, now)))
    if out:
        txn.tasks.put_rows(out)
        moves.write()


def on_requeued(txn: Txn, old_id: int, new_id: int) -> None:
    """A held group released under a new ledger id: its task follows it."""
    if txn.get_value(ANY_KEY) is None:
        return
    rows = txn.tasks.by_ledger([old_id])
    txn.tasks.put_rows([replace(r, ledger_id=new_id) for r in rows])
