"""A Hugging Face decoder layer whose MLP is an expert-parallel MoE block, declared as parts.

``MoEDecoderLayer`` is a ``twinpipe.hf.layer.DecoderLayer`` (same children, same parameter names,
same ``layer(hidden, ctx) -> hidden``) whose ``mlp`` is a ``twinpipe.hf.experts.EPMoE``. Its
``parts()`` work on the state ``(hidden, ctx)`` (the ``twinpipe.hf.layer`` convention), so a stage
of such layers (``twinpipe.hf.stages.HFPartedStage``, or ``twinpipe.overlap.PartedSequential``)
overlaps one micro-batch's all-to-alls with another's compute in DualPipe/DualPipeV F&B ops
(``twinpipe.hf.build(..., wrap_layer=wrap_layer)`` builds them; ``part_layers_`` converts a
built stage):

    attn (compute)     h = hidden + self_attn(input_layernorm(hidden)); the router on
                       post_attention_layernorm(h); token copies sorted by slot
    counts (comm)      copies per slot, to every EP rank (nothing in backward)
    dispatch (comm)    the token copies to their slots' ranks
    experts (compute)  the local expert slots; the shared experts on the local tokens
    combine (comm)     the expert outputs back
    mix (compute)      h + (sum_j w_j * y_j + shared)

Called as a module (``forward``) it runs the layer's halves as ``DecoderLayer`` does, the MoE
block's parts in order inside ``mlp``: the same arithmetic.
"""

from __future__ import annotations

from torch import nn

from twinpipe.checks import bad
from twinpipe.hf.experts import EPMoE
from twinpipe.hf.layer import DecoderLayer, drops_router_logits
from twinpipe.hf.moe_parts import moe_parts

__all__ = ["MoEDecoderLayer", "part_layers_", "wrap_layer"]


class MoEDecoderLayer(DecoderLayer):
    """A ``DecoderLayer`` whose ``mlp`` is an ``EPMoE`` (``shard_experts_`` first), with parts. The
    router logits (auxiliary loss) travel in the parts' state from ``attn`` to ``mix``, which
    appends them to ``ctx.router_logits``: the stage folds them as without parts."""

    parts_carry_router_logits = True

    def __init__(self, layer: nn.Module, index: int, mask_kind: str = "full_attention", router: nn.Module | None = None):
        super().__init__(layer, index, mask_kind, router)
        _check(self)

    def parts(self) -> list:
        return moe_parts(self)




def _check(layer: DecoderLayer) -> None:
    if not isinstance(layer.mlp, EPMoE):
        raise bad("layer", f"{layer.kind} {layer.index}", f"must have an EPMoE as mlp, not a {type(layer.mlp).__name__} "
                  "(twinpipe.hf.experts.shard_experts_ replaces the MoE blocks first)")


def wrap_layer(layer: DecoderLayer) -> DecoderLayer:
    """``layer`` as a ``MoEDecoderLayer`` when its ``mlp`` is an ``EPMoE``, else unchanged: pass it
    as ``twinpipe.hf.build(..., wrap_layer=wrap_layer)`` on a model sharded by ``shard_experts_``."""
    if type(layer) is DecoderLayer and isinstance(layer.mlp, EPMoE):
        layer.__class__ = MoEDecoderLayer  # adds parts() only: no state of its own
    return layer


def part_layers_(module: nn.Module) -> nn.Module:
    """``wrap_layer`` on every ``DecoderLayer`` of ``module`` in place, and ``module``, when it is
    a ``twinpipe.hf.stage.HFStage``, made an ``HFPartedStage`` (whose F&B ops overlap part by part):
    the same objects, the same parameters; returns ``module``.

    For stages built without ``wrap_layer``: call it on every stage module of a rank before making
    the pipeline (a ``Pipeline`` overlaps F&B ops when all its modules are of one class that
    declares them; an ``HFPartedStage`` without MoE layers gives what an ``HFStage`` gives). A
    ``MoEDecoderLayer`` passes its router logits (the auxiliary loss) through the parts' state; a
    plain ``DecoderLayer`` with a router would leave them in the ``Context``, past the parts'
    boundaries (their backward would run twice): refused."""
    from twinpipe.hf.stage import HFPartedStage, HFStage

    for layer in module.modules():
        if isinstance(layer, DecoderLayer):
            wrap_layer(layer)
    if type(module) is HFStage:
        plain = [layer.index for layer in module.modules() if isinstance(layer, DecoderLayer) and drops_router_logits(layer)]
        if plain:
            raise bad("module", f"HFStage with layers {plain}", "must have its MoE layers sharded (shard_experts_) "
                      "when the router auxiliary loss is on: those layers' router logits cannot cross the parts")
        module.__class__ = HFPartedStage  # adds parts() and the F&B op only
    return module
