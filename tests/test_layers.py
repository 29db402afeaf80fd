"""The house rule of `api/`: a room imports only rooms below it in `api.layers.ROOMS`, so no import cycle runs
between rooms. Every import counts, at module level or inside a function (a function-level import is still a
dependency at run time); imports under `TYPE_CHECKING` do not (annotations only, never run)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from api import layers

API = Path(__file__).resolve().parents[1] / "api"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(API.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_only(tree: ast.Module) -> set[int]:
    """The ids of the nodes under an `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def imported(source: str, module: str, package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in `module`'s source run at import or call time; `from x import y`
    yields x.y too, as y may be a submodule."""
    tree = ast.parse(source)
    skipped = type_checking_only(tree)
    package_name = module if package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package_name.split(".")
                base = parts[: len(parts) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            yield node.lineno, source
            for alias in node.names:
                yield node.lineno, f"{source}.{alias.name}"


def rooms_on_disk() -> set[str]:
    modules = {p.stem for p in API.glob("*.py") if p.name != "__init__.py"}
    return modules | {p.parent.name for p in API.glob("*/__init__.py")}


def test_every_room_is_placed_once() -> None:
    assert len(set(layers.NAMES)) == len(layers.NAMES), "a room listed twice in api/layers.py"
    assert rooms_on_disk() == set(layers.NAMES), "api/layers.py lists api/'s modules and packages"


def test_no_room_imports_one_above_it() -> None:
    """An import from a lower room to a higher one is refused; with a total order, that refuses every cycle."""
    rank = {name: i for i, name in enumerate(layers.NAMES)}
    upward = set()
    for path in sorted(API.rglob("*.py")):
        mine = layers.room_of(module_name(path))
        for line, target in imported(path.read_text(), module_name(path), path.name == "__init__.py"):
            theirs = layers.room_of(target)
            if theirs in rank and theirs != mine and rank[theirs] < rank[mine]:
                upward.add(f"{path.relative_to(API.parent)}:{line} ({mine}) imports {target} ({theirs})")
    assert not upward, "imports from a room to one above it (api/layers.py):\n" + "\n".join(sorted(upward))


def test_the_rule_reads_function_level_imports_and_skips_type_checking() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from api.service import Service\n"
        "def f():\n    from ..app import create_app\n"
    )
    found = {target for _, target in imported(source, "api.run.x")}
    assert "api.app" in found and not any(t.startswith("api.service") for t in found)


def test_the_architecture_page_shows_the_order() -> None:
    current = layers.DOC.read_text()
    assert layers.render(current) == current, "docs/architecture.md differs from api/layers.py: python -m api.layers"
