"""Bodies: size limits, gzip both ways (ISA-L; no zip bombs), and JSON checked against the schema.

Gzip bodies inflate as a stream, a megabyte at a time, and stop at the limit: a bomb costs the server at
most `max_decompressed_bytes` of memory and the time to inflate that much, in a worker thread
(`api.run.offloop`), so other requests go on meanwhile. Bytes after the end of the gzip data are refused.

`parse_json` is the schema path: orjson, then pydantic over the Python objects, faster than FastAPI's
stdlib-json body parsing; errors keep FastAPI's 422 shape with `loc` starting at "body". Scored groups
mostly skip it: `api.ingest.json_groups` reads their per-token lists straight into arrays.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from isal import igzip, igzip_lib, isal_zlib
from pydantic import TypeAdapter, ValidationError

from api.errors import BadEncoding, PayloadTooLarge
from api.http.inflight import UNBOUNDED, Hold
from api.run.offloop import off_loop
from api.wire.records import Buffer

T = TypeVar("T")

INFLATE_STEP = 1 << 20
"""Bytes of output per inflate call: the most a bomb allocates beyond the limit, and short GIL holds."""
INLINE_GZIP = 64 << 10
"""Gzip bodies up to this size inflate on the event loop; larger ones (up to any ratio) in a thread."""
JOIN_UP_TO = 1 << 20
"""Bodies up to this size are received as their chunks, joined once at the end (a body of one chunk is not
copied at all): appending each chunk to one buffer re-copied a 262 KB body as the buffer grew, 46 against 9 us.
A larger body grows one buffer in place, as joining would hold it twice at the end."""


async def read_body(
    request: Request, *, max_bytes: int, max_decompressed: int, hold: Hold | None = None
) -> bytes | bytearray:
    """The request body, gunzipped when sent with Content-Encoding: gzip, within both limits (`JOIN_UP_TO`: how
    it is received).

    Its bytes, as received and as inflated, are taken from `hold` (the process's budget across requests) as
    they arrive: past the budget, 503 (`Busy`). A declared Content-Length reserves at most the budget's
    `reserve` before any byte is read (so a body that cannot fit is refused early, and one that declares much
    and sends little holds little)."""
    hold = hold or UNBOUNDED.hold()
    declared = request.headers.get("content-length")
    expected = int(declared) if declared is not None and declared.isdigit() else None
    if expected is not None and expected > max_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    taken = min(expected, hold.budget.reserve) if expected is not None else 0
    hold.take(taken)
    chunks: list[bytes] = []
    grown: bytearray | None = None  # once the body passed JOIN_UP_TO
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
        if size > taken:
            hold.take(size - taken)
            taken = size
        if grown is not None:
            grown += chunk
        elif not chunk:  # Starlette ends the stream with b"": a join of it and one chunk would copy that chunk
            continue
        elif size <= JOIN_UP_TO:
            chunks.append(chunk)
        else:  # too large to be held twice while joined: on in one buffer, from what came so far
            grown = bytearray().join((*chunks, chunk))
            chunks.clear()
    body = b"".join(chunks) if grown is None else grown
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip"):
        raise BadEncoding(f"Content-Encoding {encoding!r} is not supported; use gzip or none")
    inflated = await off_loop(len(body), INLINE_GZIP, gunzip, body, max_decompressed, hold)
    hold.give(len(body))
    return inflated


GZIP_MAGIC = b"\x1f\x8b"
MAX_GZIP_MEMBERS = 64
"""Gzip members in one body (RFC 1952 allows any number back to back; clients send one): each costs a fresh
inflater, so a body of 200,000 empty members is refused instead of inflated."""
FIRST_WINDOW = 4096
"""Input bytes a member's inflater is first given; doubled while the member goes on. What is left over when a
member ends is copied into the next one's input, so this bounds the copying per member: linear in the body."""


def gunzip(data: Buffer, limit: int, hold: Hold | None = None) -> bytearray:
    """Decompress gzip as a stream, stopping as soon as it would produce more than `limit` bytes (the output
    taken from `hold` as it grows).

    Several gzip members back to back are one gzip body (RFC 1952), up to `MAX_GZIP_MEMBERS`; anything else
    after the end of the gzip data is refused. Time and copying are linear in the body. ISA-L's inflate takes
    less than half of zlib's time; Atropos handlers gzip every group they post."""
    hold = hold or UNBOUNDED.hold()
    view = memoryview(data)
    out = bytearray()
    pos = 0
    members = 0
    while True:
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise BadEncoding(f"gzip body of more than {MAX_GZIP_MEMBERS} members; send one member")
        inflater = isal_zlib.decompressobj(wbits=16 + isal_zlib.MAX_WBITS)
        window = FIRST_WINDOW
        pending: bytes | memoryview = view[pos : pos + window]
        fed = len(pending)  # input bytes handed to this member's inflater so far
        while not inflater.eof:
            try:
                chunk = inflater.decompress(pending, INFLATE_STEP)
            except isal_zlib.error as exc:  # type: ignore[misc]  # the stub declares `error` an instance
                raise BadEncoding(f"invalid gzip body: {exc}") from None
            if len(out) + len(chunk) > limit:
                raise PayloadTooLarge(f"gzip body decompresses to more than the limit of {limit} bytes")
            hold.take(len(chunk))
            out += chunk
            pending = inflater.unconsumed_tail
            if not pending and not inflater.eof:
                if pos + fed >= len(view):
                    if not chunk:
                        raise BadEncoding("invalid gzip body: truncated")
                    continue
                window = min(window * 2, INFLATE_STEP)
                pending = view[pos + fed : pos + fed + window]
                fed += len(pending)
        pos += fed - len(inflater.unused_data)
        if pos >= len(view):
            return out
        if view[pos : pos + 2] != GZIP_MAGIC:
            n = len(view) - pos
            raise BadEncoding(f"invalid gzip body: {n} byte{'s' * (n != 1)} after the end of the gzip data")


def accepts_gzip(request: Request) -> bool:
    """The rule of Starlette's gzip middleware, so every response follows the same one."""
    return "gzip" in request.headers.get("accept-encoding", "")


def gzip_compress(data: bytes, level: int) -> bytes:
    """gzip with ISA-L, whose levels stop at 3: `level` (1-9, zlib's scale) is capped there."""
    return igzip.compress(data, compresslevel=min(level, igzip_lib.ISAL_BEST_COMPRESSION))


_LONG_DIGITS = re.compile(rb"\d{20,}")
"""Digit runs as long as 2**64's: an integer orjson would read as a float (or a long digit string)."""


def parse_json(
    adapter: TypeAdapter[T], raw: bytes | bytearray, lenient: Callable[[Any], Any] | None = None, *, many: bool = False
) -> T:
    """Validate a JSON body; 422 with FastAPI's error shape when it does not fit the schema. `many`: `adapter`
    is a list's, validated in slices (`validate_list`)."""
    try:
        # orjson reads an integer beyond 64 bits as a float (10**30 as 1e+30): such a body is read exactly, so
        # that the rule refusing it names it instead of the value changing on its way through.
        obj: Any = json.loads(raw) if _LONG_DIGITS.search(raw) else orjson.loads(raw)
    except (orjson.JSONDecodeError, ValueError):
        # Not strict JSON (NaN, say) or not JSON at all: pydantic's own parser gives the precise error.
        return _validated(lambda: adapter.validate_json(raw, strict=True))
    return validate_list(adapter, obj, lenient) if many else validate(adapter, obj, lenient)  # type: ignore[arg-type, return-value]


def validate(adapter: TypeAdapter[T], data: Any, lenient: Callable[[Any], Any] | None = None) -> T:
    """Validate decoded JSON; 422 with FastAPI's error shape when it does not fit the schema.

    Strictly, as FastAPI validates the other request bodies (`api.wire.schema._Request`): no string or boolean
    where a number belongs, so that what the OpenAPI description says is what is accepted. When that fails
    on an integer, `lenient` may rewrite the forms rollbuf accepts all the same (`api.wire.schema.lenient_group`)
    and validation runs again: only such bodies pay for the rewrite."""
    try:
        return adapter.validate_python(data, strict=True)
    except ValidationError as exc:
        if lenient is None or not any(e["type"] == "int_type" for e in exc.errors(include_url=False)):
            raise _request_error(exc) from None
    return _validated(lambda: adapter.validate_python(lenient(data), strict=True))


VALIDATE_SLICE = 1000
"""Items of a list body validated per pydantic call: one call holds the GIL throughout, so 100,000 tiny groups
in one call would stall the event loop ~1.6 s even from a worker thread; between slices it can run."""


def validate_list(adapter: TypeAdapter[list[T]], data: Any, lenient: Callable[[Any], Any] | None = None) -> list[T]:
    """`validate` for a list body, in slices of VALIDATE_SLICE items (each a short hold of the GIL); an error
    names its item's index in the whole list, and the first slice with an error raises."""
    if not isinstance(data, list) or len(data) <= VALIDATE_SLICE:
        return validate(adapter, data, lenient)
    out: list[T] = []
    for start in range(0, len(data), VALIDATE_SLICE):
        try:
            part: list[T] = validate(adapter, data[start : start + VALIDATE_SLICE], lenient)
        except RequestValidationError as exc:
            raise RequestValidationError([_shifted(e, start) for e in exc.errors()]) from None
        out += part
    return out


def _shifted(error: Any, start: int) -> Any:
    """A slice's error, its item index made the whole list's (`("body", 3, ...)` in slice 1000: 1003)."""
    loc = error["loc"]
    if len(loc) > 1 and isinstance(loc[1], int):
        return {**error, "loc": (loc[0], loc[1] + start, *loc[2:])}
    return error


def _validated(run: Callable[[], T]) -> T:
    try:
        return run()
    except ValidationError as exc:
        raise _request_error(exc) from None


def _request_error(exc: ValidationError) -> RequestValidationError:
    errors = [
        {"loc": ("body", *err["loc"]), "msg": err["msg"], "type": err["type"]}
        for err in exc.errors(include_url=False, include_context=False, include_input=False)
    ]
    return RequestValidationError(errors)
