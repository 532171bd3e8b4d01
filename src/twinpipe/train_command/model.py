"""``twinpipe train --model DIR``: a ``transformers`` causal LM from a local folder, checked and loaded
for ``Trainer`` (``twinpipe.hf.HFSource`` is its ``stages=``).

``DIR`` holds ``config.json`` (random weights from the config, seeded by ``--seed``) and, when present,
safetensors weights (each rank reads only its stages' tensors). Nothing is downloaded. Everything is
checked before any rank starts, on a model built on the meta device (no memory, no weights read):
an architecture ``twinpipe.hf`` cannot cut gets one line naming what is missing. ``twinpipe.hf`` and
``transformers`` are imported inside the functions, so nothing of them loads until ``--model`` is given.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import twinpipe.cli_options as cli_options

__all__ = ["add_arguments", "check_ep", "check_model", "load", "check_resume", "model_record_of", "build_model", "ModelInfo",
           "GPT_OPTIONS"]

# The built-in GPT's options: with --model the folder's config.json says all of it.
GPT_OPTIONS = ("--dim", "--heads", "--layers", "--experts", "--top-k", "--vocab")


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
    # Both model sources take --ep: beside the other mesh options, not in the --model group.
    cli_options.add(parser, "ep", default=None, default_text="--dp for the built-in GPT, 1 with --model",
                    more="a MoE model's experts spread over EP groups of EP consecutive data-parallel ranks of a "
                         "stage, replicated over the --dp/EP groups; any divisor of --dp that divides the expert count")
    return group


def check_ep(args) -> int:
    """The expert-parallel size: ``--ep``, else today's default (the built-in GPT: ``--dp``; ``--model``: 1),
    checked against ``--dp`` and, for the built-in GPT, ``--experts`` (``--model``'s experts: ``check_model``).
    ValueError naming the option, its value and what is allowed."""
    from twinpipe.checks import bad, check_int

    if args.ep is None:
        if args.model is None and args.experts % args.dp:
            raise bad("--experts", args.experts, f"must be a multiple of --dp={args.dp} (each data-parallel rank of a stage "
                      "holds experts/dp of every MoE block; or set --ep to a divisor of both)")
        return 1 if args.model is not None else args.dp
    check_int(args.ep, "--ep", low=1)
    if args.dp % args.ep:
        raise bad("--ep", args.ep, f"must divide --dp={args.dp} (allowed are {_divisors(args.dp)}): each stage's "
                  "data-parallel ranks split into --dp/--ep expert-parallel groups")
    if args.model is None and args.ep > 1 and not args.experts:
        raise bad("--ep", args.ep, "must be 1 for a dense model (--experts 0): it has no experts to spread")
    if args.model is None and args.experts % args.ep:
        raise bad("--ep", args.ep, f"must divide --experts={args.experts} (and --dp={args.dp}; allowed are "
                  f"{_divisors(args.experts, args.dp)}): each EP rank holds experts/ep of every MoE block")
    return args.ep


def _divisors(n: int, also: int | None = None) -> str:
    """The divisors of ``n`` (and of ``also``), comma-separated."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and (also is None or also % d == 0))


class ModelInfo:
    """What the checks learned of ``--model``: its config, vocabulary, parameter names and count,
    whether it has weights, and its tokenizer (None when absent)."""

    def __init__(self, folder: str, config, names: list, count: int, weights: bool, tokenizer):
        self.folder, self.config, self.names, self.count = folder, config, names, count
        self.weights, self.tokenizer = weights, tokenizer
        self.vocab = int(config.vocab_size)


def check_model(args, num_stages: int, defaults: dict, *, need_tokenizer: bool = False, command: str = "train") -> ModelInfo | None:
    """Check ``--model``, ``--layout`` and ``--ep`` against the model (ValueError naming the option); None
    without ``--model``. ``args.ep``: ``check_ep``'s size.

    ``num_stages``: the model stages the schedule cuts; ``defaults``: the parser's defaults, to refuse
    the built-in GPT's options set alongside ``--model``; ``command``: the sub-command its warnings name."""
    if args.model is None:
        if args.layout is not None:
            raise ValueError(f"--layout={args.layout!r}: only with --model (the built-in GPT is cut by --balance)")
        return None
    folder = _check_folder(args, defaults)
    config, model = _meta_model(args)
    parts = _model_parts(args, model, command)
    if args.ep > 1:
        _check_ep(args, model)
    if args.mtp_depth:
        _check_mtp(args, model)
    _check_balancing(args, model)
    _check_layers(args, len(parts.layers), num_stages, config)
    from twinpipe import hf
    from twinpipe.hf.weights import has_weights

    names = hf.parameter_names(model, args.mtp_depth)
    weights = has_weights(folder)
    if not weights and any(folder.glob("*.bin")) and not any(folder.glob("*.safetensors")):
        raise ValueError(f"--model={args.model!r}: holds .bin weights (pickled torch files); twinpipe reads safetensors "
                         "only: convert them (save_pretrained writes safetensors)")
    if weights:
        _check_weights(args, config)
    tokenizer = _tokenizer(args.model) if need_tokenizer else None
    info = ModelInfo(args.model, config, names, sum(_numel(shape) for _, shape in names), weights, tokenizer)
    info.dtype = getattr(args, "dtype", None)  # as load() sets it: build_model reads it
    return info


def _check_folder(args, defaults: dict) -> Path:
    """``--model``: a folder with a config.json, and none of the built-in GPT's options set beside it."""
    folder = Path(args.model)
    if not folder.is_dir():
        raise ValueError(f"--model={args.model!r}: must be a folder holding a transformers config.json (no such folder)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model={args.model!r}: has no config.json (a transformers model folder has one)")
    given = [flag for flag in GPT_OPTIONS if getattr(args, flag[2:].replace("-", "_")) != defaults[flag[2:].replace("-", "_")]]
    if given:
        raise ValueError(f"{given[0]}={getattr(args, given[0][2:].replace('-', '_'))}: not with --model (the model's "
                         "config.json sets it; --layout cuts it)")
    return folder


def _meta_model(args):
    """``--model``'s config and its causal LM on the meta device (shapes only: no memory, no initialisation)."""
    import torch

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError(f"--model={args.model!r}: needs the transformers package (pip install 'twinpipe[hf]')") from None
    config = _config(args.model)
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return config, AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--model={args.model!r}: transformers builds no causal LM from its config.json "
                         f"(model_type={getattr(config, 'model_type', None)!r}): {_first_line(error)}") from None


