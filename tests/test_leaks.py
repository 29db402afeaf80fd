"""tests/leaks.py: a test that leaves a socket open fails at its own teardown, naming it; a socket held on
purpose, or closed, fails nothing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import asyncio, socket, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

HELD = []


class Empty(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def get(close):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Empty)
    threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()

    async def main():
        client = httpx.AsyncClient()
        await client.get(f"http://127.0.0.1:{server.server_port}/")
        if close:
            await client.aclose()

    try:
        asyncio.run(main())  # unclosed, the client's pooled connection outlives its loop, in a cycle
    finally:
        server.shutdown()
        server.server_close()


def test_leaks():
    get(close=False)


def test_closes():
    get(close=True)


def test_holds_one_on_purpose():
    HELD.append(socket.socket())


def test_after():
    pass
"""


def test_a_leaked_connection_fails_the_test_that_left_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_inner=TESTS)
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # only this plugin: a faster start
    result = pytester.runpytest_subprocess("-p", "tests.leaks", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_leaks*", "*test_inner.py::test_leaks left * open: unclosed*127.0.0.1*"]
    )


def test_without_proc_the_guard_is_off_and_fails_nothing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where there is no /proc/self/fd (macOS) every test runs as without the guard, none errors at setup."""
    pytester.makepyfile(test_inner=TESTS)
    pytester.makeini("[pytest]\nfilterwarnings = error\n")
    pytester.makeconftest("from pathlib import Path\nimport tests.leaks\ntests.leaks.FDS = Path('/no/such/fd')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_subprocess("-p", "tests.leaks", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)
