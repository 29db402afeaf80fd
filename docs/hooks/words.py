"""mkdocs hook: each page's prose words and words per sentence, printed as a table when the build ends.

A long sentence is where a newcomer stops reading, so the build shows which pages have them. It never fails
the build: it measures, and the reader of the table decides. Prose is what a reader reads as sentences:
paragraphs, list items, notes. Headings, code blocks, tables and the navigation are left out, and a code span
counts as one word.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html.parser import HTMLParser
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

BLOCKS = {"p", "li", "dd", "dt", "blockquote", "div", "td", "th", "h1", "h2", "h3", "h4", "h5", "h6", "br", "hr"}
"""Elements whose start or end ends a run of prose."""
SKIPPED = {"pre", "table", "h1", "h2", "h3", "h4", "h5", "h6", "script", "style", "nav", "svg"}
"""Elements whose text is not prose."""
ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|etc|vs|cf|approx|no)\.", re.IGNORECASE)
SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s|$)")
"""A sentence ends at a full stop, a question or an exclamation mark before a space; a list item or a paragraph
without one is a sentence too."""
WORD = re.compile(r"[\w`][\w'’`.,/+-]*")


@dataclass
class Count:
    words: int = 0
    sentences: int = 0
    longest: int = 0

    @property
    def per_sentence(self) -> float:
        return self.words / self.sentences if self.sentences else 0.0


class Prose(HTMLParser):
    """Collects a page's runs of prose: the text between block boundaries, outside skipped elements."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.runs: list[str] = []
        self.current: list[str] = []
        self.skipping = 0
        self.in_code = 0

    def flush(self) -> None:
        text = "".join(self.current).strip()
        if text:
            self.runs.append(text)
        self.current = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in BLOCKS:
            self.flush()
        if tag in SKIPPED:
            self.skipping += 1
        elif tag == "code" and not self.skipping:
            self.in_code += 1
            self.current.append(" `code` ")

    def handle_endtag(self, tag: str) -> None:
        if tag in SKIPPED:
            self.skipping = max(0, self.skipping - 1)
        elif tag == "code" and self.in_code:
            self.in_code -= 1
        if tag in BLOCKS:
            self.flush()

    def handle_data(self, data: str) -> None:
        if not self.skipping and not self.in_code:
            self.current.append(data)


def count(html: str) -> Count:
    parser = Prose()
    parser.feed(html)
    parser.close()
    parser.flush()
    total = Count()
    for run in parser.runs:
        text = ABBREVIATIONS.sub(r"\1", run.replace("¶", ""))
        for sentence in SENTENCE_END.split(text):
            words = len(WORD.findall(sentence))
            if words:
                total.words += words
                total.sentences += 1
                total.longest = max(total.longest, words)
    return total


COUNTS: dict[str, Count] = {}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    COUNTS.clear()  # `mkdocs serve` builds again in the same process
    return files


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    COUNTS[page.file.src_uri] = count(html)
    return html


def on_post_build(config: MkDocsConfig, **_: Any) -> None:
    print(report(COUNTS))


def report(counts: dict[str, Count]) -> str:
    """The table, pages by words per sentence, most first."""
    width = max((len(uri) for uri in counts), default=4)
    lines = [
        "Words per sentence (prose only; docs/hooks/words.py):",
        f"{'page':<{width}}  {'words':>6}  {'sentences':>9}  {'words/sentence':>14}  {'longest':>7}",
    ]
    ordered = sorted(counts.items(), key=lambda item: -item[1].per_sentence)
    for uri, c in ordered:
        lines.append(f"{uri:<{width}}  {c.words:>6}  {c.sentences:>9}  {c.per_sentence:>14.1f}  {c.longest:>7}")
    words = sum(c.words for c in counts.values())
    sentences = sum(c.sentences for c in counts.values())
    lines.append(f"{'all pages':<{width}}  {words:>6}  {sentences:>9}  {words / max(sentences, 1):>14.1f}")
    return "\n".join(lines)
