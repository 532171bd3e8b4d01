"""What the planner is told: a transformer model (dense or MoE) and a cluster. SI units throughout:
FLOP/s, bytes, bytes/s, seconds. Every field is checked: a ValueError names it, its value and
what is allowed.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

from twinpipe import checks

__all__ = ["Model", "Cluster"]


def _check(owner: str, name: str, value, *, integer: bool = False, minimum: float = 0.0, strict: bool = True) -> None:
    """``value`` must be a finite number (an int if ``integer``), > ``minimum`` (>= if not ``strict``)."""
    if integer:
        checks.check_int(value, f"{owner}.{name}", low=int(minimum) + strict)
    else:
        checks.check_float(value, f"{owner}.{name}", low=minimum, low_open=strict)


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer trained with micro-batches of ``microbatch_size`` x ``seq`` tokens.

    ``experts`` = 0 is a dense model; otherwise every layer's MLP is ``experts`` experts of width
    ``expert_ffn`` (default ``ffn``), each token routed to ``top_k`` of them, sharded over ``ep``
    GPUs of the data-parallel group (expert parallelism; default: the largest count within a node
    that divides both the experts and the data-parallel size).
    Bytes per parameter: ``param_bytes`` (weights), ``grad_bytes`` (gradients, also what the
    all-reduces send), ``optimizer_bytes`` (master weights and Adam moments); ``zero1``: those of
    the optimizer sharded over the data-parallel replicas (ZeRO-1). ``activation_share``: the share of
    a micro-batch's activations (``plan.costs.activation_bytes_per_layer``, all of them) that stays on
    the GPU until its backward: less than 1 with recomputation, FP8 storage or offload to host.

    ``Model.from_config(cfg)`` reads the description the trainer builds its model from
    (``twinpipe.train.GPTConfig``); ``twinpipe plan`` takes the same options as ``twinpipe train``.
    """

    layers: int
    hidden: int
    seq: int
    _: KW_ONLY
    microbatch_size: int = 1
    ffn: int = 0  # 0: 4 x hidden
    vocab: int = 32000
    experts: int = 0
    top_k: int = 2
    expert_ffn: int = 0  # 0: ffn
    ep: int = 0  # 0: chosen per pipeline size (plan.costs.layout)
    param_bytes: float = 2
    grad_bytes: float = 4
    optimizer_bytes: float = 12
    activation_bytes: float = 2
    zero1: bool = False
    activation_share: float = 1.0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "seq", "microbatch_size"):
            _check("model", name, getattr(self, name), integer=True, minimum=1, strict=False)
        for name in ("ffn", "vocab", "experts", "expert_ffn", "ep"):
            _check("model", name, getattr(self, name), integer=True, minimum=0, strict=False)
        for name in ("param_bytes", "grad_bytes", "activation_bytes"):
            _check("model", name, getattr(self, name))
        _check("model", "optimizer_bytes", self.optimizer_bytes, strict=False)
        checks.check_bool(self.zero1, "model.zero1")
        checks.check_float(self.activation_share, "model.activation_share", low=0, low_open=True, high=1)
        if self.experts:
            _check("model", "top_k", self.top_k, integer=True, minimum=1, strict=False)
            if self.top_k > self.experts:
                raise checks.bad("model.top_k", self.top_k, f"must be <= experts={self.experts}")
            if self.ep and self.experts % self.ep:
                raise checks.bad("model.ep", self.ep, f"must divide experts={self.experts}")

    @classmethod
    def from_config(cls, config, *, microbatch_size: int = 1, expert_ffn: int = 0, ep: int = 0, **sizes) -> "Model":
        """The model a ``twinpipe.train.GPTConfig`` describes (any object with its fields: ``layers``,
        ``dim``, ``seq_len``, ``vocab``, ``experts``, ``top_k``), as ``GPT`` builds it: MLPs 4 x dim wide,
        experts too unless ``expert_ffn`` says (``twinpipe.train.model.block``). ``microbatch_size``,
        ``ep`` and the bytes per parameter (``sizes``) are how it is trained, not what it is."""
        experts = getattr(config, "experts", 0)
        return cls(layers=config.layers, hidden=config.dim, seq=config.seq_len, microbatch_size=microbatch_size,
                   ffn=4 * config.dim, vocab=config.vocab, experts=experts, top_k=config.top_k if experts else 2,
                   expert_ffn=(expert_ffn or 4 * config.dim) if experts else 0, ep=ep, **sizes)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def expert_width(self) -> int:
        return self.expert_ffn or self.ffn_width

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.microbatch_size * self.seq

    def layer_params(self) -> tuple[float, float]:
        """Parameters of one layer: (replicated over data parallelism, expert parameters of all experts)."""
        h = self.hidden
        attention = 4 * h * h + 4 * h  # q, k, v, o and two layer norms
        if not self.moe:
            return attention + 2 * h * self.ffn_width, 0.0
        return attention + h * self.experts, float(self.experts * 2 * h * self.expert_width)

    def total_params(self) -> float:
        dense, expert = self.layer_params()
        return self.layers * (dense + expert) + 2 * self.vocab * self.hidden


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs, ``gpus_per_node`` to a node, each with ``peak_flops`` of which ``efficiency``
    is reached on the layers' matrix products, ``memory`` bytes, and per-GPU link bandwidths inside
    a node (``intra_bw``) and across nodes (``inter_bw``); every message also pays ``latency``.
    """

    gpus: int
    _: KW_ONLY
    gpus_per_node: int = 8
    peak_flops: float = 989e12  # H100 SXM dense bf16
    efficiency: float = 0.5
    memory: float = 80 * 2**30
    intra_bw: float = 400e9  # NVLink, per direction
    inter_bw: float = 50e9  # 400 Gb/s InfiniBand
    latency: float = 10e-6

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node"):
            _check("cluster", name, getattr(self, name), integer=True, minimum=1, strict=False)
        for name in ("peak_flops", "memory", "intra_bw", "inter_bw"):
            _check("cluster", name, getattr(self, name))
        _check("cluster", "latency", self.latency, strict=False)
        checks.check_float(self.efficiency, "cluster.efficiency", low=0, low_open=True, high=1)

    def bandwidth(self, span_gpus: int) -> float:
        """Link bandwidth of a group whose members lie within ``span_gpus`` consecutive GPUs."""
        return self.intra_bw if span_gpus <= self.gpus_per_node else self.inter_bw
