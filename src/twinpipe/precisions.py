"""The training precisions by name, and the model dtype each needs (pure Python).

One home for the names ``TrainConfig(precision=...)``, ``twinpipe train --precision``, the
simulator and the planner take, and for the one rule between a precision and the model's dtype:
``"bf16-mixed"`` computes in bf16 from FP32 master weights made from the model's own, so the model
is float32 (``twinpipe.train.precision`` says what each precision does).
"""

from __future__ import annotations

from types import MappingProxyType

from twinpipe.checks import bad

__all__ = ["PURE", "BF16_MIXED", "PRECISIONS", "MASTER_DTYPE_NAME", "check_model_dtype"]

PURE = "pure"  # everything in the model's dtype
BF16_MIXED = "bf16-mixed"  # bf16 compute, FP32 masters, gradients and optimizer state
PRECISIONS = (PURE, BF16_MIXED)
MASTER_DTYPE_NAME = "float32"  # bf16-mixed's master weights, gradients and optimizer state
_MODEL_DTYPE = MappingProxyType({BF16_MIXED: MASTER_DTYPE_NAME})  # the masters are made from the model's weights


def check_model_dtype(precision: str, dtype, *, dtype_arg: str = "dtype", precision_arg: str = "precision") -> None:
    """A ``ValueError`` naming ``dtype_arg`` when the model dtype ``dtype`` (a name such as
    ``"float64"``, a ``torch.dtype``, or None: not given, the default) does not suit ``precision``."""
    needed = _MODEL_DTYPE.get(precision)
    if needed is None or dtype is None or str(dtype).removeprefix("torch.") == needed:
        return
    raise bad(dtype_arg, dtype, f"must be {needed} with {precision_arg}={precision} (the master weights' dtype; "
                                "the compute copy is bf16)")
