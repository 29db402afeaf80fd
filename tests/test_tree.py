"""The tests' house rule: no two test modules share a file name anywhere under `tests/`, so a failure's file names
the module it is about without its folder, and each folder that holds tests is a package (`__init__.py`), so pytest
imports every test module by its dotted path from the repository root (tests/README.md gives the naming scheme)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def modules_of_tests() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_no_two_test_modules_share_a_file_name() -> None:
    by_name: defaultdict[str, list[str]] = defaultdict(list)
    for path in modules_of_tests():
        by_name[path.name].append(str(path.relative_to(TESTS.parent)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"test modules that share a file name (tests/README.md says how to name them): {shared}"


def test_every_folder_holding_tests_is_a_package() -> None:
    folders = {path.parent for path in modules_of_tests()}
    missing = sorted(str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").exists())
    assert not missing, f"folders of test modules without an __init__.py: {missing}"
