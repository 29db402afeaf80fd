"""The floor tier's check of its own venv (`make floors-test`, `python -m tests.floors`): each of the service's
direct dependencies is installed at exactly the floor pyproject.toml declares for it.

uv's lowest-direct resolution installs the lowest release it can, which is not the declared floor when that
release is yanked or cannot be installed beside the others (xxhash 3.4.0 is yanked; psycopg 3.2.0's binary extra
asks for a psycopg-binary that was never published): the tier would then pass on a later release, and the floor
would look tested while nothing ran on it."""

from __future__ import annotations

import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def floors(pyproject: Path = PYPROJECT) -> dict[str, Version]:
    """Each direct dependency's floor: the version of its `>=`; a dependency without one is an error."""
    out: dict[str, Version] = {}
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        req = Requirement(line)
        lows = [Version(spec.version) for spec in req.specifier if spec.operator == ">="]
        if len(lows) != 1:
            raise ValueError(f"{line!r}: a direct dependency needs exactly one floor (>=)")
        out[req.name] = lows[0]
    return out


def off_floor(declared: dict[str, Version]) -> list[str]:
    """What is installed other than at its floor, one line each."""
    wrong = []
    for name, floor in sorted(declared.items()):
        try:
            installed = Version(version(name))
        except PackageNotFoundError:
            wrong.append(f"{name}: not installed (floor {floor})")
            continue
        if installed != floor:
            wrong.append(f"{name}: {installed} installed, but the floor is {floor}")
    return wrong


def main() -> int:
    declared = floors()
    wrong = off_floor(declared)
    for line in wrong:
        print(f"tests/floors.py: {line}", file=sys.stderr)
    if not wrong:
        print(f"tests/floors.py: all {len(declared)} direct dependencies at their floors")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
