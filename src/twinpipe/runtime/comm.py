"""Point-to-point messages between pipeline ranks: shapes, headers, posting and waiting.

A message is a tuple of tensors. Its layout (shape and dtype of each tensor) is either declared
(``set_p2p_tensor_shapes``/``set_p2p_tensor_dtype`` or per pipeline) or discovered: the sender
then precedes the payload with a small int64 header that describes it. Senders check every
outgoing message against the layout the receiver expects, so a mismatch raises a clear error on
the sending rank instead of corrupting data on the receiving one.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist

from twinpipe.runtime import waits
from twinpipe.runtime.errors import PipelineCommError, PipelinePeerFailedError, PipelineTimeoutError

__all__ = [
    "Layout",
    "set_p2p_tensor_shapes",
    "set_p2p_tensor_dtype",
    "declared_layout",
    "PipelineTimeoutError",
    "encode_header",
    "decode_header",
    "HEADER_LEN",
    "pack",
    "unpack",
    "receive_buffers",
    "PointToPoint",
]

_SHAPES: list[tuple[int, ...]] | None = None
_DTYPE: torch.dtype | None = None


def set_p2p_tensor_shapes(shapes) -> None:
    """Declare the shapes of every message's tensors, process-wide (official DualPipe API)."""
    global _SHAPES
    _SHAPES = _normalise_shapes(shapes, "shapes")


def set_p2p_tensor_dtype(dtype: torch.dtype) -> None:
    """Declare the dtype of every message's tensors, process-wide (official DualPipe API)."""
    global _DTYPE
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}: must be a torch.dtype such as torch.float32")
    _DTYPE = dtype


def _normalise_shapes(shapes, name: str) -> list[tuple[int, ...]]:
    try:
        result = [tuple(int(d) for d in shape) for shape in shapes]
    except TypeError:
        raise ValueError(f"{name}={shapes!r}: must be a list of shapes, e.g. [(3, 256, 512)]") from None
    if not result or any(d < 0 for shape in result for d in shape):
        raise ValueError(f"{name}={shapes!r}: must be a non-empty list of shapes with non-negative sizes")
    return result


@dataclass(frozen=True)
class Layout:
    """Shapes and dtypes of one message's tensors."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @classmethod
    def of(cls, tensors) -> Layout:
        return cls(tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors))

    def grad_layout(self) -> Layout:
        """Gradient messages carry one tensor per floating-point tensor of the activations."""
        keep = [i for i, d in enumerate(self.dtypes) if d.is_floating_point or d.is_complex]
        return Layout(tuple(self.shapes[i] for i in keep), tuple(self.dtypes[i] for i in keep))

    def __str__(self) -> str:
        return ", ".join(f"{list(s)}:{str(d).replace('torch.', '')}" for s, d in zip(self.shapes, self.dtypes))


def declared_layout(shapes=None, dtype=None) -> Layout | None:
    """The layout from per-pipeline arguments, else from the process-wide setters, else None."""
    shapes = _normalise_shapes(shapes, "tensor_shapes") if shapes is not None else _SHAPES
    dtype = dtype if dtype is not None else _DTYPE
    if shapes is None and dtype is None:
        return None
    if shapes is None or dtype is None:
        missing = "shapes" if shapes is None else "dtype"
        raise ValueError(f"p2p tensor {missing} not set: declare both shapes and dtype, or neither to discover them")
    if isinstance(dtype, torch.dtype):
        dtypes = (dtype,) * len(shapes)
    else:
        dtypes = tuple(dtype)
        if len(dtypes) != len(shapes):
            raise ValueError(f"tensor_dtype={dtype!r}: give one dtype, or one per shape ({len(shapes)})")
    return Layout(tuple(shapes), dtypes)


# Header: [number of messages, then per message: number of tensors, then per tensor: dtype code,
# ndim, *sizes], zero-padded to HEADER_LEN.
HEADER_LEN = 128
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_CODES = MappingProxyType({d: i for i, d in enumerate(_DTYPES)})


def encode_header(layouts: list[Layout]) -> torch.Tensor:
    """Describe the layouts of a packet's messages in one int64 tensor."""
    values = [len(layouts)]
    for layout in layouts:
        values.append(len(layout.shapes))
        for shape, dtype in zip(layout.shapes, layout.dtypes):
            if dtype not in _CODES:
                raise ValueError(f"dtype {dtype} cannot be sent between stages; allowed: {', '.join(map(str, _DTYPES))}")
            values += [_CODES[dtype], len(shape), *shape]
    if len(values) > HEADER_LEN:
        raise ValueError(f"stage outputs [{'; '.join(map(str, layouts))}] have too many tensors or dimensions to describe")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> list[Layout]:
    values = header.tolist()
    layouts, pos = [], 1
    for _ in range(values[0]):
        count, pos = values[pos], pos + 1
        shapes, dtypes = [], []
        for _ in range(count):
            code, ndim = values[pos], values[pos + 1]
            shapes.append(tuple(values[pos + 2 : pos + 2 + ndim]))
            dtypes.append(_DTYPES[code])
            pos += 2 + ndim
        layouts.append(Layout(tuple(shapes), tuple(dtypes)))
    return layouts


