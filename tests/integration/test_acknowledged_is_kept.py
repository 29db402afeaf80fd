"""What a real `rollbuf serve` process acknowledges, it never refuses later, and whatever it is sent it answers
(docs/rollouts.md, docs/tasks.md):

- a rollout posted to an open group is held to every rule its sealed group meets at ingest, and a group at its open
  to what the registered trainer can serve: a violation is a 422 naming the field, never a 200 whose group expires
  at its seal (`refused: ...`);
- lease tokens, dataset files and paths parse totally: a 4xx naming the field, never a 500 (on every store);
- the sweep passes over a group it cannot finish (logged and counted once) and seals the groups behind it.

Each finding was measured before the change; the test's docstring gives the figure."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.rollouts import groups as rg
from api.store import make_store
from api.store.base import Txn
from api.store.rollouts import GroupRow, SlotRow
from tests import pg
from tests.factories import env, group, registration
from tests.servers import ServerProcess, running_server

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("acknowledged_is_kept")]
MAX_TOKEN_LEN = 512
NAN, INF = math.nan, math.inf


def send(c: httpx.Client, path: str, body: Any) -> httpx.Response:
    """`body` as Python's json writes it: NaN and Infinity as such, lone surrogates as `\\ud800` escapes."""
    return c.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})


def refusal(reply: httpx.Response) -> tuple[int, list[Any], str]:
    """The status, and the first error's `loc` and `msg` (empty for a success)."""
    error: dict[str, Any] = reply.json()["errors"][0] if reply.status_code >= 400 else {"loc": [], "msg": ""}
    return reply.status_code, error["loc"], error["msg"]


def started(c: httpx.Client, batch_size: int = 8) -> None:
    assert c.post("/register", json=registration(batch_size=batch_size, max_token_len=MAX_TOKEN_LEN)).is_success
    assert c.get("/batch").status_code == 200  # envs may register now
    assert c.post("/register-env", json=env(group_size=4)).status_code == 200


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("acknowledged")
    (tmp / "files").mkdir()
    flags = ("--max-batch-wait", "0", "--task-files-dir", str(tmp / "files"), "--rollout-sweep-every-s", "0.1")
    with running_server(f"sqlite:///{tmp / 'rollbuf.db'}", tmp / "server.log", *flags) as server:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            started(c)
        yield server


