"""``twinpipe train``: a byte-level GPT trained on Python's standard library (or ``--model DIR`` on
``--data FILE``), on a (dp, pp) mesh.

    twinpipe train                                  # 4 CPU processes, DualPipeV, PP=4
    twinpipe train --schedule dualpipe --pp 2 --dp 2 --steps 100
    torchrun --standalone --nproc-per-node 8 -m twinpipe.train --pp 4 --dp 2 --device cuda

Without torchrun, the command starts its ``pp x dp`` processes itself (one host). Rank 0 shows a
progress bar; at the end it writes the loss curve (``train-loss.png``), a JSON log and prints a
summary table.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import twinpipe.cli_options as cli_options
import twinpipe.train_command.data as cli_data
import twinpipe.train_command.evaluate as cli_eval
import twinpipe.train_command.export_hf as export_hf
import twinpipe.train_command.model as cli_model
import twinpipe.train_command.run_record as run_record
import twinpipe.train_command.run_state as run_state
from twinpipe.checks import DEFAULT_TIMEOUT, bad, check_choice, check_float, check_int, checked_timeout
from twinpipe.folders import writable_folder
from twinpipe.moe.router import SCORES
from twinpipe.precisions import PURE, check_model_dtype
from twinpipe.train import config as train_config
from twinpipe.train.config import EPLB_THRESHOLD, check_eplb, check_eplb_mesh
from twinpipe.train.fits import check_fits
from twinpipe.train.run_lock import take_run_lock
from twinpipe.train.stopping import STOPPED_EXIT_CODE, StopOnSignals
from twinpipe.train_command.progress import LOG_EVERY, LOG_SECONDS

__all__ = ["add_train_parser", "run_train", "main"]

_DEVICES = ("cpu", "cuda")
_DTYPES = ("float32", "float64", "bfloat16")
# The choices the trainer's configuration takes, read from it (train/config.py).
_BALANCES = train_config.BALANCE
_DP_REDUCES = train_config.DP_REDUCE
_ON_NONFINITE = train_config.ON_NONFINITE
_PRECISIONS = train_config.PRECISIONS
_ZERO = train_config.ZERO
_OPTIMIZER_HPARAMS = ("checkpoint", "current")
_MAX_SEED = train_config.MAX_SEED
_DEFAULT_TOP_K = 2
_SCORES = SCORES
_SAVE_EVERY = 100
_SAVE_MINUTES = 10.0
_KEEP_LAST = 2
_GRACE = 25.0  # below the 30 s SLURM and Kubernetes wait by default between SIGTERM and SIGKILL


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to ``subparsers`` and return its parser."""
    parser = subparsers.add_parser(
        "train", help="train a small byte-level GPT on a pipeline (any schedule) with data parallelism",
        description="Train a small GPT-style byte-level language model on Python's standard library sources, "
                    "on pp x dp processes (started here, or by torchrun).", allow_abbrev=False)
    _add_arguments(parser)
    return parser


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``twinpipe train`` option, by what it sets."""
    _add_mesh_arguments(parser)
    _add_model_arguments(parser)
    _add_training_arguments(parser)
    _add_eplb_arguments(parser)
    _add_run_arguments(parser)
    cli_data.add_arguments(parser)
    cli_eval.add_arguments(parser)
    export_hf.add_train_arguments(cli_model.add_arguments(parser))


def _add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """The schedule, the mesh, the steps and the batch."""
    add = functools.partial(cli_options.add, parser)
    add("schedule", default="dualpipev", more="any registered one (twinpipe simulate --help lists them)")
    add("pp", default=4)
    add("dp", default=1, more="pp x dp processes in all")
    add("steps", default=300, more="the step to reach, counted from 0 (also with --resume)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, all replicas together (default: 16)")
    add("microbatch_size", default=2)
    add("overlap", default_text="off")
    add("overlap_warmup", dest="warmup_extra", default_text="0")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The built-in GPT's shape, its experts and DeepSeek-V3's options."""
    add = functools.partial(cli_options.add, parser)
    add("seq_len", default=64, more="a token is a byte")
    add("dim", default=64)
    add("heads", default=4)
    add("layers", default=6, more="the embedding and the head are layers too")
    add("experts", default=0, more="a multiple of --dp: each data-parallel rank of a stage holds experts/dp of them "
        "(expert parallelism)")
    add("top_k", default=None, more="only with --experts", default_text=str(_DEFAULT_TOP_K))
    parser.add_argument("--score", default="softmax", choices=_SCORES,
                        help="the routers' affinities: softmax (default) or sigmoid (DeepSeek-V3); only with --experts")
    parser.add_argument("--bias-update-speed", type=float, default=0.0, metavar="GAMMA",
                        help="DeepSeek-V3's auxiliary-loss-free balancing: after each step every routing bias moves by GAMMA "
                             "against its expert's load (default: 0, off); only with --experts, or --model with DeepSeek-V3's gates")
    parser.add_argument("--balance-alpha", type=float, default=0.0, metavar="ALPHA",
                        help="DeepSeek-V3's sequence-wise balance loss factor (default: 0, off); only with --experts, or --model "
                             "with DeepSeek-V3's gates")
    parser.add_argument("--mtp-depth", type=int, default=0, metavar="D",
                        help="multi-token prediction modules on the last stage (default: 0, off); below --seq-len")
    parser.add_argument("--mtp-weight", type=float, default=0.3, metavar="LAMBDA",
                        help="the MTP losses' weight: loss = main + LAMBDA / D x their sum (default: 0.3); only with --mtp-depth")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The optimizer, the reductions, the cut, the device and the precision."""
    add = functools.partial(cli_options.add, parser)
    add("lr", default=3e-3, more="AdamW")
    parser.add_argument("--max-norm", type=float, default=1.0, help="clip gradients to this global norm (default: 1; 0 turns clipping off)")
    parser.add_argument("--dp-reduce", default="all-reduce", choices=_DP_REDUCES,
                        help="how replicas' gradients are added: all-reduce (default) or ordered (all-gather, then replica by "
                        "replica: bitwise reproducible for any --dp)")
    parser.add_argument("--no-overlap-dp", dest="overlap_dp", action="store_false",
                        help="reduce the data-parallel gradients after the pipeline step, not stage by stage during it")
    parser.add_argument("--on-nonfinite", default="skip", choices=_ON_NONFINITE,
                        help="a step whose loss or gradients are not finite: skip its update on every rank and count it "
                             "(default), or stop with an error")
    parser.add_argument("--balance", default="params", choices=_BALANCES, help="how layers are cut into stages (default: params)")
    add("device", default="cpu", choices=_DEVICES)
    add("dtype", default="float32", choices=_DTYPES)
    parser.add_argument("--precision", default=PURE, choices=_PRECISIONS,
                        help="pure (default): weights, gradients and optimizer state in --dtype; bf16-mixed: bf16 weights and "
                             "activations, FP32 master weights, gradients and optimizer state (needs --dtype float32)")
    parser.add_argument("--zero", type=int, default=0, choices=_ZERO,
                        help="0 (default): every data-parallel rank holds the whole optimizer state; 1: each holds 1/dp of it "
                             "(ZeRO-1: gradients reduce-scattered, weights all-gathered)")


def _add_eplb_arguments(parser: argparse.ArgumentParser) -> None:
    """EPLB in the loop: with --model (a transformers MoE model) and --ep = --dp >= 2 (docs/eplb.md)."""
    group = parser.add_argument_group("EPLB in the loop (with --model, --ep = --dp >= 2; docs/eplb.md)")
    add = functools.partial(cli_options.add, parser, group=group)
    add("eplb_every", default=0, default_text="0, off")
    add("redundant_experts", default=0)
    add("eplb_window", default=None, default_text="--eplb-every")
    add("eplb_threshold", default=EPLB_THRESHOLD)


def _check_eplb(args) -> None:
    """The EPLB options against each other, the model and the mesh (ValueError naming the option)."""
    check_eplb(args.eplb_every, args.redundant_experts, args.eplb_window, args.eplb_threshold, flags=True)
    if args.eplb_every and args.model is None:
        raise bad("--eplb-every", args.eplb_every, "only with --model (a transformers MoE model) for now: the built-in "
                  "GPT's checkpoints name its experts by slot")
    if args.eplb_every and args.mtp_depth:
        raise bad("--eplb-every", args.eplb_every, f"not with --mtp-depth={args.mtp_depth} yet (the MTP layers' experts "
                  "keep one slot each)")
    check_eplb_mesh(eplb_every=args.eplb_every, redundant=args.redundant_experts, ep=args.ep, dp=args.dp,
                    precision=args.precision, zero=args.zero, mirrored=args.mirrored_stages, flags=True)


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The seed and data size, ``--out``, checkpoints, signals, the timeout and the log."""
    add = functools.partial(cli_options.add, parser)
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed (default: 0)")
    parser.add_argument("--corpus-bytes", type=int, default=4 << 20, help="bytes of the standard library to read (default: 4 MiB)")
    add("out", default="twinpipe-train", more="the folder for the picture, the log and checkpoints")
    parser.add_argument("--save-every", type=int, default=_SAVE_EVERY, metavar="N",
                        help=f"write a checkpoint (--out/checkpoint-stepK) every N steps (default: {_SAVE_EVERY}; 0: not by steps)")
    parser.add_argument("--save-minutes", type=float, default=_SAVE_MINUTES, metavar="MIN",
                        help=f"also write one when MIN minutes have passed since the last (default: {_SAVE_MINUTES:g}; 0: not by time)")
    parser.add_argument("--keep-last", type=int, default=_KEEP_LAST, metavar="N",
                        help=f"keep the N newest checkpoint-stepK folders, removing older ones (default: {_KEEP_LAST}; 0: keep all; "
                             "checkpoint-final is always kept)")
    parser.add_argument("--resume", default=None, metavar="CHECKPOINT",
                        help="continue from a checkpoint directory (any schedule/pp/dp wrote it), or 'auto' (or 'latest'): the newest "
                             "complete checkpoint in --out, a fresh start when there is none")
    parser.add_argument("--grace-period", type=float, default=_GRACE, metavar="SECONDS",
                        help=f"on SIGTERM or SIGINT: seconds to finish the step and write its checkpoint before giving up "
                             f"(default: {_GRACE:g}); a second signal gives up at once")
    parser.add_argument("--optimizer-hparams", default="checkpoint", choices=_OPTIMIZER_HPARAMS,
                        help="with --resume: the optimizer's hyper-parameters (learning rate...) from the checkpoint "
                             "(default) or from the current options (--lr)")
    add("timeout", default=DEFAULT_TIMEOUT, default_text=f"{DEFAULT_TIMEOUT:g}",
        more="a failed wait ends the run with one line naming the rank; the tracebacks go to OUT/failure-tracebacks.txt")
    parser.add_argument("--log-every", type=int, default=LOG_EVERY, metavar="N",
                        help=f"when standard output is not a terminal (nohup, a scheduler, CI): a progress line every N steps "
                             f"and at least every {LOG_SECONDS:g} s (default: {LOG_EVERY}); a terminal gets a progress bar")


