"""The clients alone: rollbuf-client (clients/pyproject.toml), the distribution a trainer's or a producer's
environment installs instead of rollbuf (docs/bring-your-environment.md, "Only the clients").

Its wheel, built from the repository and installed by pip in a new virtualenv with nothing else, imports both
clients and makes one of each without loading the service's stack; and its version, floors and extras are
rollbuf's own, so that the two distributions cannot drift apart."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

from tests.wheels import ROOT, build_wheel, install, run_alone

CLIENTS = ROOT / "clients"
SERVICE_STACK = ("fastapi", "fastapi_offline", "uvicorn", "starlette", "psycopg", "psycopg_pool", "prometheus_client")
"""What a trainer's environment must not load: the service's HTTP stack and store drivers."""
SMOKE = """
import json, socket, sys
import trainer_client, rollout_client
from api.wire.schema import ScoredData
from rollout_client import SyncRolloutClient
from trainer_client import ServerUnreachable, TrainerClient

with socket.socket() as s:  # a port that nothing listens on
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
ScoredData(tokens=[[1, 2, 3]], masks=[[-100, 2, 3]], scores=[1.0])
with SyncRolloutClient(url):
    pass
with TrainerClient(url, tries=1) as trainer:
    try:
        trainer.info()
        answered = True
    except ServerUnreachable:
        answered = False
print(json.dumps({"answered": answered, "modules": sorted(sys.modules),
                  "files": [trainer_client.__file__, rollout_client.__file__]}))
"""


def _project(path: Path) -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads(path.read_text())["project"]
    return project


def _by_name(lines: list[str]) -> dict[str, Requirement]:
    return {(req := Requirement(line)).name: req for line in lines}


def test_the_clients_version_floors_and_extras_are_rollbuf_s() -> None:
    service, clients = _project(ROOT / "pyproject.toml"), _project(CLIENTS / "pyproject.toml")
    assert clients["version"] == service["version"]
    assert clients["requires-python"] == service["requires-python"]
    ours = _by_name(service["dependencies"])
    for name, req in _by_name(clients["dependencies"]).items():
        assert name in ours, f"rollbuf-client depends on {name}, which rollbuf does not"
        assert req.specifier == ours[name].specifier, f"{name}: {req.specifier} here, {ours[name].specifier} in rollbuf"
    for extra, lines in clients["optional-dependencies"].items():
        assert lines == service["optional-dependencies"][extra], f"the {extra} extra differs from rollbuf's"


def test_the_clients_install_and_run_alone(tmp_path: Path) -> None:
    # The sources as a built sdist would hold them: the links in clients/ followed, nothing written in the checkout.
    src, env = tmp_path / "src", tmp_path / "venv"
    shutil.copytree(CLIENTS, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    python = install(tmp_path, [build_wheel(tmp_path, src, "rollbuf_client")], env)

    # From tmp_path, so that the checkout is not on sys.path: what is imported is the wheel's.
    reply = json.loads(run_alone(tmp_path, python, "-c", SMOKE))
    assert reply["answered"] is False
    assert all(Path(f).is_relative_to(env) for f in reply["files"]), reply["files"]
    modules: list[str] = reply["modules"]
    assert [m for m in modules if m.split(".")[0] in SERVICE_STACK] == []
    assert [m for m in modules if m.split(".")[0] == "api" and m != "api" and not m.startswith("api.wire")] == []
