"""The export's reads: the ledger paged from a store, converted (`api.export.table`) and written as Parquet
chunks (`api.export.parquet`), one page of the store and one row group in memory at a time.

Each page is one read transaction (`Store.read`), and its conversion and compression run in a worker thread:
the export runs beside a live service without holding its event loop or its store. A run being exported goes
on, so the tables are a walk through the ledger, not one snapshot: a group read as queued in one page may be
served by the time a later page is read. Group rows are read by ledger id (`ledger.scan`) until a page comes
back short; step rows by step, up to the run's step when the export began.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import anyio.to_thread
import msgpack
import pyarrow as pa

from api.export.parquet import ParquetChunks
from api.export.rollouts_table import rollout_row, rollouts_schema
from api.export.table import (
    ROW_GROUP_BYTES,
    ROW_GROUP_ROWS,
    RowBatcher,
    SequenceBatcher,
    fate_of,
    group_row,
    groups_schema,
    step_row,
    steps_schema,
)
from api.export.tasks_table import task_row, tasks_schema
from api.ledger.rules import readable_payloads
from api.rollouts import txns as rollout_txns
from api.run import state, stats
from api.run.state import RunState
from api.store.base import SERVED, LedgerGroup, LedgerStep, Store, Txn
from api.store.rollouts import GroupRow, TurnKey
from api.store.tasks import TaskRow
from api.tasks.service import views_txn
from api.tasks.states import STATES
from api.wire.records import Buffer, decode

SEQUENCES = "sequences"
GROUPS = "groups"
STEPS = "steps"
TASKS = "tasks"
ROLLOUTS = "rollouts"
TABLES = (SEQUENCES, GROUPS, STEPS, TASKS, ROLLOUTS)
"""The export's tables, each one Parquet file `<name>.parquet`."""

PAGE_GROUPS = 256
"""Ledger rows (and their kept payloads) read per transaction."""
PAGE_STEPS = 1024
"""Step rows read per transaction."""
PAGE_BYTES = 16 << 20
"""Payload bytes (as stored) read per transaction: a page of groups shrinks for large payloads (256 groups of
1 MB images held 256 MB, several times that decoded), down to one group."""


@dataclass(frozen=True, slots=True)
class ExportLimits:
    """How much the export holds at once: a page of the store, and a record batch (Parquet row group)."""

    page_groups: int = PAGE_GROUPS
    page_steps: int = PAGE_STEPS
    page_bytes: int = PAGE_BYTES
    row_group_rows: int = ROW_GROUP_ROWS
    row_group_bytes: int = ROW_GROUP_BYTES


@dataclass(frozen=True, slots=True)
class Page:
    """One read transaction's worth of the ledger."""

    groups: list[LedgerGroup]
    steps: list[LedgerStep]
    payloads: dict[int, bytes]
    """Payloads the store still holds of these groups (retained, or in a kept batch)."""
    run: RunState
    last: bool = False
    """The scan reached the ledger's end: no further page."""
    tasks: list[TaskRow] = field(default_factory=list)
    """Task rows (the `tasks` table: docs/tasks.md)."""
    rollouts: list[GroupRow] = field(default_factory=list)
    """Groups opened for per-rollout submission (the `rollouts` table: docs/rollouts.md)."""
    rollout_slots: dict[str, dict[int, str]] = field(default_factory=dict)
    """Their acknowledged slots -> producer, by group."""
    rollout_turns: dict[str, list[TurnKey]] = field(default_factory=dict)
    """The open ones' turns' keys, by group (a decided group's lineage is in its record)."""

    @property
    def size(self) -> int:
        return len(self.groups) + len(self.steps) + len(self.tasks) + len(self.rollouts)


def read_groups(txn: Txn, after_id: int, limit: int, payloads: bool, max_bytes: int = PAGE_BYTES) -> Page:
    """Up to `limit` group rows after `after_id`; with their `payloads`, only as many rows as hold `max_bytes`
    of them (at least one): the page's memory is bounded by bytes, not rows."""
    rows = txn.ledger.scan(after_id, limit)
    last = len(rows) < limit
    wanted: list[int] = []
    if payloads:
        size = 0
        for n, r in enumerate(rows):
            if not (r.kept or r.fate == SERVED):
                continue
            if wanted and size + r.bytes > max_bytes:
                rows, last = rows[:n], False
                break
            wanted.append(r.id)
            size += r.bytes
    kept = readable_payloads(txn, wanted)[0] if wanted else {}  # a lost one: its row, without sequences
    return Page(rows, [], kept, state.load(txn), last)


def read_steps(txn: Txn, first: int, last: int) -> Page:
    return Page([], txn.ledger.steps(first, last), {}, state.load(txn))


def read_tasks(txn: Txn, name: str, after: tuple[int, int], limit: int) -> Page:
    """A page of task rows, as stored."""
    return Page([], [], {}, state.load(txn), tasks=txn.tasks.scan(name, after, limit))


def read_rollouts(txn: Txn, after: str, limit: int) -> Page:
    rows = txn.rollouts.scan(after, limit)
    done = {r.key: txn.rollouts.done(r.key) for r in rows}
    turns = {r.key: txn.rollouts.turn_keys(r.key) for r in rows if r.state == "open"}
    return Page([], [], {}, state.load(txn), rollouts=rows, rollout_slots=done, rollout_turns=turns)


