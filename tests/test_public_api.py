"""The clients' public surface: `__all__` sorted and complete, and importing a client stays light."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ["trainer_client", "rollout_client"]
"""Client packages whose surface is guarded here."""


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_complete(name: str) -> None:
    pkg = importlib.import_module(name)
    exported = list(pkg.__all__)
    assert exported == sorted(exported)
    assert len(set(exported)) == len(exported)
    for attr in exported:
        assert hasattr(pkg, attr), f"{name}.__all__ names {attr}, which does not exist"
    public = {
        attr
        for attr, value in vars(pkg).items()
        if not attr.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__.startswith(name)
    }
    assert public <= set(exported), f"imported in {name} but not exported: {sorted(public - set(exported))}"


@pytest.mark.parametrize("name", PACKAGES)
def test_importing_a_client_does_not_import_the_server_stack(name: str) -> None:
    heavy = ("fastapi", "uvicorn", "starlette", "redis", "torch", "transformers", "tokenizers")
    code = f"import sys, {name}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_service_imports_neither_client() -> None:
    """The brief's boundary: `api/` is the service; demos and tests may import the clients, the service never."""
    root = Path(__file__).resolve().parents[1] / "api"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(root.parent)}: {n}" for n in names if n.split(".")[0] in PACKAGES]
    assert offenders == []


def test_the_client_core_stays_a_client_library() -> None:
    """client_core is imported by both clients: it must pull in neither the server stack nor the service."""
    heavy = ("fastapi", "uvicorn", "starlette", "api", "trainer_client", "rollout_client")
    modules = "client_core.errors, client_core.retry, client_core.config"
    code = f"import sys, {modules}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


WIRE = ("api", "wire")
"""What of `api` the clients may use: the wire package (bodies, their shared rules, the binary record), nothing of
the service (a trainer's or a producer's environment installs the clients without it)."""


def _is_wire(module: str) -> bool:
    return tuple(module.split(".")[:2]) == WIRE


def test_the_clients_import_only_the_wire_modules_of_api() -> None:
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for package in [*PACKAGES, "client_core"]:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module == "api":
                    modules = [f"api.{a.name}" for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    modules = [node.module]
                else:
                    continue
                bad = [m for m in modules if m.split(".")[0] == "api" and not _is_wire(m)]
                offenders += [f"{path.relative_to(root)}: {m}" for m in bad]
    assert offenders == []


def test_the_wire_imports_alone() -> None:
    """Importing every wire module pulls in neither the server stack nor anything of `api` outside the wire."""
    wire = Path(__file__).resolve().parents[1] / "api" / "wire"
    package = ".".join(WIRE)
    modules = ", ".join(f"{package}.{p.stem}" for p in sorted(wire.glob("*.py")) if p.stem != "__init__")
    heavy = ("fastapi", "uvicorn", "starlette", "prometheus_client", "trainer_client", "rollout_client")
    code = (
        f"import sys, {modules}; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r} "
        f"or (m.startswith('api.') and not m.startswith('{package}'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
