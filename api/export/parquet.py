"""Parquet written as a stream of byte chunks: one row group per record batch, handed on as soon as it is
written, so that neither the endpoint nor the command holds more than one row group (the footer, written
last, holds the row groups' offsets: a reader needs the whole file, a writer never does)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

COMPRESSION = "zstd"
"""Token ids and masks compress well with zstd, and every reader the export promises (pyarrow, `datasets`,
pandas, Polars, DuckDB) reads it."""


class Chunks:
    """A write-only file whose bytes are taken out as they come (`take`), never kept past that."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._pos = 0
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._parts.append(bytes(data))
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readable(self) -> bool:
        return False

    def take(self) -> bytes:
        parts, self._parts = self._parts, []
        return b"".join(parts)


class ParquetChunks:
    """Writes record batches of one schema as Parquet, each as its own row group; `write` and `close` return
    the bytes written since the last call."""

    def __init__(self, schema: pa.Schema, compression: str = COMPRESSION) -> None:
        self.sink = Chunks()
        strings = [f.name for f in schema if pa.types.is_string(f.type)]
        scalars = [f.name for f in schema if not pa.types.is_nested(f.type)]
        # Dictionary encoding only where values repeat (env names, fates, reasons): on token ids it builds a
        # dictionary it then abandons, at twice the time of the whole write. Statistics (min/max per row
        # group, what readers prune with) only on scalar columns.
        self.writer = pq.ParquetWriter(
            self.sink, schema, compression=compression, use_dictionary=strings, write_statistics=scalars
        )
        self.bytes = 0

    def write(self, batch: pa.RecordBatch) -> bytes:
        self.writer.write_batch(batch, row_group_size=max(1, batch.num_rows))
        return self._take()

    def close(self) -> bytes:
        """The rest of the file: its footer (a file of no rows is a valid file with no row groups)."""
        self.writer.close()
        return self._take()

    def _take(self) -> bytes:
        out = self.sink.take()
        self.bytes += len(out)
        return out


def parquet_bytes(schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> Iterator[bytes]:
    """The Parquet file of these batches, chunk by chunk (empty chunks left out)."""
    out = ParquetChunks(schema)
    for batch in batches:
        if chunk := out.write(batch):
            yield chunk
    yield out.close()
