"""``twinpipe.moe.demo``: a tiny PP=1 x EP=2 run, and its argument checks."""

from __future__ import annotations

import pytest

from twinpipe.moe import demo


def test_demo_runs_and_overlap_keeps_losses(capsys):
    assert demo.main(["--pp", "1", "--ep", "2", "--steps", "1", "--chunks", "2", "--tokens", "16", "--hidden", "8",
                      "--experts", "2", "--expert-hidden", "8", "--blocks", "1"]) == 0
    out = capsys.readouterr().out
    assert "losses identical" in out
    assert "all-to-alls in flight" in out


@pytest.mark.parametrize("argv,match", [(["--ep", "3"], "--ep=3 must divide"), (["--tokens", "10"], "--tokens=10"),
                                        (["--pp", "0"], "--pp=0")])
def test_demo_rejects_bad_arguments(argv, match):
    with pytest.raises(SystemExit, match=match):
        demo.main(argv)
