"""StdlibTransport, the trainer client's HTTP wire, against the app served by uvicorn on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from api.config.settings import Settings
from tests.clients.test_trainer_client import serve_in_thread
from tests.factories import registration
from tests.servers import free_port
from trainer_client.errors import is_retryable
from trainer_client.transport import StdlibTransport


@pytest.fixture
def settings() -> Settings:
    return Settings(store="memory://")


@pytest.fixture
def client(settings: Settings) -> Iterator[httpx.Client]:
    with serve_in_thread(settings) as url, httpx.Client(base_url=url, transport=StdlibTransport()) as c:
        yield c


def idle_socket(c: httpx.Client) -> object:
    transport = c._transport
    assert isinstance(transport, StdlibTransport)
    [conn] = transport._idle.values()
    return conn.sock


def test_requests_bodies_and_keep_alive(client: httpx.Client) -> None:
    assert client.post("/register", json=registration(batch_size=8)).status_code == 200
    first = idle_socket(client)
    assert client.get("/info").json()["batch_size"] == 8
    assert idle_socket(client) is first  # the connection was reused
    schema = client.get("/openapi.json")  # large enough for the server to gzip it
    assert schema.headers["content-encoding"] == "gzip" and "paths" in schema.json()


def test_reconnects_when_the_server_dropped_an_idle_connection(client: httpx.Client) -> None:
    client.get("/info")
    stale = idle_socket(client)
    stale.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]  # as a server's keep-alive timeout would
    assert client.get("/info").status_code == 200
    assert idle_socket(client) is not stale


def test_errors_are_httpx_errors_the_retry_predicate_knows(client: httpx.Client) -> None:
    client.post("/register", json=registration(batch_size=8))
    with pytest.raises(httpx.ReadTimeout) as slow:
        # the server holds the poll it can no longer answer until its wait ends: 2 s, not 30, of the fixture's stop
        client.get("/batch", params={"step": 0, "wait": 2}, timeout=httpx.Timeout(5.0, read=0.2))
    assert is_retryable(slow.value)
    with httpx.Client(transport=StdlibTransport()) as c, pytest.raises(httpx.ConnectError) as refused:
        c.get(f"http://127.0.0.1:{free_port()}/info")
    assert is_retryable(refused.value)
    with httpx.Client(transport=StdlibTransport()) as c, pytest.raises(httpx.UnsupportedProtocol):
        c.get("ftp://127.0.0.1/info")
