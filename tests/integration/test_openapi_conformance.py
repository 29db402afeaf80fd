"""The OpenAPI description tells the truth: schemathesis, with every check, against a real server's
/openapi.json finds nothing (no 5xx, no undocumented status code or header, no reply outside its schema, no
schema-valid request refused, no schema-invalid request accepted, auth enforced where declared).

The server runs with an API key, so the description declares it and the `ignored_auth` check has something
to check, a trainer registered with the largest limits and one environment. Rules that tie a request's values
together, which the schema can only describe in words (one mask row per sequence, `rank` below `world_size`, ...),
and the Atropos routes' documented 422s of state (an unregistered env_id) are kept by `tests.openapi_hooks`; on
rollbuf's own routes the server's state is a 404 or a 409, which needs no hook.
A fixed seed and a bounded number of examples per operation keep it to about a minute and reproducible;
`ROLLBUF_SCHEMATHESIS_EXAMPLES` and `ROLLBUF_SCHEMATHESIS_SEED` explore further. The `too_slow` health check
is off: it times data generation, and on a loaded machine (the suite on several workers) it failed a run
whose every case passed; time belongs in bench/.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api.routes.ledger import LEDGER_EXAMPLE
from api.wire.rules import INT32_MAX
from api.wire.schema import REGISTRATION_EXAMPLE
from tests.factories import group
from tests.servers import ServerProcess, running_server

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
KEY = "conformance-key"
EXAMPLES = os.environ.get("ROLLBUF_SCHEMATHESIS_EXAMPLES", "10")
SEED = os.environ.get("ROLLBUF_SCHEMATHESIS_SEED", "1")


CONFIG = """
[[operations]]
include-path = "/tasks/rows"
parameters = { "query.dataset" = "conformance" }

[[operations]]
include-path = "/rollouts/turns"
parameters = { "query.group_id" = "conformance" }
"""
"""Values that name something the server holds, so that schemathesis reaches past the 404 of an unknown one (the
set-up registers the dataset and opens the group; `tests.openapi_hooks` names the group in a turn's body): test
data, not a rule."""


def schemathesis(server: ServerProcess, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        "all",
        "--workers",
        "1",
        "--max-examples",
        EXAMPLES,
        "--seed",
        SEED,
        "--generation-database",
        "none",
        "--header",
        f"Authorization: Bearer {KEY}",
        "--no-color",
        "--suppress-health-check",
        "too_slow",
        *args,
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.openapi_hooks", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540, check=False)


def summary(out: subprocess.CompletedProcess[str]) -> str:
    text = out.stdout + out.stderr
    start = text.find("FAILURES")
    return text[start if start >= 0 else -6000 :][-12000:]


def test_every_schemathesis_check_passes_against_openapi_json(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with running_server("memory://", log, "--api-key", KEY, "--max-batch-wait", "1") as server:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
            # The largest batch_size, so any group_size schemathesis registers fits (422 beyond otherwise).
            reg = REGISTRATION_EXAMPLE | {"batch_size": INT32_MAX, "max_token_len": 1 << 20}
            assert c.post("/register", json=reg).status_code == 200
            assert c.get("/batch").json() == {"batch": None}
            env = {"max_token_length": 4096, "desired_name": "conformance", "weight": 1.0, "group_size": 2}
            assert c.post("/register-env", json=env).json()["env_id"] == 0
            assert c.post("/tasks/datasets", json={"name": "conformance", "tasks": [{"q": 1}]}).status_code == 200
            spec = {"group_id": "conformance", "env_id": 0, "producer_id": "p", "group_size": 2, "deadline_s": 3600}
            assert c.post("/rollouts/open", json=spec).status_code == 200
        # /reset_data would undo that set-up in the middle of the run: it gets its own run afterwards.
        # The ledger's reads need a formed batch, which that run's batch_size never forms: theirs come last.
        out = schemathesis(server, tmp_path, "--exclude-path", "/reset_data", "--exclude-path-regex", "^/ledger/")
        assert out.returncode == 0, summary(out)
        assert "No issues found" in out.stdout, summary(out)
        out = schemathesis(server, tmp_path, "--include-path", "/reset_data")
        assert out.returncode == 0, summary(out)
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
            assert c.post("/register", json=REGISTRATION_EXAMPLE | {"batch_size": 2}).status_code == 200
            c.get("/batch")
            env = {"max_token_length": 4096, "desired_name": "conformance", "weight": 1.0, "group_size": 2}
            assert c.post("/register-env", json=env).json()["env_id"] == 0
            assert c.post("/scored_data", json=group(2, group_id=LEDGER_EXAMPLE)).status_code == 200
            assert len(c.get("/batch").json()["batch"]) == 1  # step 0, in the ledger
        out = schemathesis(server, tmp_path, "--include-path-regex", "^/ledger/")
        assert out.returncode == 0, summary(out)
        assert "No issues found" in out.stdout, summary(out)
    assert "Traceback" not in log.read_text()
