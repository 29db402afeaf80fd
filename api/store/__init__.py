"""Store backends behind one interface, chosen by URL: `memory://`, `sqlite:///path.db`,
`postgresql://user@host:port/dbname`."""

from __future__ import annotations

from urllib.parse import urlsplit

from api.store.base import Store
from api.store.url import redacted, without_password


class UnknownStoreURL(ValueError):
    pass


def make_store(url: str) -> Store:
    """Open the backend a store URL names."""
    scheme = urlsplit(url).scheme
    if scheme == "memory":
        from api.store.memory import MemoryStore

        return MemoryStore(url)
    if scheme == "sqlite":
        from api.store.sqlite import SqliteStore

        return SqliteStore(url)
    if scheme in ("postgresql", "postgres"):
        from api.store.postgres import PostgresStore

        return PostgresStore(url)
    raise UnknownStoreURL(
        f"store URL {redacted(url)!r}: scheme must be memory://, sqlite:///path or postgresql://user@host:port/dbname"
    )


__all__ = ["Store", "UnknownStoreURL", "make_store", "redacted", "without_password"]
