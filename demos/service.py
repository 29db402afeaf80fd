"""The rollbuf service under uvicorn in a thread of the demo's process, on a free loopback port: a demo is
one command, with nothing to start beforehand."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from api.app import create_app
from api.config.settings import Settings


@contextlib.contextmanager
def serve_in_thread(store: str, **settings: Any) -> Iterator[str]:
    """The rollbuf app under uvicorn on a free loopback port, in a thread of this process (`settings`: others
    than the store, as `Settings` takes them)."""
    app = create_app(Settings(store=store, **settings))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="rollbuf-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the rollbuf service did not start")
        time.sleep(0.02)  # polling interval while waiting for readiness
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
