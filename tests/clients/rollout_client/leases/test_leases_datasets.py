"""`rollout_client.register_dataset` against the ASGI app (docs/tasks.md, "From a Python iterable or a file"): a
dataset larger than a page goes in pages the server takes, a page whose reply is lost is sent again and stores
nothing twice, a registration cut off midway goes on where the server's tasks end, rows come from a JSONL file,
and rows that are not JSON are refused before their page is sent."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Collection, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from rollout_client import RolloutClient, SyncRolloutClient, register_dataset
from tests.clients.test_trainer_client import serve_in_thread

DOCS = Path(__file__).resolve().parents[4] / "docs"
PAGE = 10
"""The server's `task_page_size` in these tests: 25 rows are three pages."""


class Recorder(httpx.AsyncBaseTransport):
    """The app's transport, recording each dataset request (path, first, tasks), and losing the replies of the
    requests numbered in `lose` after the app handled them (a connection cut on the way back)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, lose: Collection[int] = ()) -> None:
        self.inner = inner
        self.lose = lose
        self.sent: list[tuple[str, int, int]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.startswith("/tasks/"):
            body = json.loads(request.content)
            self.sent.append((request.url.path, body.get("first", 0), len(body["tasks"])))
            if len(self.sent) in self.lose:
                await response.aread()
                raise httpx.ReadError("the reply was lost", request=request)
        return response


@pytest.fixture
async def app() -> AsyncIterator[httpx.AsyncBaseTransport]:
    application = create_app(Settings(store="memory://", task_page_size=PAGE))
    async with application.router.lifespan_context(application):
        yield httpx.ASGITransport(app=application)


@asynccontextmanager
async def client(transport: httpx.AsyncBaseTransport) -> AsyncIterator[RolloutClient]:
    """A `RolloutClient` on `transport`; its HTTP client closed at the end."""
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
        async with RolloutClient(http_client=http) as c:
            yield c


def rows(n: int, start: int = 0) -> Iterator[dict[str, Any]]:
    return ({"id": f"t{i}", "prompt": f"Q: {i} + 1 =", "answer": str(i + 1)} for i in range(start, n))


async def stored(transport: httpx.AsyncBaseTransport, name: str) -> list[str]:
    """The ids of the dataset's tasks in its first epoch, by index, as the server leases them (a page a lease)."""
    leased: list[tuple[int, str]] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
        while True:
            body = {"dataset": name, "producer_id": f"p{len(leased)}", "n": PAGE}
            reply = (await http.post("/tasks/lease", json=body)).json()
            leased += [(lease["index"], lease["task"]["id"]) for lease in reply["leases"] if lease["epoch"] == 0]
            if not reply["leases"]:
                return [task for _, task in sorted(leased)]


@pytest.mark.anyio
async def test_a_dataset_larger_than_a_page_goes_in_pages_the_server_takes(app: httpx.AsyncBaseTransport) -> None:
    recorder = Recorder(app)
    async with client(recorder) as c:
        view = await register_dataset(c, "d", rows(25), env="math", epochs=2)
        assert (view.name, view.size, view.sealed, view.env, view.epochs) == ("d", 25, True, "math", 2)
        # A page is bounded by bytes too: one task at least.
        small = await register_dataset(c, "small", rows(3), page_bytes=1)
        assert (small.size, small.sealed) == (3, True)
    assert recorder.sent == [
        ("/tasks/datasets", 0, 10),
        ("/tasks/pages", 10, 10),
        ("/tasks/pages", 20, 5),
        ("/tasks/datasets", 0, 1),
        ("/tasks/pages", 1, 1),
        ("/tasks/pages", 2, 1),
    ]
    assert await stored(app, "d") == [f"t{i}" for i in range(25)]


