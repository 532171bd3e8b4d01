"""From a model on a cluster at one pipeline size to the simulator's costs and the step's collectives.

GPU layout (Megatron's order, pipeline outermost): the ``dp`` data-parallel replicas of a stage sit
on consecutive GPUs, the expert-parallel groups (``ep`` GPUs) inside them, the next stage on the
next ``dp`` GPUs. So a group of n consecutive GPUs uses NVLink when n <= GPUs per node, else the
inter-node links; pipeline neighbours and DualPipe's mirrored ranks (r, p-1-r) share a node only if
the whole pipeline does.

Per layer and micro-batch of T tokens (matrix products at ``efficiency`` x peak): F = weights' 2 x
params x T FLOPs + attention scores 4 T s h; B (input gradient) = the same with the scores twice;
W (weight gradient) = the weight products again. An MoE layer adds dispatch and combine
all-to-alls (T x top_k x h activations each) to F and to B; F&B (an FB op) hides them behind the
other micro-batch's compute as ``sim.overlap.predict_fb`` orders the parts, whether its backward
half is a full backward (``t_fb``) or a B whose W runs later (``t_fb_b``).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from twinpipe.plan.spec import Cluster, Model
from twinpipe.schedule.costs import CostModel, full_backward_time, pair_time
from twinpipe.sim.overlap import predict_fb

__all__ = ["Layout", "layout", "LayerTimes", "layer_times", "stage_costs", "all_reduce_time", "activation_bytes_per_layer",
           "weight_grad_bytes_per_layer"]


@dataclass(frozen=True)
class Layout:
    """One pipeline size on the cluster: ``pp`` stages x ``dp`` data-parallel replicas, ``ep`` expert-parallel."""

    pp: int
    dp: int
    ep: int


def layout(model: Model | None, cluster: Cluster, pp: int) -> Layout:
    """The layout at ``pp`` (``model`` None: dense); ValueError saying why it does not fit the cluster."""
    if cluster.gpus % pp:
        raise ValueError(f"pipeline size {pp} does not divide the {cluster.gpus} GPUs")
    dp = cluster.gpus // pp
    ep = 1
    if model is not None and model.moe:
        # Default: the widest expert parallelism inside a node that divides both the experts and dp.
        ep = model.ep or max(d for d in range(1, min(dp, cluster.gpus_per_node) + 1) if dp % d == 0 and model.experts % d == 0)
        if dp % ep:
            raise ValueError(f"expert parallelism ep={ep} does not divide the data-parallel size {dp} (= {cluster.gpus} GPUs / pipeline {pp})")
    return Layout(pp, dp, ep)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one layer and one micro-batch: compute of attention and MLP (F, B, W) and one all-to-all."""

    attn_f: float
    attn_b: float
    attn_w: float
    mlp_f: float
    mlp_b: float
    mlp_w: float
    _: KW_ONLY
    a2a: float  # one dispatch or combine; 0 for a dense model

    @property
    def f(self) -> float:
        return self.attn_f + self.mlp_f + 2 * self.a2a

    @property
    def b(self) -> float:
        return self.attn_b + self.mlp_b + 2 * self.a2a

    @property
    def w(self) -> float:
        return self.attn_w + self.mlp_w

    def fb(self) -> float:
        """An F overlapped with a full backward of another micro-batch (``predict_fb``'s part order)."""
        if not self.a2a:  # nothing to hide: the halves back to back
            return pair_time(self.f, full_backward_time(self.b, self.w))
        return self._overlapped(weight=[0.0, self.mlp_w, 0.0, self.attn_w])

    def fb_b(self) -> float:
        """An F overlapped with an input-gradient backward (B) of another: the same part order, without
        the W parts (they run later, in a W op)."""
        if not self.a2a:
            return pair_time(self.f, self.b)
        return self._overlapped(weight=None)

    def _overlapped(self, weight: list | None) -> float:
        forward = [("compute", self.attn_f), ("comm", self.a2a), ("compute", self.mlp_f), ("comm", self.a2a)]
        backward = [("comm", self.a2a), ("compute", self.mlp_b), ("comm", self.a2a), ("compute", self.attn_b)]
        return predict_fb(forward, backward, weight=weight)


