"""The ledger's recorder twins (`api/ledger/recorder.py`) change what is written down, never what is decided:
the same requests get the same replies, batches and counters with the ledger off, on, and retaining payloads;
the ledger's rows account for every group, and retention for every payload it keeps."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from api.batches.outcomes import FormedBatch
from api.errors import RollbufError
from api.ingest.submit import expire_txn
from api.ledger.recorder import LEDGER, OFF, RETAINING, Ledger, Recorder, Retaining, recorder
from api.ledger.rules import RETAINED, LedgerSettings
from api.run import state
from api.service import Service
from api.store.base import DROPPED, HELD, QUEUED, SERVED, LedgerGroup, Txn
from api.store.memory import MemoryStore
from api.wire.schema import RegisterEnv, Registration
from tests.factories import env, group, registration

BOOKS = {
    "off": LedgerSettings(enabled=False),
    "ledger": LedgerSettings(),
    "retaining": LedgerSettings(retain_steps=1000),
}

post = st.tuples(
    st.just("post"),
    st.sampled_from([4, 2]),  # a group of 2 waits in the side buffer for another
    st.booleans(),  # zero variance: dropped by the filters
    st.booleans(),  # sent at policy step 0: stale once the run is past max_staleness
)
op = st.one_of(
    post,
    st.tuples(st.just("batch"), st.sampled_from([None, "next", "again"])),
    st.tuples(st.just("commit")),
    st.tuples(st.just("expire")),
)


def test_the_twins_follow_the_settings() -> None:
    assert recorder(BOOKS["off"]) is OFF and type(OFF) is Recorder and not OFF.retain
    assert recorder(BOOKS["ledger"]) is LEDGER and type(LEDGER) is Ledger and not LEDGER.retain
    assert recorder(BOOKS["retaining"]) is RETAINING and type(RETAINING) is Retaining and RETAINING.retain
    assert recorder(LedgerSettings(enabled=False, retain_bytes=10)) is OFF  # no ledger, nothing retained


async def run_ops(books: LedgerSettings, mode: str, ops: list[tuple[Any, ...]]) -> tuple[list[object], Books]:
    """What each operation answered (then what the decisions left), on a fresh in-memory service with these
    ledger settings; and what the ledger and retention hold at the end."""
    service = Service(MemoryStore(), books=books)
    reg = registration(batch_size=8, drop_zero_variance=True, max_staleness=1, acknowledge=mode)
    await service.register_trainer(Registration(**reg))
    out: list[object] = [await outcome(service.batches.next_batch(0 if mode == "commit" else None))]
    await service.register_env(RegisterEnv(**env("math", group_size=4)))
    for i, (kind, *args) in enumerate(ops):
        if kind == "post":
            n, flat, old = args
            scores = [1.0] * n if flat else [float(j % 2) for j in range(n)]
            extra: dict[str, Any] = {"policy_step": 0} if old else {}
            body = group(n, seed=i, scores=scores, **extra)
            out.append(await outcome(service.ingest.submit(orjson.dumps(body), "application/json", many=False)))
        elif kind == "batch":
            run = await service.run_state()
            step = {None: None, "next": run.step, "again": max(0, run.step - 1)}[args[0]]
            out.append(await outcome(service.batches.next_batch(step)))
        elif kind == "commit":
            out.append(await outcome(service.batches.commit((await service.run_state()).step)))
        else:  # every held group past its ttl
            far = time.time() + 1e6
            expire = partial(expire_txn, now=far, limits=service.limits.side, books=service.ledger.recorder())
            out.append(await service.store.transact(expire))
    out.append(await service.store.read(decided))
    books_kept = await service.store.read(written)
    await service.close()
    return out, books_kept


async def outcome(call: Any) -> object:
    try:
        got = await call
    except RollbufError as exc:
        return type(exc).__name__, exc.status_code
    if isinstance(got, FormedBatch):
        return got.step, got.n_groups, got.seqs, got.stored
    if isinstance(got, list):
        return [r.model_dump(exclude={"duplicate"}) for r in got]
    return got if got is None else repr(got)


def decided(txn: Txn) -> object:
    """What the decisions left in the store, apart from the ledger and retention (item ids aside: the ledger
    numbers dropped groups too)."""
    run = state.load(txn)
    return (
        run.step,
        state.load_kept(txn, run),
        {e: (c.groups, c.seqs, c.tokens) for e, c in txn.counts().items()},
        {e: (c.groups, c.seqs, c.tokens) for e, c in txn.held.counts().items()},
        txn.get_counts(state.DROPPED),
    )


Books = tuple[list[LedgerGroup], int, int, int, dict[str, int], dict[int, bytes]]


def written(txn: Txn) -> Books:
    """The ledger's rows, the groups queued, held and dropped (counted), the retained-payload counter, and the
    payloads of the rows marked retained."""
    found = txn.ledger.scan(-1, 10_000)
    queued = sum(c.groups for c in txn.counts().values())
    held = sum(c.groups for c in txn.held.counts().values())
    dropped = sum(txn.get_counts(state.DROPPED).values())
    return (
        found,
        queued,
        held,
        dropped,
        txn.get_counts(RETAINED),
        txn.ledger.kept_payloads([r.id for r in found if r.kept]),
    )


@given(mode=st.sampled_from(["next", "commit"]), ops=st.lists(op, max_size=25))
def test_the_ledger_off_on_or_retaining_decides_the_same(mode: str, ops: list[tuple[Any, ...]]) -> None:
    results = {name: asyncio.run(run_ops(books, mode, ops)) for name, books in BOOKS.items()}
    off = results["off"][0]
    assert results["ledger"][0] == off
    assert results["retaining"][0] == off


@given(mode=st.sampled_from(["next", "commit"]), ops=st.lists(op, max_size=25), retain=st.booleans())
def test_the_ledger_accounts_for_every_group_and_retention_for_every_payload(
    mode: str, ops: list[tuple[Any, ...]], retain: bool
) -> None:
    books = BOOKS["retaining" if retain else "ledger"]
    out, (found, queued, held, dropped, retained, payloads) = asyncio.run(run_ops(books, mode, ops))
    stored = sum(1 for (kind, *_), got in zip(ops, out[1:], strict=False) if kind == "post" and isinstance(got, list))
    fates = [r.fate for r in found]
    assert len(found) == stored  # one row a group, whatever its fate
    assert fates.count(QUEUED) == queued and fates.count(HELD) == held and fates.count(DROPPED) == dropped
    assert len(found) == queued + held + dropped + fates.count(SERVED)
    assert all((r.step is not None) == (r.fate in (SERVED, DROPPED)) for r in found)
    n_kept = sum(r.kept for r in found)
    if retain:  # every served or dropped group's payload, counted against the byte budget
        assert n_kept == fates.count(SERVED) + fates.count(DROPPED) == len(payloads)
        assert retained.get("groups", 0) == n_kept
        assert retained.get("bytes", 0) == sum(map(len, payloads.values()))
    else:
        assert n_kept == 0 and not retained
