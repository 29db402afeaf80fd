"""The docs' runnable examples (docs/examples/) run as written, against a real rollbuf server and the stand-in
inference process's capped sandbox pool, and the pages that show them show them whole (they cannot drift)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_vllm import fake_vllm
from tests.integration.test_runner import start_trainer
from tests.integration.test_runner_faults import finish
from tests.servers import running_server

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"sandboxed_pool.py": "rollout-client.md"}
"""Each example, and the page that shows it in a python block."""


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_the_page_shows_the_example_whole(example: str) -> None:
    code = (ROOT / "docs" / "examples" / example).read_text()
    assert f"```python\n{code}```" in (ROOT / "docs" / EXAMPLES[example]).read_text()


def test_the_sandboxed_pool_example_runs_as_written(tmp_path: Path) -> None:
    """Two worker processes, G=8 on a pool of 8, 16 in flight: no deadlock, every sandbox given back."""
    with running_server("memory://", tmp_path / "s.log") as server, fake_vllm(tmp_path / "v.log") as pool:
        start_trainer(server.url, batch_size=8)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "ROLLBUF_URL": server.url,
               "SANDBOX_URL": pool.url + "/sandbox", "MAX_GROUPS": "4"}  # fmt: skip
        proc = subprocess.Popen([sys.executable, str(ROOT / "docs" / "examples" / "sandboxed_pool.py")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env=env,
                                cwd=tmp_path)  # fmt: skip
        code, out, err = finish(proc, 120)
        assert code == 0, err[-3000:]
        assert out.strip() == "4 groups accepted, 0 failed"
        seen = pool.stats()
        assert seen["sandbox_acquired"] == 32 and seen["sandbox_held"] == 0 and seen["sandbox_max_held"] <= 8
