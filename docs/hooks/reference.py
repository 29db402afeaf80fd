"""mkdocs hook: pages made at build time, so the site cannot drift from what they describe.

- `reference/http-api.md` and `reference/http-schemas.md`: the HTTP API reference, rendered as Markdown from the
  OpenAPI description the app itself builds (`api.app.create_app`, no server, no store opened). The
  Swagger UI at `/docs` needs a running server and JavaScript; these pages need neither.
- `changelog.md`: CHANGELOG.md from the repository's top, which lives outside `docs/`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = "reference/http-api.md"
SCHEMAS = "reference/http-schemas.md"
METHODS = ("get", "put", "post", "patch", "delete", "head", "options")

TAG_TEXT = {
    "trainer": "The trainer registers, reads batches, acknowledges them and announces its weights.",
    "environments": "An environment registers and submits scored groups (the AtroposLib routes).",
    "rollouts": "Groups opened by a producer and filled one rollout at a time, sealed by the server.",
    "tasks": "Datasets registered with the server, their tasks leased to producers and settled.",
    "producers": "Producers announce themselves and heartbeat, so the server knows who can still send.",
    "ledger": "What each step trained on and what became of every acknowledged group.",
    "admin": "Routes for an admin key: the run's reset and the export.",
    "operations": "Probes, metrics and pages for whoever runs the service.",
}
"""One line per tag, shown under its heading, in the order of the page. A tag missing here comes last, with no
line; the page still builds."""


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated pages before the nav is built, so mkdocs.yml's nav can name them."""
    operations, schemas = http_reference()
    for uri, text in ((OPERATIONS, operations), (SCHEMAS, schemas)):
        files.append(File.generated(config, uri, content=text))
    changelog = (ROOT / "CHANGELOG.md").read_text()
    files.append(File.generated(config, "changelog.md", content=changelog))
    return files


def openapi() -> dict[str, Any]:
    """The description the service serves at /openapi.json, with its default settings (no keys: locks are
    left out, and each operation's roles come from the route table instead). The service is imported from this
    checkout, whatever else is installed."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from api.app import create_app
    from api.config.settings import Settings

    schema: dict[str, Any] = create_app(Settings()).openapi()
    return schema


def route_roles() -> dict[tuple[str, str], str]:
    """(METHOD, path) -> who may call the route when the server has keys, from the routes' own declarations."""
    from api.keys.access import PUBLIC
    from api.routes.spec import DECLARED

    out = {}
    for (method, path), (rule, _body, _acts) in DECLARED.items():
        out[(method, path)] = "anyone (no key)" if rule == PUBLIC else ", ".join(sorted(rule))
    return out


# ------------------------------------------------------------------------------------------- rendering


def http_reference() -> tuple[str, str]:
    """The operations page and the schemas page, as Markdown."""
    spec = openapi()
    hoist_inline_schemas(spec)
    roles = route_roles()
    by_tag: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for path, item in spec["paths"].items():
        for method in METHODS:
            if method in item:
                operation = item[method]
                tag = (operation.get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append((method.upper(), path, operation))
    order = list(TAG_TEXT)
    by_tag = dict(sorted(by_tag.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)))
    info = spec["info"]
    out = [
        "# HTTP API operations",
        "",
        f"rollbuf {info['version']}: every route the service answers, rendered from its own OpenAPI description "
        "when this site was built. The same description is served at `/openapi.json`, with the Swagger UI at "
        "`/docs`. The request and reply types are on [the schemas page](http-schemas.md). "
        "[HTTP API](../api.md) explains the status codes and what rollbuf adds to the AtroposLib API.",
        "",
        "**Roles.** With API keys set, each route admits the roles listed under it ([security](../security.md)). "
        "Without keys, every route is open.",
        "",
        *(f"- [{tag}](#{tag}): {len(ops)} routes" for tag, ops in by_tag.items()),
        "",
    ]
    for tag, operations in by_tag.items():
        out += [f"## {tag}", ""]
        if tag in TAG_TEXT:
            out += [TAG_TEXT[tag], ""]
        for method, path, operation in operations:
            out += render_operation(method, path, operation, roles.get((method, path)))
    return "\n".join(out), render_schemas(spec["components"].get("schemas", {}))


def hoist_inline_schemas(spec: dict[str, Any]) -> None:
    """Give a request or reply body declared inline (`/scored_data`'s ScoredData) a section on the schemas page,
    as if it were a component: the operation links to it like any other."""
    schemas = spec.setdefault("components", {}).setdefault("schemas", {})

    def hoisted(schema: dict[str, Any]) -> dict[str, Any]:
        if "items" in schema and isinstance(schema["items"], dict):
            schema = {**schema, "items": hoisted(schema["items"])}
        if "properties" in schema and "title" in schema:
            schemas.setdefault(schema["title"], schema)
            return {"$ref": f"#/components/schemas/{schema['title']}"}
        return schema

    for item in spec["paths"].values():
        for method in METHODS:
            operation = item.get(method, {})
            bodies = [operation.get("requestBody", {}), *operation.get("responses", {}).values()]
            for body in bodies:
                for content in body.get("content", {}).values():
                    if "schema" in content:
                        content["schema"] = hoisted(content["schema"])


