"""Whatever a client sends, the answer is never a 5xx other than a deliberate 503."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from api.config.settings import Settings
from tests.factories import env, group, registration

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
keys = st.sampled_from(
    [*group(), "policy_step", "group_id", "env_id", "batch_size", "max_token_len", "weight", "reuse", "max_served"]
)
REUSE = {"max_served": 2, "max_age": 3, "max_reused_share": 0.5, "order": "advantage"}


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    """A valid body with a few fields replaced by arbitrary JSON."""
    bodies = [group(4), registration(), env(), {"env_id": 0}, registration(reuse=REUSE), env(reuse=REUSE)]
    body: dict[str, Any] = dict(draw(st.sampled_from(bodies)))
    for key in draw(st.lists(keys, max_size=3)):
        body[key] = draw(json_values)
    if isinstance(body.get("reuse"), dict) and draw(st.booleans()):  # a field of the policy replaced
        body["reuse"] = {**body["reuse"], draw(st.sampled_from([*REUSE, "x"])): draw(json_values)}
    return body


ENDPOINTS = ["/scored_data", "/scored_data_list", "/register", "/register-env", "/disconnect-env", "/status-env"]


async def probe(requests: list[tuple[str, Any, dict[str, str]]]) -> list[int]:
    app = create_app(Settings(store="memory://", max_batch_wait=0))  # ?wait= must not hold the test
    codes = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            await c.post("/register", json=registration())
            await c.get("/batch")
            await c.post("/register-env", json=env())
            for path, body, params in requests:
                method = "GET" if path == "/status-env" else "POST"
                r = await c.request(method, path, json=body, params=params)
                codes.append(r.status_code)
                codes.append((await c.get("/batch", params=params)).status_code)
    return codes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(ENDPOINTS),
            mutated() | json_values | st.lists(mutated(), max_size=3),
            st.dictionaries(
                st.sampled_from(["step", "rank", "world_size", "wait", "env_id"]),
                st.sampled_from(["0", "1", "-1", "x", "99999999999999999999", "0.5"]),
                max_size=3,
            ),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_no_server_errors(requests: list[tuple[str, Any, dict[str, str]]]) -> None:
    for code in asyncio.run(probe(requests)):
        assert code < 500 or code == 503, code
