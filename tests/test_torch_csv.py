"""torch.distributed.pipelining CSV interop: our schedules exported in torch's compute-only format
run in torch's own ``_PipelineScheduleRuntime`` (2 ranks, gloo) with the single-process loss, and
torch's CSVs read back as Schedules we validate, simulate and draw.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_world
from twinpipe.cli import main
from twinpipe.schedule import registry
from twinpipe.schedule.torch_csv import from_torch_csv, parse_torch_csv, to_torch_csv, unexpressible
from twinpipe.sim import simulate

WORLD, HIDDEN, ROWS = 2, 6, 3
# Split backward (I/W), full backward, looped and V placements, and OVERLAP_F_B pairs.
TORCH_CASES = [("1f1b", 4), ("zb-h1", 4), ("interleaved-1f1b", 4), ("zbv", 5), ("dualpipev", 6)]


def _stage_module(stage: int) -> torch.nn.Module:
    torch.manual_seed(100 + stage)
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh()).double()


def _data(m: int):
    gen = torch.Generator().manual_seed(7)
    return torch.randn(m * ROWS, HIDDEN, generator=gen, dtype=torch.float64), torch.randn(m * ROWS, HIDDEN, generator=gen, dtype=torch.float64)


def _mse(out, target):
    return torch.nn.functional.mse_loss(out, target)


def _reference(num_stages: int, m: int):
    """Per-micro-batch losses and the gradients (mean over micro-batches) of one process."""
    modules = [_stage_module(s) for s in range(num_stages)]
    x, y = _data(m)
    losses = []
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        out = xs
        for mod in modules:
            out = mod(out)
        loss = _mse(out, ys)
        (loss / m).backward()
        losses.append(loss.detach())
    return torch.stack(losses), [[p.grad for p in mod.parameters()] for mod in modules]


def _run_in_torch(rank: int, world: int, path: str, m: int):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = from_torch_csv(path)
    placement = schedule.placement
    mine = placement.stages_of(rank)
    modules = {s: _stage_module(s) for s in mine}
    example = torch.zeros(ROWS, HIDDEN, dtype=torch.float64, requires_grad=True)
    stages = [PipelineStage(modules[s], s, placement.num_stages, torch.device("cpu"), input_args=(example,), output_args=(example,))
              for s in mine]
    runtime = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=_mse)
    runtime._load_csv(path)
    x, y = _data(m)
    losses: list = []
    first, last = 0 in mine, placement.num_stages - 1 in mine
    runtime.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
    # Plain lists: tensors would cross the process boundary as shared-memory handles.
    return {"losses": torch.stack(losses).tolist() if last else None,
            "grads": {s: [p.grad.tolist() for p in modules[s].parameters()] for s in mine}}


def _world(rank: int, world: int, paths: dict) -> dict:
    out = {}
    for (name, m), path in paths.items():
        try:
            out[name] = _run_in_torch(rank, world, path, m)
        except Exception as exc:  # one broken case fails its own test
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("csv")
    paths = {}
    for name, m in TORCH_CASES:
        path = root / f"{name}.csv"
        assert main(["export", name, "--ranks", str(WORLD), "--microbatches", str(m), "--format", "torch-csv", "--out", str(path)]) == 0
        paths[(name, m)] = str(path)
    return run_world(WORLD, _world, paths)


@pytest.mark.parametrize("name,m", TORCH_CASES)
def test_exported_schedule_runs_in_torch_with_the_single_process_loss(torch_runs, name, m):
    results = [torch_runs[r][name] for r in range(WORLD)]
    assert all(isinstance(r, dict) for r in results), results
    placement = registry.placement_for(name, WORLD)
    ref_losses, ref_grads = _reference(placement.num_stages, m)
    last = placement.rank_of(placement.num_stages - 1)
    assert torch.equal(torch.tensor(results[last]["losses"], dtype=torch.float64), ref_losses)
    for rank, result in enumerate(results):
        for stage, grads in result["grads"].items():
            for got, want in zip(grads, ref_grads[stage]):
                torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- the format, no torch runtime


@pytest.mark.parametrize("name", [n for n in registry.names() if n in ("gpipe", "1f1b", "zb-h2", "interleaved-1f1b", "zbv", "v-min", "dualpipev")])
def test_round_trip_keeps_every_op_and_the_placement(name):
    schedule = registry.build(name, 4, 8)
    back = parse_torch_csv(to_torch_csv(schedule))
    assert back.ops == schedule.ops
    assert back.placement.stage_ranks == schedule.placement.stage_ranks
    assert back.placement.kind == schedule.placement.kind
    assert simulate(back).makespan == simulate(schedule).makespan


@pytest.mark.parametrize("torch_name,kind", [("Interleaved1F1B", "looped"), ("LoopedBFS", "looped"), ("InterleavedZeroBubble", "looped"),
                                            ("ZBVZeroBubble", "v"), ("DualPipeV", "v")])
def test_torchs_own_schedules_read_validate_and_simulate(torch_name, kind):
    import contextlib
    import csv
    import io

    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    with contextlib.redirect_stdout(io.StringIO()):  # the visualizer prints its debug lines
        ops = get_schedule_ops(torch_name, 4, 8, num_stages_per_rank=2)
    text = io.StringIO()
    csv.writer(text).writerows([["" if a is None else str(a) for a in row] for row in ops])
    schedule = parse_torch_csv(text.getvalue(), torch_name)
    assert (schedule.placement.kind, schedule.num_ranks, schedule.num_microbatches) == (kind, 4, 8)
    assert sum(map(len, schedule.ops)) == sum(a is not None for row in ops for a in row)
    assert simulate(schedule).makespan > 0


def test_torch_letters_map_to_ours():
    text = to_torch_csv(registry.build("dualpipev", 2, 4))
    cells = {cell for row in text.splitlines() for cell in row.split(",")}
    assert {"0F0", "3I0", "3W0"} <= cells  # I is our B (input gradient), W our W
    assert any(c.startswith("(") and c.endswith(")OVERLAP_F_B") and "B" in c.split(";")[1] for c in cells)
    assert "0B0" in to_torch_csv(registry.build("1f1b", 2, 2))  # torch's B is our full backward BW


def test_torch_dump_with_bubbles_and_comms_reads_back(tmp_path):
    # Torch pads rows with empty cells and, in compute_comms format, adds communication actions.
    path = tmp_path / "t.csv"
    path.write_text("0F0,,0F1,0UNSHARD,0SEND_F0,0B0,0B1\n1RECV_F0,1F0,1B0,1F1,1B1,1REDUCE_GRAD,\n")
    schedule = from_torch_csv(path)
    assert schedule.name == "t" and schedule.num_microbatches == 2 and schedule.placement.kind == "linear"
    assert schedule.to_strings() == [["0F0", "0F1", "0BW0", "0BW1"], ["1F0", "1BW0", "1F1", "1BW1"]]
    assert simulate(schedule).makespan > 0


def test_drawn_from_torch_csv(tmp_path):
    from twinpipe.viz import draw_timeline

    schedule = parse_torch_csv(to_torch_csv(registry.build("zbv", 2, 4)))
    draw_timeline(simulate(schedule), tmp_path / "zbv.png")
    assert (tmp_path / "zbv.png").stat().st_size > 1000


@pytest.mark.parametrize("text,message", [
    ("", "no rows"),
    ("0F0,0X0\n", "column 2: action '0X0'"),
    ("0F0,0B0\n0F1,0B1\n", "stage 0 appears on rank 0 and rank 1"),
    ("0F0,0B0\n2F0,2B0\n", "no action names stage(s) [1]"),
    ("0F0\n1F0,1B0\n", "0BW0"),  # check_work: a missing backward is named
])
def test_bad_csv_is_refused_with_the_place(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        parse_torch_csv(text)


@pytest.mark.parametrize("name", [n for n in registry.names() if len(registry.placement_for(n, 4).chains) > 1])
def test_several_chains_are_refused_with_why(name, tmp_path, capsys):
    assert "chains" in unexpressible(registry.build(name, 4, 8))
    with pytest.raises(ValueError, match="cannot export to torch CSV"):
        to_torch_csv(registry.build(name, 4, 8))
    assert main(["export", name, "--ranks", "4", "--microbatches", "8", "--out", str(tmp_path / "x.csv")]) == 2
    assert "mirrored weight copies" in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()


def test_export_list_says_which_schedules_cannot_be_written(capsys):
    assert main(["export", "--list"]) == 0
    lines = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert list(lines) == registry.names()
    for name, verdict in lines.items():
        several = len(registry.placement_for(name, 4).chains) > 1
        assert verdict.startswith("no, its micro-batches walk 2 chains") if several else verdict == "yes", (name, verdict)


def test_export_to_stdout_and_schedule_errors(capsys):
    assert main(["export", "1f1b", "--ranks", "2", "--microbatches", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == ["0F0,0F1,0B0,0B1", "1F0,1B0,1F1,1B1"]
    assert main(["export", "nope", "--ranks", "2", "--microbatches", "2"]) == 2
    assert "allowed" in capsys.readouterr().err
    assert main(["export", "1f1b", "--ranks", "0", "--microbatches", "2"]) == 2
    assert "num_ranks=0" in capsys.readouterr().err
    assert main(["export", "1f1b"]) == 2
    assert "missing --pp, --microbatches (or --list)" in capsys.readouterr().err
