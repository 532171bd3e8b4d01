"""Parts a last stage's criterion adds after the stage's own parts (DeepSeek-V3's MTP layers,
``twinpipe.hf.mtp``), run in the stage's record.

A criterion declares them as ``stage_parts(*labels) -> list`` (they may read the micro-batch's
labels, which the stage never sees): the first takes the stage's outputs, the last returns them
followed by what the criterion reads. In the stage's record they are the stage's last parts: an
F&B op interleaves them with the other micro-batch's parts (their all-to-alls hidden as the
stage's), and one backward runs them and the stage's parts (captured by an F&B op, B/W split
alike). The criterion gets them by ``with_tail(outputs, parts)`` on the stage's outputs:

- in an F&B op the engine has run them already (``tail_parts``): their joined outputs;
- after a plain forward of a stage in parts: its record goes on with them and joins again;
- on other outputs (a stage without parts, no autograd): they run on their own, as a block does.
"""

from __future__ import annotations

from twinpipe.overlap.graph import record_of, run_parts
from twinpipe.overlap.parts import check_parts

__all__ = ["tail_parts", "with_tail"]


def tail_parts(criterion, labels) -> list:
    """The parts ``criterion`` adds to the last stage for ``labels`` (none when it declares none)."""
    declare = getattr(criterion, "stage_parts", None)
    parts = declare(*labels) if declare is not None else None
    return check_parts(parts, "criterion.stage_parts") if parts else []


def with_tail(outputs: tuple, parts: list) -> tuple:
    """The stage's ``outputs`` followed by what ``parts`` compute from them (see the module doc)."""
    record = record_of(outputs)
    if record is not None and record.tail_outputs is not None:
        return record.tail_outputs
    parts = check_parts(parts, "criterion.stage_parts")
    if record is not None:
        return record.extend(parts, tuple(outputs))
    out = run_parts(parts, tuple(outputs), "criterion.stage_parts", capture=False)
    return out if isinstance(out, tuple) else (out,)
