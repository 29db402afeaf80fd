"""The store contract: where everything the service acknowledged lives, and how it changes atomically.

The service's logic (ingest, side buffer, batch formation) is written once, as synchronous functions over
a `Txn`; each backend supplies `Store.transact`, which runs such a function so that its effects apply
fully or not at all and no other transaction interleaves with it. That is what makes "take a batch" one
atomic operation on every backend, whether it runs under one event loop, one SQLite write transaction
or a lock shared by many server processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from api.errors import Unavailable
from api.items import ItemMeta
from api.store.tasks import TaskTxn

T = TypeVar("T")

__all__ = [
    "ANON_ENV",
    "DROPPED",
    "FATES",
    "HELD",
    "QUEUED",
    "SERVED",
    "HeldGroup",
    "HeldMeta",
    "ItemMeta",
    "KeptPayload",
    "LedgerGroup",
    "LedgerStep",
    "QueueCounts",
    "QueuedItem",
    "Store",
    "StoreUnavailable",
    "Txn",
    "held_slot",
]

ANON_ENV = -1
"""Queue of groups posted with `env_id: null` (Atropos accepts them; they get weight 1 and no side buffer)."""


@dataclass(frozen=True, slots=True)
class QueuedItem:
    """A unit of the queue: one group, or side-buffered partial groups released together (never split)."""

    meta: ItemMeta
    n_groups: int
    payload: bytes
    """`n_groups` group records (docs/binary-format.md), concatenated."""


@dataclass(frozen=True, slots=True)
class HeldGroup:
    """A group in its env's side buffer: its size is not the env's group size, so it waits until held groups
    add up to it (Atropos's mixed-size buffering). One row per group, like the queue."""

    meta: ItemMeta
    """`item_id` from `next_item_id`: held groups of an env are ordered by it, oldest first."""
    held_at: float
    """Wall-clock seconds when it was held: it expires `side_buffer_ttl_s` later."""
    payload: bytes


@dataclass(frozen=True, slots=True)
class HeldMeta:
    """What deciding on a held group needs (release, expiry, limits), without its payload."""

    meta: ItemMeta
    held_at: float
    size: int
    """Payload bytes."""


def held_slot(env_id: int) -> int:
    """The key under which SQL backends keep env_id's side-buffer counts beside the queue counts (ids of real
    queues are ANON_ENV or above), so that both are read together, at no extra round trip."""
    return -2 - env_id


@dataclass(frozen=True, slots=True)
class QueueCounts:
    items: int = 0
    groups: int = 0
    seqs: int = 0
    tokens: int = 0
    bytes: int = 0
    """Payload bytes: the stored records, metadata included."""

    @staticmethod
    def of(items: Iterable[QueuedItem]) -> QueueCounts:
        """What these items add to a queue's counts (or take from them, popped)."""
        n = groups = seqs = tokens = size = 0
        for it in items:
            n += 1
            groups += it.n_groups
            seqs += it.meta.seqs
            tokens += it.meta.tokens
            size += len(it.payload)
        return QueueCounts(n, groups, seqs, tokens, size)

    def __add__(self, other: QueueCounts) -> QueueCounts:
        return QueueCounts(
            self.items + other.items,
            self.groups + other.groups,
            self.seqs + other.seqs,
            self.tokens + other.tokens,
            self.bytes + other.bytes,
        )

    def __sub__(self, other: QueueCounts) -> QueueCounts:
        return QueueCounts(
            self.items - other.items,
            self.groups - other.groups,
            self.seqs - other.seqs,
            self.tokens - other.tokens,
            self.bytes - other.bytes,
        )


QUEUED = "queued"
HELD = "held"
"""In its env's side buffer (`side-buffered`)."""
SERVED = "served"
DROPPED = "dropped"
FATES = (QUEUED, HELD, SERVED, DROPPED)
"""A group's fate in the ledger: queued and held are open (they change), served and dropped are final."""


@dataclass(frozen=True, slots=True)
class LedgerGroup:
    """The ledger's row for one acknowledged group (docs/ledger.md): written in the transaction that
    acknowledged it, and changed only in the transaction that decided its fate."""

    id: int
    """The item id the group is stored under (`next_item_id`): a group released from a side buffer is queued
    under a new id, and its row moves with it (`ledger_requeue`), so one group is always one row."""
    env_id: int
    """ANON_ENV for groups posted with `env_id: null`."""
    group_id: str | None
    """The handler's group id, as sent."""
    handler: str | None
    """The API key that sent it (its name), when the service knows it: None without auth."""
    acked_at: float
    """Wall-clock seconds when it was acknowledged."""
    policy_step: int
    seqs: int
    tokens: int
    bytes: int
    """Payload bytes as stored (what keeping it costs)."""
    score_mean: float
    score_min: float
    score_max: float
    score_std: float
    """Population standard deviation of its sequences' scores (0 for one sequence)."""
    fate: str
    """One of FATES."""
    step: int | None = None
    """Served: the batch's step. Dropped: the step to be formed next when it was dropped. Else None."""
    reason: str | None = None
    """Dropped: why (a filter's name, `stale`, `side_buffer_expired`). Else None."""
    decided_at: float | None = None
    """Wall-clock seconds of the served or dropped decision."""
    kept: bool = False
    """Its payload is retained past its fate (retention): readable with `kept_payloads` until pruned."""
    producer_id: str | None = None
    """The producer that made it (the group's `producer_id`, a rollbuf extension: its heartbeat id), if sent."""


@dataclass(frozen=True, slots=True)
class LedgerStep:
    """The ledger's row for one formed batch: written in the transaction that formed it."""

    step: int
    formed_at: float
    formation_s: float
    """Seconds batch formation took (inside the transaction)."""
    group_ids: tuple[int, ...]
    """Ledger ids (`LedgerGroup.id`) of its groups, in the order the batch holds them: any rank's share is
    `api.sharding.rank_share` of the batch in this order (shares are cut on reads, not recorded: docs/ledger.md)."""
    seqs: int
    tokens: int
    groups_by_env: dict[str, int]
    """Groups per env name (`wandb_name`)."""
    seqs_by_env: dict[str, int]
    staleness: dict[int, int]
    """Groups by staleness (the step minus the group's policy step)."""
    committed_at: float | None = None
    """When the batch was acknowledged (commit, or asking for a later step); None while it is not."""


@dataclass(frozen=True, slots=True)
class KeptPayload:
    """A retained payload's place in the retention order (`kept_oldest`)."""

    id: int
    step: int
    bytes: int


class Txn(ABC):
    """Synchronous view of the store inside one atomic transaction.

    Every method may be called any number of times; writes are visible to later reads of the same
    transaction. Nothing a transaction wrote is visible to others or survives a crash unless the
    transaction function returned normally.
    """

    # --- small named values: run config, step, scheduler credits, counters (JSON text) ---
    @abstractmethod
    def get_value(self, key: str) -> str | None: ...

    @abstractmethod
    def set_value(self, key: str, value: str) -> None: ...

    # --- the queue: one FIFO per env ---
    @abstractmethod
    def append(self, env_id: int, item: QueuedItem) -> None:
        """Add at the tail of env_id's queue; `item.meta.item_id` comes from `next_item_id`."""

    @abstractmethod
    def next_item_id(self) -> int:
        """A fresh id, larger than every id handed out before (also across restarts)."""

    @abstractmethod
    def head(self, env_id: int) -> Iterator[ItemMeta]:
        """env_id's queued items, oldest first. Costs what is consumed of it, not the queue length."""

    @abstractmethod
    def pop(
        self, env_id: int, item_ids: Iterable[int], *, keep_for: int | None = None, retain: bool = False
    ) -> list[QueuedItem]:
        """Remove these items of env_id's queue and return them in the order asked for.

        With `keep_for=N` their payloads stay in the store for batch N (`put_batch`) until
        `drop_batches_before` passes N: a kept batch refers to payloads, it never copies them.
        With `retain` (and no `keep_for`), their payloads stay as retained payloads (`kept_payloads`), under
        their item ids, until `prune_payloads`: no copy either."""

    @abstractmethod
    def counts(self) -> dict[int, QueueCounts]:
        """Queued items, groups, sequences, tokens and payload bytes per env (envs with nothing queued may be absent).
        Kept incrementally: O(envs), not O(queue)."""

    # --- the side buffer: groups held per env until they add up to its group size (bounded by the service) ---
    @abstractmethod
    def hold(self, env_id: int, group: HeldGroup) -> None:
        """Hold `group` in env_id's side buffer. Costs the group, not what the buffer holds."""

    @abstractmethod
    def held(self, env_id: int) -> list[HeldMeta]:
        """env_id's held groups, oldest first, without payloads."""

    @abstractmethod
    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        """Remove these held groups of env_id and return them, with payloads, in the order asked for; KeyError
        (and nothing removed) if one of them is not held there."""

    @abstractmethod
    def held_counts(self) -> dict[int, QueueCounts]:
        """Held groups (as items and groups), sequences, tokens and payload bytes per env (envs holding nothing
        may be absent). Kept incrementally: O(envs), not O(held groups)."""

    # --- envs: one record per env, each with the version of the change that last wrote it ---
    @abstractmethod
    def put_env(self, env_id: int, name: str, version: int, record: str) -> None:
        """Write env `env_id`'s record (JSON text), registered under `name`, by the change numbered `version`."""

    @abstractmethod
    def envs_since(self, version: int) -> list[tuple[int, str]]:
        """(env_id, record) of the envs written by a change numbered above `version` (-1: every env), by id.
        Costs the envs returned, not all of them: a process that knows the envs reads only what changed."""

    @abstractmethod
    def count_named(self, name: str) -> int:
        """Envs registered under `name`. Costs those, not all envs."""

    # --- counters: cumulative counts by kind and name (groups received per env, ...) ---
    @abstractmethod
    def add_counts(self, kind: str, deltas: Mapping[str, int]) -> None:
        """Add to these counters of `kind`; costs the counters added to, not all of that kind."""

    @abstractmethod
    def get_counts(self, kind: str) -> dict[str, int]:
        """Every counter of `kind`, by name."""

    # --- idempotency: replies remembered by submission key ---
    @abstractmethod
    def get_reply(self, key: str) -> str | None: ...

    @abstractmethod
    def put_reply(self, key: str, reply: str) -> None: ...

    # --- formed batches, kept until acknowledged (exactly-once per step) ---
    @abstractmethod
    def put_batch(self, step: int, header: bytes, item_ids: Sequence[int]) -> None:
        """Keep batch `step`: `header`, then the payloads of these items (popped with `keep_for=step`)."""

    @abstractmethod
    def get_batch(self, step: int) -> bytes | None:
        """Batch `step` as put: its header and its items' payloads, back to back; None if not kept."""

    @abstractmethod
    def drop_batches_before(self, step: int, *, retain: bool = False) -> None:
        """Forget every batch before `step`, and the payloads kept for them; with `retain`, those payloads stay
        as retained payloads (`kept_payloads`) until `prune_payloads`."""

    # --- the ledger (docs/ledger.md): one row per acknowledged group, one per formed batch ---
    # Every write lands in the same transaction as the decision it records: a row is never ahead of or behind
    # the queue. Ledger rows of ids that are absent (pruned) are skipped by every update, never an error.
    @abstractmethod
    def ledger_add(self, rows: Sequence[LedgerGroup]) -> None:
        """Add rows for newly acknowledged groups (ids not in the ledger). Costs the rows."""

    @abstractmethod
    def ledger_decide(
        self,
        ids: Sequence[int],
        fate: str,
        *,
        step: int | None = None,
        reason: str | None = None,
        at: float | None = None,
        kept: bool = False,
    ) -> None:
        """Set these rows' fate, `step`, `reason`, `decided_at=at` and `kept`. Costs the rows (id lookups)."""

    @abstractmethod
    def ledger_requeue(self, old_id: int, new_id: int) -> None:
        """A held group released into its queue under `new_id`: its row moves to that id, fate QUEUED."""

    @abstractmethod
    def ledger_groups(self, ids: Iterable[int]) -> list[LedgerGroup]:
        """The rows of these ids that exist, in the order asked for."""

    @abstractmethod
    def ledger_named(self, group_id: str) -> list[LedgerGroup]:
        """Rows whose `group_id` is this one (one per env that used it, or more), by id. Costs those rows."""

    @abstractmethod
    def ledger_scan(self, after_id: int, limit: int) -> list[LedgerGroup]:
        """Up to `limit` rows with id above `after_id`, by id: page through the ledger (the export) at a cost of
        the page, not the ledger."""

    @abstractmethod
    def ledger_dropped(self, first_step: int, last_step: int, limit: int) -> list[LedgerGroup]:
        """Up to `limit` rows of dropped groups whose `step` is in [first_step, last_step], by step then id: what
        the drop-bias monitor compares with the groups trained. Costs the rows returned (an index on dropped
        rows only: the write cost lands on drops, not on every group)."""

    @abstractmethod
    def ledger_put_step(self, row: LedgerStep) -> None:
        """Write a formed batch's row (replacing one of the same step: a reset run forms step N again)."""

    @abstractmethod
    def ledger_committed(self, first: int, before: int, at: float) -> None:
        """Mark the step rows in [first, before) not marked yet as committed at `at`. Costs that range."""

    @abstractmethod
    def ledger_steps(self, first: int, last: int) -> list[LedgerStep]:
        """Step rows in [first, last], by step."""

    @abstractmethod
    def ledger_prune(self, below_id: int, below_step: int) -> int:
        """Forget group rows with id below `below_id` whose fate is final (served, dropped) and whose payload is
        not retained (`kept`), and step rows below `below_step`; the group rows forgotten. Costs the rows below
        `below_id`, not the ledger."""

    # --- retained payloads (retention, docs/ledger.md): payloads of served and dropped groups, by ledger id ---
    @abstractmethod
    def keep_payloads(self, items: Sequence[tuple[int, bytes]]) -> None:
        """Retain payloads of groups that are not stored otherwise (dropped at ingest, expired when held)."""

    @abstractmethod
    def kept_payloads(self, ids: Iterable[int]) -> dict[int, bytes]:
        """The retained payloads of these ids (absent ones left out); also payloads of kept batches."""

    @abstractmethod
    def kept_oldest(self, limit: int) -> list[KeptPayload]:
        """Up to `limit` retained payloads, oldest step first (then id), from the ledger rows marked `kept`:
        what retention prunes first. Costs the rows returned."""

    @abstractmethod
    def prune_payloads(self, ids: Sequence[int]) -> None:
        """Forget these retained payloads and unmark their rows' `kept`. The caller never names one that is
        queued or in a kept batch."""

    # --- tasks leased to producers (docs/tasks.md): their own concern, in api/store/tasks.py ---
    @property
    @abstractmethod
    def tasks(self) -> TaskTxn:
        """The task tables, in this transaction."""

    # --- everything ---
    @abstractmethod
    def clear(self) -> None:
        """Forget every queue, buffer, batch, env, counter, value, remembered reply, ledger row and retained
        payload (GET /reset_data)."""


class StoreUnavailable(Unavailable):
    """The store cannot be reached, or whether a transaction committed is unknown (the connection dropped
    during COMMIT): answered with 503, and a retry with the same group id or Idempotency-Key is recognised
    as a duplicate if the first attempt did commit."""

    code = "store_unavailable"


class Store(ABC):
    """A backend. `transact` is the only way state changes."""

    url: str

    @abstractmethod
    async def transact(self, fn: Callable[[Txn], T], *, replies: Sequence[str] = ()) -> T:
        """Run fn atomically: its writes apply all together, and only if it returns without raising.

        Durable backends return only after the writes are durable, so a reply sent after `transact`
        returns never acknowledges something a crash could lose. `replies`: idempotency keys fn will look up
        with `get_reply`; a backend whose reads are round trips may read them ahead, with its first reads.
        """

    async def read(self, fn: Callable[[Txn], T]) -> T:
        """Run fn, which only reads, on a consistent view of what is committed (a write raises or is refused).

        A backend may run reads beside transactions (PostgreSQL: a snapshot, without the store lock); by
        default a read is a transaction like any other."""
        return await self.transact(fn)

    def not_ready(self) -> str | None:
        """Why the store cannot take writes now, when it knows without a round trip (a full disk, a failing
        checkpoint): /readyz says it. None: nothing known to be wrong (reads are probed separately)."""
        return None

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the running event loop whenever another process sharing this store commits
        queued data (long-polling trainers wake on it). Backends shared only within one process never call it;
        without it, long-polls re-check on a timer."""
        return None

    async def close(self) -> None:
        """Release connections and files."""
        return None
