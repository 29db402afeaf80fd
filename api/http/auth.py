"""Optional bearer-token auth: with `api_key` set, every endpoint but the health checks (`GET /`, `/healthz`,
`/readyz`), the dashboard page and the API's description (`/docs`, `/redoc`, `/openapi.json` and the Swagger
UI's files) requires it. The dependency declares FastAPI's bearer scheme, so the OpenAPI description says
which operations need the key (`api.http.openapi.drop_auth` takes that out when no key is set).

Atropos clients send no credentials, so auth is off by default and the server then refuses to listen on
anything but loopback unless told `allow_unauthenticated` (see `Settings`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.errors import RollbufError


class Unauthorized(RollbufError):
    status_code = 401
    code = "unauthorized"
    loc = ("header", "authorization")


BEARER = HTTPBearer(auto_error=False, scheme_name="bearer", description="The server's `api_key`.")


async def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]
) -> None:
    """Declares the bearer scheme on the routes behind a key, for the OpenAPI description. The key itself and
    the caller's role are checked by the front door (`api.http.frontdoor`), before any body is read."""
    return None
