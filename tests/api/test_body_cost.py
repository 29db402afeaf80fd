"""The body budget counts what a submission costs while it is decoded, not only its bytes (a JSON
body's peak memory is 12.9-19x its bytes, msgpack's 4.1x; `api.http.body_cost` charges the measured cost, and
`bench.body_rss` measures peak memory within 1.3x of what is counted)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from api.app import create_app
from api.config.settings import Settings
from api.http.body_cost import JSON_VALUE_BYTES, MSGPACK_FACTOR, decoded_cost
from api.http.inflight import BodyBudget
from api.wire.records import encode_submission
from tests.factories import env, group, registration

LIMIT = 6 << 20


@given(st.lists(st.lists(st.integers(0, 10**6), max_size=50), max_size=20))
def test_a_json_body_is_charged_its_bytes_and_each_value(rows: list[list[int]]) -> None:
    raw = json.dumps({"tokens": rows}, separators=(",", ":")).encode()
    values = sum(len(r) for r in rows)
    assert decoded_cost(raw, "application/json") >= len(raw) + JSON_VALUE_BYTES * values


def test_a_msgpack_body_is_charged_a_factor_of_its_bytes() -> None:
    raw = encode_submission(**group(4, length=256, env_id=0))
    assert decoded_cost(raw, "application/msgpack") >= MSGPACK_FACTOR * len(raw)


@pytest.fixture
async def tight(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient, BodyBudget]]:
    bounded = settings.model_copy(
        update={"max_body_bytes": 1 << 20, "max_decompressed_bytes": 2 << 20, "max_inflight_bytes": LIMIT}
    )
    app = create_app(bounded)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            await c.post("/register", json=registration(batch_size=8, max_token_len=1 << 20))
            await c.get("/batch")
            await c.post("/register-env", json=env(group_size=4, max_token_length=1 << 20))
            yield c, app.state.body_budget


@pytest.mark.anyio
async def test_concurrent_json_bodies_hold_at_most_the_budget_counting_what_each_costs(
    tight: tuple[httpx.AsyncClient, BodyBudget],
) -> None:
    client, budget = tight
    bodies = [json.dumps([group(4, length=2048, env_id=0, seed=i)]).encode() for i in range(8)]
    cost = decoded_cost(bodies[0], "application/json")
    assert 4 * len(bodies[0]) < cost < LIMIT < 8 * cost  # together they cost more than the budget holds

    budget.peak = 0
    assert (await client.post("/scored_data_list", content=bodies[0])).status_code == 200
    assert budget.peak == cost  # one request alone holds what it costs, not its bytes

    answers: list[httpx.Response] = []

    async def send(raw: bytes) -> None:
        answers.append(await client.post("/scored_data_list", content=raw))

    async with anyio.create_task_group() as tg:
        for raw in bodies[1:]:
            tg.start_soon(send, raw)
    assert all(r.status_code == 200 or r.json()["code"] == "busy" for r in answers)
    stored = sum(r.status_code == 200 for r in answers)
    assert budget.peak <= LIMIT and budget.held == 0  # however many ran at once, their costs fit the budget
    assert (await client.get("/status")).json()["queue_size"] == 1 + stored
