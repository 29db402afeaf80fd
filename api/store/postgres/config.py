"""What a `postgresql://user@host:port/dbname?...` URL says, and the settings of every connection a store opens."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import psycopg

from api.store.url import DURABLE_PARAMS, Durable, durable_params, redacted

LIBPQ_DEFAULTS = {
    "connect_timeout": "5",
    "application_name": "rollbuf",
    # A database that stops answering (a network partition: no reset, just silence) is given up on within about
    # 10 s, so the request gets its 503 and the connection is replaced, instead of waiting out the kernel's
    # retransmissions (15 minutes): unacknowledged data for 10 s, or 5 s idle and then 3 probes 2 s apart.
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}
"""libpq parameters a store URL gets unless it sets them."""
SESSION_SETTINGS = {
    # The server's side of the same: a replica cut off while it holds the store lock loses its session, and
    # the other replicas the lock, within about 11 s (not the two hours of the kernel's default keepalive).
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
    "tcp_user_timeout": "10000",
    # A replica that stops mid-transaction without losing its connection (stopped, hung) frees the lock after
    # this; rollbuf's own transactions never wait for anything between statements.
    "idle_in_transaction_session_timeout": "15000",
}
"""Settings of every session a replica opens (lock_timeout and search_path come from the URL)."""
_OWN_PARAMS = {"schema", "lock_timeout", "pool_timeout", *DURABLE_PARAMS}
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,40}")


@dataclass(frozen=True, slots=True)
class PostgresConfig(Durable):
    """What a `postgresql://user@host:port/dbname?...` URL says."""

    conninfo: str
    """The URL without rollbuf's own parameters: everything else (sslmode, connect_timeout, ...) is libpq's."""
    schema: str = "rollbuf"
    """Schema holding rollbuf's tables: runs that share a database use different schemas."""
    lock_timeout: float = 10.0
    """Seconds a transaction waits for the store lock (held by another replica's transaction) before a 503."""
    pool_timeout: float = 3.0
    """Seconds a transaction waits for a connection to the database before a 503."""

    @property
    def lock_key(self) -> int:
        """Advisory lock id of this schema (advisory locks are per database already)."""
        digest = hashlib.blake2b(f"rollbuf:{self.schema}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big", signed=True)

    @property
    def channel(self) -> str:
        return f"rollbuf_{self.schema}"


def parse_url(url: str) -> PostgresConfig:
    """`postgresql://user[:password]@host[:port]/dbname[?param=value&...]`.

    rollbuf's parameters: `schema` (default rollbuf), `max_replies`, `reply_ttl` (seconds), `lock_timeout`
    and `pool_timeout` (seconds). Every other parameter goes to libpq as it is (`sslmode`, `connect_timeout`,
    `application_name`, ...).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"store URL {redacted(url)!r}: use postgresql://user@host:port/dbname")
    if not parts.path.strip("/"):
        raise ValueError(f"store URL {redacted(url)!r} names no database: postgresql://user@host:port/dbname")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    own = {k: v for k, v in pairs if k in _OWN_PARAMS}
    libpq = [(k, v) for k, v in pairs if k not in _OWN_PARAMS]
    given = {k for k, _ in libpq}
    libpq += [(k, v) for k, v in LIBPQ_DEFAULTS.items() if k not in given]
    conninfo = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(libpq), ""))
    try:
        psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as exc:
        raise ValueError(f"store URL {redacted(url)!r}: {exc}") from None
    schema = own.get("schema", "rollbuf")
    if not _IDENTIFIER.fullmatch(schema):
        raise ValueError(f"store URL {redacted(url)!r}: schema must be a lower-case identifier ([a-z_][a-z0-9_]*)")
    shared = durable_params(own, url)
    try:
        lock_timeout = float(own.get("lock_timeout", 10.0))
        pool_timeout = float(own.get("pool_timeout", 3.0))
    except ValueError:
        raise ValueError(f"store URL {redacted(url)!r}: lock_timeout and pool_timeout are seconds") from None
    if not lock_timeout > 0 or not pool_timeout > 0:
        raise ValueError(f"store URL {redacted(url)!r}: lock_timeout and pool_timeout must be positive")
    return PostgresConfig(
        conninfo,
        schema,
        lock_timeout,
        pool_timeout,
        max_replies=shared.max_replies,
        reply_ttl=shared.reply_ttl,
        commit_delay=shared.commit_delay,
    )


def connect_kwargs(config: PostgresConfig) -> dict[str, Any]:
    """`psycopg.connect` arguments (besides the conninfo) of the writer's and the reader's sessions:
    autocommit (the store sends BEGIN itself), SESSION_SETTINGS, lock_timeout and the schema's search_path."""
    settings = {
        "search_path": config.schema,
        "lock_timeout": str(round(config.lock_timeout * 1000)),
        **SESSION_SETTINGS,
    }
    options = " ".join(f"-c {name}={value}" for name, value in settings.items())
    return {"autocommit": True, "options": options}