def _model_parts(args, model, command: str):
    """``twinpipe.hf.model_parts`` of ``model``: an unsupported one refused naming ``--model``, an
    untested one's warning said in one line (by ``twinpipe {command}``)."""
    from twinpipe import hf

    try:
        with warnings.catch_warnings(record=True) as said:  # an untested architecture passing the self-check
            warnings.simplefilter("always", hf.UntestedModelWarning)
            parts = hf.model_parts(model)
    except ValueError as error:  # UnsupportedModelError: names what is missing or differs
        why = _first_line(error).split("; pass untested=True")[0]  # the Python API's way out, not the command line's
        raise ValueError(f"--model={args.model!r}: {why}") from None
    for w in said:  # one line for ours; the others as they came
        if issubclass(w.category, hf.UntestedModelWarning):
            print(f"twinpipe {command}: warning: {w.message}", file=sys.stderr)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return parts


def _check_layers(args, layers: int, num_stages: int, config) -> None:
    """``--layout`` (or the model's ``layers`` decoder layers) against the schedule's ``num_stages``, and
    ``--seq-len`` against the model's positions."""
    from twinpipe import hf

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


def _check_weights(args, config) -> None:
    """The folder's safetensors against its config.json, from the files' headers (``twinpipe.hf.preflight``)."""
    from twinpipe.hf.preflight import check_weights

    try:
        check_weights(args.model, config)
    except ValueError as error:
        raise ValueError(f"--model={args.model!r}: its weights do not fit its config.json: {_first_line(error)}") from None