@pytest.fixture
def c(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


ROLLOUT = {"tokens": [5, 6, 7], "masks": [-100, 6, 7], "inference_logprobs": [-0.1, -0.2, -0.3], "score": 1.0}
LONG = MAX_TOKEN_LEN + 3000
DEEP: Any = 0
for _ in range(40):
    DEEP = [DEEP]
POSTS: list[tuple[str, dict[str, Any], list[Any], str]] = [  # (what, fields, the loc it names, the rule's words)
    ("a token id past int32", {"tokens": [5, 2**40, 7]}, ["body", "tokens", 1], "token ids must fit in int32"),
    ("a token id past 64 bits", {"tokens": [5, 2**70, 7]}, ["body", "tokens"], "must fit in int32"),
    ("a negative token id", {"tokens": [-5, 6, 7]}, ["body", "tokens", 0], "token ids must be >= 0"),
    (
        "3,000 tokens past max_token_len",
        {"tokens": [1] * LONG, "masks": [1] * LONG, "inference_logprobs": [-0.1] * LONG},
        ["body", "tokens"],
        f"exceed the trainer's max_token_len of {MAX_TOKEN_LEN}",
    ),
    ("a mask past int32", {"masks": [-100, 2**40, 7]}, ["body", "masks", 1], "mask values must fit in int32"),
    ("masks not one per token", {"masks": [1]}, ["body", "masks"], "one mask per token"),
    ("logprobs not one per token", {"inference_logprobs": [-0.1]}, ["body", "inference_logprobs"], "one logprob"),
    ("a NaN logprob", {"inference_logprobs": [-0.1, NAN, -0.3]}, ["body", "inference_logprobs"], "finite float32"),
    (
        "a logprob past float32",
        {"inference_logprobs": [-0.1, -1e39, -0.3]},
        ["body", "inference_logprobs"],
        "finite float32",
    ),
    ("a NaN score", {"score": NAN}, ["body", "score"], "scores must be finite"),
    ("an infinite score", {"score": INF}, ["body", "score"], "scores must be finite"),
    (
        "a lone surrogate in the record",
        {"overrides": {"turns": ["\ud800"]}},
        ["body", "overrides", "turns", 0],
        "valid Unicode",
    ),
    ("a lone surrogate as a record's key", {"overrides": {"\udfff": 1}}, ["body", "overrides"], "valid Unicode"),
    ("a record nested 40 deep", {"overrides": {"a": DEEP}}, ["body", "overrides", "a"], "nested deeper than 32"),
    ("an integer past 64 bits in the record", {"overrides": {"n": 2**70}}, ["body", "overrides", "n"], "64 bits"),
    ("NaN in the record", {"overrides": {"x": NAN}}, ["body", "overrides", "x"], "finite"),
    ("a policy_step ahead of the trainer", {"policy_step": 5}, ["body", "policy_step"], "ahead of the trainer"),
]


def test_every_ingest_rule_a_rollout_can_break_is_refused_at_its_post(c: httpx.Client) -> None:
    """Each rule of ingest a rollout can break (api/ingest/validation.py: `pack_group`'s rules on one sequence, its
    record's JSON, `check_policy_step`), posted through the per-rollout path: a 422 naming the field, and nothing
    acknowledged; the same rollouts sent as a whole group are refused at ingest, as their sealed group would be.
    Before, each was acknowledged (200) and its group expired at its seal (`refused: ... token ids must fit in
    int32`): a 2^40 id, a -5 id, 3,000 tokens past max_token_len and a G=16 group (below) in a run of batch 8 were
    4 groups whose 28 acknowledged rollouts were dropped; a NaN score was stored as null, the group left waiting,
    unscored, for its deadline."""
    spec = {"group_id": "rules", "env_id": 0, "producer_id": "p1", "group_size": 4, "deadline_s": 600}
    assert c.post("/rollouts/open", json=spec).status_code == 200
    before = c.get("/rollouts").json()
    for i, (what, fields, loc, rule) in enumerate(POSTS):
        rollout = {**ROLLOUT, **fields}
        code, where, msg = refusal(
            send(c, "/rollouts/post", {"group_id": "rules", "slot": 0, "producer_id": "p1", **rollout})
        )
        expected = 409 if "policy_step" in fields else 422  # a step ahead: valid, refused by the run's state now
        assert (code, where[: len(loc)]) == (expected, loc) and rule in msg, (what, code, where, msg)
        whole: dict[str, Any] = {k: [v] * 4 for k, v in rollout.items() if k not in ("score", "policy_step")}
        whole |= {
            "scores": [rollout["score"]] * 4,
            "policy_step": rollout.get("policy_step"),
            "env_id": 0,
            "group_id": f"whole-{i}",
        }
        assert send(c, "/scored_data", whole).status_code == 422, f"{what}: not an ingest rule?"
    assert c.get("/rollouts").json() == before, "something was acknowledged"
    for slot in range(4):  # the group itself goes on: sealed whole, served as any group
        reply = send(c, "/rollouts/post", {"group_id": "rules", "slot": slot, "producer_id": "p1", **ROLLOUT})
        assert reply.status_code == 200, reply.text
    assert reply.json()["group"]["state"] == "sealed", reply.json()
    assert "expired:refused" not in c.get("/rollouts").json()


def test_a_group_the_trainer_could_never_serve_is_refused_at_its_open(c: httpx.Client) -> None:
    """At its open, a group is held to what its sealed group will be: G within the trainer's batch (8), a producer
    id a group may carry, a task every sibling lease can carry. Before: G=16 was opened and its 16 rollouts
    acknowledged, then refused at the seal ("16 sequences in one group; at most 8 are accepted"); a producer id with a
    newline was opened (its sealed group refused); a task with a lone surrogate nested in it was opened, and every
    sibling lease that handed it out answered 500 after committing its leases; a task nested 900 deep was a 500."""
    spec = {"group_id": "opened", "env_id": 0, "producer_id": "p1", "group_size": 4, "deadline_s": 600}
    deep: Any = 0
    for _ in range(900):
        deep = [deep]
    cases: list[tuple[dict[str, Any], list[Any], str]] = [
        ({"group_size": 16}, ["body", "group_size"], "16 sequences in one group; at most 8"),
        ({"producer_id": "p\n1"}, ["body", "producer_id"], "printable"),
        ({"task": {"prompt": "q", "meta": [{"x": "\ud800"}]}}, ["body", "task", "meta", 0, "x"], "valid Unicode"),
        ({"task": deep}, ["body", "task"], "nested deeper than 32"),
    ]
    for fields, loc, rule in cases:
        code, where, msg = refusal(send(c, "/rollouts/open", {**spec, **fields}))
        assert (code, where[: len(loc)]) == (422, loc) and rule in msg, (fields.keys(), code, where, msg)
    assert c.get("/rollouts/group", params={"group_id": "opened"}).status_code == 404, "opened all the same"
    assert send(c, "/scored_data", group(16, env_id=0)).status_code == 422, "G=16 is refused at ingest too"
    assert send(c, "/scored_data", group(4, env_id=0, producer_id="p\n1")).status_code == 422


def test_a_seal_with_a_score_that_is_not_finite_is_refused_and_the_group_stays_open(c: httpx.Client) -> None:
    """A producer's seal with the group's scores: a NaN among them is a 422 naming its slot (before: the seal
    answered with the group expired, `refused: ... scores must be finite`, its rollouts dropped)."""
    spec = {
        "group_id": "scored",
        "env_id": 0,
        "producer_id": "p1",
        "group_size": 4,
        "min_group_size": 2,
        "deadline_s": 600,
        "scores_at_seal": True,
    }
    assert c.post("/rollouts/open", json=spec).status_code == 200
    for slot in (0, 1):
        post = {"group_id": "scored", "slot": slot, "producer_id": "p1", **ROLLOUT, "score": None}
        assert send(c, "/rollouts/post", post).is_success
    seal = {"group_id": "scored", "producer_id": "p1", "scores": {"0": 1.0, "1": NAN}}
    assert refusal(send(c, "/rollouts/seal", seal))[:2] == (422, ["body", "scores", "1"])
    assert c.get("/rollouts/group", params={"group_id": "scored"}).json()["state"] == "open"
    sealed = send(c, "/rollouts/seal", {**seal, "scores": {"0": 1.0, "1": 0.0}})
    assert sealed.json()["state"] == "sealed", sealed.text


@contextmanager
def server_on(backend: str, tmp: Path) -> Iterator[ServerProcess]:
    with ExitStack() as stack:
        url = {"memory": "memory://", "sqlite": f"sqlite:///{tmp / 'rollbuf.db'}"}.get(backend)
        url = url or pg.url_of(stack.enter_context(pg.database()))
        yield stack.enter_context(running_server(url, tmp / "server.log", "--max-batch-wait", "0"))


@pytest.mark.parametrize("backend", ["memory", "sqlite", "postgresql"])
def test_lease_tokens_parse_totally_on_every_store(backend: str, tmp_path: Path) -> None:
    """A group id that claims to be a lease token and is not one (`task:x:0:0:²`, numbers past 64 bits, a leading
    zero) is a 422 naming `group_id`, on /scored_data and /rollouts/open; such tokens in /tasks/heartbeat and
    /tasks/fail are leases not held. Before the token parser (api/tasks/tokens.py parse_token), `task:x:0:0:²` made
    /scored_data answer 500 on every store, and integers past 64 bits in a token made /tasks/heartbeat, /tasks/fail
    and /scored_data answer 500 on SQLite."""
    with server_on(backend, tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        started(c)
        assert c.post("/tasks/datasets", json={"name": "d", "tasks": [{"q": 1}, {"q": 2}]}).status_code == 200
        [lease] = c.post("/tasks/lease", json={"dataset": "d", "producer_id": "p1"}).json()["leases"]
        token = lease["token"]
        name, epoch, index, rest = token.split(":", 1)[1].split(":")
        bad = [
            "task:x:0:0:\u00b2",
            f"task:d:{epoch}:{index}:{'9' * 30}",
            f"task:d:{'9' * 25}:0:1",
            f"task:d:0{epoch}:{index}:{rest}",
            f"task:d:{epoch}:{index}:\u0661",
        ]
        for gid in bad:
            reply = c.post("/scored_data", json=group(4, env_id=0, group_id=gid, producer_id="p1"))
            assert refusal(reply)[:2] == (422, ["body", "group_id"]), (gid, reply.text)
            opened = c.post(
                "/rollouts/open",
                json={"group_id": gid, "env_id": 0, "producer_id": "p1", "group_size": 4, "deadline_s": 60},
            )
            assert refusal(opened)[:2] == (422, ["body", "group_id"]), (gid, opened.text)
            assert c.post("/tasks/fail", json={"token": gid, "reason": "x"}).json() == {"accepted": False}
        beat = c.post("/tasks/heartbeat", json={"tokens": [*bad, token]})
        assert beat.status_code == 200, beat.text
        assert [beat.json()["expires_at"][t] is None for t in [*bad, token]] == [True] * len(bad) + [False]
        assert c.post("/scored_data", json=group(4, env_id=0, group_id=token, producer_id="p1")).status_code == 200
        assert "Traceback" not in Path(server.log).read_text()


def test_dataset_files_and_paths_are_tasks_or_a_422_naming_the_path(server: ServerProcess, c: httpx.Client) -> None:
    """A dataset file's line that no lease reply can carry is refused at registration, naming `path` and the task;
    a path the file system cannot look up is a 422 naming `path`. Before: a line with a lone surrogate nested in it
    and a line nested 900 deep registered, then the lease that handed them out answered 500 after committing its
    leases (3 of 3 and 2 of 2 tasks left leased until they lapsed); a line nested 100,000 deep, a NUL byte in the
    path, a 300-character name and a loop of symbolic links were 500s."""
    files = Path(server.log).parent / "files"
    (files / "loop").symlink_to(files / "loop")
    lines = {
        "surrogate": ('{"q": 1}\n{"q": ["\\ud800"]}\n{"q": 3}\n', "task 1 at q.0: strings must be valid Unicode"),
        "deep": ('{"q": 1}\n' + "[" * 900 + "]" * 900 + "\n", "task 1 at 0.0.0"),
        "deeper": ("[" * 100_000 + "]" * 100_000 + "\n", "task 0: nested deeper than 32 levels"),
        "nan": ('{"q": NaN}\n', "task 0 at q: numbers must be finite"),
        "huge": ('{"q": 1e400}\n', "task 0 at q: numbers must be finite"),
    }
    for name, (content, rule) in lines.items():
        (files / f"{name}.jsonl").write_text(content)
        code, where, msg = refusal(c.post("/tasks/datasets", json={"name": name, "path": f"{name}.jsonl"}))
        assert (code, where) == (422, ["body", "path"]) and rule in msg, (name, code, msg)
    for path in ("a\x00b.jsonl", "a" * 300, "loop"):
        code, where, msg = refusal(send(c, "/tasks/datasets", {"name": "paths", "path": path}))
        assert 400 <= code < 500 and where == ["body", "path"], (path, code, msg)
    for name in lines:  # what was stored before the refusal is served as any task
        leased = c.post("/tasks/lease", json={"dataset": name, "producer_id": "p1", "n": 10})
        assert leased.status_code in (200, 404), leased.text
    assert "Traceback" not in Path(server.log).read_text()


def rewrite(url: str, fn: Any) -> None:
    async def run() -> None:
        store = make_store(url)
        try:
            await store.transact(fn)
        finally:
            await store.close()

    asyncio.run(run())


def test_the_sweep_passes_over_a_group_it_cannot_finish(tmp_path: Path) -> None:
    """Two groups this release cannot read are due first (a record of a later release; a `sealing` group whose
    rollout is not a record) and three good groups behind them: the restarted server seals the three, logs each of the
    two once, counts them (`unfinished`), and its lease requests answer. Before: the first unreadable group failed
    the sweep at every try, and the three stayed `open` past their deadline (the 500 of a `task:x:0:0:²` group at
    the head of the sweep had kept 3 of 3 groups behind it `sealing` 8 s past their deadline)."""
    url, log = f"sqlite:///{tmp_path / 'rollbuf.db'}", tmp_path / "server.log"
    with running_server(url, log) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        started(c)
        for k in range(3):
            spec = {
                "group_id": f"due{k}",
                "env_id": 0,
                "producer_id": "p1",
                "group_size": 4,
                "min_group_size": 1,
                "deadline_s": 600,
            }
            assert c.post("/rollouts/open", json=spec).status_code == 200
            post = {"group_id": f"due{k}", "slot": 0, "producer_id": "p1", **ROLLOUT}
            assert c.post("/rollouts/post", json=post).status_code == 200
    past = time.time() - 60

    def damage(txn: Txn) -> None:
        for k in range(3):  # their deadline passed while the server was down
            row = txn.rollouts.get(f"due{k}")
            assert row is not None
            g = rg.OpenGroup.of(row.record)
            g.deadline = past
            txn.rollouts.put(replace(row, deadline=past, record=g.to_json()))
        later = rg.OpenGroup(
            key="later", env_id=0, group_size=2, min_group_size=1, deadline=past - 2, producer="p1", expires_at=past - 2
        )
        record = {**json.loads(later.to_json()), "from_a_later_release": 1}
        txn.rollouts.put(GroupRow("later", 0, "open", past - 2, past - 2, 0, json.dumps(record)))
        broken = rg.OpenGroup(
            key="broken",
            env_id=0,
            group_size=2,
            min_group_size=1,
            deadline=past - 1,
            producer="p1",
            expires_at=past - 1,
        )
        txn.rollouts.put(GroupRow("broken", 0, "sealing", past - 1, past - 1, 0, broken.to_json()))
        txn.rollouts.add_slot(SlotRow("broken", 0, "p1", "d", b"{not a record", 1, 1.0, None), 13)

    rewrite(url, damage)
    with running_server(url, log, "--rollout-sweep-every-s", "0.1") as server:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            deadline = time.monotonic() + 60  # a hang guard
            states: list[str] = []
            while states != ["sealed"] * 3:
                assert time.monotonic() < deadline, states
                time.sleep(0.05)  # polling the groups' states, not a wait for them
                states = [c.get("/rollouts/group", params={"group_id": f"due{k}"}).json()["state"] for k in range(3)]
            for _ in range(3):  # each runs a sweep first
                assert c.post("/rollouts/lease", json={"producer_id": "sibling", "n": 4}).status_code == 200
            assert c.get("/rollouts").json()["unfinished"] == 2
            assert c.get("/rollouts/group", params={"group_id": "broken"}).json()["state"] == "sealing"
    text = log.read_text()
    for key in ("later", "broken"):
        assert text.count(f"the sweep cannot finish group '{key}'") == 1, text[-3000:]
    assert "background job rollout_sweep failed" not in text
