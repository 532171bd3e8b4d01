"""What ``train-log.json`` records of the model a ``twinpipe train`` run trained: the options, without
the built-in GPT's sizes on a ``--model`` run (they do not apply), and for ``--model`` the model as it
ran (``model``: its folder, ``config.json`` as loaded, the stages' layout as resolved, ``--ep``, the
MTP depth and the parameter count)."""

from __future__ import annotations

import json

from twinpipe.train_command.model import GPT_OPTIONS

__all__ = ["logged_options", "model_entry"]

_GPT_DESTS = frozenset({flag[2:].replace("-", "_") for flag in GPT_OPTIONS})


def logged_options(options: dict, model) -> dict:
    """``options`` (every option by ``dest``) as the log keeps them: with ``--model`` (``model`` not
    None) without ``--dim``, ``--heads``, ``--layers``, ``--experts``, ``--top-k`` and ``--vocab``."""
    return options if model is None else {k: v for k, v in options.items() if k not in _GPT_DESTS}


def model_entry(args, info, layout: str) -> dict:
    """``{"model": ...}``: the ``--model`` run's model (``info``: ``train_command.model.ModelInfo``;
    ``layout``: the stages as built), or ``{}`` for the built-in GPT (its sizes are the options)."""
    if info is None:
        return {}
    config = info.config
    return {"model": {"folder": args.model, "model_type": config.model_type, "parameters": info.count, "layout": layout,
                      "ep": args.ep, "mtp_depth": args.mtp_depth, "config": json.loads(config.to_json_string(use_diff=False))}}
