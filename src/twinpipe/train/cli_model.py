"""``twinpipe train --model DIR``: a ``transformers`` causal LM from a local folder, cut into stages by
``twinpipe.hf``, trained by ``Trainer`` (``HFStages`` is its ``stages=``).

``DIR`` holds ``config.json`` (random weights from the config, seeded by ``--seed``) and, when present,
safetensors weights (each rank reads only its stages' tensors). Nothing is downloaded. Everything is
checked before any rank starts, on a model built on the meta device (no memory, no weights read):
an architecture ``twinpipe.hf`` cannot cut gets one line naming what is missing.

``twinpipe.hf`` sits above ``twinpipe.train`` in the layers (it builds on the trainer's checkpoint files
and balance), so this module reaches it by name at run time (``_hf``), as ``twinpipe.cli`` reaches each
sub-command's module: nothing of ``twinpipe.hf`` or ``transformers`` is imported until ``--model`` is given.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import twinpipe.cli_options as cli_options

__all__ = ["add_arguments", "check_model", "ModelInfo", "HFStages", "TokenLoss", "GPT_OPTIONS"]

# The built-in GPT's options: with --model the folder's config.json says all of it.
GPT_OPTIONS = ("--dim", "--heads", "--layers", "--experts", "--top-k", "--vocab")
_HF = "twinpipe.hf"


def _hf(module: str = ""):
    """``twinpipe.hf`` (or one of its modules), imported by name: see the module docstring."""
    return importlib.import_module(_HF + (f".{module}" if module else ""))


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``--model`` options, in a group of their own."""
    group = parser.add_argument_group("a transformers model (default: the built-in byte-level GPT)")
    group.add_argument("--model", default=None, metavar="DIR",
                       help="a local transformers causal LM folder: config.json (random weights) and, if present, "
                            "safetensors weights; nothing is downloaded; --dim, --heads, --layers, --experts, --top-k, "
                            "and --vocab do not apply")
    group.add_argument("--layout", default=None, metavar="STR",
                       help="with --model: the stages, e.g. 'E,t*3|t*4|t*4|t*3,L' (E embedding, t decoder layer, L norm "
                            "+ head + loss; '|' between stages; default: balanced by parameters)")
    cli_options.add(parser, "ep", group=group, default=1,
                    more="with --model (a MoE model): 1, or --dp: each stage's MoE experts spread over its data-parallel ranks")
    return group


class ModelInfo:
    """What the checks learned of ``--model``: its config, vocabulary, parameter names and count,
    whether it has weights, and its tokenizer (None when absent)."""

    def __init__(self, folder: str, config, names: list, count: int, weights: bool, tokenizer):
        self.folder, self.config, self.names, self.count = folder, config, names, count
        self.weights, self.tokenizer = weights, tokenizer
        self.vocab = int(config.vocab_size)


