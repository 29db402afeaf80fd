"""`rollbuf export DIR`: the run's ledger and kept groups as Parquet files in DIR (docs/ledger.md, "Export").

Reads the store directly (`--store`, as `rollbuf serve` takes it: SQLite or PostgreSQL, beside a running
server), or asks a running server for each table (`--url`, the only way into a `memory://` store). Each table
is written to `DIR/<table>.parquet.part` as it streams and renamed when complete, so a file under its
final name is always whole. A progress bar on stderr shows each table's ledger rows (groups or steps) when
stderr is a terminal; otherwise one line per table when it is done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, NoReturn, TextIO

import httpx

from api import export

PROG = "rollbuf export"
EXIT_CONFIG = 2
REDRAW_S = 0.1
"""Shortest time between two redraws of the progress bar."""
BAR_WIDTH = 30


def fail(message: str) -> NoReturn:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)


class Bar:
    """A one-line progress bar on a terminal (`\\r` redraws, at most every REDRAW_S); elsewhere, one line when
    the table is done. `total` may be an estimate (or None): the bar stops at 100%."""

    def __init__(self, label: str, total: int | None, unit: str, out: TextIO = sys.stderr) -> None:
        self.label, self.total, self.unit, self.out = label, total, unit, out
        self.done = 0
        self.bytes = 0
        self.started = self.drawn = time.monotonic()
        self.live = out.isatty()

    def advance(self, n: int = 0, size: int = 0) -> None:
        self.done += n
        self.bytes += size
        now = time.monotonic()
        if self.live and now - self.drawn >= REDRAW_S:
            self.drawn = now
            self.out.write("\r" + self.line(now))
            self.out.flush()

    def line(self, now: float) -> str:
        secs = max(now - self.started, 1e-9)
        speed = f"{self.bytes / secs / 1e6:.1f} MB/s"
        if self.total:
            frac = min(1.0, self.done / self.total)
            filled = round(BAR_WIDTH * frac)
            bar = "#" * filled + "-" * (BAR_WIDTH - filled)
            return f"{self.label:<9} [{bar}] {100 * frac:3.0f}% {self.done}/{self.total} {self.unit} {speed}"
        return f"{self.label:<9} {self.done} {self.unit} {self.bytes / 1e6:.1f} MB {speed}"

    def close(self, path: Path, rows: int | None) -> None:
        now = time.monotonic()
        end = "\r" if self.live else ""
        what = f"{rows} rows, " if rows is not None else ""
        self.out.write(
            f"{end}{self.label:<9} {what}{self.bytes / 1e6:.1f} MB in {now - self.started:.1f} s -> {path}\n"
        )
        self.out.flush()


@contextmanager
def written(path: Path) -> Iterator[BinaryIO]:
    """A file written as `path`.part and renamed to `path` once whole. A write that fails (a full disk, a
    read-only directory) is one line and exit 2, not a traceback, and leaves no part behind."""
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "wb") as f:
            yield f
        os.replace(part, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            part.unlink()
        fail(f"{path}: cannot write the export: {exc.strerror or exc} (nothing of this table was left behind)")


async def from_store(url: str, tables: Sequence[str], out: Path) -> None:
    from api.export.stream import ExportLimits, TableWriter, pages, totals
    from api.store import make_store, redacted, without_password

    if url.startswith("memory://"):
        fail("a memory:// store lives inside its server process: export it with --url http://HOST:PORT")
    try:
        store = make_store(url)
    except Exception as exc:  # the operator's URL or file: one line, exit 2
        fail(f"--store {redacted(url)}: {without_password(str(exc), url)}")
    try:
        counts = await totals(store)
        limits = ExportLimits()
        for table in tables:
            writer = TableWriter(table, limits)
            bar = Bar(table, counts[table], "steps" if table == "steps" else "groups")
            path = out / f"{table}.parquet"
            with written(path) as f:
                async for page in pages(table, store, limits):
                    chunk = await asyncio.to_thread(writer.feed, page)
                    f.write(chunk)
                    bar.advance(page.size, len(chunk))
                chunk = writer.finish()
                f.write(chunk)
                bar.advance(0, len(chunk))
            bar.close(path, writer.written_rows)
    finally:
        await store.close()


async def from_server(url: str, api_key: str | None, tables: Sequence[str], out: Path) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(60.0)) as client:
        for table in tables:
            bar = Bar(table, None, "chunks")
            path = out / f"{table}.parquet"
            async with client.stream("GET", "/export", params={"table": table}) as reply:
                if reply.status_code != 200:
                    body = (await reply.aread()).decode(errors="replace")
                    fail(f"{url}/export?table={table}: HTTP {reply.status_code}: {body[:500]}")
                with written(path) as f:
                    async for chunk in reply.aiter_raw():
                        f.write(chunk)
                        bar.advance(1, len(chunk))
            bar.close(path, None)


async def write_from_server(url: str, api_key: str | None, out: Path) -> None:
    """Every table of a running server's run into `out` (created if missing): what `rollbuf demo --export` does."""
    out.mkdir(parents=True, exist_ok=True)
    await from_server(url, api_key, ("sequences", "groups", "steps"), out)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Write the run's ledger and kept groups as Parquet: DIR/sequences.parquet (one row per kept "
        "sequence), DIR/groups.parquet and DIR/steps.parquet (the ledger). docs/ledger.md#export",
    )
    parser.add_argument("dir", type=Path, help="directory to write the tables to (created if missing)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="the store to read (default: ROLLBUF_STORE, else rollbuf serve's default)",
    )
    source.add_argument("--url", metavar="URL", help="a running server to ask instead (http://HOST:PORT)")
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("ROLLBUF_API_KEY"),
        help="with --url: a trainer or admin key (default: ROLLBUF_API_KEY)",
    )
    parser.add_argument(
        "--tables",
        default=",".join(("sequences", "groups", "steps")),
        help="comma-separated tables to write: sequences, groups, steps (the default), tasks and rollouts",
    )
    args = parser.parse_args(argv)
    tables = [t for t in args.tables.split(",") if t]
    unknown = sorted(set(tables) - {"sequences", "groups", "steps", "tasks", "rollouts"})
    if unknown or not tables:
        fail(f"--tables: {', '.join(unknown) or 'none given'}; choose from sequences, groups, steps, tasks, rollouts")
    if not export.available():
        fail(export.MISSING)
    try:
        args.dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"{args.dir}: {exc.strerror or exc}")
    if args.url:
        asyncio.run(from_server(args.url.rstrip("/"), args.api_key, tables, args.dir))
        return
    from api.config.settings import Settings

    url = args.store or os.environ.get("ROLLBUF_STORE") or Settings.model_fields["store"].default
    asyncio.run(from_store(url, tables, args.dir))
