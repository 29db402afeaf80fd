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


_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}
_FIXED.update({0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18})
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
"""bin 8/16/32 and str 8/16/32: the bytes of their length."""
_EXT = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
"""array 16/32 and map 16/32: the bytes of their count, and values per entry."""


def _int(view: memoryview, pos: int, n: int) -> int:
    if pos + n > len(view):
        raise ValueError("truncated msgpack")
    return int.from_bytes(view[pos : pos + n], "big")


def _container(view: memoryview, pos: int) -> tuple[int, int, int]:
    """An array or map header at `pos`: (entries, values per entry (1 or 2), where its first value starts); entries
    -1 when it is neither."""
    first = view[pos]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, 1, pos + 1
    if 0x80 <= first <= 0x8F:
        return first & 0x0F, 2, pos + 1
    if first in _COUNTED:
        width, per = _COUNTED[first]
        return _int(view, pos + 1, width), per, pos + 1 + width
    return -1, 0, pos


def _skip(view: memoryview, pos: int) -> int:
    """Where the msgpack value at `pos` ends. Strings and bins are jumped over, never read or copied: a record's
    large values cost their headers."""
    todo = 1
    while todo:
        todo -= 1
        if pos >= len(view):
            raise ValueError("truncated msgpack")
        first = view[pos]
        if first <= 0x7F or first >= 0xE0:
            pos += 1
        elif 0xA0 <= first <= 0xBF:
            pos += 1 + (first & 0x1F)
        elif first in _FIXED:
            pos += _FIXED[first]
        elif first in _SIZED:
            width = _SIZED[first]
            pos += 1 + width + _int(view, pos + 1, width)
        elif first in _EXT:
            width = _EXT[first]
            pos += 2 + width + _int(view, pos + 1, width)
        else:
            n, per, pos = _container(view, pos)
            if n < 0:
                raise ValueError(f"not msgpack: byte 0x{first:02x}")
            todo += n * per
    if pos > len(view):
        raise ValueError("truncated msgpack")
    return pos


def _key(view: memoryview, pos: int) -> tuple[str | None, int]:
    """A map key at `pos` and where it ends: its text if it is a string, else None."""
    first = view[pos]
    end = _skip(view, pos)
    if 0xA0 <= first <= 0xBF:
        return bytes(view[pos + 1 : end]).decode("utf-8", "replace"), end
    if first in (0xD9, 0xDA, 0xDB):
        return bytes(view[pos + 1 + _SIZED[first] : end]).decode("utf-8", "replace"), end
    return None, end


def _meta_spans(view: memoryview) -> Iterator[tuple[str | None, int, int, list[tuple[int, int]] | None]]:
    """In one record (`view`, exactly its bytes) each meta field as (name, start, end, spans of its entries where it
    is a blob field holding an array)."""
    n, per, pos = _container(view, 0)
    if per != 2:
        raise ValueError("a record is a msgpack map")
    for _ in range(n):
        key, pos = _key(view, pos)
        if key != "meta":
            pos = _skip(view, pos)
            continue
        fields, per, pos = _container(view, pos)
        if per != 2:
            pos = _skip(view, pos)
            continue
        for _ in range(fields):
            name, start = _key(view, pos)
            elements: list[tuple[int, int]] | None = None
            count, per, at = _container(view, start)
            if name in BLOB_FIELDS and per == 1:
                elements = []
                for _ in range(count):
                    after = _skip(view, at)
                    elements.append((at, after))
                    at = after
                pos = at
            else:
                pos = _skip(view, start)
            yield name, start, pos, elements


def externalize(record: Buffer, min_size: int, tag: bytes) -> tuple[bytes, dict[bytes, Buffer]]:
    """One stored record with each blob field's value (or list element) of `min_size` bytes or more replaced by
    a reference, and the blobs by digest. A record with none is returned as it is (no copy, no blobs)."""
    view = memoryview(record)
    cuts: list[tuple[int, int]] = []
    for name, start, end, elements in _meta_spans(view):
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
        digest = digest_of(data)  # about 1 GB/s: cheaper than comparing a sibling's copy through a memoryview
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
    view = memoryview(record)
    spans: list[tuple[int, int]] = []
    for _name, start, end, elements in _meta_spans(view):
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
    view = memoryview(records)
    n, at = None, 0
    if array:
        n, per, at = _container(view, 0)
        if per != 1:
            raise ValueError("a batch is a msgpack array")
    count = 0
    while at < len(view) and (n is None or count < n):
        end = _skip(view, at)
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
