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
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

from api.errors import Unavailable
from api.store.items import ItemMeta
from api.store.ledger_contract import (
    DROPPED,
    FATES,
    HELD,
    QUEUED,
    SERVED,
    KeptPayload,
    LedgerGroup,
    LedgerStep,
    LedgerTxn,
)
from api.store.rollouts import OpenGroupTxn
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
    "HeldTxn",
    "ItemMeta",
    "KeptPayload",
    "LedgerGroup",
    "LedgerStep",
    "LedgerTxn",
    "PayloadLost",
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


class HeldTxn(ABC):
    """The side buffers inside one transaction (`txn.held`): groups held per env until they add up to its group
    size (bounded by the service)."""

    @abstractmethod
    def add(self, env_id: int, group: HeldGroup) -> None:
        """Hold `group` in env_id's side buffer. Costs the group, not what the buffer holds."""

    @abstractmethod
    def groups(self, env_id: int) -> list[HeldMeta]:
        """env_id's held groups, oldest first, without payloads."""

    @abstractmethod
    def release(self, env_id: int, item_ids: Iterable[int]) -> list[HeldGroup]:
        """Remove these held groups of env_id and return them, with payloads, in the order asked for; KeyError
        (and nothing removed) if one of them is not held there."""

    @abstractmethod
    def counts(self) -> dict[int, QueueCounts]:
        """Held groups (as items and groups), sequences, tokens and payload bytes per env (envs holding nothing
        may be absent). Kept incrementally: O(envs), not O(held groups)."""


class Txn(ABC):
    """Synchronous view of the store inside one atomic transaction.

    Every method may be called any number of times; writes are visible to later reads of the same
    transaction. Nothing a transaction wrote is visible to others or survives a crash unless the
    transaction function returned normally. The side buffers and the ledger are concerns of their own, behind
    `held`, `ledger`, `tasks` (tasks leased to producers, docs/tasks.md) and `rollouts` (groups
    whose rollouts arrive one by one, docs/rollouts.md): each backend supplies them as objects
    sharing this transaction.
    """

    held: HeldTxn
    ledger: LedgerTxn
    tasks: TaskTxn
    rollouts: OpenGroupTxn

    # --- small named values: run config, step, scheduler credits, counters (JSON text) ---
    @abstractmethod
    def get_value(self, key: str) -> str | None: ...

    @abstractmethod
    def set_value(self, key: str, value: str) -> None: ...

    @abstractmethod
    def delete_value(self, key: str) -> None:
        """Forget the value of `key` (none set: nothing happens), so that values made per thing (a producer, a
        dataset being read) do not outlive it."""

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
        With `retain` (and no `keep_for`), their payloads stay as retained payloads (`ledger.kept_payloads`), under
        their item ids, until `ledger.prune_payloads`: no copy either."""

    def drop_lost(self, item_ids: Sequence[int]) -> dict[int, list[tuple[ItemMeta, int]]]:
        """Remove from the queue those of these items that are queued, and their payloads, without reading them
        (their bytes were lost: `PayloadLost`); per env, each removed item's meta and `n_groups`. Only a store
        that can lose payloads (SQLite's segment files, after a power loss) raises `PayloadLost`, so only it
        needs this."""
        raise NotImplementedError(f"{type(self).__name__} never loses a payload")

    @abstractmethod
    def counts(self) -> dict[int, QueueCounts]:
        """Queued items, groups, sequences, tokens and payload bytes per env (envs with nothing queued may be absent).
        Kept incrementally: O(envs), not O(queue)."""

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
        as retained payloads (`ledger.kept_payloads`) until `ledger.prune_payloads`."""

    # --- what payloads refer to ---
    @abstractmethod
    def payloads_with(self, marker: bytes) -> Iterator[bytes]:
        """Every stored payload (queued, held, kept for a batch, retained) whose bytes contain `marker`, and
        possibly others, one at a time (read in pages: what a caller does not keep is not held), consumed inside
        the transaction: what the blob tier's collection reads to know which blobs are referenced
        (api/wire/blobs.py). Costs a read of the payloads (a backend that can filter by content does so)."""

    # --- everything ---
    @abstractmethod
    def clear(self) -> None:
        """Forget every queue, buffer, batch, env, counter, value, remembered reply, ledger row and retained
        payload (GET /reset_data)."""


class PayloadLost(RuntimeError):
    """Payloads whose bytes are not what was written (`item_ids`): the store kept the rows but lost the bytes
    (SQLite after a power loss under `synchronous=NORMAL`, docs/stores.md). Raised by whatever reads them
    (`Txn.pop`, `Txn.get_batch`); batch formation drops such queued groups as `payload_lost` and forms a batch
    of the rest (api/batches/lost.py)."""

    def __init__(self, item_ids: Sequence[int], message: str) -> None:
        super().__init__(message)
        self.item_ids = tuple(item_ids)


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

    def expecting(self) -> AbstractContextManager[None]:
        """Around a transaction being prepared (a request decoding the groups it will store): a backend that
        commits in groups may wait briefly for it to join the next one (`api.store.jobs.next_group`). A hint,
        never a promise: nothing waits past its delay, and nothing is held if the transaction never comes."""
        return nullcontext()

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
