"""Every route's roles and body rule, as the route modules declare them beside each route (`api.routes.spec`),
and FastAPI's own description pages: what the front door enforces (`api.http.frontdoor.Door.routes`)."""

from __future__ import annotations

from api.keys.access import PUBLIC, Body, RouteTable, Rule
from api.owners import Acts
from api.routes import admin, envs, export, ledger, ops, producers, rollouts, tasks, trainer
from api.routes.spec import DECLARED

ROUTERS = (
    admin.health,
    ops.probes,
    admin.router,
    trainer.router,
    envs.router,
    producers.router,
    tasks.router,
    rollouts.router,
    ledger.router,
    ops.router,
    export.router,
)
"""Every router, in the order the app includes them (`ops.prometheus`, /metrics, only with `metrics` on)."""
DESCRIPTION_PAGES: dict[tuple[str, str], Rule] = {
    ("GET", "/docs"): PUBLIC,
    ("GET", "/docs/oauth2-redirect"): PUBLIC,
    ("GET", "/redoc"): PUBLIC,
    ("GET", "/openapi.json"): PUBLIC,
}
"""The API's description, served by FastAPI itself: no data, no key."""
ROUTES: dict[tuple[str, str], Rule] = {**DESCRIPTION_PAGES, **{key: roles for key, (roles, *_) in DECLARED.items()}}
"""Every route and the roles it admits (tests/unit/keys/test_keys_access.py checks that the app has no other)."""
BODIES: dict[str, Body] = {path: body for (_, path), (_, body, _) in DECLARED.items() if body != "small"}
ACTS: dict[tuple[str, str], Acts] = {key: acts for key, (*_, acts) in DECLARED.items()}
"""What each route acts on and who may act on another key's (the description pages act on nothing)."""
TABLE = RouteTable(ROUTES, BODIES, ACTS)
