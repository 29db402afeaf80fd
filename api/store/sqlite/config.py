"""What a `sqlite:///path.db?...` URL says, and the connection settings every SQLite connection of a store
gets."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from api.store.url import DURABLE_PARAMS, Durable, durable_params

PAGE_SIZE = 1024
"""Page size of new files: SQLite's smallest. Payloads of 4 KiB and more live in segment files
(api/store/sqlite/segments.py), so the pages hold rows and indexes, and every commit rewrites each page it
touches whole, in the WAL and again at the checkpoint: the last page of each table it appends to (queue,
payloads, ledger, replies, counts) and a page of each index keyed by a client's id per group (the replies'
keys, the ledger's group ids). Smaller pages write less of what did not change. Measured (`python -m
bench.limit --sqlite-query page_size=N`, 3 rounds in turns, bytes written per payload byte): 8 KB groups
2.93x at 4 KiB, 2.18x at 2 KiB, 1.77x at 1 KiB; lists of 16 2.08x, 1.75x, 1.52x; 262 KB groups 1.07x, 1.04x,
1.03x; server CPU per group no higher (small groups 0.308, 0.256, 0.280 ms). Reads gain too: popping and
reading 128 groups of 128 KB in process (`python -m bench.sqlite_pages`) took 4.75 ms at 4 KiB, 3.36 ms at 2
KiB, 2.68 ms at 1 KiB. Earlier: 64 KiB pages (before segments) wrote 25x the bytes of an 8 KB group. A file
created with another page size keeps it (WAL mode fixes it); the URL's `page_size` chooses for new ones."""
WAL_LIMIT = 128 * 1024 * 1024
"""Default `wal_limit`. Each truncation blocks writes briefly: fewer, larger ones cost ingest less (measured in
turns: 64 MiB cost 6-16% of groups/s, 128 MiB 0-10%)."""
PAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
BUSY_TIMEOUT_S = 30.0
"""How long BEGIN IMMEDIATE waits for another process holding the write lock before failing."""


@dataclass(frozen=True, slots=True)
class SqliteConfig(Durable):
    """What a `sqlite:///path.db?...` URL says."""

    path: Path
    synchronous: str = "NORMAL"
    """NORMAL: commits survive a crash of the process; FULL: also a crash of the machine (fsync per commit)."""
    page_size: int = PAGE_SIZE
    """Page size of a new file (an existing file keeps its own)."""
    wal_limit: int = WAL_LIMIT
    """WAL bytes past which checkpoints truncate it, the writer waiting for them (`api.store.sqlite.checkpoint`)."""


def parse_url(url: str) -> SqliteConfig:
    """`sqlite:///rel/path.db` is relative to the working directory, `sqlite:////abs/path.db` absolute.

    Query parameters: `synchronous=NORMAL|FULL`, `page_size=BYTES` (new files), `wal_limit=BYTES`,
    `max_replies=N`, `reply_ttl=SECONDS`, `commit_delay=MICROSECONDS`.
    """
    parts = urlsplit(url)
    if parts.scheme != "sqlite" or parts.netloc:
        raise ValueError(f"store URL {url!r}: use sqlite:///relative/path.db or sqlite:////absolute/path.db")
    path = unquote(parts.path[1:] if parts.path.startswith("/") else parts.path)
    if not path or path.endswith("/") or path == ":memory:":
        raise ValueError(f"store URL {url!r} names no file: use sqlite:///path/to/rollbuf.db (or memory://)")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - {"synchronous", "page_size", "wal_limit", *DURABLE_PARAMS}
    if unknown:
        raise ValueError(f"store URL {url!r}: unknown parameter(s) {', '.join(sorted(unknown))}")
    sync = query.get("synchronous", "NORMAL").upper()
    if sync not in ("NORMAL", "FULL"):
        raise ValueError(f"store URL {url!r}: synchronous must be NORMAL or FULL")
    page_size = _int(query, "page_size", PAGE_SIZE, url)
    if page_size not in PAGE_SIZES:
        raise ValueError(f"store URL {url!r}: page_size must be a power of two from 1024 to 65536")
    wal_limit = _int(query, "wal_limit", WAL_LIMIT, url)
    if wal_limit < 1 << 20:
        raise ValueError(f"store URL {url!r}: wal_limit must be at least 1048576 (1 MiB)")
    shared = durable_params(query, url)
    return SqliteConfig(
        Path(path),
        sync,
        page_size,
        wal_limit,
        max_replies=shared.max_replies,
        reply_ttl=shared.reply_ttl,
        commit_delay=shared.commit_delay,
    )


def _int(query: dict[str, str], name: str, default: int, url: str) -> int:
    try:
        return int(query.get(name, default))
    except ValueError:
        raise ValueError(f"store URL {url!r}: {name} must be an integer") from None


def connect(config: SqliteConfig) -> sqlite3.Connection:
    """The writer's connection, in WAL mode with rollbuf's settings (a new file gets `config.page_size` pages)."""
    db = sqlite3.connect(config.path, isolation_level=None, timeout=BUSY_TIMEOUT_S, cached_statements=256)
    try:
        db.execute(f"PRAGMA page_size = {config.page_size}")  # a new file only: before WAL mode writes the header
        mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise RuntimeError(f"{config.path}: SQLite cannot use WAL mode here (journal_mode is {mode})")
        db.execute(f"PRAGMA synchronous = {config.synchronous}")
        db.execute("PRAGMA journal_size_limit = 67108864")  # truncate a WAL that one big transaction grew
        db.execute("PRAGMA cache_size = -65536")  # 64 MiB: the queues' indexes stay in memory
        db.execute("PRAGMA wal_autocheckpoint = 0")  # the Checkpointer does it, off the writer's path
        # Debian builds SQLite with SECURE_DELETE: every popped payload would be overwritten with zeros, as
        # many bytes written again as were queued. This buffer is no security boundary: free pages are reused.
        db.execute("PRAGMA secure_delete = OFF")
    except BaseException:
        db.close()
        raise
    return db