def layer_times(model: Model, cluster: Cluster, lay: Layout) -> LayerTimes:
    t, h, s = model.tokens, model.hidden, model.seq
    rate = cluster.peak_flops * cluster.efficiency
    attn_mm = 2 * t * 4 * h * h
    scores = 4 * t * s * h
    per_token_mlp = 2 * h * (model.expert_width * model.top_k if model.moe else model.ffn_width)
    mlp_mm = 2 * t * per_token_mlp
    a2a = 0.0
    if model.moe and lay.ep > 1:
        volume = t * model.top_k * h * model.activation_bytes * (lay.ep - 1) / lay.ep
        a2a = cluster.latency + volume / cluster.bandwidth(lay.ep)
    return LayerTimes((attn_mm + scores) / rate, (attn_mm + 2 * scores) / rate, attn_mm / rate,
                      mlp_mm / rate, mlp_mm / rate, mlp_mm / rate, a2a=a2a)


def activation_bytes_per_layer(model: Model) -> float:
    """Activations one layer keeps for one micro-batch until its backward (Korthikanti et al., no recompute).

    ``34 s b h`` bytes at 16 bits, the MLP's 19 of them scaled by its width (and top-k); the
    attention-score term ``5 a s^2 b`` is left out (fused attention does not keep the scores).
    """
    t, h = model.tokens, model.hidden
    width = model.expert_width * model.top_k if model.moe else model.ffn_width
    return t * h * (15 + 19 * width / (4 * h)) * model.activation_bytes / 2


def weight_grad_bytes_per_layer(model: Model) -> float:
    """What a deferred W keeps of one layer after B (the runtime's M_W, docs/memory.md): each linear's
    input and output gradient. Linears: q/k/v (h -> 3h), output (h -> h), the MLP's two (h -> w -> h,
    w = its width, x top-k for experts)."""
    t, h = model.tokens, model.hidden
    width = model.expert_width * model.top_k if model.moe else model.ffn_width
    inputs = 3 * h + width
    output_grads = 3 * h + h + width + h
    return t * (inputs + output_grads) * model.activation_bytes


def stage_costs(model: Model, cluster: Cluster, lay: Layout) -> tuple[CostModel, LayerTimes, float]:
    """Costs of one 1F1B stage (``layers / pp`` layers; ``sim.costs.for_model`` scales them to any
    placement), its layer times, and M_B in bytes (the ``activation_share`` kept). ``t_fb`` (an F with a BW) and
    ``t_fb_b`` (an F with a B) only for MoE layers (F&B hides all-to-alls);
    ``mw``: M_W / M_B of a layer (``weight_grad_bytes_per_layer``), what B leaves until a deferred W.
    """
    per = layer_times(model, cluster, lay)
    n = model.layers / lay.pp
    message = model.tokens * model.hidden * model.activation_bytes
    t_comm = cluster.latency + message / cluster.bandwidth(cluster.gpus if lay.pp > 1 else 1)
    m_b = activation_bytes_per_layer(model)
    pairs = {"t_fb": n * per.fb(), "t_fb_b": n * per.fb_b()} if per.a2a else {}
    costs = CostModel(t_f=n * per.f, t_b=n * per.b, t_w=n * per.w, t_comm=t_comm, mw=weight_grad_bytes_per_layer(model) / m_b, **pairs)
    return costs, per, n * m_b * model.activation_share


def all_reduce_time(num_bytes: float, group: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``num_bytes`` over ``group`` members: 2 (n-1)/n of the data over each link."""
    if group <= 1 or num_bytes <= 0:
        return 0.0
    return 2 * (group - 1) * latency + 2 * (group - 1) / group * num_bytes / bandwidth