def _check_ep(args, model) -> None:
    """``--ep`` above 1: the model has MoE blocks ``twinpipe.hf.experts`` shards, each with a multiple of
    ``--ep`` experts."""
    from twinpipe.hf import experts

    blocks = [m for m in model.modules() if experts.is_moe_block(m)]
    if not blocks:
        raise ValueError(f"--ep={args.ep}: --model={args.model!r} has no MoE layers to spread (only 1 with a dense model)")
    for block in blocks:
        why = experts.unsupported(block)  # refused here, before any rank starts, rather than by every rank
        if why:
            raise ValueError(f"--ep={args.ep}: --model={args.model!r}'s MoE layers cannot be spread: {why}")
        count = int(block.experts.gate_up_proj.shape[0])
        if count % args.ep:
            raise ValueError(f"--ep={args.ep}: must divide the {count} experts of --model={args.model!r}'s MoE layers")


def _check_mtp(args, model) -> None:
    """``--mtp-depth`` above 0: a DeepSeek-V3 model with untied embeddings (``twinpipe.hf.mtp``); with
    ``--ep`` the MTP layers' experts spread over the data-parallel ranks as the main layers'."""
    from twinpipe.hf.mtp import mtp_depth_of

    try:
        mtp_depth_of(model, args.mtp_depth)
    except ValueError as error:  # "mtp_depth=1: must be 0 for ..."
        raise ValueError(f"--{_first_line(error).replace('_', '-', 1)} (--model={args.model!r})") from None


def _check_balancing(args, model) -> None:
    """``--bias-update-speed`` and ``--balance-alpha`` act on DeepSeek-V3's gates (their
    ``e_score_correction_bias``): refused for a model without one."""
    from twinpipe.moe.bias import HF_BIAS, hf_gates

    if hf_gates(model):
        return
    for flag, value in (("--bias-update-speed", args.bias_update_speed), ("--balance-alpha", args.balance_alpha)):
        if value:
            raise ValueError(f"{flag}={value}: must be 0 with --model={args.model!r} "
                             f"(model_type={getattr(model.config, 'model_type', None)!r}): it acts on DeepSeek-V3's "
                             f"routers (their {HF_BIAS}), and this model has none")


def load(args, *, need_tokenizer: bool = False) -> ModelInfo:
    """``--model``'s config, parameter names, weights and tokenizer, for a rank (``check_model`` checked them)."""
    import torch
    from transformers import AutoModelForCausalLM

    from twinpipe import hf
    from twinpipe.hf.weights import has_weights

    config = _config(args.model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    warnings.filterwarnings("ignore", category=hf.UntestedModelWarning)  # check_model said it before any rank started
    names = hf.parameter_names(model, args.mtp_depth)
    info = ModelInfo(args.model, config, names, sum(_numel(s) for _, s in names),
                     has_weights(args.model), _tokenizer(args.model) if need_tokenizer else None)
    info.aux = hf.model_parts(model).aux
    info.dtype = getattr(args, "dtype", None)
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


def model_record_of(info: ModelInfo) -> dict:
    """The model record (``train.config.model_record``) the ranks' model of ``info`` has: built as they
    build it (``build_model``), on the meta device."""
    import torch

    from twinpipe.train.config import model_record

    with torch.device("meta"):
        return model_record(build_model(info))


def _config(folder: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--model={folder!r}: its config.json does not load: {_first_line(error)}") from None


def _tokenizer(folder: str):
    from twinpipe.train_command.data import load_tokenizer

    return load_tokenizer(folder)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def build_model(info: ModelInfo):
    """The causal LM of ``info``'s config, randomly initialised (``torch.manual_seed`` first: every rank alike).
    In float64 a MoE model's experts run ``transformers``' eager loop: its grouped matmul takes
    float32, bfloat16 and float16 only (and the model is converted to the run's dtype after this)."""
    from transformers import AutoModelForCausalLM

    options = {"experts_implementation": "eager"} if getattr(info, "dtype", None) == "float64" else {}
    return AutoModelForCausalLM.from_config(info.config, **options)
