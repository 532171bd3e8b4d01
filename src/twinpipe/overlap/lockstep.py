"""Several ranks' parts driven in lock-step in one process: the part engine for expert-parallel
ranks simulated in one process (``twinpipe.moe.local``), beside ``engine.py``'s F&B op.

Every rank's part k runs before any rank's part k + 1, and a comm part is started on every rank
before it is waited for on any, so an in-process all-to-all finds every rank's rows posted. The
parts are the ``Record``s of ``graph.py``, the same steps a pipeline rank runs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from twinpipe.overlap.graph import Record, capture_backward, input_grad_roots
from twinpipe.overlap.parts import Comm, check_parts

__all__ = ["forward", "backward"]


def forward(stages: Sequence, inputs: Sequence) -> list:
    """Rank r's ``stages[r]`` on ``inputs[r]`` (a tensor or a tuple of them), for every rank at once;
    each rank's output (a tensor, or a tuple of them). Stages that declare ``parts()`` run part by
    part in lock-step; any other stage is called as it is."""
    inputs = [x if isinstance(x, tuple) else (x,) for x in inputs]
    if not hasattr(stages[0], "parts"):  # a stage of plain modules: nothing to keep in step
        return [stage(*x) for stage, x in zip(stages, inputs)]
    name = type(stages[0]).__name__
    records = [Record(check_parts(stage.parts(), name), x, name) for stage, x in zip(stages, inputs)]
    if len({len(r.parts) for r in records}) != 1:
        raise ValueError(f"local EP: the ranks' stages declare {[len(r.parts) for r in records]} parts; they must match")
    for k, part in enumerate(records[0].parts):
        _in_step(records, k, isinstance(part, Comm), Record.start, Record.wait, Record.run)
    outs = [record.outputs() for record in records]
    return [o[0] if len(o) == 1 else tuple(o) for o in outs]


def backward(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Backward from each rank's ``roots[r]`` (with ``grads[r]``) through what ``forward`` ran:
    part-declaring stages part by part in lock-step, each part's backward as the rank's own backward
    runs it, then on into whatever computed their inputs."""
    pending = [([root], [grad]) for root, grad in zip(roots, grads)]
    while True:
        # Each rank's backward up to its next parted layer (no gradient passes on to the layers
        # before it: those are reached next time, from the inputs' gradients).
        captured = [[(rec, g) for rec, g in capture_backward(r, gs) if any(x is not None for x in g)] for r, gs in pending]
        if not any(captured):
            return
        if any(len(c) != 1 for c in captured):
            raise ValueError(f"local EP backward: the ranks reached {[len(c) for c in captured]} part-declaring layers; expected one each")
        records = []
        for [(record, out_grads)] in captured:
            record.state = out_grads
            records.append(record)
        for k in reversed(range(len(records[0].parts))):
            comm = records[0].parts[k].backward_kind == "comm"
            _in_step(records, k, comm, Record.start_back, Record.wait_back, Record.run_back)
        pending = [input_grad_roots(record) for record in records]


def _in_step(records: list[Record], k: int, comm: bool, start, wait, run) -> None:
    """Part ``k`` of every record: a comm part started on all before it is waited for on any."""
    if comm:
        for record in records:
            start(record, k)
        for record in records:
            wait(record, k)
    else:
        for record in records:
            run(record, k)