def check_model(args, num_stages: int, defaults: dict, *, need_tokenizer: bool = False) -> ModelInfo | None:
    """Check ``--model``, ``--layout`` and ``--ep`` (ValueError naming the option); None without ``--model``.

    ``num_stages``: the model stages the schedule cuts; ``defaults``: the parser's defaults, to refuse
    the built-in GPT's options set alongside ``--model``."""
    if args.model is None:
        if args.layout is not None:
            raise ValueError(f"--layout={args.layout!r}: only with --model (the built-in GPT is cut by --balance)")
        if args.ep != 1:
            raise ValueError(f"--ep={args.ep}: only with --model (the built-in GPT's experts spread over --dp)")
        return None
    folder = Path(args.model)
    if not folder.is_dir():
        raise ValueError(f"--model={args.model!r}: must be a folder holding a transformers config.json (no such folder)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model={args.model!r}: has no config.json (a transformers model folder has one)")
    given = [flag for flag in GPT_OPTIONS if getattr(args, flag[2:].replace("-", "_")) != defaults[flag[2:].replace("-", "_")]]
    if given:
        raise ValueError(f"{given[0]}={getattr(args, given[0][2:].replace('-', '_'))}: not with --model (the model's "
                         "config.json sets it; --layout cuts it)")
    if args.ep not in (1, args.dp):
        raise ValueError(f"--ep={args.ep}: must be 1 or --dp={args.dp}: the experts of each stage spread over its "
                         "data-parallel ranks (as --experts does for the built-in GPT)")
    import torch

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError(f"--model={args.model!r}: needs the transformers package (pip install 'twinpipe[hf]')") from None
    config = _config(args.model)
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # shapes only: no memory, no initialisation
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--model={args.model!r}: transformers builds no causal LM from its config.json "
                         f"(model_type={getattr(config, 'model_type', None)!r}): {_first_line(error)}") from None
    hf = _hf()
    try:
        parts = hf.model_parts(model)
    except ValueError as error:  # UnsupportedModelError: names what is missing
        why = _first_line(error).split("; pass untested=True")[0]  # the Python API's way out, not the command line's
        raise ValueError(f"--model={args.model!r}: {why}") from None
    if args.ep > 1:
        _check_ep(args, model, parts)
    layers = len(parts.layers)
    if args.layout is not None:
        try:
            hf.parse_layout(args.layout, num_stages, layers)
        except ValueError as error:
            raise ValueError(f"--{_first_line(error)}") from None  # "layout=...: must be ..."
    elif layers + 2 < num_stages:
        raise ValueError(f"--model={args.model!r}: has {layers} decoder layers (with the embedding and the head, "
                         f"{layers + 2} items), and --schedule {args.schedule} on --pp={args.pp} cuts {num_stages} stages")
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and args.seq_len > limit:
        raise ValueError(f"--seq-len={args.seq_len}: must be at most {limit}, --model's max_position_embeddings")
    names = parameter_names(model)
    weights = _hf("weights").has_weights(folder)
    if not weights and any(folder.glob("*.bin")) and not any(folder.glob("*.safetensors")):
        raise ValueError(f"--model={args.model!r}: holds .bin weights (pickled torch files); twinpipe reads safetensors "
                         "only: convert them (save_pretrained writes safetensors)")
    tokenizer = _tokenizer(args.model) if need_tokenizer else None
    return ModelInfo(args.model, config, names, sum(_numel(shape) for _, shape in names), weights, tokenizer)


def _check_ep(args, model, parts) -> None:
    """``--ep`` above 1: the model has MoE blocks ``twinpipe.hf.experts`` shards, each with a multiple of
    ``--ep`` experts, and no router auxiliary loss (its logits cannot cross the layers' parts yet)."""
    experts = _hf("experts")
    blocks = [m for m in model.modules() if experts.is_moe_block(m)]
    if not blocks:
        raise ValueError(f"--ep={args.ep}: --model={args.model!r} has no MoE layers to spread (only 1 with a dense model)")
    for block in blocks:
        count = int(block.experts.gate_up_proj.shape[0])
        if count % args.ep:
            raise ValueError(f"--ep={args.ep}: must divide the {count} experts of --model={args.model!r}'s MoE layers")
    if parts.aux:
        raise ValueError(f"--ep={args.ep}: not with --model={args.model!r}'s router auxiliary loss (output_router_logits): "
                         "expert-parallel layers do not carry it through the pipeline yet; set it to false in config.json")


