"""Optional bearer-token auth: with `api_key` set, every endpoint but the health check (`GET /`) and the API's
description (`/docs`, `/redoc`, `/openapi.json` and the Swagger UI's files) requires it.

Atropos clients send no credentials, so auth is off by default and the server then refuses to listen on
anything but loopback unless told `allow_unauthenticated` (see `Settings`).
"""

from __future__ import annotations

import secrets

from fastapi import Request

from api.errors import RollbufError


class Unauthorized(RollbufError):
    status_code = 401
    code = "unauthorized"
    loc = ("header", "authorization")


async def require_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), key.get_secret_value().encode()):
        raise Unauthorized(
            "missing or wrong API key: send 'Authorization: Bearer <key>'", headers={"WWW-Authenticate": "Bearer"}
        )
