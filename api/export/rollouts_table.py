"""The export's `rollouts` table (docs/rollouts.md): one row per group opened for per-rollout submission, in any
state, with its slots as lists: which were acknowledged and by whom, which are leased to a sibling, which were
left out of its seal and why, and each slot's lineage (resumes, restarts, its turns' producers). The rollouts'
tokens are not here: a sealed group's are the `sequences` table's (joined by `group_id`), an expired group's are
dropped with it (its `groups` row says why)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from api.export.table import TIMESTAMP
from api.rollouts import groups as rg
from api.rollouts import lineage
from api.store.base import ANON_ENV
from api.store.rollouts import GroupRow, TurnKey

_DONE = pa.list_(pa.struct([pa.field("slot", pa.int32()), pa.field("producer", pa.string())]))
_LEASED = pa.list_(
    pa.struct([pa.field("slot", pa.int32()), pa.field("producer", pa.string()), pa.field("expires_at", TIMESTAMP)])
)
_LEFT_OUT = pa.list_(pa.struct([pa.field("slot", pa.int32()), pa.field("reason", pa.string())]))
_RUNS = pa.list_(
    pa.struct(
        [
            pa.field("producer", pa.string()),
            pa.field("turns", pa.int64()),
            pa.field("start", pa.int64()),
            pa.field("end", pa.int64()),
        ]
    )
)
_LINEAGE = pa.list_(
    pa.struct(
        [
            pa.field("slot", pa.int32()),
            pa.field("resumes", pa.int64()),
            pa.field("restarts", pa.int64()),
            pa.field("tokens_saved", pa.int64()),
            pa.field("turns", _RUNS),
        ]
    )
)


def rollouts_schema() -> pa.Schema:
    return pa.schema(
        [
            pa.field("group_id", pa.string(), nullable=False),
            pa.field("env", pa.string(), nullable=False),
            pa.field("env_id", pa.int32()),
            pa.field("state", pa.string(), nullable=False),
            pa.field("group_size", pa.int32(), nullable=False),
            pa.field("min_group_size", pa.int32(), nullable=False),
            pa.field("producer", pa.string(), nullable=False),
            pa.field("deadline", TIMESTAMP, nullable=False),
            pa.field("scores_at_seal", pa.bool_(), nullable=False),
            pa.field("done", _DONE, nullable=False),
            pa.field("leased", _LEASED, nullable=False),
            pa.field("redispatched", pa.int64(), nullable=False),
            pa.field("left_out", _LEFT_OUT, nullable=False),
            pa.field("expired_reason", pa.string()),
            pa.field("bytes", pa.int64(), nullable=False),
            pa.field("lineage", _LINEAGE, nullable=False),
        ]
    )


def _micros(t: float) -> int:
    return round(t * 1_000_000)


def rollout_row(row: GroupRow, done: dict[int, str], env: str, keys: Sequence[TurnKey] = ()) -> dict[str, Any]:
    """`done`: its acknowledged slots -> their producer (`OpenGroupTxn.done`); `leased`: missing slots under a
    sibling's lease (lapsed or not) while the group is live; `left_out`: the slots a sealed group was sealed
    without; `expired_reason`: why an expired group expired; `lineage`: per slot resumed, restarted or with turns,
    its resumes, restarts, tokens they saved and its turns by producer (`keys`: an open group's turns' keys; a
    decided group's record holds them, api/rollouts/lineage.py)."""
    g = rg.OpenGroup.of(row.record)
    made = lineage.with_runs(g.lineage, keys)
    live = row.state in ("open", "sealing")
    leased = sorted((int(k), v) for k, v in g.leases.items() if int(k) not in done) if live else []
    expired = g.left_out.get("group") if row.state == "expired" else None
    left = [] if expired is not None else sorted((int(k), why) for k, why in g.left_out.items())
    return {
        "group_id": g.key,
        "env": env,
        "env_id": None if row.env_id == ANON_ENV else row.env_id,
        "state": row.state,
        "group_size": g.group_size,
        "min_group_size": g.min_group_size,
        "producer": g.producer,
        "deadline": _micros(g.deadline),
        "scores_at_seal": g.scores_at_seal,
        "done": [{"slot": k, "producer": p} for k, p in sorted(done.items())],
        "leased": [{"slot": s, "producer": str(v[0]), "expires_at": _micros(float(v[1]))} for s, v in leased],
        "redispatched": g.redispatched,
        "left_out": [{"slot": s, "reason": why} for s, why in left],
        "expired_reason": expired,
        "bytes": row.bytes,
        "lineage": [
            {
                "slot": int(slot),
                "resumes": e.get("resumes", 0),
                "restarts": e.get("restarts", 0),
                "tokens_saved": e.get("saved", 0),
                "turns": [{"producer": p, "turns": n, "start": a, "end": b} for p, n, a, b in e.get("turns", [])],
            }
            for slot, e in sorted(made.items(), key=lambda kv: int(kv[0]))
        ],
    }
