"""Writes the data files `tests/store/test_migrations.py` opens: a store of each backend as one release left it.

Run it at the release whose files they stand for, before changing the layout (`python -m
tests.store.old_files.write`), and commit what it writes; a file once committed is never rewritten, so every
later release is tested against what that one really wrote. It goes through the HTTP API only, so it runs
at any release: a registered run, an env, queued groups (one with a group id), a partial group in the side
buffer; from SQLite layout 11 and PostgreSQL layout 9 on also tasks trained and tasks served in a batch not
acknowledged yet (`trained_tasks`), and a group open for per-rollout submission with 2 of its 4 slots posted;
from SQLite layout 14 and PostgreSQL layout 12 on also a group open with 2 turns of a slot acknowledged. The
files are named by the schema version stored in them.
"""

from __future__ import annotations

import asyncio
import gzip
import shutil
import sqlite3
import subprocess
import tempfile
from pathlib import Path

import httpx
import psycopg

from api.app import create_app
from api.config.settings import Settings
from tests import pg
from tests.factories import env, group, registration

DRILL = 4
"""Tasks of the dataset `drill`, each one group of 4 sequences: batches of 8 train two of them a step."""

HERE = Path(__file__).parent
SCHEMA = "old_run"
"""The PostgreSQL schema the dump holds (not the default one: `?schema=` must keep working too)."""


async def fill(store: str) -> None:
    app = create_app(Settings(store=store))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            for method, path, body in [
                ("POST", "/register", registration(batch_size=8)),
                ("GET", "/batch", None),  # the trainer polls: envs may register now
                ("POST", "/register-env", env("math", group_size=4)),
            ]:
                reply = await c.request(method, path, json=body)
                reply.raise_for_status()
            await trained_tasks(c)
            for method, path, body in [
                ("POST", "/scored_data", group(4, seed=1, group_id="g-1")),
                ("POST", "/scored_data", group(4, seed=2)),
                ("POST", "/scored_data", group(4, seed=3)),
                ("POST", "/scored_data", group(2, seed=4)),  # half a group: waits in the side buffer
                # From layout 10 (SQLite) and 8 (PostgreSQL) on: a dataset with a task leased, a group open.
                ("POST", "/tasks/datasets", {"name": "arith", "env": "math", "tasks": [{"q": 1}, {"q": 2}]}),
                ("POST", "/tasks/lease", {"dataset": "arith", "producer_id": "p-1", "n": 1}),
                (
                    "POST",
                    "/rollouts/open",
                    {"group_id": "o-1", "env_id": 0, "group_size": 4, "producer_id": "p-1", "deadline_s": 3600},
                ),
                # From layout 11 (SQLite) and 9 (PostgreSQL) on: a group open with 2 of its 4 slots posted.
                (
                    "POST",
                    "/rollouts/open",
                    {"group_id": "o-2", "env_id": 0, "group_size": 4, "producer_id": "p-2", "deadline_s": 3600},
                ),
                *(("POST", "/rollouts/post", rollout("o-2", slot, "p-2")) for slot in (0, 1)),
                # From layout 14 (SQLite) and 12 (PostgreSQL) on: a group open with 2 turns of its slot 0 in.
                (
                    "POST",
                    "/rollouts/open",
                    {"group_id": "o-3", "env_id": 0, "group_size": 2, "producer_id": "p-3", "deadline_s": 3600},
                ),
                *(("POST", "/rollouts/turn", turn("o-3", 0, n, "p-3")) for n in (0, 1)),
            ]:
                reply = await c.request(method, path, json=body)
                reply.raise_for_status()


async def trained_tasks(c: httpx.AsyncClient) -> None:
    """From layout 11 (SQLite) and 9 (PostgreSQL) on: dataset `drill`'s tasks leased and sent as groups, and two
    batches asked for in "next" mode: tasks 0 and 1 trained in step 0 (asking for step 1 acknowledged it), tasks 2
    and 3 served in step 1, which nothing acknowledged yet."""
    made = await c.post("/tasks/datasets", json={"name": "drill", "env": "math", "tasks": list(range(DRILL))})
    made.raise_for_status()
    leased = await c.post("/tasks/lease", json={"dataset": "drill", "producer_id": "p-2", "n": DRILL})
    leased.raise_for_status()
    for x in leased.json()["leases"]:
        sent = await c.post("/scored_data", json=group(4, seed=100 + x["index"], group_id=x["token"]))
        sent.raise_for_status()
    for _ in range(2):
        batch = await c.get("/batch")
        batch.raise_for_status()
        assert len(batch.json()["batch"]) == 2, batch.text


def rollout(group_id: str, slot: int, producer: str) -> dict[str, object]:
    """One rollout of an open group, as `POST /rollouts/post` takes it."""
    return {
        "group_id": group_id,
        "slot": slot,
        "producer_id": producer,
        "tokens": [1, 2, 3 + slot],
        "masks": [-100, 2, 3 + slot],
        "score": float(slot % 2),
    }


def turn(group_id: str, slot: int, n: int, producer: str) -> dict[str, object]:
    """Turn `n` of a slot, as `POST /rollouts/turn` takes it: 3 tokens, then 2."""
    tokens = [10 + n, 20 + n, 30 + n][: 3 - n]
    return {"group_id": group_id, "slot": slot, "producer_id": producer, "turn": n, "tokens": tokens, "masks": tokens}


def write_sqlite(tmp: Path) -> Path:
    path = tmp / "rollbuf.db"
    asyncio.run(fill(f"sqlite:///{path}"))
    with sqlite3.connect(path) as db:
        version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    out = HERE / f"sqlite-v{version}.db.gz"
    with path.open("rb") as src, gzip.open(out, "wb") as dst:  # 64 KiB pages, mostly empty
        shutil.copyfileobj(src, dst)
    return out


def write_postgres() -> Path:
    with pg.database() as name:
        url = pg.url_of(name, schema=SCHEMA)
        asyncio.run(fill(url))
        with psycopg.connect(pg.url_of(name), autocommit=True) as conn:
            row = conn.execute(f"SELECT value FROM {SCHEMA}.meta WHERE key = 'schema_version'").fetchone()
            assert row is not None
        dump = subprocess.run(
            ["pg_dump", "--schema", SCHEMA, "--no-owner", "--no-privileges", "--inserts", pg.url_of(name)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    out = HERE / f"postgres-v{row[0]}.sql.gz"
    # psql's meta-commands (`\\restrict`) are not SQL: the file stays plain SQL, for any client to run.
    sql = "".join(line for line in dump.splitlines(keepends=True) if not line.startswith("\\"))
    out.write_bytes(gzip.compress(sql.encode(), mtime=0))  # gzipped as the SQLite file: data, not code to read
    return out


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(write_sqlite(Path(tmp)))
    print(write_postgres())