def _check(args) -> None:
    """Refuse bad settings before any process starts: a ValueError whose message is one line,
    ``--option=value: must be ...``."""
    from twinpipe.schedule import registry

    for flag, low in (("--pp", 1), ("--dp", 1), ("--steps", 1), ("--batch-size", 1), ("--microbatch-size", 1),
                      ("--seq-len", 1), ("--dim", 1), ("--heads", 1), ("--layers", 1), ("--experts", 0),
                      ("--save-every", 0), ("--keep-last", 0), ("--corpus-bytes", 1), ("--log-every", 1)):
        check_int(_option(args, flag), flag, low=low)
    if args.vocab is not None:
        check_int(args.vocab, "--vocab", low=1)
    export_hf.check_train_options(args)
    _check_overlap(args)
    check_int(args.seed, "--seed", low=0, high=_MAX_SEED, why="torch's generator keeps 32 bits of a seed")
    check_float(args.lr, "--lr", low=0, low_open=True)
    check_float(args.max_norm, "--max-norm", low=0)  # 0: no clipping
    check_float(args.save_minutes, "--save-minutes", low=0)  # 0: not by time
    check_float(args.grace_period, "--grace-period", low=0, low_open=True)
    checked_timeout(args.timeout, "--timeout")
    for flag, allowed in (("--device", _DEVICES), ("--dtype", _DTYPES), ("--balance", _BALANCES), ("--dp-reduce", _DP_REDUCES),
                          ("--on-nonfinite", _ON_NONFINITE), ("--optimizer-hparams", _OPTIMIZER_HPARAMS),
                          ("--precision", _PRECISIONS), ("--zero", _ZERO)):
        check_choice(_option(args, flag), flag, allowed)
    check_model_dtype(args.precision, args.dtype, dtype_arg="--dtype", precision_arg="--precision")
    try:
        registry.get(args.schedule)
    except ValueError as error:  # it lists the names and aliases
        raise bad("--schedule", args.schedule, "allowed are " + str(error).split("allowed are ", 1)[-1]) from None
    _model_config(args)
    args.ep = cli_model.check_ep(args)  # --ep, or its default (the built-in GPT: --dp; --model: 1)
    if args.batch_size % (args.dp * args.microbatch_size):
        raise bad("--batch-size", args.batch_size, f"must be a multiple of --dp={args.dp} x --microbatch-size={args.microbatch_size} "
                  "(every replica runs whole micro-batches)")
    stages = _check_schedule(args, args.batch_size // (args.dp * args.microbatch_size))
    _check_eplb(args)
    info = cli_model.check_model(args, stages, _defaults(), need_tokenizer=_needs_tokenizer(args))
    # the built-in GPT's vocabulary: --vocab, or the data's largest id + 1 (with --model: the model's)
    args.data_vocab = cli_data.check_data(args, info and info.vocab, info and info.tokenizer)
    cli_eval.check(args, info.vocab if info else cli_data.vocab(args), info and info.tokenizer)
    if info is None and args.layers + 2 < stages:
        raise ValueError(f"--layers={args.layers}: {args.schedule} on --pp={args.pp} cuts the model into {stages} stages, "
                         f"and the model has {args.layers + 2} layers (blocks, embedding, head); use --layers {stages - 2} or more")
    need = args.batch_size * (args.seq_len + 1)
    if args.data is None and args.corpus_bytes < need:
        raise bad("--corpus-bytes", args.corpus_bytes, f"must be at least --batch-size x (--seq-len + 1) = {need} "
                  "(one batch of windows, each a sequence and its next byte)")
    _check_device(args)
    check_fits(args, _model_config(args))  # what the fullest rank needs, against what this machine has
    world = args.pp * args.dp
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", 1)) != world:  # started by torchrun
        raise ValueError(f"--pp={args.pp} x --dp={args.dp} = {world} processes, but torchrun started "
                         f"{os.environ.get('WORLD_SIZE')}: the mesh sizes must multiply to the world size")
    _check_host_id()
    if args.resume in run_state.AUTO:
        _resolve_auto(args)
    if args.resume is not None:
        _check_resume(args, info)
    writable_folder(args.out, "--out")  # last: it makes the folder, so only when nothing else is wrong


def _schedule_options(args) -> tuple:
    """``--overlap`` and ``--overlap-warmup`` as ``TrainConfig.schedule_options``."""
    options = (("overlap", True),) if args.overlap else ()
    return options + ((("warmup_extra", args.warmup_extra),) if args.warmup_extra is not None else ())


def _check_overlap(args) -> None:
    """``--overlap`` only with a schedule that has a steady phase, ``--overlap-warmup`` only with
    ``--overlap`` (ValueError naming the option, before ranks start)."""
    from twinpipe.schedule import registry

    if args.warmup_extra is not None:
        check_int(args.warmup_extra, "--overlap-warmup", low=0)
        if not args.overlap:
            raise bad("--overlap-warmup", args.warmup_extra, "only with --overlap (the extra warm-up of overlapped F&B ops)")
    if args.overlap and "overlap" not in (registry.get(args.schedule).options or ()):
        already = " (it overlaps its F&B ops already)" if registry.get(args.schedule).name in ("dualpipe", "dualpipev") else ""
        raise bad("--overlap", True, f"not with --schedule {args.schedule}{already}; the schedules that take it: "
                  f"{', '.join(registry.overlappable())}")


def _needs_tokenizer(args) -> bool:
    """Whether --model's tokenizer reads text: the built-in corpus, or a text --data or --eval-data."""
    from twinpipe.train.tokens import is_text

    return args.data is None or is_text(args.data) or cli_eval.needs_tokenizer(args)


def _check_host_id() -> None:
    """``$TWINPIPE_HOST_ID``, when set, by the rule the ranks apply (``runtime.shm.host_id``): refused
    here, before any rank starts, not by every rank as it sets up its first pipe."""
    from twinpipe.runtime.shm import host_id

    host_id()


def _resolve_auto(args) -> None:
    """``--resume auto``: the newest complete checkpoint in ``--out`` (torn ones skipped, with a note),
    or None (a fresh start). Under torchrun each worker looks on its own: ``_agree_on_resume`` then
    checks that every rank found the same one."""
    path, step, notes = run_state.newest_checkpoint(args.out)
    args.auto_resumed = [path, step]  # not an option: what this rank found, for _agree_on_resume
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank checks: one says it
        for note in notes:
            print(f"note: --resume {args.resume}: {note}", file=sys.stderr)
        print(f"note: --resume {args.resume}: " + (f"continuing from {path} (step {step})" if path else
              f"no complete checkpoint in --out={args.out}: starting from step 0"), file=sys.stderr)
    args.resume = path


def _agree_on_resume(args) -> None:
    """Under torchrun: every rank of the default group resumes from the checkpoint rank 0 found with
    ``--resume auto``, or every rank raises naming what each found (a rank seeing another ``--out``,
    a folder not shared between hosts, would otherwise resume another step). Collective."""
    found = getattr(args, "auto_resumed", None)
    if found is None:  # no --resume auto
        return
    import torch.distributed as dist

    from twinpipe.runtime.collectives import cpu_group, gather_objects, release_cpu_group

    group = cpu_group(dist.group.WORLD, args.timeout)  # gloo: an NCCL world's own group for a few bytes
    try:
        said = gather_objects(group, found, args.timeout, "--resume auto: agreeing on the checkpoint")
    finally:
        release_cpu_group(group)
    if any(s != said[0] for s in said):
        each = "; ".join(f"rank {r}: {p or 'none'} (step {step})" for r, (p, step) in enumerate(said))
        raise ValueError(f"--resume auto: the ranks found different newest checkpoints in --out={args.out} ({each}); "
                         "--out must be one folder every rank sees (a shared filesystem)")


def _check_schedule(args, num_microbatches: int) -> int:
    """The schedule on ``--pp`` ranks with this many micro-batches per pipeline; its number of model stages."""
    from twinpipe.runtime.batches import batch_layout
    from twinpipe.schedule import resolve

    try:
        schedule = resolve(args.schedule, args.pp)
        schedule.build(num_microbatches)
        for rank in range(args.pp):
            batch_layout(schedule, args.pp, rank, num_microbatches)
    except ValueError as error:
        raise ValueError(_schedule_problem(args, num_microbatches, str(error))) from None
    args.mirrored_stages = len(schedule.placement.chains) > 1  # not an option: DualPipe's copies (_check_eplb)
    return schedule.placement.num_model_stages


def _schedule_problem(args, num_microbatches: int, message: str) -> str:
    """The schedule's own complaint said in the options' terms (``--pp``, the batch sizes)."""
    rule = re.match(r"^[\w-]+: (num_ranks|num_microbatches|num_chunks)=\d+: must be (.*)$", message)
    if rule and rule[1] == "num_ranks":
        return f"--pp={args.pp}: must be {rule[2]} for --schedule {args.schedule}"
    split = (f"--batch-size={args.batch_size} / (--dp={args.dp} x --microbatch-size={args.microbatch_size}) "
             f"= {num_microbatches} micro-batch(es) per pipeline")
    if rule:
        return f"{split}: --schedule {args.schedule} needs a number of micro-batches that is {rule[2]}"
    return f"--schedule={args.schedule} on --pp={args.pp} with {split}: {message}"


def _check_device(args) -> None:
    """``--device cuda`` needs a GPU for every process of this host."""
    if args.device != "cuda":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    here = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "RANK" in os.environ else args.pp * args.dp
    if count == 0:
        raise bad("--device", "cuda", "must be cpu on this machine: torch sees no CUDA GPU")
    if here > count:
        raise bad("--device", "cuda", f"needs one GPU per process: {here} processes on this host, {count} GPU(s)")


def _check_resume(args, info=None) -> None:
    """The checkpoint, complete and safe to read (``read_checkpoint_info``: its marker, files and
    metadata, nothing unpickled but through an allow-list), and its model against the options that
    shape it (blocks, width, sequence length, experts, heads, top-k), before any process starts: inside the
    ranks the same mismatch is an error too, but with a traceback per rank."""
    from twinpipe.train.checkpoint import CheckpointError, read_checkpoint_info

    try:
        model, info = info, read_checkpoint_info(args.resume)
    except CheckpointError as error:
        raise ValueError(f"--resume={args.resume}: {error.problem}") from None
    shapes = info.parameters
    if model is not None:  # --model: its parameters by name, then its configuration
        cli_model.check_resume(args, model, shapes)
        return _check_record(args, info.model, cli_model.model_record_of(model))
    saved = {
        "--layers": len({n.split(".")[1] for n in shapes if n.startswith("blocks.")}),
        "--dim": shapes.get("embed.tokens.weight", [0, args.dim])[1],
        "--vocab": shapes.get("embed.tokens.weight", [cli_data.vocab(args)])[0],
        "--seq-len": shapes.get("embed.positions.weight", [args.seq_len])[0],
        "--experts": len({n.split(".experts.")[1].split(".")[0] for n in shapes if n.startswith("blocks.0.experts.")}),
    }
    config = info.model.get("config") if isinstance(info.model.get("config"), dict) else {}
    if "heads" in config:  # a model configuration the parameter shapes do not show
        saved["--heads"] = config["heads"]
    if config.get("experts"):
        saved["--top-k"] = config.get("top_k")
    described = _model_config(args)  # the options with their defaults applied (--top-k's is not argparse's)
    mine = {**{flag: _option(args, flag) for flag in saved}, "--vocab": cli_data.vocab(args), "--top-k": described.top_k}
    wrong = [f"{flag}={mine[flag]} (the checkpoint's model has {value})" for flag, value in saved.items() if value != mine[flag]]
    if wrong:
        raise ValueError(f"--resume={args.resume}: holds another model than the options describe: {'; '.join(wrong)}")
    _check_record(args, info.model, train_config.model_record(types.SimpleNamespace(config=described)))


def _check_record(args, saved: dict, mine: dict) -> None:
    """The checkpoint's model record (``train.config.model_record``) against this run's: the ranks'
    ``load_checkpoint`` refuses a difference, so it is refused here, before they start."""
    differences = train_config.record_differences(saved, mine)
    if differences:
        more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
        raise ValueError(f"--resume={args.resume}: was written by a model of another configuration with the same "
                         f"parameter shapes: {'; '.join(differences[:3])}{more}")


def _options_record(args) -> dict:
    """The ``twinpipe train`` options of ``args`` by name, for the log: only the options, not what the
    command line adds around them (the sub-command's name and function)."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_arguments(parser)
    return {action.dest: getattr(args, action.dest) for action in parser._actions}


def _defaults() -> dict:
    """Every option's default, by ``dest``."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_arguments(parser)
    return {action.dest: parser.get_default(action.dest) for action in parser._actions}  # not an old spelling's


def _option(args, flag: str):
    return getattr(args, flag[2:].replace("-", "_"))


def run_train(args: argparse.Namespace) -> int:
    """Run ``twinpipe train``; 0 on success, 2 (message on stderr) on bad input, 1 (one line on stderr
    naming the rank, its error and the remedy; the tracebacks in ``--out``) when a rank fails or dies,
    ``STOPPED_EXIT_CODE`` (75) when a signal stopped it after writing a checkpoint (``--resume auto``
    continues from it)."""
    try:
        _check(args)
        lock = take_run_lock(args.out) if os.environ.get("RANK", "0") == "0" else None  # the rule: train/run_lock.py
    except ValueError as error:
        print(f"twinpipe train: error: {error}", file=sys.stderr)
        return 2
    if lock is not None and lock.note:
        print(f"twinpipe train: note: {lock.note}", file=sys.stderr)
    if lock is not None:  # no save into --out runs now: a temporary folder there is a killed run's
        _remove_abandoned(args.out)
    try:
        return _run_ranks(args)
    finally:
        if lock is not None:
            lock.release()


def _remove_abandoned(out) -> None:
    """Remove every temporary checkpoint folder in ``out``: called only where no save runs there."""
    from twinpipe.train.checkpoint_files import remove_abandoned  # imports torch

    remove_abandoned(out, all_abandoned=True)


def _run_ranks(args: argparse.Namespace) -> int:
    world = args.pp * args.dp
    from twinpipe.launch import RankFailedError, run_local

    if "RANK" in os.environ:  # started by torchrun: each worker tells of its own failure
        rank = int(os.environ["RANK"])
        try:
            return _torchrun_worker(int(os.environ.get("LOCAL_RANK", 0)), args)
        except Exception as exc:
            print(f"twinpipe train: {_failure(args, RankFailedError.caught(rank, exc), f'failure-tracebacks-rank{rank}.txt')}",
                  file=sys.stderr, flush=True)
            return 1
    if args.device == "cpu" and world > (os.cpu_count() or 1):
        print(f"note: {world} processes on {os.cpu_count()} CPU cores; they take turns", file=sys.stderr)
    try:  # the group's timeout bounds mesh setup too; a signal here reaches the ranks as SIGTERM
        codes = run_local(world, _spawned_worker, args, threads=_threads(args), backend=_backend(args),
                          group_timeout=args.timeout, forward_signals=True)
    except RankFailedError as error:  # the rank whose failure stopped the run
        print(f"twinpipe train: {_failure(args, error, 'failure-tracebacks.txt')}", file=sys.stderr)
        return 1
    finally:  # what a rank killed mid-save left (the ranks are gone: no save runs)
        _remove_abandoned(args.out)
    return max(codes)  # every rank agreed: all 0, or all stopped


def _failure(args, error, file_name: str) -> str:
    """The one line a failed run prints: the rank by its mesh coordinates, its error, the remedy, and
    where the full tracebacks went (``file_name`` in ``--out``)."""
    from twinpipe.launch import failure_line, write_tracebacks
    from twinpipe.train.mesh import rank_name

    written = write_tracebacks(error, Path(args.out) / file_name)
    return failure_line(error, lambda rank: rank_name(rank, args.pp), args.timeout, written)


def _backend(args) -> str:
    return "nccl" if args.device == "cuda" else "gloo"


def _threads(args) -> int | None:
    """Torch threads per rank: on CPU the host's cores shared out over the ranks; on CUDA torch's default."""
    return max(1, (os.cpu_count() or 1) // (args.pp * args.dp)) if args.device == "cpu" else None


def _spawned_worker(rank: int, world: int, args) -> int:
    """One rank started by ``run_local``, which made the process group (and chose the GPU), and passes
    it SIGINT as SIGTERM; its exit code."""
    import signal

    with StopOnSignals(args.grace_period, signals=(signal.SIGTERM,)) as stopper:
        return _train(args, _device(args), stopper)


def _torchrun_worker(local_rank: int, args) -> int:
    """One rank started by torchrun (or a launcher that sets its variables): the process group comes
    from its environment, or is the one the launcher made already (Ray's TorchTrainer), left to it."""
    import torch
    import torch.distributed as dist

    from twinpipe.launch import init_torchrun_group

    if args.device == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(_threads(args))
    ours = not dist.is_initialized()
    if ours:
        init_torchrun_group(_backend(args), args.timeout)  # the timeout bounds mesh setup too
    try:
        _agree_on_resume(args)
        with StopOnSignals(args.grace_period) as stopper:  # SIGTERM (torchrun passes its own on) and SIGINT
            return _train(args, _device(args), stopper)
    finally:
        if ours:
            dist.destroy_process_group()


def _device(args):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")


def _train(args, device, stopper: StopOnSignals | None = None) -> int:
    """One rank's run; its exit code: 0, or ``STOPPED_EXIT_CODE`` when ``stopper`` heard a signal and
    every rank saved the step they agreed on. Without ``stopper`` no signal is heard (a caller's own
    handlers stay), but a stop another rank asked for is still honoured."""
    if stopper is None:
        stopper = StopOnSignals(args.grace_period, signals=())
    from twinpipe.train.checkpoint import load_checkpoint

    trainer, hf = _build_trainer(args, device)
    start = load_checkpoint(trainer, args.resume, optimizer_hparams=args.optimizer_hparams) if args.resume else 0
    if start >= args.steps:
        if trainer.mesh.is_first:
            print(f"twinpipe train: nothing to do: the checkpoint is at step {start} and --steps={args.steps}; raise --steps")
        return 0
    return _loop(_set_up(args, trainer, hf, start), args, stopper)


@dataclass(kw_only=True)
class _Run:
    """What one rank's run carries from its set-up through its loop to its end."""

    trainer: object  # twinpipe.train.Trainer
    start: int  # the first step to run (a checkpoint's, or 0)
    first: bool  # rank dp=0 pp=0: writes the log, the picture and the summary
    out: Path
    log: run_state.TrainLog
    saves: run_state.SavePolicy
    title: str  # the model and mesh, for the progress bar, the picture and the summary
    unit: str  # what the loss is counted per: "byte" (the built-in corpus) or "token"
    vocab: int  # the model's vocabulary (the picture's uniform-guess line)
    tokens: int  # per step
    tokenizer: object = None  # --model's, for a text --eval-data
    times: dict[str, list[float]] = field(default_factory=dict)  # each step's result.times, by key
    evaluation: object = None  # train_command/evaluate.Evaluation, made by the loop


def _set_up(args, trainer, hf, start: int) -> _Run:
    """The run of ``trainer`` from step ``start``: ``--out`` made, the log (carrying an earlier start's
    steps), the save policy and what the progress bar and the summary say."""
    from twinpipe.train.model import GPT

    out, first = Path(args.out), trainer.mesh.is_first
    if first:
        out.mkdir(parents=True, exist_ok=True)
    carried, starts = run_state.earlier_log(out, args.resume, start)
    what_ran = {"args": run_record.logged_options(_options_record(args), args.model),
                **run_record.model_entry(args, hf, trainer.source.built.layout if hf is not None else None)}
    log = run_state.TrainLog(out / run_state.LOG, {**what_ran, "starts": [*starts, {"step": start, "resumed_from": args.resume}]},
                             carried)
    cfg = _model_config(args)
    mesh = f"{args.schedule}, PP={args.pp} x DP={args.dp}"
    if hf is None:
        moe = f", {cfg.experts} experts (top-{cfg.top_k})" if cfg.experts else ""
        title = f"{mesh}, {sum(p.numel() for p in GPT(cfg).parameters()):,} parameters{moe}"
    else:
        title = f"{mesh}, {hf.config.model_type} ({args.model}), {hf.count:,} parameters"
    return _Run(trainer=trainer, start=start, first=first, out=out, log=log,
                saves=run_state.SavePolicy(args.save_every, args.save_minutes), title=title,
                unit="byte" if args.data is None and args.model is None else "token",
                vocab=hf.vocab if hf is not None else cfg.vocab, tokens=args.batch_size * args.seq_len,
                tokenizer=hf and hf.tokenizer)


def _build_trainer(args, device):
    """The trainer of the options on ``device``: the built-in GPT, or ``--model`` (then also its loaded
    ``cli_model`` record; else None)."""
    import torch

    from twinpipe.train.data import BatchSampler
    from twinpipe.train.mesh import build_mesh
    from twinpipe.train.model import GPT, lm_loss
    from twinpipe.train.trainer import TrainConfig, Trainer

    hf = None
    if args.model is not None:
        hf = cli_model.load(args, need_tokenizer=_needs_tokenizer(args))
    sampler = BatchSampler(cli_data.tokens(args, hf and hf.tokenizer), args.seq_len, seed=args.seed)  # the built-in corpus by default
    config = TrainConfig(schedule=args.schedule, batch_size=args.batch_size, microbatch_size=args.microbatch_size,
                         max_norm=args.max_norm or None, balance=args.balance, seed=args.seed, timeout=args.timeout,
                         dp_reduce=args.dp_reduce, overlap_dp=args.overlap_dp, on_nonfinite=args.on_nonfinite,
                         precision=args.precision, zero=args.zero, ep=args.ep, schedule_options=_schedule_options(args),
                         eplb_every=args.eplb_every, redundant_experts=args.redundant_experts, eplb_window=args.eplb_window,
                         eplb_threshold=args.eplb_threshold, **_ds3_config(args))
    mesh = build_mesh(args.dp, args.pp, device.type)
    optimizer_fn = lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.01)  # noqa: E731
    dtype = getattr(torch, args.dtype)
    if hf is None:
        cfg = _model_config(args)
        return Trainer(lambda: GPT(cfg), sampler, lm_loss, optimizer_fn, mesh, config, device=device, dtype=dtype), None
    from twinpipe.hf.training import HFSource, TokenLoss

    stages = HFSource(args.model, args.layout, balance=args.balance, weights=hf.weights,
                      sample=sampler.batch(0, args.microbatch_size)[0].to(device),
                      ep_group=mesh.expert_groups(args.ep).ep_group, mtp_depth=args.mtp_depth,
                      redundant_experts=args.redundant_experts)
    return Trainer(lambda: cli_model.build_model(hf), sampler, TokenLoss(hf.aux), optimizer_fn, mesh, config,
                   device=device, dtype=dtype, stages=stages), hf


def _loop(run: _Run, args, stopper: StopOnSignals) -> int:
    """Steps ``run.start`` .. ``--steps - 1``, then the end of the run; a stop agreed by every rank
    ends it early, after its checkpoint."""
    from twinpipe.train.memory import measured_step
    from twinpipe.train_command.rank_times import RankTimes

    trainer, log = run.trainer, run.log
    progress = _progress(args, run.first, run.title, run.start, run.tokens, run.unit)
    evaluation = run.evaluation = cli_eval.Evaluation(args, trainer, run.tokenizer, log, progress)
    rank_times = RankTimes(args.timeout)
    began = time.perf_counter()
    with progress:
        for step in range(run.start, args.steps):
            if step == args.steps - 1:  # the last step is measured (after the first, message layouts are known)
                result, memory_entry = measured_step(trainer, step)
            else:  # a signal, or rank 0's clock, asks; the step's all-reduce tells every rank alike
                result = trainer.step(step, stop=stopper.requested, save=run.first and run.saves.clock_due())
            by_rank = rank_times.gather(step, result.times["busy"])  # collective
            log.add({"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "skipped": result.skipped,
                     **result.times, "rank_times": by_rank, **_rebalanced(trainer, result, progress)})
            for key, value in result.times.items():
                run.times.setdefault(key, []).append(value)
            progress.update(step, result, by_rank, trainer.skipped_steps)
            if not result.stop:  # a stop agreed by every rank spends its grace period on the save, not an evaluation
                evaluation.after(step)  # collective, when --eval-every or the last step says so
            # after a step (every rank alike): a checkpoint when one is due (or a transformers folder), or the run stops
            hf_due = export_hf.due(args, step + 1) and not result.stop
            if step + 1 < args.steps and (result.stop or run.saves.due(step + 1, result.save) or hf_due):
                if result.stop:
                    stopper.agreed()  # the grace period runs on every rank now
                path = _save_step(trainer, run.out, step + 1, args.keep_last, run.first, log)
                run.saves.saved()
                if run.first and hf_due:
                    export_hf.export_after_save(args, path, export_hf.step_folder(run.out, step + 1))
                if result.stop:
                    rank_times.close()
                    return _stopped(stopper, path, step + 1, args, run.first, log)
            elif run.first:
                log.write_if_due(skipped_steps=trainer.skipped_steps)
    rank_times.close()
    return _end_of_run(run, args, time.perf_counter() - began, memory_entry)


def _rebalanced(trainer, result, progress) -> dict:
    """A rebalance at the end of the step: a progress line when experts moved, and the log's entry
    (this rank's blocks: their loads before and after, the placements now); ``{}`` without one."""
    if result.rebalance is None:
        return {}
    from twinpipe.train.live_eplb import summary

    entry = summary(result.rebalance, trainer.eplb.placements())
    moved = [b for b in entry["blocks"] if b["moved"]]
    if moved:
        worst = max(moved, key=lambda b: b["before"])
        progress.note(f"rebalance after step {result.step}: {len(moved)} of {len(entry['blocks'])} MoE blocks re-placed, "
                      f"{entry['experts_sent']} experts sent; max/mean EP-rank load {worst['before']:.3f} -> "
                      f"{worst['after']:.3f} ({worst['name']})")
    return {"eplb": entry}


def _end_of_run(run: _Run, args, elapsed: float, memory_entry) -> int:
    """After the last step: the memory report and the final checkpoint (collectives), then rank 0's
    log, loss picture and summary table."""
    from twinpipe.train.memory import gather_report
    from twinpipe.train.report import memory_rows, plot_losses, print_summary, summary_rows

    from twinpipe.train.checkpoint import save_checkpoint

    trainer, out, log = run.trainer, run.out, run.log
    memory = gather_report(trainer, memory_entry)  # collective
    save_checkpoint(trainer, str(out / run_state.FINAL), args.steps)
    if not run.first:
        return 0
    if args.model is not None:
        export_hf.export_after_save(args, out / run_state.FINAL, out / export_hf.FINAL)
    placements = {"eplb_placements": trainer.eplb.placements()} if trainer.eplb else {}
    log.write(elapsed_s=elapsed, skipped_steps=trainer.skipped_steps, memory=[e.to_dict() for e in memory], **placements)
    plot_losses([e["step"] for e in log.steps], [e["loss"] for e in log.steps], str(out / "train-loss.png"), run.title,
                unit=run.unit, vocab=run.vocab, held_out=[(e["step"], e["loss"]) for e in run.evaluation.results])
    mine = log.steps[len(log.steps) - (args.steps - run.start):]  # this start's steps (the summary's times are its own)
    rows = summary_rows([e["loss"] for e in mine], run.times, run.tokens, mirrored=trainer.is_dual, replicas=args.dp,
                        unit=run.unit)
    rows.append(("steps skipped (not finite)", str(trainer.skipped_steps)))
    rows.append(("wall time", f"{elapsed:.1f} s"))
    rows += memory_rows(memory)
    hf_final = f", {out / export_hf.FINAL}" if args.model is not None else ""
    rows.append(("written", f"{out / 'train-loss.png'}, {out / 'train-log.json'}, {out / run_state.FINAL}{hf_final}"))
    print_summary(run.title, rows)
    return 0


def _save_step(trainer, out: Path, step: int, keep_last: int, first: bool, log) -> Path:
    """The checkpoint of ``step`` (collective), the older ones pruned, the log rewritten (rank 0)."""
    from twinpipe.train.checkpoint import save_checkpoint

    path = run_state.step_folder(out, step)
    save_checkpoint(trainer, str(path), step)
    if first:
        run_state.prune(out, keep_last)
        log.write(skipped_steps=trainer.skipped_steps)
    return path


def _stopped(stopper: StopOnSignals, path: Path, step: int, args, first: bool, log) -> int:
    """After the agreed stop's checkpoint: say so (rank 0) and give the exit code."""
    if first:
        why = f"{stopper.signal_name} on this rank" if stopper.requested else "a signal on another rank"
        log.write(stopped={"step": step, "checkpoint": str(path), "why": why})
        print(f"twinpipe train: stopped by {why} after step {step - 1}: wrote {path}; continue with --resume auto "
              f"--out {args.out} (exit code {STOPPED_EXIT_CODE})", file=sys.stderr)
    return STOPPED_EXIT_CODE


def _model_config(args):
    """The GPT the options describe (ValueError naming the option when they do not make one)."""
    from twinpipe.train.model import GPTConfig

    if args.experts < 0:
        raise bad("--experts", args.experts, "must be >= 0 (0: dense MLPs)")
    if args.dim % args.heads:
        raise bad("--dim", args.dim, f"must be a multiple of --heads={args.heads} (every head gets dim/heads columns)")
    top_k = _DEFAULT_TOP_K if args.top_k is None else args.top_k
    if args.experts and not 1 <= top_k <= args.experts:
        raise bad("--top-k", top_k, f"must be in 1..--experts ({args.experts})")
    if not args.experts and args.top_k is not None:
        raise bad("--top-k", args.top_k, "needs --experts: a dense model (--experts 0) routes no tokens")
    _check_ds3(args)
    return GPTConfig(vocab=cli_data.vocab(args), seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers,
                     experts=args.experts, top_k=top_k if args.experts else _DEFAULT_TOP_K, score=args.score,
                     balance_alpha=args.balance_alpha if args.model is None else 0.0, mtp_depth=args.mtp_depth)


def _check_ds3(args) -> None:
    """DeepSeek-V3's options (docs/deepseek-v3.md), each named with what it needs."""
    check_choice(args.score, "--score", _SCORES)
    check_float(args.bias_update_speed, "--bias-update-speed", low=0)
    check_float(args.balance_alpha, "--balance-alpha", low=0)
    check_int(args.mtp_depth, "--mtp-depth", low=0, high=args.seq_len - 1)
    check_float(args.mtp_weight, "--mtp-weight", low=0)
    if args.score != "softmax" and args.model is not None:
        raise bad("--score", args.score, "not with --model: it sets the built-in GPT's MoE routers (--experts); a "
                  "transformers model scores its experts as its config.json says (DeepSeek-V3: sigmoid)")
    for flag, value, off in (("--score", args.score, "softmax"), ("--bias-update-speed", args.bias_update_speed, 0.0),
                             ("--balance-alpha", args.balance_alpha, 0.0)):
        if value != off and args.model is None and not args.experts:
            raise bad(flag, value, "needs --experts: a dense model (--experts 0) routes no tokens")


def _ds3_config(args) -> dict:
    """The TrainConfig fields of DeepSeek-V3's options."""
    # --balance-alpha: the built-in GPT's routers take it from its config (_model_config), a
    # transformers DeepSeek-V3's gates from the trainer (cli_model._check_balancing checked them)
    return {"bias_update_speed": args.bias_update_speed, "mtp_depth": args.mtp_depth,
            "balance_alpha": args.balance_alpha if args.model is not None else 0.0,
            "mtp_weight": args.mtp_weight if args.mtp_depth else 0.0}


def _progress(args, show: bool, title: str, start: int, tokens_per_step: int, unit: str):
    """What rank dp=0 pp=0 shows while the run goes (``progress.TrainProgress``); the other ranks show nothing."""
    from twinpipe.train_command.progress import ProgressOutput, TrainProgress

    return TrainProgress(title=title, steps=range(start, args.steps), unit=unit, tokens_per_step=tokens_per_step, pp=args.pp,
                         output=ProgressOutput(show=show, log_every=args.log_every))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twinpipe.train", description=__doc__.splitlines()[0], allow_abbrev=False)
    _add_arguments(parser)
    return run_train(parser.parse_args(argv))
