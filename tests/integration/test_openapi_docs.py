"""The API's description as a user meets it, on a real server: a Swagger UI that needs no internet, examples
that work when tried in the order the description gives, a description for every status code and field,
and one error shape for every error, FastAPI's and pydantic's included."""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.wire.schema import ErrorBody
from tests.factories import env, group, registration
from tests.servers import ServerProcess, running_server

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("openapi_docs")]  # one worker: one module-scoped server

KEY = "docs-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("docs") / "server.log"
    with running_server("memory://", log, "--max-body-bytes", "100000") as server:
        yield server


@pytest.fixture(scope="module")
def spec(server: ServerProcess) -> dict[str, Any]:
    return httpx.get(server.url + "/openapi.json").json()  # type: ignore[no-any-return]


def test_swagger_ui_is_served_without_internet(server: ServerProcess) -> None:
    page = httpx.get(server.url + "/docs")
    assert page.status_code == 200
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets) and any(a.endswith(".css") for a in assets)
    for asset in assets:
        assert asset.startswith("/"), f"{asset} is not served by rollbuf"
        r = httpx.get(server.url + asset)
        assert r.status_code == 200 and len(r.content) > 1000, asset
    assert "http://" not in page.text and "https://" not in page.text
    redoc = httpx.get(server.url + "/redoc")
    assert redoc.status_code == 200 and "https://" not in redoc.text


