"""``twinpipe train --eval-data FILE``: held-out evaluation, checked before any rank starts and run by
every rank between steps (``Trainer.evaluate``: forward-only steps through the same pipeline).

``--eval-data`` takes what ``--data`` takes (token ids, or text with ``--model``'s tokenizer); its
first ``--eval-batches`` x ``--batch-size`` consecutive windows of ``--seq-len`` tokens are the held-out
set, the same at every evaluation. The run evaluates after every ``--eval-every`` steps and after its
last step; each result goes to the progress output, ``train-log.json``'s ``eval`` list
(``{"step", "loss", "perplexity"}``: ``step`` counts the steps trained, as ``checkpoint-stepK`` does)
and the loss plot.
"""

from __future__ import annotations

import argparse

from twinpipe.checks import bad, check_int
from twinpipe.train.tokens import CHUNK, is_text, token_range
from twinpipe.train_command.data import file_tokens

__all__ = ["add_arguments", "check", "needs_tokenizer", "Evaluation", "DEFAULT_BATCHES"]

DEFAULT_BATCHES = 4


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``--eval-*`` options, in a group of their own."""
    group = parser.add_argument_group("held-out evaluation (default: none)")
    group.add_argument("--eval-data", default=None, metavar="FILE",
                       help="held-out tokens, as --data takes them: the loss and perplexity of its first --eval-batches "
                            "x --batch-size windows of --seq-len tokens, forward only, after the last step (and every "
                            "--eval-every steps), in the progress output, train-log.json and the plot")
    group.add_argument("--eval-every", type=int, default=None, metavar="N",
                       help="also evaluate after every N steps (default: after the last step only); needs --eval-data")
    group.add_argument("--eval-batches", type=int, default=None, metavar="K",
                       help=f"held-out batches of --batch-size sequences (default: {DEFAULT_BATCHES}); needs --eval-data")
    return group


def needs_tokenizer(args) -> bool:
    """Whether ``--eval-data`` is text (``--model``'s tokenizer reads it)."""
    return args.eval_data is not None and is_text(args.eval_data)


def check(args, vocab: int | None, tokenizer=None) -> None:
    """Check the ``--eval-*`` options and the file (ValueError naming the option): enough tokens for
    the batches, every id below ``vocab`` (the model's). Sets ``args.eval_batches``' default."""
    if args.eval_data is None:
        for flag, value in (("--eval-every", args.eval_every), ("--eval-batches", args.eval_batches)):
            if value is not None:
                raise bad(flag, value, "needs --eval-data FILE (the held-out tokens to evaluate on)")
        return
    if args.eval_every is not None:
        check_int(args.eval_every, "--eval-every", low=1)
    if args.eval_batches is None:
        args.eval_batches = DEFAULT_BATCHES
    check_int(args.eval_batches, "--eval-batches", low=1)
    ids = file_tokens(args, args.eval_data, "--eval-data", tokenizer)
    from twinpipe.train.evaluation import HeldOutBatches

    need = HeldOutBatches.tokens_needed(args.eval_batches, args.batch_size, args.seq_len)
    if ids.size < need:
        raise bad("--eval-data", args.eval_data, f"holds {ids.size} tokens; --eval-batches={args.eval_batches} x "
                  f"--batch-size={args.batch_size} x --seq-len={args.seq_len} + 1 = {need} are needed (lower --eval-batches)")
    low, high = token_range(ids, CHUNK)
    if low < 0:
        raise bad("--eval-data", args.eval_data, f"holds a negative token id ({low})")
    if vocab is not None and high >= vocab:
        raise bad("--eval-data", args.eval_data, f"holds token id {high}, and the model's vocabulary has {vocab} "
                  f"(ids 0..{vocab - 1}): tokenized for another model?")


class Evaluation:
    """A rank's held-out evaluation: ``after(step)`` evaluates when due (collective: every rank calls
    it after every step), records the result in ``log`` and shows it on ``progress``."""

    def __init__(self, args, trainer, tokenizer, log, progress):
        self.trainer, self.log, self.progress = trainer, log, progress
        self.every, self.count, self.last = args.eval_every, args.eval_batches, args.steps
        self.batches = None
        if args.eval_data is not None:
            from twinpipe.train.evaluation import HeldOutBatches

            self.batches = HeldOutBatches(file_tokens(args, args.eval_data, "--eval-data", tokenizer), args.seq_len)
            log.header["eval"] = []  # written with the header, every time the log is

    @property
    def results(self) -> list[dict]:
        return self.log.header.get("eval", [])

    def after(self, step: int) -> None:
        """After training ``step`` (counted from 0): evaluate if ``--eval-every`` or the run's end says so."""
        done = step + 1
        if self.batches is None or not (done == self.last or (self.every and done % self.every == 0)):
            return
        result = self.trainer.evaluate(self.batches, self.count)
        self.results.append({"step": done, "loss": result.loss, "perplexity": result.perplexity})
        self.progress.evaluated(done, result.loss, result.perplexity)
