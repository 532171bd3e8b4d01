"""twinpipe: DualPipe, DualPipeV and the pipeline schedules they are measured against.

Exact (bitwise losses against a single process), simulated (bubbles and memory from op timings)
and drawn. See README.md.
"""

from twinpipe.schedule.ops import Op, OpKind, Schedule
from twinpipe.schedule.registry import build as build_schedule
from twinpipe.schedule.registry import names as schedule_names
from twinpipe.schedule.registry import stages_of_rank

__version__ = "0.1.0"

_RUNTIME = {
    "Pipeline", "DualPipe", "DualPipeV", "WeightGradStore", "GradStore", "DeferredLinear", "defer_weight_grads",
    "set_p2p_tensor_shapes", "set_p2p_tensor_dtype", "run_backward", "batch_layout", "BatchLayout",
    "PipelineCommError", "PipelineTimeoutError", "PipelineMismatchError", "PipelineAbortedError", "PipelineBrokenError",
    "PipelineOutOfStepError",
    "PipelinePeerFailedError",
}

_MOE = {
    "MoEBlock", "MoEStage", "expert_counts", "reduce_dense_grads", "reduce_replica_grads", "pp_ep_groups",
    "ExpertLoads", "apply_placement_",
}
_OVERLAP = {"PartedStage", "PartedSequential", "Compute", "Comm"}

__all__ = [
    "Op", "OpKind", "Schedule", "build_schedule", "schedule_names", "stages_of_rank", "simulate",
    *sorted(_RUNTIME), *sorted(_MOE), *sorted(_OVERLAP), "split",
]


def __getattr__(name):
    # The runtime needs torch; the schedule layer and simulator do not, so import it on first use.
    if name in _RUNTIME:
        from twinpipe import runtime

        return getattr(runtime, name)
    if name in _MOE:
        from twinpipe import moe

        return getattr(moe, name)
    if name in _OVERLAP:
        from twinpipe import overlap

        return getattr(overlap, name)
    if name == "split":
        from twinpipe.train import split

        return split
    if name == "simulate":
        from twinpipe.sim import simulate

        return simulate
    raise AttributeError(f"module 'twinpipe' has no attribute {name!r}")
