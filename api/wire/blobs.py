"""Blob references in stored group records: large metadata values kept outside the row store (docs/payloads.md).

A record's `meta` holds each field as the msgpack of its JSON value. A field (`images`, `distill_token_ids`,
`distill_logprobs`) whose value, or, for a list, one of whose elements, takes `min_size` bytes or more is stored
as a blob: the exact msgpack bytes of that value or element, named by their SHA-256. In the record they are
replaced by a reference, a msgpack ext value of type `EXT_TYPE` holding the owner's tag, the digest and the
size. Nothing else of the record changes (the map and array headers count entries, not bytes), so putting the
bytes back (`inline`) gives the record as it was sent, byte for byte: what an Atropos trainer reads is unchanged.

Elements of a list are referenced one by one, not the whole list: a group's G siblings that each carry the same
image are G references to one blob, and a group cut to its first sequences (`api/batches/trim.py`) cuts the
references as it cuts any per-sequence list.

Pure: no I/O. The caller writes and reads the bytes (`api/store/blobs.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgpack

from api.wire.records import BLOB_EXT_TYPE, Buffer

EXT_TYPE = BLOB_EXT_TYPE
"""The msgpack ext type of a reference (application types are 0-127)."""
TAG_SIZE = 16
"""Bytes of the owner's tag: the first bytes of the SHA-256 of the owner's name."""
DIGEST_SIZE = 32
REF_DATA = TAG_SIZE + DIGEST_SIZE + 8
"""A reference's payload: tag, digest, size (uint64, big-endian)."""
MARKER = bytes([0xC7, REF_DATA, EXT_TYPE])
"""How every reference starts (msgpack `ext 8`, its length, its type): a store finds the payloads that hold
references by looking for these bytes (`Txn.payloads_with`). Other bytes may match (a token array): `refs_in`
then names a blob that does not exist, which keeps nothing alive."""
REF_BYTES = len(MARKER) + REF_DATA
BLOB_FIELDS = ("images", "distill_token_ids", "distill_logprobs")
"""The metadata fields whose large values are stored as blobs."""


@dataclass(frozen=True, slots=True)
class Ref:
    """A blob: whose (`tag`), which bytes (`digest`, SHA-256) and how many."""

    tag: bytes
    digest: bytes
    size: int

    def pack(self) -> bytes:
        return MARKER + self.tag + self.digest + self.size.to_bytes(8, "big")

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @classmethod
    def unpack(cls, data: Buffer) -> Ref:
        """The reference whose `REF_DATA` bytes (after the marker) are `data`."""
        raw = bytes(data)
        return cls(raw[:TAG_SIZE], raw[TAG_SIZE : TAG_SIZE + DIGEST_SIZE], int.from_bytes(raw[-8:], "big"))


def owner_tag(owner: str) -> bytes:
    """The tag that scopes an owner's blobs: blobs of two owners never share a name unless the operator allows it
    (then every owner's tag is that of the shared owner)."""
    return hashlib.sha256(owner.encode()).digest()[:TAG_SIZE]


def digest_of(data: Buffer) -> bytes:
    return hashlib.sha256(data).digest()


def _is_array(first: int) -> bool:
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def _meta_spans(
    unpacker: msgpack.Unpacker, view: memoryview
) -> Iterator[tuple[str, int, int, list[tuple[int, int]] | None]]:
    """In a record (`view`, from the start of its map) each meta field as (name, start, end, spans of its
    elements where it is a blob field holding an array). The unpacker ends after the record."""
    for _ in range(unpacker.read_map_header()):
        key = unpacker.unpack()
        if key != "meta":
            unpacker.skip()
            continue
        for _ in range(unpacker.read_map_header()):
            name = unpacker.unpack()
            start = unpacker.tell()
            elements: list[tuple[int, int]] | None = None
            if name in BLOB_FIELDS and _is_array(view[start]):
                elements = []
                for _ in range(unpacker.read_array_header()):
                    a = unpacker.tell()
                    unpacker.skip()
                    elements.append((a, unpacker.tell()))
            else:
                unpacker.skip()
            yield name, start, unpacker.tell(), elements


def _unpacker(data: Buffer) -> msgpack.Unpacker:
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    return unpacker


