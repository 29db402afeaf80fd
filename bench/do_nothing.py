"""A do-nothing FastAPI endpoint: the ingest ceiling of a client, HTTP and the framework, with no parsing and no
storage. `bench.limit` divides each server's CPU per group by this one's (side `sink`), and `bench.ab` and the
HTTP part of `python -m bench` run the same client against it (side `do-nothing`).

It answers the Atropos protocol's calls minimally, so that any client of that protocol runs against it:
`/scored_data` and `/scored_data_list` read the whole body and answer `{"status": "received"}`; `/register`,
`/register-env`, `/reset_data`, `/status` and `/batch` answer a valid minimum (`/batch`: no batch). `/ping`
answers `{"ok": true}` (the readiness probe), and `POST /sink` reads the body and answers its length.

    uvicorn bench.do_nothing:app
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

app = FastAPI()


@app.get("/ping")
async def ping() -> dict[str, bool]:
    return {"ok": True}


@app.get("/status")
async def status() -> dict[str, int]:
    return {"current_step": 0, "queue_size": 0}


@app.post("/sink")
async def sink(request: Request) -> dict[str, int]:
    return {"bytes": len(await request.body())}


@app.post("/scored_data")
async def scored_data(request: Request) -> dict[str, str]:
    await request.body()
    return {"status": "received"}


@app.post("/scored_data_list")
async def scored_data_list(request: Request) -> dict[str, str]:
    await request.body()
    return {"status": "received"}


@app.get("/reset_data")
async def reset_data() -> Response:
    return Response(b"Reset successful", media_type="text/plain")


@app.post("/register")
async def register(request: Request) -> dict[str, int]:
    await request.body()
    return {"uuid": 1}


@app.post("/register-env")
async def register_env(request: Request) -> dict[str, object]:
    await request.body()
    return {
        "status": "success",
        "env_id": 0,
        "wandb_name": "x_0",
        "checkpoint_dir": "",
        "starting_step": 0,
        "checkpoint_interval": 0,
        "num_steps": 0,
    }


@app.get("/batch")
async def batch() -> dict[str, None]:
    return {"batch": None}
