"""A do-nothing endpoint that keeps what it reads: the floor of a buffer that holds groups in memory.

The do-nothing endpoint (`bench/do_nothing.py`) drops each body, so its memory is reused from one request to the
next; a buffer must keep its bytes, and memory the process has not touched before costs page faults (on a 2-vCPU
VM about 0.1 ms for 262 KB: as much as reading the request). This endpoint reads each body as rollbuf does (into
one buffer) and keeps it, nothing else: `bench.limit --sides keep` puts the memory store next to it.

    uvicorn bench.keeping_sink:app
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

app = FastAPI()
KEPT: list[bytearray] = []


async def _kept(request: Request) -> bytearray:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
    KEPT.append(body)
    return body


@app.get("/ping")
async def ping() -> dict[str, bool]:
    return {"ok": True}


@app.post("/register")
async def register() -> dict[str, object]:
    return {"uuid": "keep"}


@app.get("/batch")
async def batch() -> dict[str, None]:
    return {"batch": None}


@app.post("/register-env")
async def register_env() -> dict[str, object]:
    return {"status": "success", "env_id": 0}


@app.post("/scored_data")
async def scored_data(request: Request) -> Response:
    await _kept(request)
    return Response(b'{"status":"received"}', media_type="application/json")


@app.post("/scored_data_list")
async def scored_data_list(request: Request) -> Response:
    await _kept(request)
    return Response(b'{"status":"received"}', media_type="application/json")
