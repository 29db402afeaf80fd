"""Auth: off by default on loopback; with api_key every endpoint but the health check needs it."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError

from api.config.settings import Settings
from tests.factories import registration

pytestmark = pytest.mark.anyio


@pytest.fixture
def settings() -> Settings:
    return Settings(store="memory://", api_key="s3cret")


async def test_api_key_required(client: httpx.AsyncClient) -> None:
    assert (await client.get("/")).status_code == 200
    r = await client.get("/reset_data")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    assert (await client.post("/register", json=registration())).status_code == 401
    ok = await client.post("/register", json=registration(), headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    wrong = await client.get("/status", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_public_interface_without_key_is_refused() -> None:
    with pytest.raises(ValidationError, match="no api_key is set"):
        Settings(host="0.0.0.0")
    assert Settings(host="0.0.0.0", allow_unauthenticated=True).host == "0.0.0.0"
    assert Settings(host="0.0.0.0", api_key="k" * 16).api_key is not None
    with pytest.raises(ValidationError, match="shorter than 16 characters on 0.0.0.0"):
        Settings(host="0.0.0.0", api_key="k")  # accepted before: a key that can be guessed
