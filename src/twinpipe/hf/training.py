"""``twinpipe.hf`` for ``twinpipe.train.Trainer``: ``HFSource`` (its ``stages=``: a ``transformers`` causal
LM cut by ``build``, weights read per stage, MoE experts sharded over an EP group) and
``TokenLoss`` (its criterion). ``twinpipe train --model DIR`` trains with these two."""

from __future__ import annotations

from twinpipe.hf.experts import FUSED, EPMoE, expert_rows, is_moe_block, shard_experts_
from twinpipe.hf.moe_layer import wrap_layer
from twinpipe.hf.mtp import copy_name, load_places, mtp_names
from twinpipe.hf.stages import HFStage, build
from twinpipe.hf.self_check import model_parts
from twinpipe.hf.weights import Place, load
from twinpipe.checks import bad
from twinpipe.moe.balance_loss import install_balance_loss
from twinpipe.moe.bias import HF_BIAS, CountedRouter, hf_gates

__all__ = ["HFSource", "TokenLoss", "parameter_names"]


def parameter_names(model, mtp_depth: int = 0) -> list:
    """``(name, shape)`` of every parameter of the unsplit causal LM, in stage order (``twinpipe.hf``'s names),
    with ``mtp_depth`` MTP layers (DeepSeek-V3) those of the last stage's MTP layers and embedding copy last."""
    parts = model_parts(model)
    whole = HFStage(parts, ["E"] + ["t"] * len(parts.layers) + ["L"], 0)
    return [(name, tuple(p.shape)) for name, p in whole.named_model_parameters()] + mtp_names(model.config, mtp_depth)


def _gates(module) -> list:
    """``(bias name in the unsplit model, gate)`` of every DeepSeek-V3 gate of a built stage module
    (the biases among its ``named_model_buffers``), in order."""
    gates = {id(getattr(m, HF_BIAS)): m for _, m in hf_gates(module)}
    return [(name, gates[id(t)]) for name, t in module.named_model_buffers() if id(t) in gates]


