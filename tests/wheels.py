"""A distribution of this repository as a user gets it: its sources copied out of the checkout (nothing written
in it), built into a wheel by pip, and installed with its dependencies from the machine's package index in a new
virtualenv under the test's `tmp_path`; commands then run from outside the checkout, without what would let them
see it or this venv. Shared by `test_clients_alone.py` (rollbuf-client) and `test_four_process_layout.py`
(rollbuf)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = frozenset({"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"})
"""What would let a command see the checkout or this venv."""
INSTALL_GUARD_S = 600
"""A hang guard for building and installing, never a speed check."""


def alone_environ(bin_dir: Path | None = None) -> dict[str, str]:
    """This process's environment without `HIDDEN`; with `bin_dir` first on PATH (an activated virtualenv)."""
    env = {k: v for k, v in os.environ.items() if k not in HIDDEN}
    if bin_dir is not None:
        env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_alone(cwd: Path, *args: str | Path) -> str:
    """Run a command from `cwd` with `alone_environ()`; its stdout (a failure shows its output)."""
    done = subprocess.run(args, cwd=cwd, env=alone_environ(), capture_output=True, text=True, timeout=INSTALL_GUARD_S)
    assert done.returncode == 0, f"{' '.join(map(str, args))}: exit {done.returncode}\n{done.stdout}{done.stderr}"
    return done.stdout


def rollbuf_sources(dest: Path) -> Path:
    """rollbuf's sdist contents at `dest`: pyproject.toml, README.md and the packages it ships (its
    `packages.find` patterns), without caches."""
    dest.mkdir(parents=True)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["packages"]["find"]["include"]
    tops = {p.removesuffix("*") for p in patterns}
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for top in sorted(tops):
        shutil.copytree(ROOT / top, dest / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def build_wheel(tmp: Path, sources: Path, name: str) -> Path:
    """The wheel of the project at `sources`, built by pip into `tmp/dist` (`name`: its file name's start)."""
    dist = tmp / "dist"
    run_alone(tmp, sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", dist, sources)
    [wheel] = dist.glob(f"{name}-*.whl")
    return wheel


def install(tmp: Path, wheels: Iterable[Path], env: Path) -> Path:
    """A new virtualenv at `env` with `wheels` installed by pip with their dependencies, `pip check` clean; its
    python."""
    venv.create(env, with_pip=True)
    python = env / "bin" / "python"
    run_alone(tmp, python, "-m", "pip", "install", "--quiet", *wheels)
    run_alone(tmp, python, "-m", "pip", "check")
    return python
