"""How the SQL stores write the ledger's rows (`LedgerGroup`, `LedgerStep`) as columns and read them back: one
layout for SQLite and PostgreSQL, so both answer the contract alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from api.store.base import LedgerGroup, LedgerStep

_I64 = np.dtype("<i8")

GROUP_COLUMNS = (
    "id, env_id, group_id, handler, acked_at, policy_step, seqs, tokens, bytes, score_mean, score_min, score_max, "
    "score_std, fate, step, reason, decided_at, kept, producer_id"
)
STEP_COLUMNS = (
    "step, formed_at, formation_s, group_ids, seqs, tokens, groups_by_env, seqs_by_env, staleness, committed_at"
)


def gid_bytes(group_id: str | None) -> bytes | None:
    """A group id as stored: its UTF-8 bytes (a handler's id may hold NUL or a lone surrogate, which text
    columns refuse)."""
    return None if group_id is None else group_id.encode("utf-8", "surrogatepass")


def group_values(r: LedgerGroup) -> tuple[Any, ...]:
    """The columns of GROUP_COLUMNS, in order."""
    return (
        r.id, r.env_id, gid_bytes(r.group_id), r.handler, r.acked_at, r.policy_step, r.seqs, r.tokens, r.bytes,
        r.score_mean, r.score_min, r.score_max, r.score_std, r.fate, r.step, r.reason, r.decided_at, bool(r.kept),
        r.producer_id,
    )  # fmt: skip


def group_of(row: Sequence[Any]) -> LedgerGroup:
    gid = row[2]
    return LedgerGroup(
        id=int(row[0]),
        env_id=int(row[1]),
        group_id=None if gid is None else bytes(gid).decode("utf-8", "surrogatepass"),
        handler=row[3],
        acked_at=float(row[4]),
        policy_step=int(row[5]),
        seqs=int(row[6]),
        tokens=int(row[7]),
        bytes=int(row[8]),
        score_mean=float(row[9]),
        score_min=float(row[10]),
        score_max=float(row[11]),
        score_std=float(row[12]),
        fate=str(row[13]),
        step=None if row[14] is None else int(row[14]),
        reason=row[15],
        decided_at=None if row[16] is None else float(row[16]),
        kept=bool(row[17]),
        producer_id=row[18],
    )


def step_values(r: LedgerStep) -> tuple[Any, ...]:
    """The columns of STEP_COLUMNS, in order (ids as int64 bytes, the dicts as JSON text)."""
    return (
        r.step,
        r.formed_at,
        r.formation_s,
        np.asarray(r.group_ids, dtype=_I64).tobytes(),
        r.seqs,
        r.tokens,
        orjson.dumps(r.groups_by_env).decode(),
        orjson.dumps(r.seqs_by_env).decode(),
        orjson.dumps({str(k): v for k, v in sorted(r.staleness.items())}).decode(),
        r.committed_at,
    )


def step_of(row: Sequence[Any]) -> LedgerStep:
    return LedgerStep(
        step=int(row[0]),
        formed_at=float(row[1]),
        formation_s=float(row[2]),
        group_ids=tuple(np.frombuffer(bytes(row[3]), _I64).tolist()),
        seqs=int(row[4]),
        tokens=int(row[5]),
        groups_by_env=orjson.loads(row[6]),
        seqs_by_env=orjson.loads(row[7]),
        staleness={int(k): int(v) for k, v in orjson.loads(row[8]).items()},
        committed_at=None if row[9] is None else float(row[9]),
    )
