"""What a group's free-form fields (and a task) may hold: what JSON can print and a JSON reader reads back.

Every path that takes free-form values holds them to these rules (groups in JSON and binary, rollouts' tasks,
task files), so it sits below every flow (`api/layers.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.errors import InvalidData

MAX_META_DEPTH = 32
"""Deepest nesting of lists and maps in a group's free-form fields (`images`, `overrides`, ...)."""
INT64 = (-(2**63), 2**63 - 1)
_SCALARS = (str, int, float, bool, type(None))


def check_printable(meta: Mapping[str, Any]) -> None:
    """Every value of the free-form fields as JSON can print it and a JSON reader reads it back: maps with
    string keys, lists, strings (valid Unicode), 64-bit integers, finite floats, booleans and null, nested at
    most MAX_META_DEPTH deep. Anything else (msgpack `bin`, ext types, timestamps; an integer beyond 64 bits)
    would be accepted and then fail every JSON /batch that holds the group: refused here, naming where."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(v, (k,)) for k, v in meta.items()]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, _SCALARS):
            rule = _scalar_rule(value)
            if rule:
                raise InvalidData(loc, rule)
            continue
        if len(loc) > MAX_META_DEPTH:
            raise InvalidData(loc, f"nested deeper than {MAX_META_DEPTH} levels")
        if type(value) in (list, tuple):  # exactly: msgpack's ExtType is a tuple too
            stack.extend((v, (*loc, i)) for i, v in enumerate(value))
        elif type(value) is dict:
            for k, v in value.items():
                if not isinstance(k, str):
                    raise InvalidData(loc, f"map keys must be strings (JSON's), got {type(k).__name__}")
                if rule := _scalar_rule(k):
                    raise InvalidData(loc, f"map keys: {rule}")
                stack.append((v, (*loc, k)))
        else:
            kind = "bytes (msgpack bin)" if isinstance(value, bytes | bytearray) else type(value).__name__
            raise InvalidData(loc, f"{kind} cannot be served as JSON: send strings, numbers, lists and maps")


def _scalar_rule(value: str | int | float | bool | None) -> str | None:
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "strings must be valid Unicode (no lone surrogates)"
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return "numbers must be finite (no NaN or infinity)"
    elif isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1]:
        return "integers must fit in 64 bits (JSON readers and the binary format cannot carry more)"
    return None
