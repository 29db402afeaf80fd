"""The docs site builds with `mkdocs build --strict` (mkdocs.yml): a broken link or anchor, a page left out of
the nav or a hook that fails is a failure here, in `make test`, rather than on a reader's screen.

One build, in a subprocess, into `tmp_path`: the hooks render the HTTP API reference from the app's OpenAPI and
print each page's words per sentence. The site must work offline, so no page loads a script or a stylesheet
from another host.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REMOTE_ASSET = re.compile(r"<(?:script|link)\b[^>]*\b(?:src|href)=\"(?:https?:)?//[^\"]+\"")


def test_the_docs_site_builds_strictly_and_offline(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    assert "Words per sentence" in done.stdout  # docs/hooks/words.py's report, a row per page
    assert re.search(r"^concepts\.md\s+\d+\s+\d+\s+\d", done.stdout, re.MULTILINE), done.stdout

    operations = (site / "reference" / "http-api.html").read_text()
    assert "POST /scored_data" in operations and "GET /batch" in operations  # rendered from the app's OpenAPI
    assert "TrainerClient" in (site / "reference" / "trainer_client.html").read_text()  # from the docstrings

    pages = list(site.rglob("*.html"))
    remote = [f"{page.relative_to(site)}: {m[0]}" for page in pages for m in REMOTE_ASSET.finditer(page.read_text())]
    assert not remote, "\n".join(remote)
