"""``transformers`` folders from ``twinpipe train`` checkpoints (``twinpipe.hf.export``):

    twinpipe export-hf CHECKPOINT --model DIR --out OUT     # any checkpoint, from any mesh

and, in a ``twinpipe train --model`` run, ``hf-final/`` in ``--out`` at the end and, with
``--save-hf-every N``, ``hf-stepK/`` beside the checkpoint of every N-th step (each written by rank
0 from the checkpoint just saved; kept, not pruned by ``--keep-last``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import twinpipe.cli_options as cli_options
from twinpipe.checks import bad, check_int

__all__ = ["FINAL", "step_folder", "add_train_arguments", "check_train_options", "due", "export_after_save",
           "add_export_hf_parser", "run_export_hf"]

FINAL = "hf-final"
SUMMARY = "write a twinpipe train checkpoint as a transformers folder (from_pretrained loads it)"


def step_folder(out, step: int) -> Path:
    """Where the ``transformers`` folder of ``step`` (the checkpoint-stepK beside it) goes."""
    return Path(out) / f"hf-step{step}"


# ---- twinpipe train --model: --save-hf-every and the hooks


def add_train_arguments(group) -> None:
    """``--save-hf-every`` in ``twinpipe train``'s ``--model`` group."""
    group.add_argument("--save-hf-every", type=int, default=None, metavar="N",
                       help=f"with --model: every N steps also a checkpoint and beside it a transformers folder "
                            f"(--out/hf-stepK, kept); the run always ends with --out/{FINAL} (default: at the end only)")


def check_train_options(args) -> None:
    """``--save-hf-every``: an int >= 1, only with ``--model`` (ValueError naming it)."""
    if args.save_hf_every is None:
        return
    check_int(args.save_hf_every, "--save-hf-every", low=1)
    if args.model is None:
        raise bad("--save-hf-every", args.save_hf_every, "only with --model (the built-in GPT has no transformers form)")


def due(args, step: int) -> bool:
    """Whether the step ``step`` (the next to run) gets a ``transformers`` folder beside its checkpoint."""
    return args.model is not None and bool(args.save_hf_every) and step % args.save_hf_every == 0


def export_after_save(args, checkpoint, folder) -> Path:
    """Rank 0, after a save: the checkpoint just written as a ``transformers`` folder (replacing one
    left by an earlier run)."""
    from twinpipe.hf.export import export_checkpoint

    return export_checkpoint(checkpoint, args.model, folder, overwrite=True)


# ---- twinpipe export-hf


def add_export_hf_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "export-hf", help=SUMMARY, allow_abbrev=False,
        description="Write a twinpipe train checkpoint (any schedule, pp, dp, ep or precision wrote it) of a transformers "
                    "model as a folder AutoModelForCausalLM.from_pretrained loads: config.json, safetensors in "
                    "save_pretrained's names and layout, the tokenizer files of --model. The weights are the ones the "
                    "trained model computes with (bf16-mixed: the FP32 masters rounded to bfloat16).")
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint folder (checkpoint-final, checkpoint-stepK)")
    parser.add_argument("--model", required=True, metavar="DIR", help="the transformers model folder the run trained (--model)")
    cli_options.add(parser, "out", required=True, more="the transformers folder to write")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    return parser


def _check(args) -> None:
    if not Path(args.model).is_dir():
        raise bad("--model", args.model, "must be a transformers model folder (no such folder)")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise bad("--out", args.out, "must be a folder; it is a file")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise bad("--out", args.out, "must be absent or empty (or pass --overwrite to replace it)")


def run_export_hf(args) -> int:
    """Run ``twinpipe export-hf``; 0 on success, 2 (one line on stderr) when it cannot."""
    try:
        _check(args)
        import transformers  # noqa: F401
    except ImportError:
        print("twinpipe export-hf: error: it needs the transformers package (pip install 'twinpipe[hf]')", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"twinpipe export-hf: error: {error}", file=sys.stderr)
        return 2
    from twinpipe.hf.export import export_checkpoint
    from twinpipe.train.checkpoint import CheckpointWriteError

    try:
        folder = export_checkpoint(args.checkpoint, args.model, args.out, overwrite=args.overwrite)
    except (ValueError, OSError, CheckpointWriteError) as error:
        print(f"twinpipe export-hf: error: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"twinpipe export-hf: wrote {folder} (AutoModelForCausalLM.from_pretrained({str(folder)!r}))")
    return 0
