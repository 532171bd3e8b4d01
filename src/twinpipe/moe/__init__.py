"""MoE transformer blocks with expert parallelism, declared as parts for the F&B overlap engine."""

from twinpipe.moe.block import FeedForward, MoEBlock
from twinpipe.moe.grads import reduce_dense_grads
from twinpipe.moe.mesh import pp_ep_groups
from twinpipe.moe.router import TopKRouter
from twinpipe.moe.stage import MoEStage, expert_counts

__all__ = ["MoEBlock", "MoEStage", "TopKRouter", "FeedForward", "expert_counts", "reduce_dense_grads", "pp_ep_groups"]
