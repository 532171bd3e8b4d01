"""The torch layer: P2P messages, deferred weight gradients, the executor and the pipelines.

For: running a schedule on real tensors (``Pipeline``), the official DualPipe API, and the errors
ranks raise when they fail, disagree or wait too long (all ``PipelineError``)."""

from twinpipe.runtime.batches import BatchLayout, batch_layout
from twinpipe.runtime.comm import set_p2p_tensor_dtype, set_p2p_tensor_shapes
from twinpipe.runtime.errors import (
    PipelineError, PipelineAbortedError, PipelineBrokenError, PipelineCommError, PipelineMismatchError, PipelineOutOfStepError,
    PipelinePeerFailedError,
    PipelineTimeoutError,
)
from twinpipe.runtime.executor import run_backward
from twinpipe.runtime.pipeline import DualPipe, DualPipeV, Pipeline
from twinpipe.runtime.weight_grad import DeferredLinear, GradStore, WeightGradStore, defer_weight_grads

__all__ = [
    "Pipeline", "DualPipe", "DualPipeV", "WeightGradStore", "GradStore", "DeferredLinear", "defer_weight_grads",
    "set_p2p_tensor_shapes", "set_p2p_tensor_dtype", "run_backward", "batch_layout", "BatchLayout",
    "PipelineError", "PipelineCommError", "PipelineTimeoutError", "PipelineMismatchError", "PipelineAbortedError", "PipelineBrokenError",
    "PipelineOutOfStepError",
    "PipelinePeerFailedError",
]