def pack(tensors: list[torch.Tensor], flatten: bool = True) -> list[torch.Tensor]:
    """The buffers to send for ``tensors``: one flat buffer when they share a dtype (one P2P call),
    unless ``flatten`` is off (shared-memory pipes: calls are cheap, the copy is not)."""
    if len(tensors) == 1 or not flatten:
        return [t.contiguous() for t in tensors]
    if len({t.dtype for t in tensors}) == 1:
        return [torch.cat([t.reshape(-1) for t in tensors])]
    return [t.contiguous() for t in tensors]


def receive_buffers(shapes, dtypes, device, flatten: bool = True) -> list[torch.Tensor]:
    """Empty buffers matching what ``pack`` sends for tensors of these shapes and dtypes."""
    if flatten and len(shapes) > 1 and len(set(dtypes)) == 1:
        total = sum(math.prod(s) for s in shapes)
        return [torch.empty(total, dtype=dtypes[0], device=device)]
    return [torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, dtypes)]


def unpack(buffers: list[torch.Tensor], shapes) -> list[torch.Tensor]:
    """Inverse of ``pack`` on the receiving side: one tensor per shape."""
    if len(buffers) == len(shapes):
        return buffers
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buffers[0][offset : offset + n].view(shape))
        offset += n
    return out


def wait_work(work, timeout: float, what: str, group=None) -> None:
    """Wait for a P2P request or collective, raising PipelineTimeoutError with ``what`` after
    ``timeout`` s, PipelinePeerFailedError when another rank published a failure that breaks this
    wait (``twinpipe.runtime.waits``), or PipelineCommError if it failed (e.g. the peer died).

    A wait ends only when the work completes, at a published failure, or at ``timeout``: a peer
    that is late, or a rank that the operating system did not run for a while, is not a failure.

    ``group``: the group of a collective (never give it for a send or receive: gloo closes the
    connection of a send or receive whose wait times out, so those cannot wait in slices). A
    collective of a gloo group not finished at once is waited for in slices of ``waits.POLL``
    seconds, with a look at ``group``'s failure notices between them."""
    start = time.monotonic()
    try:
        if group is None or work.is_completed() or not _gloo_only(group):
            done = work.wait(datetime.timedelta(seconds=timeout))
        else:
            done = _wait_in_slices(work, start + timeout, group, what)
    except PipelinePeerFailedError as exc:  # from a polling wait (shared memory, slices): name this wait
        raise waits.peer_failed(what, exc.first) from None
    except RuntimeError as exc:
        first = waits.notice(group)
        if first is not None:  # the likely cause: a peer failed, and closed its connections
            raise waits.peer_failed(what, first) from exc
        raise _failure(exc, what, timeout, time.monotonic() - start, group) from exc
    if done is False:
        raise PipelineTimeoutError(f"{what}: did not complete within {timeout:g} s")


