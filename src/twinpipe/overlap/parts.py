"""How a layer declares its parts: an ordered list of ``Compute`` and ``Comm`` parts.

Parts pass a *state* along: a tuple of values (tensors and anything else, such as routing
metadata). The stage's inputs are the first part's state; the last part's state is the stage's
output and holds tensors only. Entry ``i`` of one part's output is entry ``i`` of the next
part's input, so gradients line up by position.

- ``Compute(name, fn)``: ``fn(*state) -> tuple``, ordinary autograd code on this rank.
- ``Comm(name, start, start_backward)``: communication, issued asynchronously.
  ``start(*state)`` returns a ``Pending`` whose ``wait()`` gives ``(state_out, ctx)``; tensors in
  ``state_out`` that need gradients must have ``requires_grad`` set. ``start_backward(ctx,
  grads_out)`` (one gradient or None per output entry) returns a ``Pending`` whose ``wait()``
  gives the gradients of the input entries (one per input entry, None where there is none).
  ``start_backward=None``: the backward communicates nothing and hands each entry's gradient
  back unchanged (metadata exchanges, such as counts before an all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["Compute", "Comm", "Pending", "Done", "check_parts"]


class Pending:
    """Something started and not yet finished; ``wait()`` returns its result."""

    def wait(self) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


class Done(Pending):
    """A result that is ready at once (communication that needed none, e.g. EP=1)."""

    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


@dataclass(frozen=True)
class Compute:
    name: str
    fn: Callable[..., tuple]
    kind = "compute"
    backward_kind = "compute"


@dataclass(frozen=True)
class Comm:
    name: str
    start: Callable[..., Pending]
    start_backward: Callable[[Any, tuple], Pending] | None = None

    kind = "comm"

    @property
    def backward_kind(self) -> str:
        """A comm part with nothing to send back is, in backward, a (free) compute step."""
        return "comm" if self.start_backward is not None else "compute"


def check_parts(parts: Sequence, owner: str) -> list:
    """Return ``parts`` as a list, or raise ValueError saying what is wrong with the declaration."""
    parts = list(parts) if isinstance(parts, (list, tuple)) else None
    if not parts:
        raise ValueError(f"{owner}.parts() must return a non-empty list of Compute/Comm parts")
    for i, part in enumerate(parts):
        if not isinstance(part, (Compute, Comm)):
            raise ValueError(f"{owner}.parts()[{i}] is a {type(part).__name__}; allowed are Compute and Comm")
        fns = (part.fn,) if isinstance(part, Compute) else (part.start,) + ((part.start_backward,) if part.start_backward else ())
        if not isinstance(part.name, str) or not all(callable(f) for f in fns):
            raise ValueError(f"{owner}.parts()[{i}] ({part.name!r}): needs a str name and callables")
    return parts


def check_state(value, part, what: str) -> tuple:
    """A part's result must be a tuple (its next state / its gradients)."""
    if not isinstance(value, tuple):
        raise ValueError(f"part {part.name!r}: {what} must be a tuple, got {type(value).__name__}")
    return value
