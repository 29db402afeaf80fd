"""Ingest: bad data gets a 4xx naming the field and the rule, and nothing of the request is applied."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.app import create_app
from api.config.settings import Settings
from tests import pg
from tests.factories import env, group, registration

pytestmark = pytest.mark.anyio


async def start(client: httpx.AsyncClient, **reg: Any) -> None:
    await client.post("/register", json=registration(**reg))
    await client.get("/batch")
    r = await client.post("/register-env", json=env(group_size=4))
    assert r.json()["status"] == "success"


async def queued(client: httpx.AsyncClient) -> int:
    return (await client.get("/status")).json()["queue_size"]  # type: ignore[no-any-return]


def corrupt(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


BAD_GROUPS = [
    (("masks", 1), [1, 2, 3], ["body", "masks", 1], "lengths must match"),
    (("scores",), [1.0], ["body", "scores"], "need one per sequence"),
    (("masks",), [[-100] * 8] * 3, ["body", "masks"], "need one per sequence"),
    (("tokens", 2), [], ["body", "tokens", 2], "empty sequence"),
    (("tokens", 0), list(range(600)), ["body", "tokens", 0], "max_token_len of 512"),
    (("inference_logprobs", 3), [0.0] * 7, ["body", "inference_logprobs", 3], "lengths must match"),
    (("tokens", 1, 6), -5, ["body", "tokens", 1, 6], "token ids must be >= 0"),
    (("masks", 2, 3), 2**31, ["body", "masks", 2, 3], "fit in int32"),
    (("policy_step",), 999_999, ["body", "policy_step"], "ahead of the trainer, which is at step 0"),
    (("tokens", 0, 0), 2**40, ["body", "tokens"], "int32"),
    (("tokens", 0, 0), 2**63, ["body", "tokens"], "int32"),  # beyond int64: was a 500
    (("masks", 1, 0), 2**70, ["body", "masks"], "int32"),  # beyond 64 bits: read strictly, then too large
    (("inference_logprobs", 0, 1), 1e300, ["body", "inference_logprobs"], "float32"),  # was stored as infinity
    (("env_id",), 7, ["body", "env_id"], "no environment with env_id 7"),
    (("tokens", 0, 0), 1.5, ["body", "tokens", 0, 0], "integer"),
    (("messages",), [[{"role": "user"}]], ["body", "messages"], "'role' and 'content'"),
]


@pytest.mark.parametrize(("path", "value", "loc", "msg"), BAD_GROUPS)
async def test_bad_group_is_rejected_with_field_and_rule(
    client: httpx.AsyncClient, path: tuple[Any, ...], value: Any, loc: list[Any], msg: str
) -> None:
    await start(client)
    r = await client.post("/scored_data", json=corrupt(group(4, env_id=0), path, value))
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"][: len(loc)] == loc
    assert msg in err["msg"]
    assert await queued(client) == 0


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_scores_are_422(client: httpx.AsyncClient, bad: str) -> None:
    await start(client)
    raw = httpx.Request("POST", "/", json=group(4, env_id=0)).content.decode()
    raw = raw.replace('"scores":[0.0,', f'"scores":[{bad},').replace('"scores": [0.0,', f'"scores": [{bad},')
    assert bad in raw
    r = await client.post("/scored_data", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][:2] == ["body", "scores"]


async def test_list_is_all_or_nothing(client: httpx.AsyncClient) -> None:
    await start(client)
    good = [group(4, env_id=0, seed=i) for i in range(3)]
    bad = corrupt(group(4, env_id=0), ("scores",), [1.0, 2.0])
    r = await client.post("/scored_data_list", json=[*good, bad])
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"][:3] == ["body", 3, "scores"]
    assert await queued(client) == 0


async def test_no_lax_coercion_but_integral_floats_and_extra_fields(client: httpx.AsyncClient) -> None:
    """What the OpenAPI description says is what is accepted: no string or boolean where a number belongs
    (pydantic's lax mode, which Atropos has, would take them; no known client sends them), but `3.0` is an
    integer as in JSON Schema, and unknown fields are ignored as Atropos does."""
    await start(client)
    body = group(4, env_id=0)
    body["tokens"][0] = [float(t) for t in body["tokens"][0]]
    body["extra_field"] = "ignored"
    assert (await client.post("/scored_data", json=body)).status_code == 200
    for where, value in [(("tokens", 1, 0), "5"), (("scores", 2), True), (("env_id",), "0"), (("masks", 0, 0), 1.5)]:
        bad = group(4, env_id=0, seed=7)
        target: Any = bad
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = value
        r = await client.post("/scored_data", json=bad)
        assert r.status_code == 422, (where, r.text)
        assert r.json()["errors"][0]["loc"] == ["body", *where]
    r = await client.post("/register", json=registration(batch_size="8"))
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "batch_size"]


async def test_bad_gzip_is_400(client: httpx.AsyncClient) -> None:
    await start(client)
    r = await client.post("/scored_data", content=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert r.status_code == 400
    assert "gzip" in r.json()["detail"]


async def test_group_larger_than_batch_is_422(client: httpx.AsyncClient) -> None:
    await start(client, batch_size=4)
    r = await client.post("/scored_data", json=group(8, env_id=None))
    assert r.status_code == 422
    assert "at most 4" in r.json()["detail"][0]["msg"]


async def test_submit_before_any_trainer_is_503_not_4xx(client: httpx.AsyncClient) -> None:
    r = await client.post("/scored_data", json=group(4, env_id=None))
    assert r.status_code == 503 and "Retry-After" in r.headers


async def test_group_id_makes_retries_idempotent(client: httpx.AsyncClient) -> None:
    await start(client)
    body = group(4, env_id=0, group_id="abc")
    first = await client.post("/scored_data", json=body)
    again = await client.post("/scored_data", json=body)
    assert first.json() == {"status": "received"}
    assert again.json() == {"status": "received", "duplicate": True}
    r = await client.post("/scored_data_list", json=[body, group(4, env_id=0, group_id="def")])
    assert r.json() == {"status": "received", "groups_processed": 2, "duplicates": 1, "duplicate_at": [0]}
    assert await queued(client) == 2


async def test_idempotency_key_header(client: httpx.AsyncClient) -> None:
    await start(client)
    body = group(4, env_id=0, seed=1)
    for _ in range(3):  # a retry of the same group, plain or gzipped: the key decides, nothing stored twice
        r = await client.post("/scored_data", json=body, headers={"Idempotency-Key": "k1"})
        assert r.status_code == 200
    r = await client.post("/scored_data", json=group(4, env_id=0, seed=2), headers={"Idempotency-Key": "k1"})
    assert r.status_code == 409 and "Idempotency-Key 'k1'" in r.json()["detail"]
    assert await queued(client) == 1


@pytest.fixture
def settings() -> Settings:
    return Settings(store="memory://", max_queue_groups=2, max_body_bytes=200_000, max_decompressed_bytes=300_000)


async def test_full_queue_is_503_with_retry_after_and_stores_nothing(client: httpx.AsyncClient) -> None:
    await start(client)
    r = await client.post("/scored_data_list", json=[group(4, env_id=0, seed=i) for i in range(2)])
    assert r.status_code == 200
    st = (await client.request("GET", "/status-env", json={"env_id": 0})).json()
    assert st["queue_capacity_groups"] == 0
    r = await client.post("/scored_data", json=group(4, env_id=0, seed=9))
    assert r.status_code == 503
    assert r.headers["Retry-After"] == "2"
    assert "queue full" in r.json()["detail"]
    assert await queued(client) == 2


async def test_body_limits(client: httpx.AsyncClient) -> None:
    await start(client)
    big = group(4, length=4000, env_id=0)  # ~400 KB of JSON
    r = await client.post("/scored_data", json=big)
    assert r.status_code == 413
    bomb = gzip.compress(b"[" + b" " * 1_000_000 + b"]")
    r = await client.post("/scored_data_list", content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413
    assert "decompresses to more than" in r.json()["detail"]


async def test_token_limit_capacity_is_known_before_any_data() -> None:
    """With only a token bound, an env learns its room from its worst case (group_size x max_token_length),
    then from the average of what it has queued."""
    app = create_app(Settings(store="memory://", max_queue_tokens=20_000))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c,
    ):
        await start(c)
        capacity = (await c.get("/status-env", params={"env_id": 0})).json()["queue_capacity_groups"]
        assert capacity == 20_000 // (4 * 512)  # env(): group_size 4, max_token_length 512
        assert (await c.post("/scored_data", json=group(4, length=100, env_id=0))).status_code == 200
        capacity = (await c.get("/status-env", params={"env_id": 0})).json()["queue_capacity_groups"]
        assert capacity == (20_000 - 400) // 400


@pytest.fixture(params=["sqlite", "postgresql"])
def group_committing(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """The stores whose writer commits in groups (the memory store commits on the event loop)."""
    if request.param == "postgresql":
        with pg.database() as name:
            yield Settings(store=pg.url_of(name))
        return
    yield Settings(store=f"sqlite:///{tmp_path / 'rollbuf.db'}")


async def test_a_request_is_announced_to_the_group_commit_while_its_transaction_runs(
    group_committing: Settings,
) -> None:
    """`Ingest.submit` tells the store a transaction is coming (`Store.expecting`), so a SQL store's writer
    can wait for it (`api.store.jobs.next_group`): counted while its transaction runs, and no longer after."""
    app = create_app(group_committing)
    async with app.router.lifespan_context(app):
        inner = app.state.service.store.inner  # behind the metrics' timing wrapper
        lane = inner._lane if hasattr(inner, "_lane") else inner._writer
        seen: list[int] = []
        submit = lane.submit

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            seen.append(lane.coming)
            return await submit(*args, **kwargs)

        lane.submit = recorded
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            await c.post("/register", json=registration())
            await c.get("/batch")
            env_id = (await c.post("/register-env", json=env())).json()["env_id"]
            seen.clear()
            assert (await c.post("/scored_data", json=group(env_id=env_id))).status_code == 200
        assert seen and all(n == 1 for n in seen), seen
        assert lane.coming == 0
