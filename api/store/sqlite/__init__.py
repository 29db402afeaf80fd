"""Durable embedded backend: one SQLite file in WAL mode and a directory of payload segments beside it, the
default of `rollbuf serve`.

All SQLite work happens on one dedicated thread that owns the connection: the event loop never blocks on
disk, the connection is never shared between threads, and SQLite's single-writer lock orders the writers
(processes sharing the file also take turns by an flock first, so a waiting one wakes at once).
Transactions queued while the thread is busy are committed together (group commit): one `BEGIN IMMEDIATE
... COMMIT` with a SAVEPOINT per function, so a function that raises rolls back only itself. `transact`
returns after COMMIT: with `synchronous=NORMAL` (the default) a committed transaction survives `kill -9` of
the server; `?synchronous=FULL` also survives power loss. See docs/stores.md.

Modules: `config` (the URL, the connection's settings), `schema` (the layout, as versioned steps), `txn` (a
function's view of the file), `segments` and `payloads` (payload bytes in append-only files, their rows in
the file), `checkpoint` (WAL checkpoints beside the writer), `write_lock` (the writers' turn between
processes), `store` (the writer thread).
"""

from api.store.sqlite.checkpoint import CHECKPOINT_EVERY
from api.store.sqlite.config import SqliteConfig, parse_url
from api.store.sqlite.schema import SCHEMA_VERSION
from api.store.sqlite.store import SqliteStore

__all__ = ["CHECKPOINT_EVERY", "SCHEMA_VERSION", "SqliteConfig", "SqliteStore", "parse_url"]
