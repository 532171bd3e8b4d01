"""MoE transformer blocks with expert parallelism, declared as parts for the F&B overlap engine;
physical expert slots (replicas), measured loads and live re-placement for EPLB in the loop."""

from twinpipe.moe.bias import BiasBalancer, bias_step, update_bias_
from twinpipe.moe.block import FeedForward, MoEBlock
from twinpipe.moe.grads import expert_parameters, reduce_dense_grads, reduce_replica_grads
from twinpipe.moe.loads import ExpertLoads, moe_blocks
from twinpipe.moe.mesh import pp_ep_groups
from twinpipe.moe.move import MovePlan, MoveReport, apply_placement_, plan_moves
from twinpipe.moe.placement import check_placement, replica_table, slots_of_copies
from twinpipe.moe.router import TopKRouter
from twinpipe.moe.stage import MoEStage, expert_counts

__all__ = ["MoEBlock", "MoEStage", "TopKRouter", "FeedForward", "expert_counts", "reduce_dense_grads", "pp_ep_groups",
           "expert_parameters", "reduce_replica_grads", "ExpertLoads", "moe_blocks", "apply_placement_", "plan_moves", "MovePlan", "MoveReport",
           "check_placement", "replica_table", "slots_of_copies", "BiasBalancer", "bias_step", "update_bias_"]
