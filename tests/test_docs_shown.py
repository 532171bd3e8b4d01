"""What the docs show besides commands is what the code gives: docs/runtime.md's op list is the
real DualPipeV schedule's."""

from __future__ import annotations

import re
from pathlib import Path

from twinpipe.schedule import registry

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_runtime_md_shows_rank_0_of_the_real_4x10_dualpipev_schedule():
    text = (DOCS / "runtime.md").read_text()
    assert 'twinpipe.build_schedule("dualpipev", 4, 10)' in text
    block = re.search(r"```\nrank 0: (.*?)```", text, re.S)
    assert block, "docs/runtime.md: no ```rank 0: ...``` block"
    shown = block[1].split()
    real = registry.build("dualpipev", 4, 10).to_strings()[0]
    assert shown == real, f"docs/runtime.md shows\n{' '.join(shown)}\nthe schedule is\n{' '.join(real)}"
    # The ops the text explains are in that list.
    explained = text[block.end():].strip().split("\n\n", 1)[0]
    ops = re.findall(r"`(\(\d+F\d+;\d+BW\d+\))`", explained)
    assert ops and all(op in real for op in ops), ops
