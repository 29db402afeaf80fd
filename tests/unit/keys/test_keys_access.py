"""api.keys.access and the front door's pure checks: keys, the role matrix (and that it names every route the app
has), hosts, cross-site requests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import APIRouter

from api.app import create_app
from api.config.settings import Settings
from api.http.frontdoor import cross_site, host_allowed, loopback_host
from api.keys.access import ANY_KEY, PUBLIC, Identity, Key, identify, parse_keys
from api.keys.keyring import KeyFile, fixed_keys
from api.owners import RUN
from api.routes.spec import route
from api.routes.table import ROUTES, TABLE

SECRET = "0123456789abcdef"


def test_keys_parse_with_roles_and_refuse_what_is_not_a_key() -> None:
    keys = parse_keys(f"# handlers\nmath env {SECRET}1; trainer trainer {SECRET}2\nops admin {SECRET}3", "keys")
    assert [(k.name, k.role) for k in keys] == [("math", "env"), ("trainer", "trainer"), ("ops", "admin")]
    assert identify(keys, f"{SECRET}2") == Identity("trainer", "trainer")
    assert identify(keys, "wrong") is None and identify(keys, "") is None and identify(keys, None) is None
    for bad, why in [
        ("math env", "expected 'name role secret'"),
        (f"math root {SECRET}", "role 'root' is not one of env, trainer, admin"),
        ("math env short", "shorter than 16"),
        (f"a env {SECRET}1\na trainer {SECRET}2", "the key name 'a' is used twice"),
        (f"a env {SECRET} x", "got 4 fields"),
        (f"a env {SECRET}\nb trainer {SECRET}", "have the same secret"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_keys(bad, "keys")


def test_a_hash_starts_a_comment_only_at_a_line_start_or_after_whitespace() -> None:
    [key] = parse_keys(f"# a comment\nmath env {SECRET}#tail # a comment", "keys")
    assert key.secret == f"{SECRET}#tail".encode()  # taken whole: its prefix does not authenticate
    assert identify([key], SECRET) is None
    assert parse_keys("# todo", "keys") == [] and parse_keys(";", "keys") == [] and parse_keys("", "keys") == []


def test_key_sources_fail_closed_and_are_checked_against_each_other(tmp_path: Path) -> None:
    for empty in ("", "# todo", ";", "  "):
        with pytest.raises(ValueError, match="must hold a key"):
            Settings(store="memory://", host="0.0.0.0", api_keys=empty)
        assert fixed_keys(None, empty, required=False)[1]  # on loopback: a warning
        app = create_app(Settings(store="memory://", api_keys=empty))
        assert app.state.door.keys is not None and app.state.door.keys() == []  # keyed, with no key: refuses all
    with pytest.raises(ValueError, match="'admin' is used twice"):
        Settings(store="memory://", api_key=f"{SECRET}1", api_keys=f"admin env {SECRET}2")
    with pytest.raises(ValueError, match="have the same secret"):
        Settings(store="memory://", api_key=f"{SECRET}1", api_keys=f"math env {SECRET}1")
    path = tmp_path / "keys"
    path.write_text(f"ops env {SECRET}1\n")
    with pytest.raises(ValueError, match="have the same secret"):
        Settings(store="memory://", api_key=f"{SECRET}1", api_keys_file=path)
    path.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        Settings(store="memory://", host="0.0.0.0", api_keys_file=path)
    keys = KeyFile(path, [Key("admin", "admin", b"x" * 16)], required=False)  # loopback: starts, says why
    assert [k.name for k in keys()] == ["admin"] and "holds no key" in (keys.error or "")


def test_the_matrix_names_every_route_of_the_app() -> None:
    app = create_app(Settings(store="memory://"))
    schema = app.openapi()
    routes = {(method.upper(), path) for path, ops in schema["paths"].items() for method in ops}
    routes |= {("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"), ("GET", "/redoc")}
    assert routes == set(ROUTES), "a route without its roles (api.routes.spec.route), or one listed no longer exists"
    admits = TABLE.admits
    assert admits("GET", "/no/such/path") == ANY_KEY and admits("HEAD", "/healthz") == PUBLIC
    assert admits("GET", "/static-offline-docs/swagger-ui.css") == PUBLIC
    assert admits("POST", "/batch") == ANY_KEY  # a wrong method needs a key too: scanners learn nothing
    assert admits("GET", "/ledger/groups/a/b") == admits("GET", "/ledger/groups/{group_id}") != PUBLIC


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost:8000", True),
        ("127.0.0.1", True),
        ("[::1]:8000", True),
        ("app.localhost", True),
        ("127.1.2.3:1", True),
        ("evil.example", False),
        ("127.0.0.1.evil.example", False),
        ("10.0.0.1:8000", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert loopback_host(host) is loopback
    assert host_allowed(host, ("loopback",)) is loopback
    assert host_allowed(host, None) and host_allowed(host, ("*",))


def test_configured_hosts() -> None:
    assert host_allowed("rollbuf.internal:8000", ("rollbuf.internal",))
    assert host_allowed("a.svc.cluster.local", ("*.cluster.local",))
    assert not host_allowed("cluster.local.evil", ("*.cluster.local",)) and not host_allowed(None, ("x",))


def test_browser_cross_site_requests_are_recognised() -> None:
    host = "127.0.0.1:8000"
    assert cross_site({}, host) is None  # Atropos clients, curl, httpx, requests
    assert cross_site({b"origin": b"http://127.0.0.1:8000", b"sec-fetch-site": b"same-origin"}, host) is None
    assert cross_site({b"sec-fetch-site": b"none"}, host) is None  # a URL typed in the address bar
    assert cross_site({b"origin": b"http://evil.example"}, host) == "Origin 'http://evil.example'"
    assert cross_site({b"sec-fetch-site": b"cross-site"}, host) == "Sec-Fetch-Site: cross-site"  # <img src=...>
    assert cross_site({b"origin": b"null"}, host) == "Origin null"  # a sandboxed frame, a file:// page


def test_the_openapi_lock_and_body_rules_follow_each_routes_declaration() -> None:
    """A route behind a key shows the lock (security) and documents the front door's 401 and 403; a public one
    neither. The front door's body rules are the routes' declared ones."""
    schema = create_app(Settings(store="memory://", api_key="k" * 16)).openapi()
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            secured = ROUTES[(method.upper(), path)] != PUBLIC
            assert ("security" in op) is secured, (method, path)
            assert {"401", "403"} <= set(op["responses"]) if secured else "403" not in op["responses"], (method, path)
    assert TABLE.body("/scored_data") == TABLE.body("/scored_data_list") == "ingest"
    assert TABLE.body("/register") == TABLE.body("/register-env") == TABLE.body("/disconnect-env") == "json"
    assert TABLE.body("/commit") == TABLE.body("/no/such/path") == "small"


def test_a_route_is_declared_once() -> None:
    with pytest.raises(ValueError, match="declared twice"):
        route(APIRouter(), "GET", "/status", ANY_KEY, acts=RUN)
