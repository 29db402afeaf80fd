"""A route's security facts declared with the route, once: the roles it admits, what it acts on and who may act
on another key's (`api.owners.Acts`), the body it takes and the error statuses it documents. `route(...)`
registers the FastAPI route with them (a route behind a key gets the key's dependency, so the OpenAPI
description shows its lock, and the front door's 401/403/503) and records them in `DECLARED`, from which
`api.routes.table` builds what the front door enforces: the roles, and the `api.owners.Actor` every handler
acts as."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends

from api.http.auth import require_api_key
from api.http.openapi import SECURED, errors
from api.keys.access import PUBLIC, Body, Rule
from api.owners import Acts

F = TypeVar("F", bound=Callable[..., Any])

DECLARED: dict[tuple[str, str], tuple[Rule, Body, Acts]] = {}
"""(method, path as OpenAPI writes it) -> roles, body rule and what it acts on, of every route declared so far."""
_CONVERTER = re.compile(r":\w+}")


def route(
    router: APIRouter,
    method: str,
    path: str,
    roles: Rule,
    *,
    acts: Acts,
    body: Body = "small",
    statuses: tuple[int, ...] = (),
    responses: dict[int | str, dict[str, Any]] | None = None,
    **options: Any,
) -> Callable[[F], F]:
    """`router.api_route(path, methods=[method], ...)`, with `roles`, what it `acts` on (required: a route that
    forgot it would act on other keys' resources unchecked), `body` and the error `statuses` it documents
    (beyond `SECURED`, which every route behind a key documents); `responses` for other entries (a 200's
    content)."""
    key = (method, _CONVERTER.sub("}", path))
    if key in DECLARED:
        raise ValueError(f"{method} {path} is declared twice")
    DECLARED[key] = (roles, body, acts)
    secured = roles != PUBLIC
    documented = {**(SECURED if secured else {}), **(responses or {}), **errors(*statuses)}
    dependencies = [Depends(require_api_key)] if secured else []
    return router.api_route(path, methods=[method], responses=documented, dependencies=dependencies, **options)
