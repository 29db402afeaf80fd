"""What the OpenAPI description says about errors: every status code a route can answer, with what it means
for the client (Atropos handlers drop data on any 4xx and retry 5xx), all in the one error shape."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from api.wire.schema import ErrorBody

ERROR_DESCRIPTIONS = {
    400: "Unreadable body: not JSON, bad gzip or an unsupported `Content-Encoding`. Resending it will not help.",
    401: "Missing or wrong API key (only when the server has keys): send `Authorization: Bearer <key>`.",
    403: "The key's role does not admit this route, an env key used another key's env, or a web page's "
    "cross-site request (docs/security.md).",
    404: "What the request names is unknown to this key: an environment, a dataset, a lease, an open group, a "
    "file under `task_files_dir`.",
    409: "Conflicts with the server's state: a registration unlike the run's, a `?step=` ahead of the next "
    "batch or of the trainer's, a group id reused for different content, a name another key holds, a page past "
    "the tasks stored, or one of the key's bounds reached (`task_max_datasets_per_key`, `task_max_bytes_per_key`)."
    " Nothing was applied.",
    410: "`?step=N` for a batch the trainer has already acknowledged by asking for N+1.",
    413: "Body over `max_body_bytes`, or gzip that inflates past `max_decompressed_bytes`.",
    422: "The data breaks a rule: each of `errors` names the field (`loc`) and the rule (`msg`). Nothing of the "
    "request was applied; fix it rather than resend it.",
    501: "The server lacks an optional extra this route needs (`pip install 'rollbuf[export]'` for the export).",
    503: "Try again after `Retry-After` seconds: no trainer has registered yet, the queue is full (`unavailable`), "
    "the server holds too many request bytes (`busy`), or the store is unreachable or its disk full "
    "(`store_unavailable`). Nothing was stored.",
}

ERROR_REF = {"$ref": "#/components/schemas/ErrorBody"}
"""For a route whose replies are not JSON, where FastAPI would document an error model in the route's type."""

RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before resending.", "schema": {"type": "integer"}}}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The `responses` entries of these status codes, in the one error shape (`ErrorBody`)."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        entry: dict[str, Any] = {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[code]}
        if code == 503:
            entry["headers"] = RETRY_AFTER
        out[code] = entry
    return out


SECURED = errors(401, 403, 503)
"""What routes behind a key may answer too (documented whether or not keys are set): 401 and 403 from the front
door, 503 when the store cannot be reached (every one of them reads or writes it)."""


def drop_auth(app: FastAPI) -> None:
    """Without an API key nothing needs one: the description then declares no security scheme (the routes'
    `require_api_key` dependency declares it for every operation behind the key)."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = plain()  # cached by FastAPI as app.openapi_schema: changed in place
        schema.get("components", {}).pop("securitySchemes", None)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.pop("security", None)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def declare_limits(app: FastAPI, maxima: dict[tuple[str, str, str], int]) -> None:
    """Query parameters whose maximum is a setting: the description states this server's (a schema-valid
    request is accepted, as schemathesis checks)."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = plain()
        for (path, method, name), maximum in maxima.items():
            for param in schema["paths"][path][method].get("parameters", ()):
                if param["name"] == name:
                    target = param["schema"]
                    for option in target.get("anyOf", [target]):
                        if option.get("type") == "integer":
                            option["maximum"] = maximum
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def declare_body_limits(app: FastAPI, bounds: dict[tuple[str, str, str], int | float]) -> None:
    """Body fields whose bound is a setting, as (model, field, JSON Schema keyword) -> this server's value
    (`maximum` of a number, `maxItems` of a list; of the list or number option of a nullable field): the
    description states them, so that a request it calls valid is accepted."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = plain()
        for (model, name, keyword), bound in bounds.items():
            target = schema["components"]["schemas"][model]["properties"][name]
            for option in target.get("anyOf", [target]):
                if option.get("type") in ("array", "number", "integer"):
                    option[keyword] = bound
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
