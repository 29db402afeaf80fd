"""The clients' public surface: `__all__` sorted and complete, and importing a client stays light."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

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
    heavy = ("fastapi", "uvicorn", "starlette", "redis", "torch")
    code = f"import sys, {name}; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
