"""Start-up agreement: every rank of a training run states its settings, and a difference raises
``PipelineMismatchError`` on every rank, naming each field and each rank's value, before any
collective whose sizes depend on those settings (gloo answers buffers of different sizes by
aborting the process; other differences let replicas drift apart silently).

Facts travel in the runtime's fixed-size frames (``gather_objects``); a set of facts longer than one
frame is cut into several, and every rank first learns how many rounds the longest needs.
"""

from __future__ import annotations

import base64
import json

from twinpipe.runtime.agreement import Claim, disagreements, short
from twinpipe.runtime.collectives import FRAME_BYTES, gather_objects
from twinpipe.runtime.errors import PipelineMismatchError

__all__ = ["gather_json", "agree", "canonical"]

_CHUNK = (FRAME_BYTES - 64) * 3 // 4  # raw bytes per frame: base64 and the JSON around it fit one frame


def gather_json(group, obj, timeout: float, what: str) -> list:
    """Every rank's JSON-able ``obj``, in group-rank order, whatever its size (bounded by ``timeout``)."""
    data = json.dumps(obj, sort_keys=True).encode()
    chunks = [base64.b64encode(data[i : i + _CHUNK]).decode() for i in range(0, len(data), _CHUNK)] or [""]
    first = gather_objects(group, [len(chunks), chunks[0]], timeout, what)
    rounds = max(n for n, _ in first)
    parts = [[c] for _, c in first]
    for i in range(1, rounds):  # every rank runs the same number of rounds: the largest count
        for part, (_, c) in zip(parts, gather_objects(group, [0, chunks[i] if i < len(chunks) else ""], timeout, what)):
            part.append(c)
    return [json.loads(b"".join(base64.b64decode(c) for c in part)) for part in parts]


def canonical(value):
    """``value`` as ranks that mean the same should state it: numbers as floats (``1`` and ``1.0``
    alike), tensors as their values, lists and tuples as tuples, anything else as it is."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # a tensor
        return canonical(value.tolist())
    if isinstance(value, (list, tuple)):
        return tuple(canonical(v) for v in value)
    return value


def agree(group, facts: dict[str, object], timeout: float, where: str, advice: str, decisive: tuple[str, ...] = ()) -> None:
    """Raise ``PipelineMismatchError`` on every rank of ``group`` unless all state the same ``facts``.

    When a ``decisive`` fact differs (an optimizer's class), only those are reported: the facts that
    depend on it (that class's hyper-parameters) would differ too and say nothing more."""
    mine = {key: short(str(value)) for key, value in facts.items()}
    claims = [Claim(rank, theirs) for rank, theirs in enumerate(gather_json(group, mine, timeout, f"{where}: comparing the ranks' settings"))]
    keys = list(mine) + sorted({k for c in claims for k in c.facts} - set(mine))
    problems = disagreements(claims, [k for k in decisive if k in keys]) or disagreements(claims, keys)
    if problems:
        raise PipelineMismatchError(f"{where}: the ranks are configured differently: " + ", and ".join(problems) + f". {advice}")
