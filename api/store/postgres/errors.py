"""What the PostgreSQL store's errors mean to a caller: "not now" (503, retry) or "wrong" (a bug, 500)."""

from __future__ import annotations

import psycopg
import psycopg_pool

from api.store.base import StoreUnavailable

RETRY_AFTER_S = 1.0
"""Retry-After sent with a 503 when the database cannot be reached or a commit's outcome is unknown."""
_TRANSIENT_CLASSES = {"08", "40", "53", "55", "57", "58"}
"""SQLSTATE classes that say "not now", never "wrong": connection, rollback, resources, lock not available,
operator intervention (shutdown), system error."""


def is_transient(exc: BaseException) -> bool:
    """A database error that says "not now" (retry later), not "this request is wrong"."""
    if isinstance(exc, psycopg_pool.PoolTimeout | psycopg.OperationalError | psycopg.InterfaceError):
        return True
    sqlstate = getattr(exc, "sqlstate", None)
    if not isinstance(sqlstate, str):
        return False
    return sqlstate[:2] in _TRANSIENT_CLASSES or sqlstate == "25006"  # 25006: a read-only (standby) server


def unavailable(what: str, cause: BaseException) -> StoreUnavailable:
    """One exception per waiting caller (an exception object raised in several tasks gets its traceback mixed)."""
    exc = StoreUnavailable(
        f"the database is unavailable ({what}: {type(cause).__name__}: {cause}); retry", RETRY_AFTER_S
    )
    exc.__cause__ = cause
    return exc