async def pages(table: str, store: Store, limits: ExportLimits) -> AsyncIterator[Page]:
    """The store's pages a table is written from, each read in its own transaction."""
    if table == ROLLOUTS:
        opened = ""
        while True:
            page = await store.read(partial(read_rollouts, after=opened, limit=limits.page_groups))
            if page.rollouts:
                yield page
                opened = page.rollouts[-1].key
            if len(page.rollouts) < limits.page_groups:
                return
    if table == TASKS:
        for name in await store.read(lambda txn: [v.name for v in views_txn(txn)]):
            key = (-1, -1)
            while True:
                page = await store.read(partial(read_tasks, name=name, after=key, limit=limits.page_groups))
                if page.tasks:
                    yield page
                    key = (page.tasks[-1].epoch, page.tasks[-1].index)
                if len(page.tasks) < limits.page_groups:
                    break
        return
    if table == STEPS:
        end = await store.read(lambda txn: state.load(txn).step)
        first = 0
        while first < end:
            last = min(end, first + limits.page_steps) - 1
            yield await store.read(partial(read_steps, first=first, last=last))
            first = last + 1
        return
    after = -(1 << 62)
    while True:
        read = partial(
            read_groups,
            after_id=after,
            limit=limits.page_groups,
            payloads=table == SEQUENCES,
            max_bytes=limits.page_bytes,
        )
        page = await store.read(read)
        if page.groups:
            yield page
            after = page.groups[-1].id
        if page.last:
            return


def records_of(payload: Buffer) -> Iterator[Buffer]:
    """The group records of a payload: one, or several back to back (a queue item may hold more than one)."""
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(payload), 1))
    unpacker.feed(payload)
    start = 0
    while start < len(payload):
        unpacker.skip()
        end = unpacker.tell()
        yield payload[start:end]
        start = end


class TableWriter:
    """One table's Parquet file, fed page by page (synchronous: the driver runs it in a worker thread).
    `feed` and `finish` return the file's bytes written since the last call."""

    def __init__(self, table: str, limits: ExportLimits = ExportLimits()) -> None:
        if table not in TABLES:
            raise ValueError(f"table {table!r}: one of {', '.join(TABLES)}")
        self.table = table
        self.seqs = SequenceBatcher(limits.row_group_rows, limits.row_group_bytes)
        schemas = {GROUPS: groups_schema, STEPS: steps_schema, TASKS: tasks_schema, ROLLOUTS: rollouts_schema}
        rows = schemas.get(table, steps_schema)()
        self.rows = RowBatcher(rows, limits.row_group_rows)
        schema = self.seqs.schema if table == SEQUENCES else self.rows.schema
        self.out = ParquetChunks(schema)
        self.written_rows = 0

    def feed(self, page: Page) -> bytes:
        chunks: list[bytes] = []
        for batch in self._batches(page):
            self.written_rows += batch.num_rows
            chunks.append(self.out.write(batch))
        return b"".join(chunks)

    def finish(self) -> bytes:
        last = self.seqs.flush() if self.table == SEQUENCES else self.rows.flush()
        head = b""
        if last is not None:
            self.written_rows += last.num_rows
            head = self.out.write(last)
        return head + self.out.close()

    def _batches(self, page: Page) -> Iterator[pa.RecordBatch]:
        if self.table == ROLLOUTS:
            for group in page.rollouts:
                if (
                    batch := self.rows.add(
                        rollout_row(
                            group,
                            page.rollout_slots.get(group.key, {}),
                            page.run.env_name(group.env_id),
                            page.rollout_turns.get(group.key, []),
                        )
                    )
                ) is not None:
                    yield batch
            return
        if self.table == TASKS:
            for task in page.tasks:
                if (batch := self.rows.add(task_row(task))) is not None:
                    yield batch
            return
        if self.table == STEPS:
            for step in page.steps:
                if (batch := self.rows.add(step_row(step))) is not None:
                    yield batch
            return
        for row in page.groups:
            env = page.run.env_name(row.env_id)
            if self.table == GROUPS:
                if (batch := self.rows.add(group_row(row, env))) is not None:
                    yield batch
                continue
            payload = page.payloads.get(row.id)
            if payload is None:
                continue
            fate = fate_of(row, env)
            for raw in records_of(payload):
                if (batch := self.seqs.add(fate, decode(raw))) is not None:
                    yield batch


Progress = Callable[[int], None]
"""Called with the number of ledger rows (groups, or steps) just written."""


def _quiet(_: int) -> None:
    return None


async def parquet_stream(
    table: str, store: Store, limits: ExportLimits = ExportLimits(), progress: Progress = _quiet
) -> AsyncIterator[bytes]:
    """One table as a Parquet file, chunk by chunk (row groups as they fill, then the footer)."""
    writer = TableWriter(table, limits)
    async for page in pages(table, store, limits):
        chunk = await anyio.to_thread.run_sync(writer.feed, page)
        progress(page.size)
        if chunk:
            yield chunk
    yield await anyio.to_thread.run_sync(writer.finish)


async def totals(store: Store) -> dict[str, int]:
    """Roughly how many ledger rows each table is written from (groups acknowledged, steps formed, before
    pruning): a progress bar's totals."""

    def read(txn: Txn) -> dict[str, int]:
        received = sum(stats.load(txn).received.values())
        handed = sum(n for v in views_txn(txn) for k, n in v.counts.items() if k in STATES)
        opened = rollout_txns.totals_txn(txn).get("opened", 0)
        return {SEQUENCES: received, GROUPS: received, STEPS: state.load(txn).step, TASKS: handed, ROLLOUTS: opened}

    return await store.read(read)