def load(args, *, need_tokenizer: bool = False) -> ModelInfo:
    """``--model``'s config, parameter names, weights and tokenizer, for a rank (``check_model`` checked them)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _config(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = parameter_names(model)
    info = ModelInfo(args.model, config, names, sum(_numel(s) for _, s in names),
                     _hf("weights").has_weights(args.model), _tokenizer(args.model) if need_tokenizer else None)
    info.aux = _hf().model_parts(model).aux
    return info


def check_resume(args, info: ModelInfo, saved: dict) -> None:
    """The checkpoint's parameters (name -> shape) against ``--model``'s (ValueError naming ``--resume``)."""
    mine = {name: list(shape) for name, shape in info.names}
    saved = {name: list(shape) for name, shape in saved.items()}
    if mine != saved:
        differ = sorted(set(mine) ^ set(saved)) or sorted(n for n in mine if mine[n] != saved[n])
        raise ValueError(f"--resume={args.resume}: holds another model than --model={args.model!r}: "
                         f"{len(set(mine) ^ set(saved))} parameter name(s) differ and "
                         f"{sum(1 for n in set(mine) & set(saved) if mine[n] != saved[n])} shape(s) (first: {differ[0]})")


def _config(folder: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--model={folder!r}: its config.json does not load: {_first_line(error)}") from None


def _tokenizer(folder: str):
    from twinpipe.train.cli_data import load_tokenizer

    return load_tokenizer(folder)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def parameter_names(model) -> list:
    """``(name, shape)`` of every parameter of the unsplit causal LM, in stage order (``twinpipe.hf``'s names)."""
    hf = _hf()
    parts = hf.model_parts(model)
    whole = hf.HFStage(parts, ["E"] + ["t"] * len(parts.layers) + ["L"], 0)
    return [(name, tuple(p.shape)) for name, p in whole.named_model_parameters()]


def build_model(info: ModelInfo):
    """The causal LM of ``info``'s config, randomly initialised (``torch.manual_seed`` first: every rank alike)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(info.config)


class HFStages:
    """``Trainer(stages=...)`` for a ``transformers`` causal LM: ``twinpipe.hf.build`` cuts it (``layout``,
    else ``balance``: ``"params"``, or ``"time"`` measured on ``sample``, a batch of token ids); with
    ``weights`` the folder's tensors of this rank's stages are read into them
    (``twinpipe.hf.weights.load``: only those tensors). ``ep_group``: the trainer's data-parallel
    group (``mesh.dp_group``) to shard the MoE experts over, or None (every expert on every rank)."""

    def __init__(self, folder: str, layout: str | None = None, *, balance: str = "params", sample=None, weights: bool = False,
                 ep_group=None):
        self.folder, self.layout, self.balance, self.sample, self.weights = folder, layout, balance, sample, weights
        self.ep_group = ep_group  # with it, MoE experts sharded over it (twinpipe.hf.experts; the trainer's dp group)
        self.built = None

    def parameter_names(self, model) -> list:
        return parameter_names(model)

    def row_shards(self, modules) -> set:
        """``id()`` of the parameters sharded by rows over ``ep_group`` (the experts' fused tensors, rows
        ``rank * E/ep ..``): checkpoints store each as one tensor of all rows, each row written once."""
        if self.ep_group is None:
            return set()
        return {id(block.experts.get_parameter(n)) for m in modules for block in m.modules()
                if isinstance(block, _hf("experts").EPMoE) for n in _hf("experts").FUSED}

    def tied_copies(self, model) -> tuple:
        """Tied input/output embeddings: ``(("model.embed_tokens.weight", "lm_head.weight"),)``, the
        trainer's tied pair (``Trainer.tied``: gradients summed once, the head left out of the norm),
        else ``()``. The head is the embedding's tensor itself where one rank holds both ends
        (``twinpipe.hf``'s ``tie="shared"``), its own copy otherwise (``"split"``)."""
        return (("model.embed_tokens.weight", "lm_head.weight"),) if _hf().model_parts(model).tied else ()

    def build(self, model, schedule, pp_rank: int) -> list:
        wrap = None
        if self.ep_group is not None:  # each rank keeps its rows of the fused experts; layers declare parts
            _hf("experts").shard_experts_(model, self.ep_group)
            wrap = _hf("moe_layer").wrap_layer
        self.built = _hf().build(model, schedule, schedule.num_ranks, pp_rank, layout=self.layout, balance=self.balance,
                                 sample=self.sample if self.balance == "time" else None, wrap_layer=wrap)
        if self.weights:
            self._load(self.built.modules)
        return self.built.modules

    def _load(self, modules) -> None:
        import torch

        names = sorted({name for m in modules for name, _ in m.named_model_parameters()})
        tensors = _hf("weights").load(self.folder, names)
        with torch.no_grad():
            for m in modules:  # a second copy of a stage on this rank (DualPipe) gets the same tensors
                rows = {id(m.get_parameter(local)): place.rows for local, place in _hf("experts").expert_places(m).items()}
                for name, p in m.named_model_parameters():  # sharded experts: this rank's rows
                    p.copy_(tensors[name][list(rows[id(p)])] if id(p) in rows else tensors[name])

    def batch(self, layout, x, y) -> tuple:
        import torch

        return layout.inputs(x, torch.ones_like(x)), layout.labels(y)

    def sync_grads(self, pipe) -> None:
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
