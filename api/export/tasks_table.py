"""The export's `tasks` table (docs/tasks.md): one row per (dataset, epoch, task) handed out, with its fate."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from api.export.table import TIMESTAMP
from api.store.tasks import TaskRow


def tasks_schema() -> pa.Schema:
    return pa.schema(
        [
            pa.field("dataset", pa.string(), nullable=False),
            pa.field("epoch", pa.int64(), nullable=False),
            pa.field("index", pa.int64(), nullable=False),
            pa.field("state", pa.string(), nullable=False),
            pa.field("leases", pa.int64(), nullable=False),
            pa.field("producer", pa.string()),
            pa.field("retries", pa.int64(), nullable=False),
            pa.field("group", pa.int64()),
            pa.field("step", pa.int64()),
            pa.field("reason", pa.string()),
            pa.field("updated_at", TIMESTAMP, nullable=False),
        ]
    )


def task_row(r: TaskRow) -> dict[str, Any]:
    """`group`: the ledger id of its group (the `groups` table's `group`)."""
    return {
        "dataset": r.dataset,
        "epoch": r.epoch,
        "index": r.index,
        "state": r.state,
        "leases": r.leases,
        "producer": r.producer,
        "retries": r.retries,
        "group": r.ledger_id,
        "step": r.step,
        "reason": r.reason,
        "updated_at": round(r.updated_at * 1_000_000),
    }
