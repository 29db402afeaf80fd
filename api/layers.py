"""The rooms of `api/`, top to bottom: a room imports only rooms below it, so each can be read, tested and
changed knowing only what sits under it, and no import cycle runs between rooms.

A room is a subpackage of `api/` or one of its top-level modules. The composition root (`app`) wires every flow
together at the top; `routes` turn HTTP into one service operation each; the flows sit in the middle, each with
its own service; below them `http` (the edge: bodies, the front door, connections) and `run` (what every flow
reads and writes inside a transaction); at the bottom the settings, the keys, this process's meters, the store
contract with its own types, the wire format, and the plain values everyone shares.

tests/test_layers.py reads `ROOMS` and fails on an import from a room to one above it (imports under
`TYPE_CHECKING` aside: annotations only, never run) and on a room missing from it. docs/architecture.md shows
the list `python -m api.layers` writes from it (`--check` says whether the page differs).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import NamedTuple


class Room(NamedTuple):
    name: str
    holds: str


ROOMS: tuple[Room, ...] = (
    Room("__main__", "`python -m api`: the command line"),
    Room("cli", "`rollbuf serve`, `rollbuf export` and the other commands"),
    Room("app", "the composition root: the store, the service, the routes and the HTTP edge built into one app"),
    Room("routes", "the HTTP routes, each calling one service operation, and their dependencies"),
    Room("service", "`Service`: the operations composed, and their background jobs"),
    Room("views", "what operators read: /status, /metrics, the dashboard's data, the W&B run"),
    Room("export", "the ledger and the tasks written out as Parquet, streamed or to files"),
    Room("rollouts", "open groups: rollouts posted slot by slot, swept when abandoned"),
    Room("ingest", "/scored_data: a submission parsed, validated, queued or dropped"),
    Room("batches", "batches planned, formed in one transaction, kept, acknowledged, sharded"),
    Room("ledger", "what became of every group and step: recorded, ruled on, watched for drop bias"),
    Room("tasks", "datasets of tasks leased to producers, ended, ordered, resumed"),
    Room("producers", "who is producing: live heartbeats and the stored reports"),
    Room("http", "the edge: bodies, gzip, the front door, the body budget, connections, OpenAPI"),
    Room("run", "what every flow reads and writes in a transaction: run state, kept batches, filters, counters"),
    Room("config", "the settings, each declared once, and the docs table made from them"),
    Room("keys", "API keys, their roles and the key file"),
    Room("meters", "this process's timings and gauges, and the store that times its transactions"),
    Room("store", "the store contract, its types, and its memory, SQLite and PostgreSQL backends"),
    Room("wire", "the wire format: request and reply models, the binary group record (the clients import it)"),
    Room("owners", "who is acting: actors, identities, roles, refusals"),
    Room("logs", "structured logs and the request's context in them"),
    Room("scheduler", "periodic jobs on the event loop"),
    Room("errors", "the errors every room raises, with their HTTP status"),
    Room("layers", "this order"),
)
"""Every room of `api/`, top to bottom."""

NAMES: tuple[str, ...] = tuple(room.name for room in ROOMS)

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BEGIN = "<!-- layers: from api/layers -->"
END = "<!-- /layers -->"


def room_of(module: str) -> str | None:
    """The room of a dotted module name under `api` (`api.batches.planner` → `batches`), or None outside it."""
    parts = module.split(".")
    return parts[1] if parts[0] == "api" and len(parts) > 1 else None


def listing() -> str:
    """The rooms as the architecture page lists them, top first: a folder as `name/`, a module as `name.py`."""
    here = Path(__file__).resolve().parent
    shown = [f"`{room.name}/`" if (here / room.name).is_dir() else f"`{room.name}.py`" for room in ROOMS]
    return "\n".join(f"{i}. {name}: {room.holds}." for i, (name, room) in enumerate(zip(shown, ROOMS, strict=True), 1))


def render(page: str) -> str:
    """`page` with the text between the markers replaced by the list."""
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(page):
        raise ValueError(f"{DOC} has no {BEGIN!r} ... {END!r} markers")
    return pattern.sub(lambda _: f"{BEGIN}\n{listing()}\n{END}", page)


def main(argv: list[str]) -> int:
    current = DOC.read_text()
    updated = render(current)
    if "--check" in argv:
        if updated != current:
            print(f"{DOC} differs from api/layers.py: python -m api.layers", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
