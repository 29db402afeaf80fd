"""Who owns what, and who may act on another key's (docs/security.md, "Ownership").

Every resource a key makes records the key's name as its owner: an env, a dataset (and the leases of its tasks,
which are bound to the key that took them), an open group, a producer id. Each route declares, beside the route
(`api.routes.spec.route`), what it acts on and which roles may act on another key's (`Acts`); the front door
turns the declaration and the caller's key into an `Actor` before the handler runs, and every lookup of an owned
resource goes through `Actor.check`. Acting on another key's resource answers as if it did not exist (404): a
key learns nothing of what others hold. Trainer and admin keys read everything and admin keys act on
everything; an env key acts on its own.

Without keys every caller is `ANONYMOUS` (an admin, as with Atropos), resources it makes have no owner, and the
model changes nothing. A resource with no owner (made without keys, or before owners were recorded and with no
owner to inherit: docs/stores.md) is acted on by trainer and admin keys only.

Pure: no request, no store. Refusals are counted per key and resource kind, and logged once per episode (a key's
first refusal after `QUIET_S` without one), so a misconfigured producer is visible without flooding the log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("rollbuf")

Role = Literal["env", "trainer", "admin"]
ROLES: tuple[Role, ...] = ("env", "trainer", "admin")


@dataclass(frozen=True, slots=True)
class Identity:
    """The caller, as its key names it."""

    name: str
    role: Role


ANONYMOUS = Identity("anonymous", "admin")
"""The caller when the server has no keys (Atropos's model: whoever reaches the port may do everything)."""

Resource = Literal["env", "dataset", "task_lease", "open_group", "producer"]
"""The kinds of resource a key owns."""


def owner_of(caller: Identity) -> str | None:
    """What a resource made by `caller` records as its owner: the key's name, or None without keys."""
    return None if caller is ANONYMOUS else caller.name


@dataclass(frozen=True, slots=True)
class Acts:
    """A route's declaration of what it acts on (`on`: the kinds of owned resource it names; empty for the run as
    a whole or nothing owned) and which roles may act on a resource another key owns (`others`)."""

    on: tuple[Resource, ...]
    others: frozenset[Role]

    @property
    def reads(self) -> bool:
        """A view: every role admitted sees every resource, filtered where an env key's view is its own."""
        return not self.on


OWN: frozenset[Role] = frozenset({"admin"})
"""Who acts on another key's resource on a route that changes it: admin keys only."""
RUN_WIDE: frozenset[Role] = frozenset({"trainer", "admin"})
"""Who reads (or, where a route says so, acts on) another key's resource: trainer and admin keys, which see the
whole run (a trainer disconnects an env that holds its batches back)."""


def acts(*on: Resource, others: frozenset[Role] = OWN) -> Acts:
    return Acts(tuple(on), others)


RUN = Acts((), frozenset({"env", "trainer", "admin"}))
"""The route acts on the run as a whole (its role rule says who), or on nothing a key owns."""


@dataclass(frozen=True, slots=True)
class Actor:
    """The caller as its route's declaration lets it act."""

    identity: Identity
    others: frozenset[Role]

    @property
    def owner(self) -> str | None:
        """What a resource this caller makes records as its owner."""
        return owner_of(self.identity)

    @property
    def everything(self) -> bool:
        """Whether this caller acts on every key's resources here (no keys, or a role the route lets)."""
        return self.identity is ANONYMOUS or self.identity.role in self.others

    def may(self, owner: str | None) -> bool:
        """Whether this caller may act on a resource owned by `owner`."""
        return self.everything or (owner is not None and owner == self.identity.name)

    def hides(self, owner: str | None, kind: Resource) -> bool:
        """Whether a resource owned by `owner` is hidden from this caller: it must answer as an unknown one (the
        route's own answer for that: a 404, or the 422 or in-band failure an Atropos route gives an unknown env).
        Counted."""
        if self.may(owner):
            return False
        REFUSALS.count(self.identity.name, kind)
        return True

    def check(self, owner: str | None, kind: Resource, unknown: Exception) -> None:
        """Raise `unknown`, the route's answer for a resource that does not exist, unless this caller may act on a
        resource of `owner`'s (counted)."""
        if self.hides(owner, kind):
            raise unknown


def actor(identity: Identity, declared: Acts | None) -> Actor:
    """The caller on a route declared so (an undeclared route, e.g. a 404: it may act on nothing of another's)."""
    return Actor(identity, frozenset() if declared is None else declared.others)


ANYONE = Actor(ANONYMOUS, frozenset(ROLES))
"""The server itself acting (a sealed group's ingest, a sweep): acts on everything."""

QUIET_S = 60.0
"""A key's refusals within this many seconds of its last are one episode: logged once."""


class Refusals:
    """Refusals to act on another key's resource: counted per (key, kind) for /metrics, logged once an episode."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self._last: dict[str, float] = {}
        self._listeners: list[Callable[[str, str], None]] = []

    def listen(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(key, kind)` on each refusal (the metrics' counter: this module imports no metrics)."""
        self._listeners.append(listener)

    def count(self, key: str, kind: str) -> None:
        self.counts[key, kind] = self.counts.get((key, kind), 0) + 1
        for listener in self._listeners:
            listener(key, kind)
        now = time.monotonic()
        last = self._last.get(key)
        self._last[key] = now
        if last is None or now - last > QUIET_S:
            log.warning(
                "key %r acted on a %s it does not own (answered as unknown); further refusals of this key are "
                "counted in rollbuf_foreign_refused_total, logged again after %g s without one",
                key,
                kind.replace("_", " "),
                QUIET_S,
            )


REFUSALS = Refusals()
"""This process's refusals (each server process counts its own, as with its other counters)."""
