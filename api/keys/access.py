"""Who may do what: API keys with roles, and how a table of the roles each route admits is read (the routes
declare theirs beside them: `api.routes.spec`, `api.routes.table`). Pure: no request, no I/O (the key sources
are `api.keys.keyring`'s), so the matrix is tested alone (tests/unit/keys/test_keys_access.py).

Three roles (docs/security.md): `env` (a rollout handler: register envs, submit to its own, read status),
`trainer` (register the run, take batches, reset it), `admin` (everything). A key has a name, a role and a
secret; env ids are bound to the key's name, so rotating a secret keeps the envs it registered. Without keys
every request is the anonymous caller, as with Atropos, and may do everything.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from api.owners import ANONYMOUS, ROLES, Acts, Identity, Role

__all__ = [
    "ANONYMOUS",
    "ANY_KEY",
    "ENV_SIDE",
    "PUBLIC",
    "ROLES",
    "TRAINER_SIDE",
    "Acts",
    "Body",
    "Identity",
    "Key",
    "RouteTable",
    "Role",
    "Rule",
    "check_distinct",
    "identify",
    "parse_keys",
]
MIN_SECRET = 16
"""Shortest secret accepted: a key that can be guessed is no key."""


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    role: Role
    secret: bytes


COMMENT = re.compile(r"(?:^|(?<=\s))#.*")
"""A comment: `#` at the start of a line or after whitespace, to the line's end. A `#` inside a secret is part
of it (a secret cut at its `#` would let its prefix authenticate)."""


def parse_keys(text: str, where: str) -> list[Key]:
    """Keys, one per line (or separated by `;`): `name role secret`; a `#` at the start of a line or after
    whitespace starts a comment. A secret is taken whole and may hold no whitespace. Raises ValueError naming
    the entry for anything else, a short secret, or a name or secret used twice."""
    keys: list[Key] = []
    for n, line in enumerate(text.replace(";", "\n").splitlines(), 1):
        line = COMMENT.sub("", line).strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3:
            raise ValueError(
                f"{where}, entry {n}: expected 'name role secret' (a secret holds no whitespace), got "
                f"{len(parts)} fields"
            )
        name, role, secret = parts
        if role not in ROLES:
            raise ValueError(f"{where}, entry {n}: role {role!r} is not one of {', '.join(ROLES)}")
        if len(secret) < MIN_SECRET:
            raise ValueError(f"{where}, entry {n}: the secret of {name!r} is shorter than {MIN_SECRET} characters")
        keys.append(Key(name, role, secret.encode()))
    check_distinct(keys, where)
    return keys


def check_distinct(keys: Sequence[Key], where: str) -> None:
    """No name used twice and no secret used twice (one secret holding two names or roles would act as
    whichever matched last): raises ValueError naming the name (never the secret)."""
    names: set[str] = set()
    secrets: dict[bytes, str] = {}
    for key in keys:
        if key.name in names:
            raise ValueError(f"{where}: the key name {key.name!r} is used twice")
        names.add(key.name)
        other = secrets.setdefault(key.secret, key.name)
        if other != key.name:
            raise ValueError(f"{where}: keys {other!r} and {key.name!r} have the same secret (used twice)")


def identify(keys: Iterable[Key], token: str | None) -> Identity | None:
    """The key's identity, or None. Every secret is compared, in constant time, whatever matches."""
    sent = (token or "").encode()
    found = None
    for key in keys:
        if hmac.compare_digest(sent, key.secret) and token:
            found = Identity(key.name, key.role)
    return found


# ------------------------------------------------------------------------------------------------ the matrix

PUBLIC = "public"
ANY_KEY: frozenset[Role] = frozenset(ROLES)
ENV_SIDE: frozenset[Role] = frozenset({"env", "admin"})
TRAINER_SIDE: frozenset[Role] = frozenset({"trainer", "admin"})

Rule = frozenset[Role] | str
"""The roles that may call a route, or PUBLIC."""
Body = Literal["small", "json", "ingest"]
"""What a route's body may be, as the front door checks it on its headers: `small` (any type, at most
`frontdoor.SMALL_BODY`), `json` (that, and not a type a browser sends cross-site without asking), `ingest`
(JSON up to `max_body_bytes`)."""
PUBLIC_PREFIXES = ("/static-offline-docs/",)
"""The files the API's description pages load."""


class RouteTable:
    """Every route's roles, what it acts on (declared beside the route, `api.routes.spec`; the table is
    `api.routes.table`) and the body rule of each path that takes more than a small body."""

    def __init__(
        self,
        roles: Mapping[tuple[str, str], Rule],
        bodies: Mapping[str, Body],
        acts: Mapping[tuple[str, str], Acts] | None = None,
    ) -> None:
        self.roles = dict(roles)
        self.bodies = dict(bodies)
        self.acts = dict(acts or {})
        self.templates = tuple((m, path[: path.index("{")], path) for (m, path) in roles if "{" in path)
        """Routes ending with a path parameter (which may hold `/`): method, the path before it, the route."""

    def route(self, method: str, path: str) -> tuple[str, str] | None:
        """The declared route a request's method and path reach, or None (a 404, a wrong method)."""
        if method == "HEAD":
            method = "GET"
        if (method, path) in self.roles:
            return method, path
        for m, prefix, templated in self.templates:
            if m == method and path.startswith(prefix) and len(path) > len(prefix):
                return m, templated
        return None

    def admits(self, method: str, path: str) -> Rule:
        """The roles that may call this route (or PUBLIC). A path not listed (a 404, a wrong method) needs any
        valid key: scanners learn nothing."""
        found = self.route(method, path)
        if found is not None:
            return self.roles[found]
        if method in ("GET", "HEAD") and path.startswith(PUBLIC_PREFIXES):
            return PUBLIC
        return ANY_KEY

    def declared(self, method: str, path: str) -> tuple[Rule, Acts | None]:
        """`admits`, and what the route declares it acts on (None for a route that declares nothing)."""
        found = self.route(method, path)
        if found is None:
            return self.admits(method, path), None
        return self.roles[found], self.acts.get(found)

    def body(self, path: str) -> Body:
        return self.bodies.get(path, "small")
