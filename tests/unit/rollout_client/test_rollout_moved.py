"""The deprecated module paths of `rollout_client` (rollout_client/_moved.py): each still imports, with one
DeprecationWarning that names the new path and points at the importing line, and gives the new module itself,
so that every object (and every patch) is the same by either path."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

import rollout_client
from rollout_client._moved import MOVED

PACKAGE = Path(rollout_client.__file__).parent


def _shims() -> dict[str, str]:
    """Each module at the package's top that calls `moved`, and the module its type-checking import names."""
    found = {}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "moved"]
        if calls:
            star = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.names[0].name == "*"]
            found[f"rollout_client.{path.stem}"] = star[0].module if star else ""
    return found


def test_every_moved_path_has_its_module_and_types_as_its_new_one() -> None:
    assert _shims() == MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_path_warns_once_and_gives_the_new_module(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    sys.modules.pop(old, None)  # as a new process finds it, whether an earlier test imported it or not
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(f"import {old}\nimport {old}", __file__, "exec"), {})
    assert [w.category for w in caught] == [DeprecationWarning]
    assert f"{old} has moved to {MOVED[old]}" in str(caught[0].message)
    assert caught[0].filename == __file__, "the warning points at the line that imported the old path"
    assert sys.modules[old] is new
    names = [name for name in vars(new) if not name.startswith("_")]
    assert names
    scope: dict[str, object] = {}
    exec(f"from {old} import {', '.join(names)}", scope)
    assert all(scope[name] is getattr(new, name) for name in names)
