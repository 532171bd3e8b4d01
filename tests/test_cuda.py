"""The CUDA path (NCCL, CUDA-event traces): skipped without a GPU, run on the device machine."""

from __future__ import annotations

import os

import pytest
import torch

import models
from distributed import run_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _dualpipev_on_gpu(rank: int, world: int, chunks: int):
    import copy

    import twinpipe

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda", torch.cuda.current_device())
    model = [m.to(device) for m in models.make_model(models.MLPStage, 2 * world, seed=3)]
    mine = [copy.deepcopy(model[rank]), copy.deepcopy(model[2 * world - 1 - rank])]
    torch.manual_seed(0)
    x = torch.randn(2 * chunks, 3, models.HIDDEN, dtype=torch.float64, device=device)
    label = torch.randn_like(x)
    xs, ls = torch.tensor_split(x, chunks), torch.tensor_split(label, chunks)
    ref = []
    for j in range(chunks):
        out = xs[j]
        for stage in model:
            out = stage(out)
        loss = models.mse(out, ls[j])
        loss.backward()
        ref.append(loss.detach())
    pipe = twinpipe.DualPipeV(mine)
    if rank == 0:
        loss, _ = pipe.step(x, num_chunks=chunks, criterion=models.mse, labels=(label,), trace=True)
    else:
        loss, _ = pipe.step(num_chunks=chunks, trace=True)
    problems = []
    if rank == 0 and not torch.equal(loss, torch.stack(ref)):
        problems.append("loss differs from the reference")
    for mod, stage in zip(pipe.module, (rank, 2 * world - 1 - rank)):
        for p, q in zip(mod.parameters(), model[stage].parameters()):
            if models.grad_error(p.grad, q.grad) > 1e-13:
                problems.append(f"stage {stage}: gradient differs")
    trace = pipe.last_trace
    if not trace or any(end < start for _, _, start, end in trace):
        problems.append("CUDA-event trace missing or negative")
    return problems


@pytest.mark.parametrize("chunks", [1, 4, 7])
def test_dualpipev_nccl_exact(chunks):
    world = min(2, torch.cuda.device_count())
    results = run_world(world, _dualpipev_on_gpu, chunks, backend="nccl")
    assert all(not r for r in results), results
