"""Timeline pictures: every registered schedule draws on 1..8 ranks; PNGs have a coloured row per
rank, SVGs are XML; FB pairs and DualPipe's two directions show; the draw CLI works and fails clearly.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from twinpipe.schedule.ops import F, FB, BW
from twinpipe.schedule.placement import linear
from twinpipe.schedule.registry import build, names
from twinpipe.sim import simulate
from twinpipe.timeline import Slice, Timeline

pytest.importorskip("matplotlib")

from twinpipe.viz import draw_timeline, draw_timelines  # noqa: E402
from twinpipe.viz.cells import timeline_cells  # noqa: E402
from twinpipe.viz.style import KIND_COLOURS  # noqa: E402

DPI = 40  # small pictures keep the 70-odd renders fast


def _first_valid(name: str, p: int):
    """The schedule ``name`` on ``p`` ranks with the first micro-batch count it allows, or None."""
    for m in (2 * p, 2 * p + 2, 4 * p, p, 8):
        try:
            return build(name, p, m)
        except ValueError:
            continue
    return None


CASES = [(name, p) for name in names() for p in range(1, 9)]


def _row_pixels(fig, image, rank: int):
    """The pixels of one rank's row across the axes (a quarter row above the centre: clear of labels)."""
    ax = fig.axes[0]
    height = image.shape[0]
    (x0, y), (x1, _) = ax.transData.transform([(ax.get_xlim()[0], rank - 0.25), (ax.get_xlim()[1], rank - 0.25)])
    row = int(round(height - y))
    return image[row, int(x0) + 1 : int(x1) - 1, :3]


@pytest.mark.parametrize("name,p", CASES, ids=[f"{n}-p{p}" for n, p in CASES])
def test_every_schedule_draws(tmp_path, name, p):
    import matplotlib.image as mpimg

    schedule = _first_valid(name, p)
    if schedule is None:  # the bidirectional schedules need an even number of ranks
        assert name in ("dualpipe", "chimera", "bitpipe") and p % 2 == 1
        with pytest.raises(ValueError, match="even"):
            build(name, p, 2 * p)
        return
    timeline = simulate(schedule)
    path = tmp_path / f"{name}.png"
    fig = draw_timeline(timeline, path, dpi=DPI)
    image = mpimg.imread(path)
    w, h = fig.get_size_inches() * DPI
    assert abs(image.shape[0] - h) <= 1 and abs(image.shape[1] - w) <= 1
    for rank in range(p):
        pixels = _row_pixels(fig, image, rank)
        chroma = pixels.max(axis=-1) - pixels.min(axis=-1)
        assert (chroma > 0.15).any(), f"rank {rank} row has no coloured cell"


@pytest.mark.parametrize("name", names())
def test_svg_is_xml(tmp_path, name):
    schedule = _first_valid(name, 4)
    path = tmp_path / f"{name}.svg"
    draw_timeline(simulate(schedule), path)
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    assert len(list(root.iter())) > 20


def test_fb_pairs_and_two_directions():
    timeline = simulate(build("dualpipe", 4, 8))
    cells = timeline_cells(timeline)
    fb = sum(1 for s in timeline.slices if s.op is not None and s.op.kind.value == "FB")
    assert fb > 0 and len(cells.dividers) == fb  # one shared border line per pair
    assert cells.shades == {0, 1} and cells.has_fb
    assert KIND_COLOURS["F"][1] in cells.faces and KIND_COLOURS["F"][0] in cells.faces
    ops = sum(1 for s in timeline.slices if s.op is not None)
    assert len(cells.outlines) == ops and sum(len(v) for v in cells.faces.values()) == ops + fb


def test_chimera_pairs_shade_down_and_up_chains():
    from twinpipe.viz.style import direction_names

    timeline = simulate(build("chimera", 8, 16, pairs=2))
    assert timeline_cells(timeline).shades == {0, 1}
    assert direction_names(timeline.placement) == ("down chains (even)", "up chains (odd)")
    assert direction_names(build("chimera", 8, 16).placement)[0] == "chain 0 (rank 0 -> p-1)"


def test_linear_schedule_has_one_shade():
    assert timeline_cells(simulate(build("1f1b", 4, 8))).shades == {0}


def _measured_like() -> Timeline:
    """Two ranks, seconds on the clock, wait slices between ops (as gather_timeline makes)."""
    t0 = 1000.0  # perf_counter-like origin: the picture shifts it to 0
    slices = [
        Slice(0, t0, t0 + 0.002, F(0, 0), "0F0"),
        Slice(1, t0, t0 + 0.0025, None, "recv for 1F0"),
        Slice(1, t0 + 0.0025, t0 + 0.004, F(1, 0), "1F0"),
        Slice(1, t0 + 0.004, t0 + 0.009, FB(F(1, 1), BW(1, 0)), "(1F1;1BW0)"),
    ]
    return Timeline("hand-made", 2, 2, slices, placement=linear(2), source="measured", meta={"time_unit": "s"})


def test_measured_timeline_with_waits(tmp_path):
    timeline = _measured_like()
    fig = draw_timeline(timeline, tmp_path / "m.png")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time (ms)"
    assert ax.get_xlim()[1] == pytest.approx(9.0, rel=0.01)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "wait for input" in legend and any("FB" in t for t in legend)
    assert "measured" in ax.get_title(loc="left")


def test_timelines_without_placement_or_slices(tmp_path):
    bare = Timeline("bare", 2, 1, [Slice(0, 0, 1, F(0, 0)), Slice(1, 1, 2, F(1, 0)), Slice(1, 2, 4, BW(1, 0))])
    draw_timeline(bare, tmp_path / "bare.png")
    draw_timeline(Timeline("empty", 2, 0, []), tmp_path / "empty.svg")
    ET.parse(tmp_path / "empty.svg")


