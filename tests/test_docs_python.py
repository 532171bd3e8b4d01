"""Every ```python block in README.md and docs/*.md runs as it stands, or is marked as an excerpt of a
file that runs, so that no block shows code that does not work.

The line just before a block says which:

- nothing: the block is complete (its imports, names and data are its own); it runs here alone, in
  a fresh namespace and an empty folder.
- ``<!-- excerpt: PATH -->``: a part of PATH (an example, which tests/test_examples.py runs, or a
  test): every non-blank line of the block is a line of PATH, leading spaces and a trailing
  ``# comment`` aside, so the block cannot drift from the code.
- ``<!-- run by: tests/test_X.py -->``: that test runs the block itself, giving it the names it
  says it needs (a model, a process group); the test must name the page.
- ``<!-- not run: WHY -->``: CI cannot run it (WHY: e.g. it needs Ray and GPUs).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```", re.M | re.S)
MARK = re.compile(r"<!--\s*(excerpt|run by|not run):\s*(.*?)\s*-->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    code: str
    kind: str  # "complete", "excerpt", "run by" or "not run"
    what: str  # the file, the test, or why

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for fence in FENCE.finditer(text):
            before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            mark = MARK.fullmatch(before)
            kind, what = (mark[1], mark[2]) if mark else ("complete", "")
            code = textwrap.dedent(fence[2])
            found.append(Block(page, text.count("\n", 0, fence.start()) + 1, code, kind, what))
    return found


def _code_of(line: str) -> str:
    """A line without its leading spaces and trailing ``  # comment`` (a line that is all comment stays)."""
    line = line.strip()
    return line if line.startswith("#") else re.sub(r"\s+#\s.*$", "", line)


BLOCKS = blocks()


def test_the_pages_have_python_blocks_of_each_kind():
    kinds = {b.kind for b in BLOCKS}
    assert {"complete", "excerpt"} <= kinds, kinds
    assert len(BLOCKS) >= 16, [str(b) for b in BLOCKS]


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "excerpt"], ids=str)
def test_an_excerpt_is_lines_of_its_file(block):
    source = ROOT / block.what
    assert source.is_file(), f"{block}: excerpt of {block.what}, which is not a file of the repository"
    lines = {_code_of(line) for line in source.read_text().splitlines()}
    missing = [line for line in block.code.splitlines() if line.strip() and _code_of(line) not in lines]
    assert not missing, f"{block}: these lines are not in {block.what}:\n" + "\n".join(missing)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "run by"], ids=str)
def test_a_block_run_by_a_test_names_a_test_that_reads_its_page(block):
    test = ROOT / block.what
    assert test.is_file() and test.name.startswith("test_"), f"{block}: run by {block.what}, which is not a test file"
    assert block.page.name in test.read_text(), f"{block}: {block.what} does not read {block.page.name}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "not run"], ids=str)
def test_a_block_not_run_says_why(block):
    assert len(block.what.split()) >= 3, f"{block}: `not run:` needs a reason, got {block.what!r}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "complete"], ids=str)
def test_a_complete_block_runs_alone(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what it writes goes to an empty folder
    # Not "__main__": a script's `if __name__ == "__main__":` must not start ranks inside the test run.
    exec(compile(block.code, str(block), "exec"), {"__name__": "docs_block"})