class HFSource:
    """``Trainer(stages=...)`` for a ``transformers`` causal LM (a ``twinpipe.train.StageSource``):
    ``twinpipe.hf.build`` cuts it (``layout``,
    else ``balance``: ``"params"``, or ``"time"`` measured on ``sample``, a batch of token ids); with
    ``weights`` the folder's tensors of this rank's stages are read into them
    (``twinpipe.hf.weights.load``: only those tensors). ``ep_group``: the mesh's EP group to shard the
    MoE experts over (``mesh.expert_groups(ep).ep_group`` for the trainer's ``TrainConfig.ep``; the
    trainer sums their gradients over the expert-data-parallel group), or None (every expert on every rank);
    ``redundant_experts``: extra slots per MoE block for replicas (``twinpipe.train.experts.initial_placement``;
    the trainer's ``eplb_every`` re-places them)."""

    def __init__(self, folder: str, layout: str | None = None, *, balance: str = "params", sample=None, weights: bool = False,
                 ep_group=None, mtp_depth: int = 0, redundant_experts: int = 0):
        self.folder, self.layout, self.balance, self.sample, self.weights = folder, layout, balance, sample, weights
        self.mtp_depth = mtp_depth  # DeepSeek-V3's MTP layers on the last stage (twinpipe.hf.mtp); the trainer reads it
        self.ep_group = ep_group  # with it, MoE experts sharded over it (twinpipe.hf.experts; the trainer's EP group)
        self.redundant_experts = redundant_experts
        self.built = None

    initial_biases_kept = True  # routing biases a checkpoint lacks keep the --model folder's values

    def parameter_names(self, model) -> list:
        return parameter_names(model, self.mtp_depth)

    def row_group(self):
        return self.ep_group

    def routers(self, module) -> list:
        """This stage module's DeepSeek-V3 gates, each counting its choices (``CountedRouter``)."""
        return [(name, name, CountedRouter(name, gate)) for name, gate in _gates(module)]

    def without_routers(self, model) -> str:
        return f"a model without DeepSeek-V3 gates ({type(model).__name__}: no module with an {HF_BIAS} buffer)"

    def mtp_modules(self, model) -> int:
        return self.mtp_depth

    def add_balance_loss(self, model, modules, alpha: float, routed: bool) -> None:
        """The sequence-wise balance loss on every copy of each gate (``install_balance_loss``)."""
        if not routed:
            raise bad("balance_alpha", alpha, f"must be 0 for {self.without_routers(model)}: "
                      "no sequence-wise balance loss to add")
        for module in modules:
            if _gates(module):
                install_balance_loss(module, alpha)

    def row_shards(self, modules) -> set:
        """``id()`` of the parameters sharded by rows over ``ep_group`` (the experts' fused tensors, rows
        ``ep_rank * E/ep ..``): checkpoints store each as one tensor of all rows, each row written once."""
        if self.ep_group is None:
            return set()
        return {id(block.experts.get_parameter(n)) for m in modules for block in m.modules()
                if isinstance(block, EPMoE) for n in FUSED}

    def tied_copies(self, model) -> tuple:
        """Tied input/output embeddings: ``(("model.embed_tokens.weight", "lm_head.weight"),)``, the
        trainer's tied pair (``Trainer.tied``: gradients summed once, the head left out of the norm),
        else ``()``. The head is the embedding's tensor itself where one rank holds both ends
        (``twinpipe.hf``'s ``tie="shared"``), its own copy otherwise (``"split"``)."""
        pairs = (("model.embed_tokens.weight", "lm_head.weight"),) if model_parts(model).tied else ()
        if self.mtp_depth:  # the MTP layers' embedding copy (the embedding itself where one rank holds both ends)
            pairs += (("model.embed_tokens.weight", copy_name(model.config)),)
        return pairs

    def routing_biases(self, model) -> list:
        """``(name, experts)`` of every DeepSeek-V3 routing bias of the unsplit model
        (``model.layers.N.mlp.gate.e_score_correction_bias``), then its MTP layers', in order: the
        trainer's vector of loads (``TrainConfig.bias_update_speed``) has a slot per expert of each."""
        out = [(f"{name}.{HF_BIAS}", len(getattr(m, HF_BIAS))) for name, m in hf_gates(model)]
        if self.mtp_depth and out:  # the MTP layers are DeepSeek-V3 MoE layers, not in the transformers model
            from twinpipe.hf.mtp import checkpoint_names

            out += [(name, shape[0]) for name, shape in checkpoint_names(model.config, self.mtp_depth)
                    if name.endswith(f".{HF_BIAS}")]
        return out

    def build(self, model, schedule, pp_rank: int) -> list:
        wrap = None
        if self.ep_group is not None:  # each rank keeps its rows of the fused experts; layers declare parts
            shard_experts_(model, self.ep_group, self._placement(model))
            wrap = wrap_layer
        self.built = build(model, schedule, schedule.num_ranks, pp_rank, layout=self.layout, balance=self.balance,
                           sample=self.sample if self.balance == "time" else None, wrap_layer=wrap,
                           mtp_depth=self.mtp_depth)
        if self.weights:
            self._load(self.built.modules)
        return self.built.modules

    def _placement(self, model):
        """Every MoE block's first placement: one slot per expert, then ``redundant_experts`` replicas (None: none)."""
        if not self.redundant_experts:
            return None
        from twinpipe.train.experts import initial_placement

        experts = {int(m.experts.gate_up_proj.shape[0]) for m in model.modules() if is_moe_block(m)}
        if len(experts) != 1:
            raise bad("redundant_experts", self.redundant_experts, f"needs MoE blocks of one expert count (found {sorted(experts)})")
        return initial_placement(experts.pop(), self.redundant_experts)

    def _load(self, modules) -> None:
        """Each parameter and persistent buffer (DeepSeek-V3's routing biases) of ``modules`` from the
        folder: of sharded experts only this rank's rows are read; MTP's embedding copy from the
        embedding; an MTP layer the checkpoint lacks keeps its initial values."""
        import torch

        held = lambda m: [*m.named_model_parameters(), *m.named_model_buffers()]  # noqa: E731
        names = sorted({name for m in modules for name, _ in held(m)})
        places = load_places(self.folder, names, self.mtp_depth)
        for m in modules:  # a second copy of a stage on this rank (DualPipe) gets the same tensors
            rows = expert_rows(m)
            for name, p in held(m):
                if name in places and id(p) in rows:
                    places[name] = Place(places[name].name, rows[id(p)])
        tensors = load(self.folder, places)
        with torch.no_grad():
            for m in modules:
                for name, p in held(m):
                    if name in tensors:
                        p.copy_(tensors[name])

    def batch(self, layout, x, y) -> tuple:
        import torch

        return layout.inputs(x, torch.ones_like(x)), layout.labels(y)

    def sync_mirrored_grads(self, pipe) -> None:
        # The mirrored copies only: the tied embedding's sum is the trainer's (tied_copies), not
        # twinpipe.hf's sync_tied_grads as well (that would add the two gradients twice).
        pipe.sync_mirrored_grads()


class TokenLoss:
    """The criterion: mean next-token cross entropy of one micro-batch (labels already shifted by
    the sampler, every position counted), plus ``coef x`` the router load-balancing loss when the
    model adds one (Mixtral, Qwen3-MoE with ``output_router_logits``), computed as ``transformers``'
    ``load_balancing_loss_func`` from the sums ``twinpipe.hf`` carries through the stages."""

    def __init__(self, aux: tuple | None = None):
        self.aux = aux  # (num_experts, top_k, coef) or None

    def __call__(self, logits, *rest):
        import torch
        import torch.nn.functional as F

        *sums, labels = rest
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        if self.aux and sums:
            num_experts, _, coef = self.aux
            tokens_per_expert, router_prob, rows = sums
            loss = loss + coef * (torch.sum((tokens_per_expert / rows) * (router_prob / rows).unsqueeze(0)) * num_experts)
        return loss
