"""Shared durable backend: PostgreSQL, so that server replicas on many hosts serve one buffer.

Every transaction takes one transaction-scoped advisory lock before it reads anything, so transactions of
all replicas run one after another, exactly as on one process: "take a batch" is atomic across replicas, a
group id seen by one replica is a duplicate on every other, and `?step=N` is one stored batch whoever
serves it. The lock ends with the transaction (commit, rollback or a dropped connection): nothing to
expire, nothing to clean up after a replica dies.

Within a replica, as in the SQLite store, one thread owns the connection and commits the transactions
queued meanwhile together (group commit): one PostgreSQL transaction, one lock acquisition and one WAL
flush for up to `GROUP_MAX` functions, each rolled back alone if it raises (a SAVEPOINT, taken only once a
function writes to the database directly). Most writes are buffered in memory and sent with the COMMIT, as
one statement, in one round trip; small tables (values, counts) are read once per transaction. A caller is
answered only after COMMIT returned. If the outcome is unknown (the connection dropped) or the database
cannot be reached, the caller gets `StoreUnavailable` (HTTP 503); a retried submission with a group id or
Idempotency-Key is then recognised as a duplicate if the first attempt did commit. See docs/stores.md and
docs/deployment.md.

A transaction that queued data ends with a NOTIFY; each replica LISTENs on its own connection and wakes its
long-polling trainers when another replica committed data.

Modules: `config` (the URL, the sessions' settings), `schema` (the layout, as versioned steps), `cache` (what a
group of functions read once and writes with its COMMIT), `txn` (a function's view), `listen` (waking
long-polls across replicas), `errors` (503 or 500), `store` (the lanes and their group commit).
"""

from api.store.postgres.config import LIBPQ_DEFAULTS, SESSION_SETTINGS, PostgresConfig, parse_url
from api.store.postgres.errors import is_transient
from api.store.postgres.schema import SCHEMA_VERSION
from api.store.postgres.store import PostgresStore

__all__ = [
    "LIBPQ_DEFAULTS",
    "SCHEMA_VERSION",
    "SESSION_SETTINGS",
    "PostgresConfig",
    "PostgresStore",
    "is_transient",
    "parse_url",
]
