"""The offline package index verifiers' harness installs from in `make test`.

verifiers' chat harness runs `uv sync --script` on its program in every worker process, with
`UV_OFFLINE=false` forced, so a warm cache does not keep it offline. At install time (`make install`) this
downloads the program's dependencies (its PEP 723 header) into a wheelhouse and writes a PEP 503 `simple/`
index over it; the tests set `UV_DEFAULT_INDEX=file://<dir>/simple` (tests/verifiers_tiny.py) and run with no
network.

    python -m rollout_client.verifiers.wheelhouse .venv/wheelhouse
"""

from __future__ import annotations

import argparse
import html
import re
import subprocess
import sys
from pathlib import Path

HARNESS_DEPENDENCIES = ["openai", "mcp==2.0.0", "httpx", "httpx2", "tenacity", "certifi"]
"""verifiers 0.4.0's chat program header (`verifiers.v1.harnesses.utils.launch.CHAT_PROGRAM_SOURCE`)."""


def normalize(name: str) -> str:
    """PEP 503's project name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(filename: str) -> str:
    """The project a wheel or sdist file belongs to (its name up to the version)."""
    if filename.endswith(".whl"):
        return normalize(filename.split("-")[0])
    stem = re.sub(r"\.(tar\.gz|zip)$", "", filename)
    return normalize(stem.rsplit("-", 1)[0])


def write_index(files: Path, simple: Path) -> int:
    """A PEP 503 index at `simple/` over every distribution in `files`; the number of projects."""
    projects: dict[str, list[Path]] = {}
    for f in sorted(files.iterdir()):
        if f.suffix in {".whl", ".gz", ".zip"}:
            projects.setdefault(project_of(f.name), []).append(f)
    simple.mkdir(parents=True, exist_ok=True)
    links = []
    for name, dists in sorted(projects.items()):
        (simple / name).mkdir(exist_ok=True)
        body = "".join(f'<a href="{d.resolve().as_uri()}">{html.escape(d.name)}</a><br>\n' for d in dists)
        (simple / name / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{body}</body></html>\n")
        links.append(f'<a href="{name}/">{name}</a><br>\n')
    (simple / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "".join(links) + "</body></html>\n")
    return len(projects)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path)
    args = parser.parse_args()
    files = args.dir / "files"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            str(files),
            *HARNESS_DEPENDENCIES,
        ],
        check=True,
    )
    n = write_index(files, args.dir / "simple")
    print(f"wheelhouse: {n} projects in {args.dir / 'simple'}")


if __name__ == "__main__":
    main()
