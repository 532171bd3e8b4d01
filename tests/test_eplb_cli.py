"""`twinpipe eplb`: reading loads files, output, plot and exit codes."""

import argparse
import json

import pytest
import torch

from twinpipe.eplb.cli import add_eplb_parser, run_eplb

README_ROWS = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]
LAYOUT = ["--replicas", "16", "--groups", "4", "--nodes", "2", "--gpus", "8"]


def _run(argv):
    parser = argparse.ArgumentParser(prog="twinpipe")
    add_eplb_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["eplb", *map(str, argv)])
    assert args.func is run_eplb
    return run_eplb(args)


@pytest.fixture
def loads_files(tmp_path):
    csv = tmp_path / "loads.csv"
    csv.write_text("# expert loads\n" + "\n".join(",".join(map(str, r)) for r in README_ROWS) + "\n")
    header = tmp_path / "header.csv"
    header.write_text("e" + ",e".join(map(str, range(12))) + "\n" + csv.read_text())
    js = tmp_path / "loads.json"
    js.write_text(json.dumps({"loads": README_ROWS}))
    pt = tmp_path / "loads.pt"
    torch.save(torch.tensor(README_ROWS, dtype=torch.float32), pt)
    return {"csv": csv, "header": header, "json": js, "pt": pt}


