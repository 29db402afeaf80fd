"""A formed batch as the store keeps and the routes serve it, or why there is none yet. Plain data shared by
formation (`api/batches/formation.py`) and the trainer's routes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgpack

from api.batches.token_staleness import apply_masks
from api.batches.trim import apply_cuts
from api.wire.records import msgpack_array_header


@dataclass(frozen=True, slots=True)
class Formation:
    """How a batch was just formed (absent when a kept batch is served again): for the log and the metrics."""

    seqs_by_env: dict[str, int]
    seconds: float


HEADER_MAX = 32
"""Longest `FormedBatch` header of a batch with no group cut: a msgpack array of three ints (1 + 3 * 9 bytes). A
batch with cut groups (`no_exact_fill: "trim"`) adds a fourth entry, the cuts, and one with stale tokens masked
(`max_token_staleness`) a fifth: read on, a little at a time."""


@dataclass(frozen=True, slots=True)
class FormedBatch:
    """A batch, held as the bytes the store keeps: formed, stored and served with one copy of the payloads."""

    step: int
    """The step this batch moved the run from."""
    n_groups: int
    seqs: int
    tokens: int
    stored: bytes
    """A small msgpack header (groups, sequences, tokens, any cuts as `[[record index, sequences kept], ...]`, and
    any masked records as `[[record index, oldest version trained], ...]`), then `records`: what `Txn.get_batch`
    returns, with the cuts and masks applied (the store keeps the groups as they came)."""
    offset: int
    """Where `records` starts in `stored`."""
    formation: Formation | None = None
    held: int = 0
    """Bytes the store keeps for this batch where that is more than `stored` (a cut group is kept whole); 0 where
    it is `stored`'s length. What the read-ahead bound counts (`api/run/kept.py`)."""

    @property
    def records(self) -> memoryview:
        """A msgpack array of group records (docs/binary-format.md), a view into `stored` (no copy)."""
        return memoryview(self.stored)[self.offset :]

    @classmethod
    def build(
        cls,
        step: int,
        n_groups: int,
        seqs: int,
        tokens: int,
        payloads: list[bytes],
        cuts: Mapping[int, int] | None = None,
        masked: Mapping[int, int] | None = None,
    ) -> FormedBatch:
        """`payloads` as served (the cut groups already cut, the stale tokens masked); `cuts`: record index to
        sequences kept, `masked`: record index to the oldest weights version whose tokens it trains on, for the
        header, so that the batch kept by reference to the groups as stored is served alike when it is read back
        (`unpack`)."""
        fields: list[object] = [n_groups, seqs, tokens]
        if cuts or masked:
            fields.append(sorted([i, keep] for i, keep in (cuts or {}).items()))
        if masked:
            fields.append(sorted([i, oldest] for i, oldest in masked.items()))
        header = msgpack.packb(fields)
        stored = b"".join([header, msgpack_array_header(n_groups), *payloads])
        return cls(step, n_groups, seqs, tokens, stored, len(header))

    def prefix(self) -> bytes:
        """What precedes the group payloads in `stored`: the header and the records' array header (`Txn.put_batch`)."""
        return self.stored[: self.offset + len(msgpack_array_header(self.n_groups))]

    @classmethod
    def unpack(cls, step: int, data: bytes) -> FormedBatch:
        """A kept batch as `Txn.get_batch` returns it: the header, then the groups as stored (cut here again)."""
        unpacker = msgpack.Unpacker()
        read = HEADER_MAX  # only the header: feeding all of a large batch copied it twice
        unpacker.feed(data[:read])
        while True:
            try:
                fields = unpacker.unpack()
                break
            except msgpack.OutOfData:
                if read >= len(data):
                    raise
                unpacker.feed(data[read : read + 4096])
                read += 4096
        n_groups, seqs, tokens = fields[:3]
        offset = unpacker.tell()
        if len(fields) > 3 and fields[3]:
            records = apply_cuts(memoryview(data)[offset:], n_groups, {i: keep for i, keep in fields[3]})
            data = data[:offset] + records
        if len(fields) > 4:  # cut first, then masked, as formed
            records = apply_masks(memoryview(data)[offset:], n_groups, {i: oldest for i, oldest in fields[4]})
            data = data[:offset] + records
        return cls(step, n_groups, seqs, tokens, data, offset)


@dataclass(slots=True)
class BatchWaiting:
    """No batch: `reason` says what is missing, `blocked` when no arrival of data alone can form one."""

    reason: str | None = None
    blocked: bool = False
    not_registered: bool = False
    read_ahead: bool = False
    """A trainer in commit mode read as far ahead as the bound allows: `reason` says so; a commit ends it."""
    recheck_in: float | None = None
    """Seconds after which forming may succeed with no change of data (a minimum share's hold runs out)."""
    finished: bool = False
    """The run is finished: every dataset feeding it is done, nothing else can arrive and nothing is queued, so no
    batch will come (api/tasks/ending.py)."""
