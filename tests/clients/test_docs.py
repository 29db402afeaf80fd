"""The Python examples in docs/trainer-client.md, docs/binary-format.md, docs/agentic.md and docs/trl.md (its resume
rule) run as written."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from api.config.settings import Settings
from api.wire.records import MSGPACK, encode_submission, encode_submission_list
from tests.clients.test_trainer_client import serve_in_thread
from tests.factories import group
from trainer_client.protocol import registration

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


def test_binary_format_example() -> None:
    [example] = python_blocks("binary-format.md")
    exec(compile(example, "binary-format.md", "exec"), {})


def test_trainer_client_quick_start(capsys: pytest.CaptureFixture[str]) -> None:
    with serve_in_thread(Settings(store="memory://")) as url, httpx.Client(base_url=url) as c:
        c.post("/register", json=registration(batch_size=8, max_token_len=64, starting_step=0))
        body = encode_submission_list(encode_submission(**group(4, env_id=None, seed=g)) for g in range(4))
        assert c.post("/scored_data_list", content=body, headers={"Content-Type": MSGPACK}).status_code == 200
        example = python_blocks("trainer-client.md")[0]  # the quick start; later blocks are fragments
        exec(compile(example, "trainer-client.md", "exec"), {"URL": url})
    assert capsys.readouterr().out.splitlines() == ["0 8 (1, 64) float32", "1 8 (1, 64) float32"]


def test_rollout_client_quotes_the_errors_it_raises() -> None:
    """docs/rollout-client.md quotes the `Rejected` message for a short mask row, over JSON and binary."""
    from api.wire.schema import ScoredData
    from rollout_client import SyncRolloutClient
    from rollout_client.errors import Rejected

    page = (DOCS / "rollout-client.md").read_text()
    quoted = [" ".join(q.split()) for q in re.findall(r"`(HTTP 422: [^`]*)`", page, flags=re.S)]
    assert len(quoted) == 2
    bad = ScoredData(tokens=[[1] * 8, [2] * 8], masks=[[1] * 7, [2] * 8], scores=[1.0, 0.0])
    with serve_in_thread(Settings(store="memory://")) as url, httpx.Client(base_url=url) as c:
        c.post("/register", json=registration(batch_size=8, max_token_len=64, starting_step=0))
        c.get("/batch")
        for binary, message in zip((False, True), quoted, strict=True):
            with SyncRolloutClient(url, prefer_binary=binary) as env:
                env.register("docs", group_size=2)
                with pytest.raises(Rejected) as raised:
                    env.submit(bad)
            assert str(raised.value) == message


def test_agentic_example_prints_what_the_page_says(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/agentic.md: the tool-using chat environment, on the local tokenizer with Qwen2.5's template."""
    page = (DOCS / "agentic.md").read_text()
    example = python_blocks("agentic.md")[0]
    printed = page.split("prints\n\n```\n", 1)[1].split("```", 1)[0]
    exec(compile(example, "agentic.md", "exec"), {"__name__": "agentic_example"})
    assert capsys.readouterr().out == printed


def distributions_installed_by(requirements: list[str]) -> set[str]:
    """The distributions pip installs for `requirements` (their own requirements and extras, transitively), read
    from this environment's metadata."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(line) for line in requirements]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(key)
        for line in metadata.requires(req.name) or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {"", *req.extras}):
                sub.marker = None
                todo.append(sub)
    return {name for name, _ in seen}


ONLY_THESE_INSTALLED = """
import importlib.machinery, sys

class OnlyThese(importlib.machinery.PathFinder):
    \"\"\"Finds what PathFinder finds, but for the top-level modules of the distributions left out.\"\"\"

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in LEFT_OUT else super().find_spec(name, path, target)

sys.meta_path = [OnlyThese if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def test_the_agentic_example_runs_with_the_service_install_and_the_chat_extra() -> None:
    """docs/agentic.md's example builds its tokenizer with `tokenizers`, `transformers` and jinja2 (the template),
    which `pip install -e .` (what `make serve` installs) does not bring: the page names the `chat` extra, and
    the example prints what the page says in a process that can import only the service's install and that
    extra's (every other installed distribution hidden from its imports)."""
    page = (DOCS / "agentic.md").read_text()
    assert "pip install -e '.[chat]'" in page
    project = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())["project"]
    service = distributions_installed_by(project["dependencies"])
    chat = distributions_installed_by(project["optional-dependencies"]["chat"])
    assert {"tokenizers", "transformers", "jinja2"} <= chat - service  # what the page says the extra is for
    installed = service | chat | {"rollbuf", "pip", "setuptools"}
    left_out = {
        m for m, ds in metadata.packages_distributions().items() if not {canonicalize_name(d) for d in ds} & installed
    }
    script = f"LEFT_OUT = {sorted(left_out)!r}\n{ONLY_THESE_INSTALLED}\n{python_blocks('agentic.md')[0]}"
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout == page.split("prints\n\n```\n", 1)[1].split("```", 1)[0]


def test_trl_resume_picks_the_highest_committed_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/trl.md's resume rule: the highest `checkpoint-N` with `rollbuf_state.json`, in numeric order (10 > 8);
    a newer one a kill left without it is skipped, and none at all resumes from scratch (None)."""
    [example] = [b for b in python_blocks("trl.md") if "last_checkpoint_or_None =" in b]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(compile(example, "trl.md", "exec"), scope)
    assert scope["last_checkpoint_or_None"] is None
    for n, committed in ((2, True), (8, True), (10, True), (12, False)):
        (tmp_path / "out" / f"checkpoint-{n}").mkdir(parents=True)
        if committed:
            (tmp_path / "out" / f"checkpoint-{n}" / "rollbuf_state.json").write_text("{}")
    exec(compile(example, "trl.md", "exec"), scope)
    assert scope["last_checkpoint_or_None"] == str(Path("out") / "checkpoint-10")
