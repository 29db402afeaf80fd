"""mkdocs hook: a page's links to repository files outside `docs/` (`../Dockerfile`), kept for readers on GitHub.

On GitHub such a link opens the file; the site has no copy of it, so on the site it becomes the file's path as
code. A link to a file that does not exist in the repository is left as it is, and `mkdocs build --strict`
fails on it as on any broken link.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"\[(?P<text>[^\]\n]+)\]\((?P<target>\.\./[^)\s#]+)(?:#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Page, **_: Any) -> str:
    if page.file.abs_src_path is None:  # a page the build makes (reference.py): no links out of docs/
        return markdown
    here = Path(page.file.abs_src_path).parent

    def plain(match: re.Match[str]) -> str:
        target = (here / match["target"]).resolve()
        if not target.is_relative_to(ROOT) or target.is_relative_to(DOCS) or not target.exists():
            return match[0]
        text, path = match["text"], target.relative_to(ROOT).as_posix()
        return text if path in text.strip("`") else f"{text} (`{path}`)"

    return LINK.sub(plain, markdown)
