"""House rule: every ```python block in README.md and docs/*.md either runs in a test or says it is a fragment.

A newcomer copies these blocks, so they must run as written. A block that runs is preceded by
`<!-- runs: tests/<file>.py::<test> -->` on the line before its fence, naming the test that executes it (the
test extracts it from the page, or runs the docs/examples/ file the block shows whole). A block that does not
run starts with a comment the reader sees, `# fragment: <what you supply>`. Parsing only: no process starts.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = ROOT / "docs" / "examples"
RUNS = re.compile(r"^<!-- runs: (tests/[\w/]+\.py)::(\w+) -->$")
FRAGMENT = re.compile(r"^# fragment: \S")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the fence's line, 1-based
    before: str  # the line right before the fence
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The page's ```python blocks (fenced at the start of a line), with what precedes each."""
    lines = page.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        if lines[i] == "```python":
            end = lines.index("```", i + 1)
            blocks.append(Block(page, i + 1, lines[i - 1] if i else "", "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


def defined_tests(path: Path) -> set[str]:
    functions = ast.FunctionDef | ast.AsyncFunctionDef
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, functions)}


def problem(block: Block) -> str | None:
    """Why the block breaks the rule, or None."""
    if FRAGMENT.match(block.code.split("\n", 1)[0]):
        return None
    runs = RUNS.match(block.before)
    if runs is None:
        return "neither runs (<!-- runs: tests/...py::test -->) nor is marked `# fragment: <what you supply>`"
    test_file, test = ROOT / runs.group(1), runs.group(2)
    if not test_file.is_file() or test not in defined_tests(test_file):
        return f"names {runs.group(1)}::{test}, which does not exist"
    shown = [p.name for p in EXAMPLES.glob("*.py") if p.read_text() == block.code]
    named = [block.page.name, *shown]
    if not any(name in test_file.read_text() for name in named):
        return f"names {runs.group(1)}, which does not mention {' or '.join(named)}"
    return None


def test_every_python_block_runs_in_a_test_or_is_marked_a_fragment() -> None:
    blocks = [b for page in PAGES for b in python_blocks(page)]
    assert len(blocks) > 20  # the parser found the pages' blocks
    broken = [f"{b.where}: {why}" for b in blocks if (why := problem(b)) is not None]
    assert not broken, "\n".join(broken)


def test_the_rule_catches_an_unmarked_block_and_a_test_that_is_gone(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    blocks = [
        "x\n\n```python\nprint(1)\n```",
        "<!-- runs: tests/test_docs_blocks.py::gone -->\n```python\nx\n```",
        "```python\n# fragment: x is yours\nprint(x)\n```",
        "<!-- runs: tests/integration/test_readme.py::test_quick_start_runs_against_a_server -->\n```python\nx\n```",
    ]
    page.write_text("\n".join(blocks) + "\n")
    unmarked, gone, fragment, runs = python_blocks(page)
    assert unmarked.line == 3 and "neither runs" in str(problem(unmarked))
    assert "does not exist" in str(problem(gone))
    assert problem(fragment) is None
    assert "does not mention page.md" in str(problem(runs))  # that test reads README.md, not this page