def test_every_status_code_and_field_is_described(spec: dict[str, Any]) -> None:
    for path, operations in spec["paths"].items():
        for method, op in operations.items():
            assert op.get("description"), f"{method} {path}"
            for code, response in op["responses"].items():
                assert response.get("description"), f"{method} {path} {code}"
                if code.startswith(("4", "5")):
                    [content] = response["content"].values()
                    assert content["schema"] == {"$ref": "#/components/schemas/ErrorBody"}, f"{method} {path} {code}"
            for param in op.get("parameters", []):
                assert param.get("description"), f"{method} {path} ?{param['name']}"
    undescribed = [
        f"{name}.{field}"
        for name, schema in spec["components"]["schemas"].items()
        for field, prop in schema.get("properties", {}).items()
        if not prop.get("description")
        and name not in ("BatchGroup", "ValidationError", "HTTPValidationError")  # BatchGroup: as ScoredData
    ]
    assert undescribed == []
    batch_200 = spec["paths"]["/batch"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert batch_200 == {"$ref": "#/components/schemas/BatchReply"}
    ingest = spec["paths"]["/scored_data"]["post"]["responses"]
    assert {"400", "401", "409", "413", "422", "503"} <= set(ingest)
    assert "Retry-After" in ingest["503"]["headers"]


def test_the_examples_work_when_tried_in_order(server: ServerProcess, spec: dict[str, Any]) -> None:
    """What a user trying out Swagger does: /register, /batch, /register-env, /scored_data with the examples."""

    def example(path: str) -> Any:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        return body["example"] if "example" in body else next(iter(body["examples"].values()))["value"]

    with httpx.Client(base_url=server.url) as c:
        c.get("/reset_data")
        reg = c.post("/register", json=example("/register"))
        assert reg.status_code == 200, reg.text
        assert c.get("/batch").json() == {"batch": None}
        assert c.post("/register-env", json=example("/register-env")).json()["status"] == "success"
        r = c.post("/scored_data", json=example("/scored_data"))
        assert r.status_code == 200 and r.json() == {"status": "received"}, r.text
        r = c.post("/scored_data_list", json=example("/scored_data_list"))
        assert r.status_code == 200 and r.json()["groups_processed"] == 2, r.text
        assert c.request("GET", "/status-env", json={"env_id": 0}).status_code == 200
        assert c.post("/disconnect-env", json={"env_id": 0}).json() == {"status": "success"}
        c.get("/reset_data")


def assert_error_shape(r: httpx.Response, status: int, code: str, loc: list[Any] | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body: dict[str, Any] = r.json()
    assert set(body) == {"code", "message", "errors", "detail"}, body
    ErrorBody.model_validate(body)
    assert body["code"] == code
    assert body["errors"] and all(set(e) == {"loc", "msg", "type"} for e in body["errors"])
    assert body["message"]
    if loc is not None:
        assert body["errors"][0]["loc"][: len(loc)] == loc
    return body


def test_every_error_has_one_shape(server: ServerProcess, tmp_path: Path) -> None:
    with httpx.Client(base_url=server.url) as c:
        c.get("/reset_data")
        # 503 before a trainer registered, with Retry-After
        r = c.post("/scored_data", json=group(2, env_id=None))
        assert_error_shape(r, 503, "unavailable")
        assert int(r.headers["Retry-After"]) >= 1
        # pydantic's 422 (FastAPI validates /register) and rollbuf's own 422 look alike
        body = assert_error_shape(c.post("/register", json={"batch_size": 8}), 422, "invalid", ["body"])
        assert isinstance(body["detail"], list) and body["detail"] == body["errors"]  # FastAPI's detail, kept
        assert c.post("/register", json=registration()).status_code == 200
        assert_error_shape(c.post("/register", json=registration(batch_size=4)), 409, "conflict")
        c.get("/batch")
        c.post("/register-env", json=env("math", group_size=2))
        bad = group(2, env_id=0)
        bad["masks"][1] = bad["masks"][1][:-1]
        body = assert_error_shape(c.post("/scored_data", json=bad), 422, "invalid", ["body", "masks", 1])
        assert body["message"].startswith("body.masks.1: ")
        # 400: bad gzip; FastAPI's body parser
        r = c.post("/scored_data", content=b"not gzip", headers={"Content-Encoding": "gzip"})
        assert_error_shape(r, 400, "bad_encoding", ["body"])
        r = c.post("/register", content=b"\xff\xfe", headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 422)
        assert_error_shape(r, r.status_code, "bad_request" if r.status_code == 400 else "invalid")
        # 413 over --max-body-bytes, also as a gzip bomb
        assert_error_shape(c.post("/scored_data", content=b"[" * 200_000), 413, "payload_too_large", ["body"])
        bomb = gzip.compress(b" " * 10_000_000)
        r = c.post("/scored_data", content=bomb, headers={"Content-Encoding": "gzip"})
        assert r.status_code in (413, 422)
        # 404 (unknown env; unknown path), 405, 409/410 on ?step=
        assert_error_shape(c.get("/status-env", params={"env_id": 99}), 404, "not_found")
        assert_error_shape(c.get("/no-such-path"), 404, "not_found")
        r = c.delete("/batch")
        assert_error_shape(r, 405, "method_not_allowed")
        assert "GET" in r.headers["Allow"]
        assert_error_shape(c.get("/batch", params={"step": 5}), 409, "conflict", ["query", "step"])
        assert_error_shape(c.get("/batch", params={"rank": 1}), 422, "invalid", ["query", "rank"])
        c.get("/reset_data")


def test_401_has_the_shape_and_the_description_declares_the_key(tmp_path: Path) -> None:
    with running_server("memory://", tmp_path / "server.log", "--api-key", KEY) as server:
        r = httpx.get(server.url + "/status")
        assert_error_shape(r, 401, "unauthorized", ["header", "authorization"])
        assert r.headers["WWW-Authenticate"] == "Bearer"
        # Open without the key: the health check and the description (so the Swagger UI can ask for the key).
        for path in ("/", "/docs", "/redoc", "/openapi.json"):
            assert httpx.get(server.url + path).status_code == 200, path
        spec = httpx.get(server.url + "/openapi.json").json()
        assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert spec["paths"]["/batch"]["get"]["security"] == [{"bearer": []}]
        assert "security" not in spec["paths"]["/"]["get"]
