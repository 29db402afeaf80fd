"""Store backends behind one interface, chosen by URL: `memory://`, `sqlite:///path.db`,
`postgresql://user@host:port/dbname`."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from api.store.base import Store


def redacted(url: str) -> str:
    """The URL without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def without_password(text: str, url: str) -> str:
    """`text` (an error message that may quote the URL) with the URL's password, if any, masked."""
    password = urlsplit(url).password
    return text.replace(password, "***") if password else text


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
