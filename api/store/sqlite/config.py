"""What a `sqlite:///path.db?...` URL says, and the connection settings every SQLite connection of a store
gets."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from api.store.url import REPLY_PARAMS, ReplyLimits, reply_limits

PAGE_SIZE = 65536
"""SQLite's largest page, for new files. A group's payload (~200 KB at 8 x 2k tokens) spans 4 pages instead
of 49, so popping a 1024 x 2k batch (25 MB) reads ~400 pages instead of ~6000: the store thread's CPU per
binary /batch fell from ~45 to ~12 ms (in-process, 1024 x 2048), ingest CPU per group did not rise. 16 and
32 KiB pages did not help. The cost is write volume: a 16 KB group writes 322 KB (WAL frames and checkpoint
copies) against 54 KB with 4 KiB pages (`python -m bench.sqlite_pages`); measured over HTTP in turns, 4 and
16 KiB pages changed ingest by -18% to +23% and /batch by -5% to +17%, within this machine's noise, so the
default stays and the URL's `page_size` chooses (the WAL is bounded either way). A file created with another
page size keeps it (WAL mode fixes it)."""
WAL_LIMIT = 128 * 1024 * 1024
"""Default `wal_limit`. Each truncation blocks writes briefly: fewer, larger ones cost ingest less (measured in
turns: 64 MiB cost 6-16% of groups/s, 128 MiB 0-10%)."""
PAGE_SIZES = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
BUSY_TIMEOUT_S = 30.0
"""How long BEGIN IMMEDIATE waits for another process holding the write lock before failing."""


@dataclass(frozen=True, slots=True)
class SqliteConfig(ReplyLimits):
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
    `max_replies=N`, `reply_ttl=SECONDS`.
    """
    parts = urlsplit(url)
    if parts.scheme != "sqlite" or parts.netloc:
        raise ValueError(f"store URL {url!r}: use sqlite:///relative/path.db or sqlite:////absolute/path.db")
    path = unquote(parts.path[1:] if parts.path.startswith("/") else parts.path)
    if not path or path.endswith("/") or path == ":memory:":
        raise ValueError(f"store URL {url!r} names no file: use sqlite:///path/to/rollbuf.db (or memory://)")
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - {"synchronous", "page_size", "wal_limit", *REPLY_PARAMS}
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
    limits = reply_limits(query, url)
    return SqliteConfig(
        Path(path), sync, page_size, wal_limit, max_replies=limits.max_replies, reply_ttl=limits.reply_ttl
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
