"""Numbers come back as sent, against a real `rollbuf serve`: /batch (JSON and msgpack) and /latest_example."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from api.wire.records import F64, MSGPACK, decode_batch, encode_submission
from tests.factories import registration
from tests.servers import running_server
from tests.unit.wire.test_wire_records import any_value, bits, body_with, float32_values, rows_of

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("numbers")]  # one worker: one module-scoped server
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module", params=["memory", "sqlite"])
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tmp: Path = tmp_path_factory.mktemp("numbers")
    store = "memory://" if request.param == "memory" else f"sqlite:///{tmp / 'rollbuf.db'}"
    with running_server(store, tmp / "server.log") as server, httpx.Client(base_url=server.url) as c:
        c.post("/register", json=registration(batch_size=1, max_token_len=64))
        c.get("/batch")
        yield c


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows_of(any_value).filter(lambda r: len(r) == 1), rows_of(float32_values).filter(lambda r: len(r) == 1))
def test_json_round_trip(client: httpx.Client, lps: list[list[float]], refs: list[list[float]]) -> None:
    refs = [refs[0][: len(lps[0])] + [0.5] * (len(lps[0]) - len(refs[0]))]
    body = {**body_with(lps), "ref_logprobs": refs, "env_id": None, "generation_params": {"temperature": 0.7}}
    assert client.post("/scored_data", content=json.dumps(body), headers=JSON).status_code == 200
    example = client.get("/latest_example").json()
    [group] = client.get("/batch").json()["batch"]
    for got in (example, group):
        assert bits(got["inference_logprobs"]) == bits(lps)
        assert bits(got["ref_logprobs"]) == bits(refs)
        assert got["generation_params"] == {"temperature": 0.7}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows_of(any_value).filter(lambda r: len(r) == 1))
def test_binary_batch_carries_the_stored_values(client: httpx.Client, lps: list[list[float]]) -> None:
    assert (
        client.post("/scored_data", content=json.dumps({**body_with(lps), "env_id": None}), headers=JSON).status_code
        == 200
    )
    r = client.get("/batch", headers={"Accept": MSGPACK})
    [rec] = decode_batch(r.content)
    assert rec.floats["inference_logprobs"].astype(F64).tolist() == lps[0]
    raw = encode_submission([[1] * len(lps[0])], [[1] * len(lps[0])], [0.0], inference_logprobs=lps)
    assert client.post("/scored_data", content=raw, headers={"Content-Type": MSGPACK}).status_code == 200
    [group] = client.get("/batch").json()["batch"]
    assert bits(group["inference_logprobs"]) == bits(lps)


def test_the_issue_examples_as_text(client: httpx.Client) -> None:
    text = (
        b'{"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "scores": [1.0], "env_id": null, '
        b'"inference_logprobs": [[1.0, -0.7, -0.6931471824645996]], '
        b'"advantages": [[-0.699999988079071, 0.5, 2.0]]}'
    )
    assert client.post("/scored_data", content=text, headers=JSON).status_code == 200
    for path in ("/latest_example", "/batch"):
        got = client.get(path).content
        assert b'"inference_logprobs":[[1.0,-0.7,-0.6931471824645996]]' in got, got
        assert b'"advantages":[[-0.699999988079071,0.5,2.0]]' in got
    assert np.float32(-0.7) == np.float32(-0.699999988079071)  # what float32 storage alone would have echoed