def test_stack_shares_time_axis(tmp_path):
    timelines = [simulate(build(n, 4, 8)) for n in ("1f1b", "zb-h1", "dualpipe")]
    fig = draw_timelines(timelines, tmp_path / "stack.svg")
    assert len(fig.axes) == 3
    assert len({ax.get_xlim() for ax in fig.axes}) == 1
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    for t, title in zip(timelines, titles):
        assert title.startswith(t.name) and "bubble" in title and "peak memory" in title and "4 ranks" in title
    ET.parse(tmp_path / "stack.svg")


def test_bad_suffix_names_path(tmp_path):
    with pytest.raises(ValueError, match="path="):
        draw_timeline(simulate(build("1f1b", 2, 4)), tmp_path / "x.gif")


def test_labels_skipped_when_cells_are_tiny():
    timeline = simulate(build("dualpipe", 16, 128))
    fig = draw_timeline(timeline)  # F/B/W cells too narrow for two digits, FB halves wide enough
    assert 0 < len(fig.axes[0].texts) < len(timeline_cells(timeline).labels)
    assert len(draw_timeline(timeline, width=8).axes[0].texts) == 0
    fig = draw_timeline(simulate(build("1f1b", 4, 8)))
    assert len(fig.axes[0].texts) == 2 * 4 * 8  # F and BW of every micro-batch on every rank


# --------------------------------------------------------------------------- CLI


def _cli(*argv):
    from twinpipe.cli import main

    return main(["draw", *argv])


def test_cli_draws_one_and_compare(tmp_path, capsys):
    assert _cli("dualpipev", "--ranks", "4", "--microbatches", "10", "--w", "0.5", "-o", str(tmp_path / "v.png")) == 0
    assert (tmp_path / "v.png").stat().st_size > 1000
    assert _cli("--compare", "1f1b,zb-h1,dualpipe", "--ranks", "4", "--microbatches", "8", "-o", str(tmp_path / "c.svg")) == 0
    ET.parse(tmp_path / "c.svg")
    assert "bubble rate" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,words",
    [
        (("dualpipe", "--ranks", "3", "--microbatches", "8"), "num_ranks=3"),
        (("1f1b", "--ranks", "2", "--microbatches", "4", "--mem-limit", "2"), "--mem-limit"),
        (("nope", "--ranks", "2", "--microbatches", "4"), "schedule='nope'"),
        (("--compare", "1f1b,dualpipe", "--ranks", "3", "--microbatches", "4"), "dualpipe"),
        (("1f1b", "--ranks", "2", "--microbatches", "4", "--f", "-1"), "--f"),
        (("1f1b", "--ranks", "2", "--microbatches", "4", "--dpi", "0"), "--dpi"),
        (("1f1b", "--ranks", "2", "--microbatches", "4", "--dpi", "100000"), "--dpi=100000: must be >= 1 and <= 2400"),
        (("1f1b", "--ranks", "2", "--microbatches", "4", "--dpi", "2400"), "pixels; at most 50,000,000 pixels"),
        (("1f1b", "--ranks", "2", "--microbatches", "4", "--width", "1e6"), "pixels; at most 50,000,000 pixels"),
    ],
)
def test_cli_errors_name_the_argument(tmp_path, capsys, argv, words):
    assert _cli(*argv, "-o", str(tmp_path / "x.png")) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinpipe draw: error:") and words in err


def test_huge_pictures_fail_before_allocating(tmp_path):
    timeline = simulate(build("1f1b", 2, 4))
    with pytest.raises(ValueError, match=r"dpi=100000: must be a finite number > 0 and <= 2400"):
        draw_timeline(timeline, tmp_path / "x.png", dpi=100000)
    with pytest.raises(ValueError, match=r"at dpi=2000 is \d+ x \d+ pixels; at most 50,000,000"):
        draw_timeline(timeline, tmp_path / "x.png", dpi=2000)
    assert not (tmp_path / "x.png").exists()


def test_picture_says_what_was_held_equal(tmp_path, monkeypatch):
    import twinpipe.viz.draw as draw

    seen = {}
    real = draw.draw_timelines

    def spy(timelines, path, **options):
        seen["fig"] = real(timelines, path, **options)
        seen["titles"] = [draw.timeline_title(t) for t in timelines]
        return seen["fig"]

    monkeypatch.setattr(draw, "draw_timelines", spy)
    assert _cli("--compare", "1f1b,dualpipev", "--ranks", "2", "--microbatches", "4", "--dpi", str(DPI), "-o", str(tmp_path / "c.png")) == 0
    texts = [t.get_text() for t in seen["fig"].texts]
    assert any(t.startswith("same model: T_F=1, T_B=1, T_W=1 and M_B per 1F1B stage") for t in texts)
    assert seen["titles"][1].endswith("stage = 1/2 of a 1F1B stage")


def test_cli_bad_output_suffix(tmp_path, capsys):
    assert _cli("1f1b", "--ranks", "2", "--microbatches", "4", "-o", str(tmp_path / "x.txt")) == 2
    assert "--out=" in capsys.readouterr().err


def test_layers_only_look_down():
    code = (
        "import sys, twinpipe, twinpipe.schedule.registry as r, twinpipe.sim, twinpipe.viz, twinpipe.trace\n"
        "r.names()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch')]\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    code = (
        "import sys, twinpipe.schedule.registry as r, twinpipe.sim\n"
        "r.names()\n"
        "assert not [m for m in sys.modules if m.startswith(('twinpipe.viz', 'twinpipe.trace'))]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
