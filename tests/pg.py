"""The machine's PostgreSQL for tests: a database of its own per test, dropped afterwards.

The server is not optional: CI runs one (127.0.0.1:5432, trust auth, user postgres), so a test that cannot
reach it fails, loudly, instead of being skipped. `ROLLBUF_TEST_POSTGRES` points the tests at another server
(an admin URL: a database the tests may connect to in order to create and drop their own).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

ADMIN_URL = os.environ.get("ROLLBUF_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
PREFIX = "rollbuf_test_"
"""Every database the tests create starts with this: other users of the server are never touched."""
CLUSTER = ("15", "main")
"""The machine's cluster, as pg_ctlcluster names it (stopped and started by the fault tests only)."""
READY_TIMEOUT_S = 60.0
CLUSTER_TESTS = os.environ.get("CI") == "true" or os.environ.get("ROLLBUF_TEST_PG_CLUSTER") == "1"
"""Whether tests may stop the cluster: in CI, or when asked for (read at import: tests run with ROLLBUF_*
variables removed). Other developers' tests on a shared machine use the same cluster."""


def admin() -> psycopg.Connection[tuple[object, ...]]:
    try:
        return psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        pytest.fail(
            f"PostgreSQL is not reachable at {ADMIN_URL} ({exc}). The PostgreSQL store's tests need it: start it "
            "(pg_ctlcluster --skip-systemctl-redirect 15 main start) or set ROLLBUF_TEST_POSTGRES to an admin URL.",
            pytrace=False,
        )


def url_of(dbname: str, **params: str) -> str:
    parts = urlsplit(ADMIN_URL)
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return urlunsplit((parts.scheme, parts.netloc, f"/{dbname}", query, ""))


@contextmanager
def database() -> Iterator[str]:
    """A new, empty database; its name. Dropped on exit, even with connections still open to it."""
    name = PREFIX + secrets.token_hex(6)
    with admin() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with admin() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def wait_until_ready(timeout: float = READY_TIMEOUT_S) -> None:
    """Poll until the server accepts connections and answers a query."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
                return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # polling interval


def stop_cluster_immediately() -> None:
    """`pg_ctlcluster 15 main stop -m immediate`: what a crash of the database server looks like to clients."""
    subprocess.run(["pg_ctlcluster", *CLUSTER, "stop", "-m", "immediate"], check=True, timeout=60)


def start_cluster() -> None:
    """Start the cluster (if it is not running) and return as soon as it accepts connections (pg_ctlcluster
    itself returns seconds later; it is reaped before returning)."""
    status = subprocess.run(["pg_ctlcluster", *CLUSTER, "status"], capture_output=True, timeout=60)
    if status.returncode == 0:
        wait_until_ready()
        return
    starting = subprocess.Popen(["pg_ctlcluster", "--skip-systemctl-redirect", *CLUSTER, "start"])
    try:
        wait_until_ready()
    finally:
        starting.wait(timeout=120)
