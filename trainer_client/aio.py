"""`AsyncTrainerClient`: `TrainerClient` for asyncio trainers; the same protocol (`protocol`), awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any

import httpx

from api.wire.producers import WeightsReply, WeightSyncReply
from api.wire.schema import CommitReply, Info, RegisterReply, Status
from trainer_client.arrays import Batch
from trainer_client.base import BaseTrainerClient
from trainer_client.errors import ServerUnreachable, error_for
from trainer_client.protocol import (
    DEFAULT_WAIT,
    DRAIN_POLL_S,
    DRAIN_TIMEOUT_S,
    NO_PROGRESS_S,
    Balance,
    BatchQuery,
    Cursor,
    DrainWait,
    Encoding,
    Server,
    parse_batch_reply,
    registration,
)
from trainer_client.transport import AsyncStdlibTransport

DECODE_IN_THREAD_BYTES = 1 << 20
"""Replies larger than this are decoded in a worker thread, so the event loop keeps serving other tasks."""


class AsyncTrainerClient(BaseTrainerClient[httpx.AsyncClient]):
    """Async twin of `TrainerClient` (same arguments, same guarantees); use `async with` and `async for`.

    ```python
    async with AsyncTrainerClient("http://127.0.0.1:8000") as rb:
        await rb.register(batch_size=256, max_token_len=4096)
        async for batch in rb.batches(start_step=checkpoint_step):
            ...
    ```
    """

    def _default_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=self.timeout, transport=AsyncStdlibTransport())

    async def __aenter__(self) -> AsyncTrainerClient:
        return self

    async def __aexit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def register(
        self, *, batch_size: int, max_token_len: int, starting_step: int = 0, **fields: Any
    ) -> RegisterReply:
        """See `TrainerClient.register`."""
        body = registration(batch_size=batch_size, max_token_len=max_token_len, starting_step=starting_step, **fields)
        return RegisterReply.model_validate_json((await self._request("POST", "/register", json=body)).content)

    async def info(self) -> Info:
        return Info.model_validate_json((await self._request("GET", "/info")).content)

    async def status(self) -> Status:
        return Status.model_validate_json((await self._request("GET", "/status")).content)

    async def commit(self, step: int) -> CommitReply:
        """See `TrainerClient.commit`."""
        reply = await self._request("POST", "/commit", json={"step": step})
        return CommitReply.model_validate_json(reply.content)

    async def announce_weights(self, step: int) -> WeightsReply:
        """See `TrainerClient.announce_weights`."""
        reply = WeightsReply.model_validate_json((await self._request("POST", "/weights", json={"step": step})).content)
        self._moves += 1
        return reply

    async def begin_weights(self, step: int) -> WeightSyncReply:
        """See `TrainerClient.begin_weights`."""
        reply = await self._request("POST", "/weights/pending", json={"step": step})
        return WeightSyncReply.model_validate_json(reply.content)

    async def weight_sync_state(self) -> WeightSyncReply:
        """GET /weights/pending: the sync begun and not yet announced, and who it waits for."""
        return WeightSyncReply.model_validate_json((await self._request("GET", "/weights/pending")).content)

    async def wait_drained(self, step: int, timeout: float | None = DRAIN_TIMEOUT_S) -> bool:
        """See `TrainerClient.wait_drained`."""
        wait = DrainWait(step, timeout, asyncio.get_running_loop().time())
        while True:
            verdict = wait.verdict(await self.weight_sync_state(), asyncio.get_running_loop().time())
            if verdict != "wait":
                return verdict == "drained"
            await asyncio.sleep(DRAIN_POLL_S)

    @asynccontextmanager
    async def weight_sync(self, step: int, timeout: float | None = DRAIN_TIMEOUT_S) -> AsyncIterator[bool]:
        """See `TrainerClient.weight_sync`."""
        await self.begin_weights(step)
        drained = await self.wait_drained(step, timeout)
        yield drained
        await self.announce_weights(step)

    async def batches(
        self,
        *,
        start_step: int | None = None,
        wait: float = DEFAULT_WAIT,
        rank: int | None = None,
        world_size: int | None = None,
        encoding: Encoding = "msgpack",
        balance: Balance = "tokens",
        no_progress_timeout: float | None = NO_PROGRESS_S,
    ) -> AsyncIterator[Batch]:
        """See `TrainerClient.batches`."""
        server = Server.from_info(await self.info())
        query = BatchQuery.make(
            server,
            wait=wait,
            rank=rank,
            world_size=world_size,
            encoding=encoding,
            balance=balance,
            timeout=self.timeout,
        )
        step = start_step if start_step is not None or not server.rollbuf else (await self.status()).current_step
        cursor = Cursor(query, step, moves=lambda: self._moves)
        cursor.progress.no_progress_timeout = no_progress_timeout
        while not cursor.finished:
            request = cursor.request()
            reply = await self._request("GET", "/batch", **request)
            if len(reply.content) > DECODE_IN_THREAD_BYTES:
                result = await asyncio.to_thread(parse_batch_reply, reply, request["step"])
            else:
                result = parse_batch_reply(reply, request["step"])
            batch = cursor.receive(result)
            if batch is not None:
                yield batch
            elif not cursor.finished and (pause := cursor.pause()):
                await asyncio.sleep(pause)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        step: int | None = None,
        answer: Callable[[httpx.Response], bool] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        kwargs.setdefault("timeout", self.timeout)
        headers = self.endpoint.headers | kwargs.pop("headers", {})
        tries = 0
        try:
            async for attempt in self.endpoint.retry_for(kwargs["timeout"]).aretrying(reraise=True):
                tries = attempt.retry_state.attempt_number
                with attempt:
                    try:
                        reply = await self._http.request(method, self.base_url + path, headers=headers, **kwargs)
                    except httpx.TransportError as exc:
                        self._outage.failed(f"{method} {path}: {type(exc).__name__}: {exc}")
                        raise
                    self._outage.answered()
                    if reply.status_code >= 400 and not (answer is not None and answer(reply)):
                        raise error_for(reply, step)
                    return reply
        except httpx.TransportError as exc:
            raise ServerUnreachable(self.base_url, tries, exc) from exc
        raise AssertionError("unreachable: tenacity reraises the last error")
