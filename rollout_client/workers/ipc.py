"""Messages between the runner and its worker processes: length-prefixed pickles over a Unix socket, read and
written through asyncio streams.

`send` never blocks the event loop, whatever the message size: it queues the bytes in user space and the
loop writes them as the peer reads. (A blocking `Connection.send` on both ends of one socketpair deadlocks
once both directions carry more than the kernel buffers hold: each loop is stuck in `send`, so neither
reads.) The queue is bounded by what is in flight: one message per job each way.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct
from typing import Any

HEADER = struct.Struct("!Q")
"""8-byte big-endian length of the pickle that follows."""
READ_LIMIT = 16 * 2**20
"""Bytes the reader buffers before it stops reading the socket: big messages arrive in few wakeups."""
OFFLOAD_BYTES = 256 * 1024
"""Messages from this size up are unpickled in a thread: a 4 MB group of Python ints takes tens of ms to
rebuild, which would otherwise stall the event loop (with the GIL it still costs CPU, but the loop keeps
getting its turn every switch interval)."""


class ChannelClosed(EOFError):
    """The other end is gone (its process exited or closed the socket)."""


class Channel:
    """One end of a message channel on a connected stream socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, fd: int) -> Channel:
        """A channel on (a duplicate of) the connected socket `fd`; the caller keeps `fd` to close."""
        sock = socket.socket(fileno=os.dup(fd))
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=READ_LIMIT)
        return cls(reader, writer)

    def send(self, msg: Any) -> None:
        """Queue `msg` for sending and return at once; ChannelClosed if the other end is known to be gone."""
        if self._writer.is_closing():
            raise ChannelClosed("channel closed")
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.writelines([HEADER.pack(len(data)), data])

    async def send_large(self, msg: Any) -> None:
        """`send` for a message that may be large (a finished group): pickled in a thread, off the loop.
        Messages sent this way may overtake ones sent after them with `send`."""
        data = await asyncio.to_thread(pickle.dumps, msg, pickle.HIGHEST_PROTOCOL)
        if self._writer.is_closing():
            raise ChannelClosed("channel closed")
        self._writer.writelines([HEADER.pack(len(data)), data])

    async def recv(self) -> Any:
        """The next message; ChannelClosed once the other end is gone."""
        try:
            (size,) = HEADER.unpack(await self._reader.readexactly(HEADER.size))
            data = await self._reader.readexactly(size)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ChannelClosed("channel closed") from exc
        if size >= OFFLOAD_BYTES:
            return await asyncio.to_thread(pickle.loads, data)
        return pickle.loads(data)

    async def drain(self) -> None:
        """Wait until the queued bytes are down to the transport's low-water mark."""
        await self._writer.drain()

    async def aclose(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
