"""api.export.table and api.export.parquet: groups become one Parquet row per sequence, tokens and masks byte for
byte, floats exactly, in row groups of bounded size; the ledger's rows become the `groups` and `steps` tables."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from api.export.parquet import parquet_bytes
from api.export.table import (
    Fate,
    SequenceBatcher,
    fate_of,
    group_row,
    groups_schema,
    record_bytes,
    sequences_schema,
    step_row,
    steps_schema,
)
from api.store.base import ANON_ENV, DROPPED, QUEUED, SERVED, LedgerGroup, LedgerStep
from api.wire.records import F64, I32, GroupRecord, decode, encode_submission

float_rows = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def groups(draw: st.DrawFn) -> GroupRecord:
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=5))
    toks = [draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)) for n in lengths]
    masks = [draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=n, max_size=n)) for n in lengths]
    scores = draw(st.lists(float_rows, min_size=len(lengths), max_size=len(lengths)))
    floats = {}
    for name in ("advantages", "inference_logprobs"):
        if draw(st.booleans()):
            floats[name] = [draw(st.lists(float_rows, min_size=n, max_size=n)) for n in lengths]
    meta = {"messages": [{"role": "user", "content": "q"}]} if draw(st.booleans()) else {}
    step = draw(st.integers(0, 50))
    versions = [draw(st.lists(st.integers(0, step), min_size=n, max_size=n)) for n in lengths]
    sent = versions if draw(st.booleans()) else None
    return decode(
        encode_submission(toks, masks, scores, env_id=0, policy_step=step, token_weight_versions=sent, **floats, **meta)
    )


def fate(i: int, rec: GroupRecord) -> Fate:
    return Fate(
        group=i,
        group_id=f"g{i}",
        env="math_0",
        env_id=0,
        policy_step=rec.policy_step,
        fate=SERVED,
        trained_step=i // 2,
        acked_at=1_700_000_000.25 + i,
    )


def read_back(data: bytes) -> pa.Table:
    return pq.read_table(io.BytesIO(data))


@settings(max_examples=60, deadline=None)
@given(st.lists(groups(), min_size=1, max_size=12), st.integers(1, 9), st.integers(64, 4096))
def test_sequences_read_back_as_stored(recs: list[GroupRecord], max_rows: int, max_bytes: int) -> None:
    batcher = SequenceBatcher(max_rows=max_rows, max_bytes=max_bytes)
    batches = [b for i, rec in enumerate(recs) if (b := batcher.add(fate(i, rec), rec)) is not None]
    if (last := batcher.flush()) is not None:
        batches.append(last)
    table = read_back(b"".join(parquet_bytes(sequences_schema(), batches)))
    assert table.schema == sequences_schema()
    assert table.num_rows == sum(r.seqs for r in recs)
    rows = table.to_pylist()
    at = 0
    for i, rec in enumerate(recs):
        bounds = np.concatenate([[0], np.cumsum(rec.lengths)])
        for s in range(rec.seqs):
            row = rows[at]
            at += 1
            a, b = bounds[s], bounds[s + 1]
            assert (row["group"], row["seq"], row["length"]) == (i, s, b - a)
            assert np.asarray(row["tokens"], I32).tobytes() == rec.tokens[a:b].tobytes()  # byte for byte
            assert np.asarray(row["masks"], I32).tobytes() == rec.masks[a:b].tobytes()
            assert np.float64(row["score"]).tobytes() == rec.scores[s].tobytes()
            for name in ("advantages", "ref_logprobs", "inference_logprobs"):
                sent = rec.floats.get(name)
                got = row[name]
                if sent is None:
                    assert got is None
                else:
                    assert np.asarray(got, F64).tobytes() == sent[a:b].astype(F64).tobytes()
            if rec.weight_versions is None:
                assert row["token_weight_versions"] is None
            else:
                assert row["token_weight_versions"] == rec.weight_versions[a:b].tolist()
            assert (row["fate"], row["trained_step"], row["drop_reason"]) == (SERVED, i // 2, None)
            assert row["acked_at"].timestamp() == 1_700_000_000.25 + i
            assert (row["meta"] is None) == (not rec.meta)


@settings(max_examples=60, deadline=None)
@given(st.lists(groups(), min_size=1, max_size=12), st.integers(1, 9), st.integers(64, 4096))
def test_record_batches_are_bounded_but_never_split_a_group(
    recs: list[GroupRecord], max_rows: int, max_bytes: int
) -> None:
    """A batch is cut as soon as it reaches a bound, so it passes the bound by at most its last group."""
    batcher = SequenceBatcher(max_rows=max_rows, max_bytes=max_bytes)
    cut: list[list[GroupRecord]] = [[]]
    for i, rec in enumerate(recs):
        cut[-1].append(rec)
        batch = batcher.add(fate(i, rec), rec)
        if batch is not None:
            assert batch.num_rows == sum(r.seqs for r in cut[-1])
            cut.append([])
    for group in cut[:-1]:
        head = group[:-1]
        assert sum(r.seqs for r in head) < max_rows and sum(record_bytes(r) for r in head) < max_bytes
    rest = batcher.flush()
    assert (rest is None) == (not cut[-1])


def ledger_row(**changes: object) -> LedgerGroup:
    row = LedgerGroup(
        id=7,
        env_id=0,
        group_id="q",
        handler=None,
        acked_at=10.5,
        policy_step=3,
        seqs=4,
        tokens=40,
        bytes=400,
        score_mean=0.5,
        score_min=0.0,
        score_max=1.0,
        score_std=0.5,
        fate=QUEUED,
    )
    return LedgerGroup(**{**{f: getattr(row, f) for f in row.__dataclass_fields__}, **changes})  # type: ignore[arg-type]


def test_fates_name_the_step_trained_or_the_reason_dropped() -> None:
    served = fate_of(ledger_row(fate=SERVED, step=9, decided_at=11.0), "math_0")
    assert (served.fate, served.trained_step, served.drop_reason, served.dropped_step) == (SERVED, 9, None, None)
    dropped = fate_of(ledger_row(fate=DROPPED, step=9, reason="stale"), "math_0")
    assert (dropped.trained_step, dropped.drop_reason, dropped.dropped_step) == (None, "stale", 9)
    assert fate_of(ledger_row(env_id=ANON_ENV), "anon").env_id is None  # as on the wire: env_id null


def test_ledger_tables_convert_every_field() -> None:
    rows = [group_row(ledger_row(fate=DROPPED, step=2, reason="zero_variance", decided_at=12.0, kept=True), "m")]
    table = pa.Table.from_pylist(rows, schema=groups_schema())
    got = table.to_pylist()[0]
    cells = (got["group"], got["env"], got["drop_reason"], got["dropped_step"], got["kept"])
    assert cells == (7, "m", "zero_variance", 2, True)
    step = LedgerStep(
        step=4,
        formed_at=20.0,
        formation_s=0.001,
        group_ids=(3, 1),
        seqs=8,
        tokens=80,
        groups_by_env={"a": 1, "b": 1},
        seqs_by_env={"a": 4, "b": 4},
        staleness={0: 1, 2: 1},
    )
    srow = pa.Table.from_pylist([step_row(step)], schema=steps_schema()).to_pylist()[0]
    assert srow["groups"] == [3, 1] and srow["committed_at"] is None
    assert srow["mix"] == [{"env": "a", "groups": 1, "seqs": 4}, {"env": "b", "groups": 1, "seqs": 4}]
    assert srow["staleness"] == [{"staleness": 0, "groups": 1}, {"staleness": 2, "groups": 1}]


def test_an_empty_table_is_a_valid_file() -> None:
    table = read_back(b"".join(parquet_bytes(sequences_schema(), [])))
    assert table.num_rows == 0 and table.schema == sequences_schema()


def test_metadata_counts_against_the_row_group_bound() -> None:
    """1 MB of `images` per group is 4 MB of a batch of 4-sequence groups (the `meta` column repeats it per
    sequence): it counts, so a row group of such groups is cut at the byte bound, not at 8,192 rows."""
    rec = decode(encode_submission([[1, 2]] * 4, [[1, 1]] * 4, [0.0, 1.0, 0.0, 1.0], env_id=0, images=["i" * 10**6]))
    batcher = SequenceBatcher(max_bytes=32 << 20)
    batches = [b for i in range(20) if (b := batcher.add(fate(i, rec), rec)) is not None]
    assert batches and batches[0].num_rows == 4 * 9  # the 9th group of 4 MB passes 32 MiB: cut there
    assert batches[0].column("meta")[0].as_py() == '{"images":["' + "i" * 10**6 + '"]}'
