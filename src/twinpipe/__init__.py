"""twinpipe: DualPipe, DualPipeV and the pipeline schedules they are measured against.

Exact (bitwise losses against a single process), simulated (bubbles and memory from op timings)
and drawn. See README.md.

The top level holds what a user starts from; the rest lives in its subpackage, each with a short
``__all__``: ``twinpipe.schedule`` (schedules as data), ``twinpipe.sim`` (simulation),
``twinpipe.runtime`` (pipelines, messages, every error), ``twinpipe.overlap`` and ``twinpipe.moe``
(F&B overlap, MoE with expert parallelism), ``twinpipe.eplb``, ``twinpipe.train``,
``twinpipe.plan``, ``twinpipe.trace`` and ``twinpipe.viz``. Names that used to be here still work
and say where they live now (a ``DeprecationWarning``); the error classes stay reachable here.
"""

import importlib
import warnings
from types import MappingProxyType

from twinpipe.schedule.registry import names as schedule_names
from twinpipe.schedule.registry import stages_of_rank

__version__ = "0.1.0"

# name -> the module it lives in. The runtime needs torch; the schedule layer and the simulator do
# not, so these load on first use.
_HERE = MappingProxyType({
    "Pipeline": "twinpipe.runtime", "DualPipe": "twinpipe.runtime", "DualPipeV": "twinpipe.runtime",
    "WeightGradStore": "twinpipe.runtime", "defer_weight_grads": "twinpipe.runtime",
    "set_p2p_tensor_shapes": "twinpipe.runtime", "set_p2p_tensor_dtype": "twinpipe.runtime",
    "batch_layout": "twinpipe.runtime", "PipelineError": "twinpipe.runtime", "simulate": "twinpipe.sim",
})
_ERRORS = frozenset({
    "PipelineCommError", "PipelineTimeoutError", "PipelinePeerFailedError", "PipelineMismatchError",
    "PipelineAbortedError", "PipelineBrokenError", "PipelineOutOfStepError",
})
# Older top-level names: (where they live now, the name there).
_MOVED = MappingProxyType({
    "Op": ("twinpipe.schedule", "Op"), "OpKind": ("twinpipe.schedule", "OpKind"),
    "Schedule": ("twinpipe.schedule", "Schedule"), "build_schedule": ("twinpipe.schedule", "build"),
    "GradStore": ("twinpipe.runtime", "GradStore"), "DeferredLinear": ("twinpipe.runtime", "DeferredLinear"),
    "run_backward": ("twinpipe.runtime", "run_backward"), "BatchLayout": ("twinpipe.runtime", "BatchLayout"),
    **{name: ("twinpipe.moe", name) for name in (
        "MoEBlock", "MoEStage", "expert_counts", "reduce_dense_grads", "reduce_replica_grads", "pp_ep_groups",
        "ExpertLoads", "apply_placement_")},
    **{name: ("twinpipe.overlap", name) for name in ("PartedStage", "PartedSequential", "Compute", "Comm")},
    "split": ("twinpipe.train", "split"),
})

__all__ = ["Pipeline", "DualPipe", "DualPipeV", "WeightGradStore", "defer_weight_grads", "set_p2p_tensor_shapes",
           "set_p2p_tensor_dtype", "batch_layout", "stages_of_rank", "schedule_names", "simulate", "PipelineError"]


def __getattr__(name):
    if name in _HERE or name in _ERRORS:
        return getattr(importlib.import_module(_HERE.get(name, "twinpipe.runtime")), name)
    if name in _MOVED:
        module, there = _MOVED[name]
        warnings.warn(f"twinpipe.{name} moved: use {module}.{there}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), there)
    raise AttributeError(f"module 'twinpipe' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
