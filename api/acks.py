"""Acknowledging served batches, inside one store transaction (`POST /commit`): the batches before the committed
step are freed on every store, and the mark is kept with them. The rules are `api/commits.py`'s."""

from __future__ import annotations

import time

from api import ledger, state
from api.commits import check_commit
from api.errors import Conflict
from api.schema import CommitReply
from api.state import RunState
from api.store.base import Txn


def commit_txn(
    txn: Txn, step: int, known: RunState | None = None, books: ledger.LedgerSettings = ledger.OFF
) -> tuple[CommitReply, RunState]:
    """Acknowledge every batch before `step` (in either mode: in "next" mode it frees what asking for `step`
    would); a step at or below the last commit changes nothing, so a retried commit is harmless. The ledger's
    step rows say when (`books`); with retention, the batches' payloads stay, retained."""
    run = state.load(txn, known)
    if run.registration is None:
        raise Conflict("no trainer is registered: POST /register first", loc=("body", "step"))
    check_commit(step, run.step)
    kept = state.load_kept(txn, run)
    after = kept.acknowledge(step)
    if after != kept:
        txn.drop_batches_before(after.committed, retain=books.retaining)
        state.save_kept(txn, after)
        if books.enabled:
            txn.ledger.committed(kept.committed, after.committed, time.time())
    reply = CommitReply(
        committed_step=after.committed, next_step=run.step, kept_batches=len(after.sizes), kept_bytes=after.bytes
    )
    return reply, run
