"""House rule: a route handler in `api/routes/` turns HTTP into one service operation. Read from the source (as
tests/test_layers.py reads imports): in the body of every function decorated with `@route(...)`, the calls made
on the service (`service.<...>(...)`, the `ServiceDep` parameter) number at most one. Reading an attribute of the
service (a setting it holds, a property) is no operation; a handler that streams from the store (GET /export)
or reads a property (GET /latest_example) makes none. What the flows do stays in their rooms, where it is tested
against the store; the route keeps the HTTP: the query checked, the reply rendered."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTES = Path(__file__).resolve().parents[1] / "api" / "routes"

TWO_CHECKS = {"readyz"}
"""/readyz asks the store for a read within its timeout (`Service.ping`), then whether it takes writes
(`Store.not_ready`): two answers, each with its own 503, kept apart so that a slow store and a full disk say
which they are."""


def service_calls(fn: ast.AsyncFunctionDef | ast.FunctionDef) -> list[str]:
    """The calls in `fn` whose callee is an attribute path on the name `service`, as dotted paths."""
    calls = []
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        callee, path = node.func, []
        while isinstance(callee, ast.Attribute):
            path.append(callee.attr)
            callee = callee.value
        if isinstance(callee, ast.Name) and callee.id == "service" and path:
            calls.append(".".join(reversed(path)))
    return calls


def handlers() -> list[tuple[str, ast.AsyncFunctionDef | ast.FunctionDef]]:
    found = []
    for path in sorted(ROUTES.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) and any(
                isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "route"
                for d in node.decorator_list
            ):
                found.append((f"{path.name}:{node.name}", node))
    return found


def test_every_route_handler_calls_at_most_one_service_operation() -> None:
    found = handlers()
    assert len(found) > 30, "the routes' handlers were not found: is `@route` still how they are declared?"
    over = {name: calls for name, fn in found if len(calls := service_calls(fn)) > (2 if fn.name in TWO_CHECKS else 1)}
    assert not over, f"route handlers calling more than one service operation: {over}"


def test_the_rule_sees_a_second_call() -> None:
    """The check itself: a handler with two calls on the service is caught, reads of its attributes are not."""
    src = "async def h(service):\n    x = service.read_ahead.max_batches\n    await service.a()\n    service.b.c()\n"
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.AsyncFunctionDef)
    assert sorted(service_calls(fn)) == ["a", "b.c"]
