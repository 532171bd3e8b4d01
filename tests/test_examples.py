"""The examples run as the README says, print one loss per micro-batch, and those losses are a
single process's, bit for bit, for the micro-batches they claim; the README shows the file itself."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import torch

from typed import run_typed_once

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _using_it() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(command: str) -> str:
    """Run a README command as typed, in a fresh folder with a copy of examples/: once per test
    session (tests/test_documented_commands.py runs these lines too, and checks their output's lines)."""
    done, _ = run_typed_once(command, ("examples",), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _reference_losses(example, num_stages: int, num_chunks: int) -> torch.Tensor:
    """Every micro-batch through stages 0..num_stages-1 in one process, before any update."""
    x, y = example.batch()
    stages = [example.make_stage(i) for i in range(num_stages)]
    losses = []
    for xs, ys in zip(torch.tensor_split(x, num_chunks), torch.tensor_split(y, num_chunks)):
        for stage in stages:
            xs = stage(xs)
        losses.append(example.loss_fn(xs, ys))
    return torch.stack(losses).detach()


def test_readme_shows_the_dualpipev_example_verbatim():
    blocks = re.findall(r"```python\n(.*?)```", _using_it(), re.S)
    assert (EXAMPLES / "dualpipev.py").read_text() in blocks


def test_dualpipev_example_runs_as_the_readme_says():
    command = "python examples/dualpipev.py"  # starts 4 ranks under torchrun itself
    assert f"`{command}`" in _using_it()
    out = _run(command)
    steps = {int(s): ast.literal_eval(v) for s, v in re.findall(r"step (\d+): losses (\[[^]]*\])", out)}
    assert sorted(steps) == [0, 1, 2], out
    ranks = 4
    reference = _reference_losses(_load("dualpipev"), 2 * ranks, 2 * ranks)
    assert torch.equal(torch.tensor(steps[0]), reference), (steps[0], reference)
    means = [sum(v) / len(v) for v in steps.values()]
    assert means[0] > means[1] > means[2], means  # the optimizer steps train the model


def test_dualpipe_example_losses_belong_to_the_microbatches_it_names():
    command = "torchrun --standalone --nproc-per-node 2 examples/dualpipe.py"
    out = _run(command)
    # Ranks print at once: a line may end up glued to another's, so match records, not lines.
    pattern = r"step (\d+): rank (\d+): micro-batches (\[[^]]*\]): losses (\[[^]]*\])"
    found = {}
    for step, rank, mbs, losses in re.findall(pattern, out):
        for j, loss in zip(ast.literal_eval(mbs), ast.literal_eval(losses), strict=True):
            assert (int(step), j) not in found, f"micro-batch {j} reported twice\n{out}"
            found[int(step), j] = (int(rank), loss)
    ranks, num_chunks = 2, 4
    assert sorted(found) == [(s, j) for s in range(3) for j in range(num_chunks)], out
    # Rank 0 feeds the first half, so it gets the losses of the second half; rank P-1 the other way.
    assert [found[0, j][0] for j in range(num_chunks)] == [ranks - 1, ranks - 1, 0, 0]
    reference = _reference_losses(_load("dualpipe"), ranks, num_chunks)
    assert torch.equal(torch.tensor([found[0, j][1] for j in range(num_chunks)]), reference)


def _records(pattern: str, out: str) -> list[tuple]:
    """Every match of ``pattern`` in ``out`` (ranks print at once: records, not lines)."""
    return re.findall(pattern, out)


def test_moe_ep_overlap_example_gives_the_same_losses_with_the_overlap_off_and_hides_some_all_to_all():
    out = _run("python examples/moe_ep_overlap.py")
    pattern = (r"step (\d): rank (\d): losses (\[[^]]*\]): same with overlap off: (\w+): all-to-all hidden (\d+)% "
               r"of ([\d.]+) ms in flight: tokens per expert (\[[^]]*\])")
    found = {(int(s), int(r)): (ast.literal_eval(losses), same, int(hidden), float(flying), ast.literal_eval(tokens))
             for s, r, losses, same, hidden, flying, tokens in _records(pattern, out)}
    assert sorted(found) == [(s, r) for s in range(2) for r in range(2)], out
    for (step, rank), (losses, same, hidden, flying, tokens) in found.items():
        assert len(losses) == 4 and same == "True", (step, rank, out)
        assert 0 <= hidden <= 100 and flying > 0, (step, rank, out)
        assert sum(tokens) == 2 * 8 * 8 * 2, tokens  # the first block: 2 runs (overlap off, on) x 8 x 8 tokens x top-2
    for rank in range(2):  # the optimizer step trains the model
        assert sum(found[1, rank][0]) < sum(found[0, rank][0]), out


def test_hf_moe_ep_example_losses_are_the_unsplit_models_on_each_ranks_batch():
    from twinpipe import hf

    out = _run("python examples/hf_moe_ep.py")
    found = {(int(s), int(r)): ast.literal_eval(v) for s, r, v in _records(r"step (\d): rank (\d): losses (\[[^]]*\])", out)}
    assert sorted(found) == [(s, r) for s in range(2) for r in range(2)], out
    example = _load("hf_moe_ep")
    model = example.make_model()
    for rank in range(2):
        ids, mask, labels = example.batch(rank)
        count = torch.tensor(hf.count_items(labels))
        with torch.no_grad():
            reference = [model(input_ids=i, attention_mask=m, labels=lab, num_items_in_batch=count).loss.item()
                         for i, m, lab in zip(*(torch.tensor_split(t, example.CHUNKS) for t in (ids, mask, labels)))]
        assert found[0, rank] == reference, (rank, found[0, rank], reference)
        assert sum(found[1, rank]) < sum(found[0, rank]), out


def test_eplb_balancer_example_re_places_experts_to_a_better_balance():
    out = _run("python examples/eplb_balancer.py")
    moves = re.findall(r"layers\.\d: max/mean rank load ([\d.]+) -> ([\d.]+) \((\d+) experts sent", out)
    assert moves, out
    assert all(float(after) < float(before) and int(sent) > 0 for before, after, sent in moves), moves


def test_tracing_example_writes_the_trace_it_names():
    import json

    done, folder = run_typed_once("python examples/tracing.py", ("examples",), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    written = re.search(r"wrote (\S+): (\d+) slices on 2 ranks", done.stdout)
    assert written, done.stdout
    events = json.loads((folder / written[1]).read_text())["traceEvents"]
    assert sum(e.get("ph") == "X" for e in events) >= int(written[2]) > 0


def test_compile_checkpointing_example_losses_are_one_eager_process():
    out = _run("python examples/compile_checkpointing.py")
    steps = {int(s): ast.literal_eval(v) for s, v in re.findall(r"step (\d+): losses (\[[^]]*\])", out)}
    assert sorted(steps) == [0, 1], out
    ranks = 2
    reference = _reference_losses(_load("compile_checkpointing"), 2 * ranks, 2 * ranks)
    assert torch.equal(torch.tensor(steps[0]), reference), (steps[0], reference)
    assert sum(steps[1]) < sum(steps[0]), steps
