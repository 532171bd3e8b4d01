"""``twinpipe.moe.demo``: a tiny PP=1 x EP=2 run, and its argument checks."""

from __future__ import annotations

import json

import pytest

from twinpipe.moe import demo


def test_demo_runs_and_overlap_keeps_losses(capsys, tmp_path):
    trace = tmp_path / "fb.json"
    assert demo.main(["--pp", "1", "--ep", "2", "--steps", "1", "--chunks", "2", "--tokens", "16", "--hidden", "8",
                      "--experts", "2", "--expert-hidden", "8", "--blocks", "1", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "losses identical" in out
    assert "all-to-alls in flight" in out
    slices = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert {e["tid"] for e in slices} == {0, 1, 2}  # compute, comm of F, comm of B
    assert {e["name"] for e in slices if e["tid"] == 2} >= {"0.dispatch(B)", "0.combine(B)"}


@pytest.mark.parametrize("argv,match", [(["--ep", "3"], "--ep=3 must divide"), (["--tokens", "10"], "--tokens=10"),
                                        (["--pp", "0"], "--pp=0")])
def test_demo_rejects_bad_arguments(argv, match):
    with pytest.raises(SystemExit, match=match):
        demo.main(argv)
