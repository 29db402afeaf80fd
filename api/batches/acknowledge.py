"""Acknowledging served batches, inside one store transaction: `acknowledge` (what asking for a later batch in
"next" mode, and `POST /commit`, both do) frees the batches before the new mark on every store, and the mark is
kept with them. The rules are `api/run/kept.py`'s."""

from __future__ import annotations

import time

from api.errors import Conflict
from api.ledger.recorder import OFF, Recorder
from api.run import state
from api.run.kept import Kept, check_commit
from api.run.state import RunState
from api.store.base import Txn
from api.wire.schema import CommitReply


def acknowledge(txn: Txn, kept: Kept, step: int, books: Recorder, at: float, *, save: bool = True) -> Kept:
    """Every batch before `step` acknowledged: the batches kept for serving again before it are freed (their
    payloads retained with retention), their ledger steps marked committed, the tasks served in the steps passed
    trained (`Recorder.trained`), and the moved mark saved (unless `save` is False: the caller saves it with
    more). A step at or below the mark changes nothing."""
    after = kept.acknowledge(step)
    if after.sizes != kept.sizes:  # the mark passed kept batches (a batch not kept was never stored)
        txn.drop_batches_before(after.committed, retain=books.retain)
        books.committed(txn, kept.committed, after.committed, at)
    if after.committed > kept.committed:
        books.trained(txn, kept.committed, after.committed, at)
    if save and after != kept:
        state.save_kept(txn, after)
    return after


def commit_txn(
    txn: Txn, step: int, known: RunState | None = None, books: Recorder = OFF
) -> tuple[CommitReply, RunState]:
    """Acknowledge every batch before `step` (in either mode: in "next" mode it frees what asking for `step`
    would); a step at or below the last commit changes nothing, so a retried commit is harmless. The ledger's
    step rows say when (`books`); with retention, the batches' payloads stay, retained."""
    run = state.load(txn, known)
    if run.registration is None:
        raise Conflict("no trainer is registered: POST /register first", loc=("body", "step"))
    check_commit(step, run.step)
    after = acknowledge(txn, state.load_kept(txn, run), step, books, time.time())
    reply = CommitReply(
        committed_step=after.committed, next_step=run.step, kept_batches=len(after.sizes), kept_bytes=after.bytes
    )
    return reply, run