def anchor(method: str, path: str) -> str:
    """The operation's anchor: `post-scored_data`, `get-tasks-dataset-status`."""
    return f"{method.lower()}-" + "-".join(p for p in re.split(r"[^\w]+", path) if p)


def render_operation(method: str, path: str, operation: dict[str, Any], roles: str | None) -> list[str]:
    out = [f"### `{method} {path}` {{#{anchor(method, path)}}}", ""]
    if operation.get("description") or operation.get("summary"):
        out += [prose(operation.get("description") or operation["summary"]), ""]
    if roles is not None:
        out += [f"Roles: {roles}.", ""]
    parameters = operation.get("parameters", [])
    if parameters:
        out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for p in parameters:
            schema = p.get("schema", {})
            out.append(
                f"| `{p['name']}` | {p['in']} | {type_of(schema)} | {'yes' if p.get('required') else 'no'} | "
                f"{cell(p.get('description') or schema.get('description', ''))}{default(schema)} |"
            )
        out.append("")
    body = operation.get("requestBody")
    if body:
        kinds = ", ".join(f"`{kind}` {type_of(c.get('schema', {}))}" for kind, c in body.get("content", {}).items())
        out += [f"Request body{' (required)' if body.get('required') else ''}: {kinds}.", ""]
    out += ["| status | meaning | body |", "|---|---|---|"]
    for status, reply in sorted(operation.get("responses", {}).items()):
        content = reply.get("content", {})
        kinds = "; ".join(f"`{kind}` {type_of(c.get('schema', {}))}" for kind, c in content.items())
        headers = ", ".join(f"`{name}`" for name in reply.get("headers", {}))
        meaning = cell(reply.get("description", "")) + (f" Headers: {headers}." if headers else "")
        out.append(f"| {status} | {meaning} | {kinds or 'none'} |")
    out.append("")
    return out


def render_schemas(schemas: dict[str, Any]) -> str:
    out = [
        "# HTTP API schemas",
        "",
        "The request and reply bodies of [the HTTP API's operations](http-api.md), from the same OpenAPI "
        "description. A field marked required must be sent; the others have the default shown or may be "
        "left out.",
        "",
    ]
    for name, schema in sorted(schemas.items()):
        out += [f"## {name} {{#{schema_anchor(name)}}}", ""]
        if schema.get("description"):
            out += [prose(schema["description"]), ""]
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        if properties:
            out += ["| field | type | required | description |", "|---|---|---|---|"]
            for field, sub in properties.items():
                out.append(
                    f"| `{field}` | {type_of(sub)} | {'yes' if field in required else 'no'} | "
                    f"{cell(sub.get('description', ''))}{default(sub)} |"
                )
            out.append("")
        elif "enum" in schema or "type" in schema:
            out += [f"Type: {type_of(schema)}.", ""]
    return "\n".join(out)


def schema_anchor(name: str) -> str:
    return "schema-" + name.lower()


def type_of(schema: dict[str, Any]) -> str:
    """A schema in a few words, a referenced one as a link to its section of the schemas page."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](http-schemas.md#{schema_anchor(name)})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            kinds = [type_of(s) for s in schema[key]]
            text = " or ".join(dict.fromkeys(kinds))
            return text + bounds(schema)
    if "allOf" in schema and len(schema["allOf"]) == 1:
        return type_of(schema["allOf"][0])
    if "const" in schema:
        return f"`{schema['const']!r}`".replace("'", '"')
    if "enum" in schema:
        return "one of " + ", ".join(f"`{v}`" for v in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"array of {type_of(schema.get('items', {}))}" + bounds(schema)
    if kind == "object" and "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        return f"object of {type_of(schema['additionalProperties'])}"
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind is None:
        return "any"
    text = str(kind)
    if "format" in schema:
        text += f" ({schema['format']})"
    return text + bounds(schema)


def bounds(schema: dict[str, Any]) -> str:
    words = {
        "minimum": ">=",
        "exclusiveMinimum": ">",
        "maximum": "<=",
        "exclusiveMaximum": "<",
        "minLength": "length >=",
        "maxLength": "length <=",
        "minItems": "items >=",
        "maxItems": "items <=",
    }
    found = [f"{word} {schema[key]}" for key, word in words.items() if key in schema]
    return f", {', '.join(found)}" if found else ""


def default(schema: dict[str, Any]) -> str:
    if "default" not in schema or schema["default"] is None:
        return ""
    value = schema["default"]
    text = "true" if value is True else "false" if value is False else str(value)
    return f" Default: `{text}`."


def cell(text: str) -> str:
    """Text that stays in one table cell: one line, its pipes escaped."""
    return " ".join(prose(text).split()).replace("|", "\\|")


CODE_OR_LINK = re.compile(r"(`[^`]*`|\[[^\]\n]*\]\([^)\s]+\))")


def prose(text: str) -> str:
    """A description as Markdown text: brackets outside code spans and links escaped, so that a shape such as
    `[sequence][position]` written in plain text is not read as a reference link."""
    parts = CODE_OR_LINK.split(text)
    return "".join(part if i % 2 else part.replace("[", "\\[").replace("]", "\\]") for i, part in enumerate(parts))
