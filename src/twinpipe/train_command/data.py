"""``twinpipe train --data FILE``: the training tokens the command line reads, checked before any rank starts.

``add_arguments`` adds the option group; ``check_data`` holds the file to its rules (exists, not
empty, a known dtype, every id below the vocabulary, at least ``--seq-len + 1`` ids) and settles the
built-in GPT's vocabulary; ``tokens`` gives a rank its ids (a memory map, or text tokenized with the
``--model`` folder's tokenizer). Pure Python and numpy at import: torch and transformers are imported
only where a function needs them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import twinpipe.cli_options as cli_options
from twinpipe.train.tokens import BIN_DTYPES, CHUNK, is_text, open_tokens, token_range, tokenize_text

__all__ = ["add_arguments", "check_data", "tokens", "file_tokens", "vocab", "BYTE_VOCAB"]

BYTE_VOCAB = 256  # the built-in corpus: a token is a byte


def add_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The ``--data`` options, in a group of their own."""
    group = parser.add_argument_group("data (default: Python's standard library as bytes)")
    group.add_argument("--data", default=None, metavar="FILE",
                       help="token ids: a flat .npy array (memory-mapped) or a raw .bin (nanoGPT, Megatron: --data-dtype "
                            "or its .idx gives the width); or text (.txt, a folder of them, a glob) tokenized with "
                            "--model's tokenizer")
    group.add_argument("--data-dtype", default=None, choices=BIN_DTYPES,
                       help="the width of a .bin file's ids (no default: a .bin has no header; a Megatron .idx beside it "
                            "gives it)")
    cli_options.add(parser, "vocab", group=group, default=None,
                    more="without --model: the built-in GPT's (default: the largest id in --data + 1, else 256 bytes)")
    return group


def check_data(args, model_vocab: int | None = None, tokenizer=None) -> int | None:
    """Check ``--data`` (ValueError naming the option); return the vocabulary the model needs
    (``model_vocab``, else ``--vocab``, else the largest id + 1), or None without ``--data``.

    Ids are checked by a full scan of the memory map, ``CHUNK`` ids at a time (memory: one chunk)."""
    if args.data is None:
        if args.data_dtype is not None:
            raise ValueError(f"--data-dtype={args.data_dtype}: only with --data (a .bin file)")
        if model_vocab is None:
            if args.vocab is not None and args.vocab < BYTE_VOCAB:
                raise ValueError(f"--vocab={args.vocab}: the built-in corpus is bytes: must be >= {BYTE_VOCAB}")
            return None
        if tokenizer is None:
            raise ValueError(f"--model={args.model!r}: has no tokenizer, so the built-in corpus (text) cannot be "
                             "tokenized for it: give --data (token ids of its vocabulary, or text)")
    ids = tokens(args, tokenizer)
    what = f"--data={args.data!r}" if args.data is not None else f"the built-in corpus (--corpus-bytes={args.corpus_bytes})"
    if ids.size < args.seq_len + 1:
        raise ValueError(f"{what}: holds {ids.size} tokens; one sequence needs --seq-len + 1 = "
                         f"{args.seq_len + 1} (lower --seq-len)")
    low, high = token_range(ids, CHUNK)
    if low < 0:
        raise ValueError(f"{what}: holds a negative token id ({low})")
    if model_vocab is not None:
        if high >= model_vocab:
            raise ValueError(f"{what}: holds token id {high}, and --model's vocabulary has {model_vocab} "
                             "(ids 0.." f"{model_vocab - 1}): tokenized for another model?")
        return model_vocab
    if args.vocab is not None:
        if high >= args.vocab:
            raise ValueError(f"--vocab={args.vocab}: must be > {high}, the largest token id in --data={args.data!r}")
        return args.vocab
    return high + 1


def tokens(args, tokenizer=None):
    """This run's token ids: the ``--data`` file memory-mapped (numpy), or its text tokenized with
    ``tokenizer`` (ValueError naming ``--data`` when text comes without one). Without ``--data``: the
    built-in corpus, its bytes, or with ``tokenizer`` its text tokenized."""
    if args.data is None:
        from twinpipe.train.data import stdlib_corpus

        corpus = stdlib_corpus(args.corpus_bytes)
        if tokenizer is None:
            return corpus
        text = corpus.numpy().tobytes().decode("utf-8", errors="replace")  # a cut may split a character
        return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    return file_tokens(args, args.data, "--data", tokenizer)


def file_tokens(args, path: str, name: str, tokenizer=None):
    """The token ids of file ``path`` (option ``name``: ``--data``, ``--eval-data``), by ``tokens``' rules:
    a memory map (a .bin's width from ``--data-dtype`` or its .idx), or text tokenized with ``tokenizer``."""
    if is_text(path):
        if args.data_dtype is not None and name == "--data":
            raise ValueError(f"--data-dtype={args.data_dtype}: only for a .bin file, not text ({name}={path!r})")
        if tokenizer is None:
            model = getattr(args, "model", None)
            where = f"--model={model} has no tokenizer files" if model else "give --model DIR, a folder with a tokenizer"
            raise ValueError(f"{name}={path!r}: text needs a tokenizer: {where} (or pass token ids as .npy/.bin)")
        return tokenize_text(path, tokenizer, name=name)
    width = args.data_dtype if name == "--data" or Path(path).suffix.lower() == ".bin" else None  # --data's rules are its own
    return open_tokens(path, width, name=name, dtype_name="--data-dtype")


def vocab(args) -> int:
    """The built-in GPT's vocabulary: what ``check_data`` settled (kept on ``args``), or 256 bytes."""
    return getattr(args, "data_vocab", None) or args.vocab or BYTE_VOCAB


def load_tokenizer(folder: str | None):
    """The ``transformers`` tokenizer saved in ``folder`` (read locally, nothing downloaded), or None
    when there is no folder or no tokenizer in it."""
    if folder is None or not Path(folder).is_dir():
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(folder) / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"--model={folder}: its tokenizer does not load: {str(error).splitlines()[0]}") from None
