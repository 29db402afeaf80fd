"""A PostgreSQL database of the benchmark's own, dropped afterwards (`ROLLBUF_BENCH_POSTGRES`: an admin URL,
default the local server with trust auth). Without a reachable server the PostgreSQL rows are skipped."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg

ADMIN_URL = os.environ.get("ROLLBUF_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")


def available() -> bool:
    try:
        with psycopg.connect(ADMIN_URL, connect_timeout=3):
            return True
    except psycopg.OperationalError as exc:
        print(f"PostgreSQL not reachable at {ADMIN_URL} ({exc}): skipping the PostgreSQL rows")
        return False


@contextmanager
def database() -> Iterator[str]:
    """A store URL on a new, empty database."""
    name = "rollbuf_bench_" + secrets.token_hex(6)
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    parts = urlsplit(ADMIN_URL)
    try:
        yield urlunsplit((parts.scheme, parts.netloc, f"/{name}", "", ""))
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
