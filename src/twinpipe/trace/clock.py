"""Clock alignment across ranks: an NTP-style ping-pong against one reference rank.

The reference sends a ping at its time ``t0``; the peer answers with its own clock ``c``; the
answer arrives at ``t1``. The peer read ``c`` somewhere between ``t0`` and ``t1`` on the
reference's clock, so ``offset = c - (t0 + t1) / 2`` is off by at most ``(t1 - t0) / 2``, however
uneven the two directions are. Of several rounds the one with the shortest round trip is kept.
On one machine ``time.perf_counter`` is shared by all processes and the offsets come out ~0.
"""

from __future__ import annotations

import time

from twinpipe import checks

__all__ = ["estimate_offsets"]


def estimate_offsets(group, reference: int, peers: list[int], device=None, rounds: int = 16, clock=time.perf_counter,
                     timeout: float | None = None) -> dict[int, tuple[float, float]] | None:
    """Collective over ``group`` (global ranks ``reference`` and ``peers``): every member calls it.

    Returns, on ``reference``, ``{peer: (offset, error_bound)}`` in seconds, where
    ``peer_clock - offset`` is the reference's clock; None elsewhere. Every message waits at most
    ``timeout`` seconds (PipelineTimeoutError naming the rank and its peer; default: the limit in
    force, see ``twinpipe.runtime.waits``, else ``twinpipe.checks.DEFAULT_TIMEOUT``). ``device``: where the
    one-number messages live (None: the CPU, what a gloo group carries).
    """
    import torch
    import torch.distributed as dist

    from twinpipe.runtime import waits
    from twinpipe.runtime.comm import wait_work

    timeout = waits.timeout_for(timeout)
    checks.check_int(rounds, "rounds", low=1)
    me = dist.get_rank()
    buf = torch.zeros(1, dtype=torch.float64, device=device)

    def swap(send_first: bool, peer: int) -> None:
        what = f"rank {me}: clock ping-pong with rank {peer} (gather_timeline)"
        for move in ((dist.isend, dist.irecv) if send_first else (dist.irecv, dist.isend)):
            wait_work(move(buf, peer, group=group), timeout, what)
            if not send_first and move is dist.irecv:
                buf.fill_(clock())

    if me != reference:
        if me in peers:
            for _ in range(rounds):
                swap(False, reference)
        return None
    result = {}
    for peer in peers:
        best = None
        for _ in range(rounds):
            t0 = clock()
            swap(True, peer)
            remote = float(buf.item())  # .item() also waits for a device copy
            t1 = clock()
            if best is None or t1 - t0 < best[1]:
                best = (remote - (t0 + t1) / 2, t1 - t0)
        result[peer] = (best[0], best[1] / 2)
    return result