def _failure(exc: RuntimeError, what: str, timeout: float, elapsed: float, group) -> Exception:
    """The error for a wait whose work raised ``exc`` after ``elapsed`` of its ``timeout`` seconds."""
    text = str(exc)
    if "timed out" not in text.lower() and "timeout" not in text.lower():
        return PipelineCommError(f"{what}: failed ({text}); the peer may have died")
    own = _group_timeout(group)
    if own is not None and own < timeout:
        return PipelineTimeoutError(
            f"{what}: timed out after {elapsed:.1f} s at the process group's own timeout, {own:g} s ({_group_timeout_source(own)}), "
            f"shorter than this wait's {timeout:g} s limit ({_limit_source(timeout)}); give the group a timeout at "
            f"least as long ({text})")
    # The group's timeout, when not shorter, runs from the collective's start (before this wait):
    # the work is over this wait's limit. gloo counts whole milliseconds.
    if (own is not None and own + 1e-3 >= timeout) or elapsed + 1e-3 >= timeout:
        return PipelineTimeoutError(f"{what}: did not complete within {timeout:g} s ({text})")
    return PipelineCommError(f"{what}: the transport gave up after {elapsed:.1f} s, before this wait's {timeout:g} s "
                             f"limit ({text}); the peer may have died")


def _group_timeout(group) -> float | None:
    """``group``'s own timeout in seconds (what its backend gives up at), or None when unknown."""
    if group is None:
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except Exception:
            return None
    try:
        return backend.options._timeout.total_seconds()
    except Exception:
        return None


def _group_timeout_source(seconds: float) -> str:
    if seconds == dist.default_pg_timeout.total_seconds():
        return "torch's default: the group was made without timeout="
    return ("the timeout= the group was made with: init_process_group or new_group, or twinpipe.launch.run_local's "
            "group_timeout=")


def _limit_source(seconds: float) -> str:
    scope = waits.current()
    if scope is not None and scope.timeout == seconds:
        return "the limit in force: the pipeline's or trainer's timeout= during its step, or waits.limit"
    return "the timeout= of this call or of the object making it (Pipeline, Trainer, reducer, balancer), else DEFAULT_TIMEOUT"


def _gloo_only(group) -> bool:
    """Whether every collective of ``group`` runs on gloo, whose waits can be retried in slices (an
    NCCL wait does not block the CPU, or, with TORCH_NCCL_BLOCKING_WAIT, aborts the communicator
    when it times out)."""
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:
        return False


def _wait_in_slices(work, deadline: float, group, what: str) -> bool:
    """Wait for a collective until ``deadline``, a slice at a time, checking for failure notices."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return _finished(work)  # a last look: done while this rank was not running is not late
        try:
            if work.wait(datetime.timedelta(seconds=max(min(waits.POLL, left), 1e-3))):
                return True
        except RuntimeError:
            # Either this slice ran out or the work failed. A slice that runs out just before the
            # work completes raises too, and the work then reads as completed: only the completed
            # work's own wait (at once: its result, or its real error) tells the two apart.
            if work.is_completed():
                return work.wait()
        first = waits.notice(group)
        if first is not None:
            raise waits.peer_failed(what, first)


def _finished(work) -> bool:
    """Whether ``work`` has completed (its real error raised if it failed); does not wait."""
    return bool(work.is_completed() and work.wait())


class PointToPoint:
    """Sends and receives by pipeline rank: through a shared-memory pipe where one connects the
    two ranks (same host, CPU), else with the process group's own calls (NCCL, gloo), which skip
    the torch.distributed wrappers' per-call cost."""

    def __init__(self, group, group_rank_of: dict[int, int], pipes=None, tag: int = 0):
        self.group, self.group_rank_of, self.tag = group, group_rank_of, tag
        self.pipes = pipes
        self.piped = pipes.peers() if pipes is not None else set()

    def isend(self, tensor: torch.Tensor, peer: int):
        if peer in self.piped:
            return self.pipes.isend(tensor, peer)
        return self.group.send([tensor], self.group_rank_of[peer], self.tag)

    def flattens(self, peer: int) -> bool:
        """Whether packets to and from ``peer`` travel as one flat buffer (both ends agree)."""
        return peer not in self.piped

    def irecv(self, tensor: torch.Tensor, peer: int):
        if peer in self.piped:
            return self.pipes.irecv(tensor, peer)
        return self.group.recv([tensor], self.group_rank_of[peer], self.tag)