@pytest.mark.parametrize("kind", ["csv", "header", "json", "pt"])
def test_json_output_from_each_file_kind(kind, loads_files, capsys):
    assert _run([loads_files[kind], *LAYOUT, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "hierarchical"
    assert out["phy2log"] == README_PHY2LOG
    assert out["logcnt"][0] == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]
    assert out["log2phy"][0][1] == [15, 13]
    assert out["balance"]["gpu"]["after"]["per_layer"] == pytest.approx([1.2081, 1.2422], abs=1e-4)
    assert out["balance"]["node"]["after"] is not None


def test_tables(loads_files, capsys):
    assert _run([loads_files["csv"], *LAYOUT, "--refine", "--distinct"]) == 0
    out = capsys.readouterr().out
    for text in ("EPLB placement", "hierarchical", "GPU 7", "before (no EPLB)", "node", "refine, distinct"):
        assert text in out
    assert "1.2081" not in out or "1.2252" in out  # mean over layers is printed


def test_global_policy_and_large_placement_hint(tmp_path, capsys):
    path = tmp_path / "big.json"
    path.write_text(json.dumps(torch.rand(10, 32).mul(100).tolist()))
    assert _run([path, "--replicas", "40", "--groups", "4", "--nodes", "3", "--gpus", "20"]) == 0
    out = capsys.readouterr().out
    assert "global" in out and "--json" in out


def test_plot(loads_files, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "eplb.png"
    assert _run([loads_files["csv"], *LAYOUT, "--plot", png]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().out


def test_plot_into_a_folder_that_does_not_exist_yet(loads_files, tmp_path, capsys):
    # docs/eplb.md's example writes docs/img/eplb_example.png, run from a fresh folder.
    png = tmp_path / "docs" / "img" / "eplb_example.png"
    assert _run([loads_files["csv"], *LAYOUT, "--plot", png]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written to" in capsys.readouterr().out


def test_plot_many_layers(tmp_path):
    pytest.importorskip("matplotlib")
    from twinpipe.eplb import balance_report, rebalance_experts
    from twinpipe.eplb.plot import plot_balance

    weight = torch.rand(6, 16) * 10
    phy2log, _, _ = rebalance_experts(weight, 20, 4, 2, 4)
    path = plot_balance(balance_report(weight, phy2log, 4, 2), tmp_path / "many.png")
    assert path.stat().st_size > 0


def test_previous_placement(loads_files, tmp_path, capsys):
    previous = tmp_path / "previous.json"
    # Nodes swapped and GPUs rotated inside each node: the same placement, relabelled.
    shifted = [row[10:16] + row[8:10] + row[2:8] + row[0:2] for row in README_PHY2LOG]
    previous.write_text(json.dumps({"phy2log": shifted}))
    assert _run([loads_files["csv"], *LAYOUT, "--previous", previous, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["phy2log"] == shifted
    assert out["migration"]["replicas_to_move"] == 0 and out["migration"]["without_previous"] > 0


@pytest.mark.parametrize(
    "argv,flag,fragment",
    [
        (["{csv}", "--replicas", "15", *LAYOUT[2:]], "--replicas", "num_replicas=15"),
        (["{csv}", "--replicas", "8", *LAYOUT[2:]], "--replicas", "num_replicas=8"),
        (["{csv}", *LAYOUT[:2], "--groups", "8", *LAYOUT[4:]], "--groups", "num_groups=8"),
        (["{csv}", "--replicas", "18", *LAYOUT[2:6], "--gpus", "3"], "--gpus", "num_gpus=3"),
        (["{csv}", *LAYOUT[:-1], "2", "--distinct"], "--distinct", "distinct_per_gpu"),
        (["{missing}", *LAYOUT], "LOADS", "does not exist"),
        (["{bad_suffix}", *LAYOUT], "LOADS", "allowed: .csv, .json, .pt"),
        (["{negative}", *LAYOUT], "LOADS", ">= 0"),
        (["{ragged}", *LAYOUT], "LOADS", "different lengths"),
        (["{one_d}", *LAYOUT], "LOADS", "2-D"),
        (["{csv}", *LAYOUT, "--previous", "{one_d}"], "--previous", "2-D"),
        (["{csv}", *LAYOUT, "--plot", "{under_a_file}"], "--plot", "cannot write"),
    ],
)
def test_errors_name_the_argument_and_exit_2(argv, flag, fragment, loads_files, tmp_path, capsys):
    (tmp_path / "loads.txt").write_text("1,2")
    (tmp_path / "negative.csv").write_text("1,2,3,-4\n")
    (tmp_path / "ragged.csv").write_text("1,2,3\n1,2\n")
    (tmp_path / "one_d.json").write_text("[1, 2, 3]")
    paths = {
        "csv": loads_files["csv"],
        "missing": tmp_path / "missing.csv",
        "bad_suffix": tmp_path / "loads.txt",
        "negative": tmp_path / "negative.csv",
        "ragged": tmp_path / "ragged.csv",
        "one_d": tmp_path / "one_d.json",
        "under_a_file": loads_files["csv"] / "dir" / "plot.png",
    }
    if flag == "--plot":
        pytest.importorskip("matplotlib")
    argv = [str(a).format(**paths) for a in argv]
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and fragment in err


@pytest.mark.parametrize("argv", [[*LAYOUT[:-1], "0"], [*LAYOUT[:-1], "x"], LAYOUT[:-2]])
def test_argparse_errors_exit_2(argv, loads_files, capsys):
    with pytest.raises(SystemExit) as info:
        _run([loads_files["csv"], *argv])
    assert info.value.code == 2
    assert "--gpus" in capsys.readouterr().err


def test_standalone_main(loads_files, capsys):
    from twinpipe.eplb.cli import main

    assert main([str(loads_files["json"]), *LAYOUT, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["phy2log"] == README_PHY2LOG


# --------------------------------------------------------------------------- CSV reading


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("90,13x2,40\n20,107,104\n", "line 1, column 2: '13x2' is not a number"),  # typo in the first row
        ("e0,e1,e2\n90,13x2,40\n", "line 2, column 2: '13x2'"),  # typo in the row after a header
        ("e0,e1,e2\nload,load,load\n90,132,40\n", "line 2, column 1: 'load'"),  # a header is one line
        ("1,2,3\n\n# note\n4,oops,6\n", "line 4, column 2"),
        ("1,2,99999999999999999999\n", "line 1, column 3: 99999999999999999999 is outside the int64 range"),
        ("90;132;40\n20;107;104\n", "line 1 is separated by ';'"),
        ("90,5;132,5\n", "line 1 is separated by ';'"),  # decimal commas: refused, not misread
        ("90\t132\t40\n", "line 1 is separated by tabs"),
        ("1,2,3\n1,2\n", "line 2 has 2 values, line 1 has 3"),
        ("# only a comment\ne0,e1\n", "no data rows"),
        ("1,2,1e39\n", "float32"),
    ],
)
def test_csv_errors_name_line_and_column(text, fragment, tmp_path, capsys):
    path = tmp_path / "loads.csv"
    path.write_text(text)
    assert _run([path, "--replicas", "4", "--groups", "1", "--nodes", "1", "--gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert "argument LOADS" in err and fragment in err


def test_csv_values_beyond_int64_written_as_floats_stay_floats(tmp_path):
    from twinpipe.eplb.io import read_table

    path = tmp_path / "loads.csv"
    path.write_text("1e30,2.5e29,1\n")
    table = read_table(path)
    assert table.dtype == torch.float64 and table.tolist() == [[1e30, 2.5e29, 1.0]]
    path.write_text("index_0,index_1\n3.0,1\n")  # whole numbers as floats still give int64 (phy2log files)
    assert read_table(path).tolist() == [[3, 1]] and read_table(path).dtype == torch.int64


def test_refine_on_a_huge_problem_is_refused_by_flag(tmp_path, capsys):
    path = tmp_path / "big.pt"
    torch.save(torch.ones(100, 4096), path)
    argv = [path, "--replicas", "4096", "--groups", "8", "--nodes", "3", "--gpus", "64", "--refine"]
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert "argument --refine" in err and "swap search" in err and "allowed: at most" in err