def externalize(record: Buffer, min_size: int, tag: bytes) -> tuple[bytes, dict[bytes, Buffer]]:
    """One stored record with each blob field's value (or list element) of `min_size` bytes or more replaced by
    a reference, and the blobs by digest. A record with none is returned as it is (no copy, no blobs)."""
    unpacker = _unpacker(record)
    view = memoryview(record)
    cuts: list[tuple[int, int]] = []
    for name, start, end, elements in _meta_spans(unpacker, view):
        if name not in BLOB_FIELDS or end - start < min_size:
            continue
        cuts.extend(span for span in (elements or [(start, end)]) if span[1] - span[0] >= min_size)
    if not cuts:
        return bytes(record), {}
    parts: list[Buffer] = []
    blobs: dict[bytes, Buffer] = {}
    at = 0
    for a, b in cuts:
        data = view[a:b]
        digest = digest_of(data)
        blobs.setdefault(digest, data)
        parts += [view[at:a], Ref(tag, digest, b - a).pack()]
        at = b
    parts.append(view[at:])
    return b"".join(parts), blobs


def refs_in(payload: Buffer) -> Iterator[Ref]:
    """Every reference a stored payload holds (and possibly some that only look like one: `MARKER`)."""
    raw = bytes(payload)
    at = raw.find(MARKER)
    while at >= 0 and at + REF_BYTES <= len(raw):
        yield Ref.unpack(raw[at + len(MARKER) : at + REF_BYTES])
        at = raw.find(MARKER, at + 1)


def has_refs(payload: Buffer) -> bool:
    return bytes(payload).find(MARKER) >= 0


def _ref_spans(record: Buffer) -> list[tuple[int, int]]:
    """Where the references of one stored record are (in its blob fields, never in its arrays)."""
    unpacker = _unpacker(record)
    view = memoryview(record)
    spans: list[tuple[int, int]] = []
    for _name, start, end, elements in _meta_spans(unpacker, view):
        for a, b in elements if elements is not None else [(start, end)]:
            if b - a == REF_BYTES and bytes(view[a : a + len(MARKER)]) == MARKER:
                spans.append((a, b))
    return spans


def inline_record(record: Buffer, get: Callable[[Ref], Buffer]) -> Buffer:
    """A stored record with every reference replaced by its blob's bytes (`get`), as it was sent; a record with
    none as it is. KeyError from `get` (a blob that is gone) goes up."""
    spans = _ref_spans(record)
    if not spans:
        return record
    view = memoryview(record)
    parts: list[Buffer] = []
    at = 0
    for a, b in spans:
        parts += [view[at:a], get(Ref.unpack(view[a + len(MARKER) : b]))]
        at = b
    parts.append(view[at:])
    return b"".join(parts)


def _each_record(records: Buffer, *, array: bool) -> Iterator[tuple[int, int]]:
    """The bounds of each record in a msgpack array of records (`array=True`) or in records back to back."""
    unpacker = _unpacker(records)
    n = unpacker.read_array_header() if array else None
    at = unpacker.tell()
    count = 0
    while at < len(records) and (n is None or count < n):
        unpacker.skip()
        end = unpacker.tell()
        yield at, end
        at, count = end, count + 1


def references(records: Buffer, *, array: bool) -> Iterator[Ref]:
    """Every reference of these records, found by their structure (unlike `refs_in`, never a look-alike)."""
    if not has_refs(records):
        return
    view = memoryview(records)
    for a, b in _each_record(records, array=array):
        for x, y in _ref_spans(view[a:b]):
            yield Ref.unpack(view[a + x + len(MARKER) : a + y])


def inline_records(records: Buffer, get: Callable[[Ref], Buffer], *, array: bool) -> Buffer:
    """A msgpack array of records (a batch, `array=True`) or records back to back, each inlined: the same bytes
    when no record holds a reference (the common case costs a search for `MARKER`)."""
    if not has_refs(records):
        return records
    view = memoryview(records)
    parts: list[Buffer] = []
    at = 0
    for a, b in _each_record(records, array=array):
        parts += [view[at:a], inline_record(view[a:b], get)]
        at = b
    parts.append(view[at:])
    return b"".join(parts)
