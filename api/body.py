"""Bodies: size limits, gzip both ways (ISA-L; no zip bombs), and JSON checked against the schema.

`parse_json` is the schema path: orjson, then pydantic over the Python objects, faster than FastAPI's
stdlib-json body parsing; errors keep FastAPI's 422 shape with `loc` starting at "body". Scored groups
mostly skip it: `api.json_groups` reads their per-token lists straight into arrays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from isal import igzip, igzip_lib, isal_zlib
from pydantic import TypeAdapter, ValidationError

from api.errors import BadEncoding, PayloadTooLarge

T = TypeVar("T")


async def read_body(request: Request, *, max_bytes: int, max_decompressed: int) -> bytes:
    """The request body, gunzipped when sent with Content-Encoding: gzip, within both limits."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "x-gzip"):
        raise BadEncoding(f"Content-Encoding {encoding!r} is not supported; use gzip or none")
    return gunzip(body, max_decompressed)


def gunzip(data: bytes, limit: int) -> bytes:
    """Decompress gzip, refusing to produce more than `limit` bytes.

    ISA-L's inflate takes less than half of zlib's time; Atropos handlers gzip every group they post."""
    inflater = isal_zlib.decompressobj(wbits=16 + isal_zlib.MAX_WBITS)
    try:
        out = inflater.decompress(data, limit + 1)
    except isal_zlib.error as exc:  # type: ignore[misc]  # the stub declares `error` an instance
        raise BadEncoding(f"invalid gzip body: {exc}") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"gzip body decompresses to more than the limit of {limit} bytes")
    if not inflater.eof:
        raise BadEncoding("invalid gzip body: truncated")
    return out


def accepts_gzip(request: Request) -> bool:
    """The rule of Starlette's gzip middleware, so every response follows the same one."""
    return "gzip" in request.headers.get("accept-encoding", "")


def gzip_compress(data: bytes, level: int) -> bytes:
    """gzip with ISA-L, whose levels stop at 3: `level` (1-9, zlib's scale) is capped there."""
    return igzip.compress(data, compresslevel=min(level, igzip_lib.ISAL_BEST_COMPRESSION))


def parse_json(adapter: TypeAdapter[T], raw: bytes) -> T:
    """Validate a JSON body; 422 with FastAPI's error shape when it does not fit the schema."""
    try:
        obj: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        # Not strict JSON (NaN, say) or not JSON at all: pydantic's own parser gives the precise error.
        return _validated(lambda: adapter.validate_json(raw))
    return validate(adapter, obj)


def validate(adapter: TypeAdapter[T], data: Any) -> T:
    """Validate decoded JSON; 422 with FastAPI's error shape when it does not fit the schema."""
    return _validated(lambda: adapter.validate_python(data))


def _validated(run: Callable[[], T]) -> T:
    try:
        return run()
    except ValidationError as exc:
        errors = [
            {"loc": ("body", *err["loc"]), "msg": err["msg"], "type": err["type"]}
            for err in exc.errors(include_url=False, include_context=False, include_input=False)
        ]
        raise RequestValidationError(errors) from None
