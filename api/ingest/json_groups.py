"""Scored groups from a JSON body, with their per-token fields read straight into numpy arrays. Pure: no I/O.

Atropos rollout handlers send groups of a few thousand tokens per sequence as JSON lists. Turning those
into Python ints, validating each, then copying them into numpy took two thirds of the server's CPU per
group. The direct path parses with simdjson and copies each per-token field into one flat array with no
Python object per number; every other field (scores, ids, messages, ...) still goes through the wire
schema, and every rule after parsing is checked once, on the arrays (`api.ingest.validation.pack_group`).

The direct path only takes a body it reads exactly as the schema would. Anything else goes down the
schema's own path, which decides: a float or a bool where an int belongs, an integer beyond int64,
duplicate keys, `\\u` escapes, invalid JSON, and deeper nesting than a list of rows. simdjson flattens
nested arrays without telling, so nesting is caught by counting: a body's `[` bytes are its arrays plus
the `[` inside its strings, and that count must match what was read (strings can only hide a `[` behind
a `\\u` escape, which sends the body down the schema path).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import simdjson
from pydantic import TypeAdapter

from api.http.body import parse_json, validate, validate_list
from api.ingest.validation import COLUMN_DTYPES, Column
from api.wire.schema import ScoredData, lenient_group

_ONE = TypeAdapter(ScoredData)
_LIST = TypeAdapter(list[ScoredData])
_BUFFER_TYPE: dict[str, Literal["i", "d"]] = {"i": "i", "f": "d"}
"""simdjson's buffer type code for each numpy dtype kind of a column."""


@dataclass(frozen=True, slots=True)
class JsonGroup:
    """One group read from JSON: its schema-validated fields and, when read directly, its columns."""

    data: ScoredData
    columns: dict[str, Column] | None = None
    """The per-token fields as arrays (their lists in `data` are then empty); None: they are in `data`."""


def read_groups(raw: bytes | bytearray, *, many: bool) -> list[JsonGroup]:
    """A /scored_data body (one group) or /scored_data_list body (a list), schema-checked; 422 otherwise."""
    direct = _read_direct(raw, many=many)
    if direct is not None:
        shells, columns = direct
        data = validate_list(_LIST, shells, lenient_group) if many else [validate(_ONE, shells[0], lenient_group)]
        return [JsonGroup(sd, cols) for sd, cols in zip(data, columns, strict=True)]
    data = parse_json(_LIST, raw, lenient_group, many=True) if many else [parse_json(_ONE, raw, lenient_group)]
    return [JsonGroup(sd) for sd in data]


_IDLE_PARSERS: list[simdjson.Parser] = []
"""Parsers free for reuse: a new one costs as much as parsing a 500 KB group, for the page faults of its buffers."""
_REUSE_UP_TO = 4 << 20
"""A parser keeps buffers sized for the largest body it read; one that read more than this is dropped."""


def _read_direct(raw: bytes | bytearray, *, many: bool) -> tuple[list[dict[str, Any]], list[dict[str, Column]]] | None:
    """Each group's other fields as Python values and its columns as arrays, or None: use the schema path."""
    if b"\\" in raw and b"\\u" in raw:  # the one-byte search is a memchr, ten times the two-byte one
        return None
    parser = _IDLE_PARSERS.pop() if _IDLE_PARSERS else simdjson.Parser()
    read = _read_document(parser, raw, many=many)
    # Only reached when no proxy into the parser's document is left (they are all locals of the frames
    # that returned); a parser in use cannot parse again. pop and append are atomic, so threads may share.
    if len(raw) <= _REUSE_UP_TO:
        _IDLE_PARSERS.append(parser)
    return read


def _read_document(
    parser: simdjson.Parser, raw: bytes | bytearray, *, many: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Column]]] | None:
    try:
        doc = parser.parse(raw)
    except (ValueError, RuntimeError):  # invalid JSON, or an integer beyond 64 bits
        return None
    if many and not isinstance(doc, simdjson.Array):
        return None
    objects: Iterable[Any] = doc if isinstance(doc, simdjson.Array) and many else [doc]
    brackets = 1 if many else 0
    shells, columns = [], []
    for obj in objects:
        if not isinstance(obj, simdjson.Object):
            return None
        read = _read_object(obj)
        if read is None:
            return None
        shell, cols, n = read
        shells.append(shell)
        columns.append(cols)
        brackets += n
    if _count_byte(raw, b"[") != brackets:  # an array nested deeper than the schema allows
        return None
    return shells, columns


def _read_object(obj: simdjson.Object) -> tuple[dict[str, Any], dict[str, Column], int] | None:
    """One group: (other fields, columns, `[` it accounts for), or None when it needs the schema path."""
    keys = list(obj.keys())
    if len(set(keys)) != len(keys):  # simdjson reads the first of duplicate keys, the schema path the last
        return None
    shell: dict[str, Any] = {}
    columns: dict[str, Column] = {}
    brackets = 0
    for key in keys:
        value = obj[key]
        dtype = COLUMN_DTYPES.get(key)
        if dtype is not None and value is not None:
            column = _read_column(value, dtype)
            if column is None:
                return None
            columns[key] = column
            shell[key] = []
            brackets += 1 + column.lengths.shape[0]
        else:
            value = _python(value)
            shell[key] = value
            brackets += key.count("[") + _count_brackets(value)
    if "tokens" not in columns or "masks" not in columns:
        return None
    return shell, columns, brackets


def _read_column(value: Any, dtype: np.dtype[Any]) -> Column | None:
    """A list of rows of numbers as one flat array; None if it is anything else."""
    if not isinstance(value, simdjson.Array):
        return None
    lengths = []
    for row in value:
        if not isinstance(row, simdjson.Array):
            return None
        lengths.append(len(row))
    try:
        buffer = value.as_buffer(of_type=_BUFFER_TYPE[dtype.kind])
    except (TypeError, ValueError, RuntimeError):  # a string, bool, null, float in an int column, or > int64
        return None
    values = np.frombuffer(buffer, dtype=dtype)
    row_lengths = np.array(lengths, dtype=np.int64)
    if values.shape[0] != int(row_lengths.sum()):  # nested arrays; the bracket count would catch it too
        return None
    return Column(values, row_lengths)


def _count_byte(raw: bytes | bytearray, byte: bytes) -> int:
    """bytes.count, five times faster for one byte: numpy compares with SIMD."""
    return int(np.count_nonzero(np.frombuffer(raw, dtype=np.uint8) == ord(byte)))


def _python(value: Any) -> Any:
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def _count_brackets(value: Any) -> int:
    """`[` bytes a decoded JSON value takes in its text (no `\\u` escapes): its arrays and its strings' `[`."""
    count = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            count += v.count("[")
        elif isinstance(v, list):
            count += 1
            stack.extend(v)
        elif isinstance(v, dict):
            count += sum(k.count("[") for k in v)
            stack.extend(v.values())
    return count
