"""What the docs show besides commands is what the code gives: docs/runtime.md's op list is the
real DualPipeV schedule's."""

from __future__ import annotations

import re
from pathlib import Path

from twinpipe.schedule import registry

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_runtime_md_shows_rank_0_of_the_real_4x10_dualpipev_schedule():
    text = (DOCS / "runtime.md").read_text()
    assert 'twinpipe.schedule.build("dualpipev", 4, 10)' in text
    block = re.search(r"```\nrank 0: (.*?)```", text, re.S)
    assert block, "docs/runtime.md: no ```rank 0: ...``` block"
    shown = block[1].split()
    real = registry.build("dualpipev", 4, 10).to_strings()[0]
    assert shown == real, f"docs/runtime.md shows\n{' '.join(shown)}\nthe schedule is\n{' '.join(real)}"
    # The ops the text explains are in that list.
    explained = text[block.end():].strip().split("\n\n", 1)[0]
    ops = re.findall(r"`(\(\d+F\d+;\d+BW\d+\))`", explained)
    assert ops and all(op in real for op in ops), ops


def test_train_md_quotes_the_rows_twinpipe_train_prints():
    # The numbers come from `twinpipe train` with its defaults (300 steps, minutes): the page names the
    # command and the machine; the rows it quotes are the summary's, for a run of 300 steps.
    from twinpipe.train.report import summary_rows

    text = (DOCS / "train.md").read_text()
    block = re.search(r"```\n(bits per byte, first step.*?)```", text, re.S)
    assert block, "docs/train.md: no quoted summary"
    quoted = [re.split(r"\s{2,}", line.strip()) for line in block[1].strip().splitlines()]
    times = {k: [0.1] * 300 for k in ("total", "pipeline", "mirror", "dp", "update")}
    printed = [label for label, _ in summary_rows([5.0] * 300, times, 1024, mirrored=False, replicas=1)]
    assert [label for label, _ in quoted] == printed[: len(quoted)]
    assert all(re.fullmatch(r"\d+\.\d{3}", value) for _, value in quoted), quoted
    before = " ".join(text[: block.start()].rstrip().rsplit("\n\n", 1)[-1].split())
    assert "`twinpipe train` with its defaults" in before and "2-core" in before, before