@pytest.mark.anyio
async def test_a_page_whose_reply_is_lost_is_sent_again_and_stores_nothing_twice(
    app: httpx.AsyncBaseTransport,
) -> None:
    recorder = Recorder(app, lose={1, 3})  # the replies to the registration and to its second page
    async with client(recorder) as c:
        view = await register_dataset(c, "d", rows(25))
    assert (view.size, view.sealed) == (25, True)
    assert recorder.sent == [
        ("/tasks/datasets", 0, 10),
        ("/tasks/datasets", 0, 10),
        ("/tasks/pages", 10, 10),
        ("/tasks/pages", 10, 10),
        ("/tasks/pages", 20, 5),
    ]
    assert await stored(app, "d") == [f"t{i}" for i in range(25)]


@pytest.mark.anyio
async def test_a_registration_cut_off_midway_goes_on_where_the_servers_tasks_end(app: httpx.AsyncBaseTransport) -> None:
    def cut(n: int) -> Iterator[dict[str, Any]]:
        yield from rows(n)
        raise RuntimeError("the producer died")

    recorder = Recorder(app)
    async with client(recorder) as c:
        with pytest.raises(RuntimeError, match="the producer died"):
            await register_dataset(c, "d", cut(15))  # the first page sent, the second never complete
        again = await register_dataset(c, "d", rows(25))
        assert (again.size, again.sealed) == (25, True)
        once_more = await register_dataset(c, "d", rows(25))  # sealed: answered as it was, nothing sent after
        assert (once_more.size, once_more.sealed) == (25, True)
    assert recorder.sent == [
        ("/tasks/datasets", 0, 10),
        ("/tasks/datasets", 0, 10),
        ("/tasks/pages", 10, 10),
        ("/tasks/pages", 20, 5),
        ("/tasks/datasets", 0, 10),
    ]
    assert await stored(app, "d") == [f"t{i}" for i in range(25)]


@pytest.mark.anyio
async def test_rows_come_from_a_jsonl_file_and_rows_that_are_not_json_are_refused(
    app: httpx.AsyncBaseTransport, tmp_path: Path
) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" + ("\n" if i % 7 == 0 else "") for i, r in enumerate(rows(12))))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n\n{"prompt": NaN}\n')
    recorder = Recorder(app)
    async with client(recorder) as c:
        view = await register_dataset(c, "file", path)
        assert (view.size, view.sealed) == (12, True)
        with pytest.raises(ValueError, match=re.escape(f"{bad}:3: not JSON")):
            await register_dataset(c, "bad", bad)
        with pytest.raises(ValueError, match="task 1 is not JSON"):
            await register_dataset(c, "nan", [{"score": 1.0}, {"score": float("nan")}])
        with pytest.raises(TypeError, match="pathlib.Path"):
            await register_dataset(c, "str", str(path))
    assert [s[0] for s in recorder.sent] == ["/tasks/datasets", "/tasks/pages"]  # nothing of the refused ones
    assert await stored(app, "file") == [f"t{i}" for i in range(12)]


def test_the_docs_block_registers_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/tasks.md's block against a real server (its default page of 1000 tasks), from a JSONL file in the
    working directory; the blocking twin registers the same dataset again and is answered as it was."""
    [block] = [
        b
        for b in re.findall(r"```python\n(.*?)```", (DOCS / "tasks.md").read_text(), flags=re.S)
        if "register_dataset(client" in b
    ]
    monkeypatch.chdir(tmp_path)
    Path("gsm8k.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i} + 2 =", "answer": str(i + 2)}) + "\n" for i in range(3))
    )
    with serve_in_thread(Settings(store="memory://")) as url:
        exec(compile(block, "tasks.md", "exec"), {"URL": url, "__name__": "tasks_md"})
        assert capsys.readouterr().out.splitlines() == ["doubles 2500 True", "gsm8k 3 True"]
        with SyncRolloutClient(url) as sync:
            again = sync.register_dataset("gsm8k", Path("gsm8k.jsonl"), env="math")
        assert (again.size, again.sealed, again.env) == (3, True, "math")
