"""Names on disk and names in the model: how a ``transformers`` checkpoint stores each tensor of a
causal LM, read from ``transformers``' own conversion mapping (nothing per architecture here).

A model's tensor (a key of ``AutoModelForCausalLM.state_dict()``) is stored either under one key
(its own name, or one a ``WeightRenaming`` maps to it: Mixtral's ``block_sparse_moe`` for ``mlp``),
or, for the fused expert tensors of transformers 5 (``experts.gate_up_proj``, ``experts.down_proj``:
3-D, experts along dim 0), as one 2-D key per expert and source (``experts.3.gate_proj.weight``,
``experts.3.up_proj.weight``), which ``transformers`` stacks (``MergeModulelist(dim=0)``) and, for
several sources, concatenates (``Concatenate(dim=d)``) when it loads. Those two operations are the
ones read here; a tensor whose conversion uses another is refused by name. Tied weights
(``lm_head.weight`` with ``tie_word_embeddings``) are stored under their source only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

__all__ = ["ModelNames", "Fused"]


@dataclass(frozen=True)
class Fused:
    """How a fused expert tensor is built from per-expert keys: ``sources`` (the converter's source
    patterns, in concatenation order), concatenated along ``dim`` of the fused tensor (None: one source)."""

    sources: tuple[str, ...]
    dim: int | None


def _ops(converter) -> tuple[list[str], int | None] | str:
    """(op names, concat dim) of a converter made of MergeModulelist(0) [+ Concatenate(d)], else why not."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim != 0:
        return f"its conversion is {ops!r}"
    if len(ops) == 1 and len(converter.source_patterns) == 1:
        return [], None
    if len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1:
        return [], ops[1].dim
    return f"its conversion is {ops!r}"


def _index_pattern(pattern: str) -> re.Pattern:
    """A converter's source pattern (``mlp.experts.*.gate_proj.weight``) as a regex capturing the expert index."""
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + r"(?!\w)")


class ModelNames:
    """The tensors of one causal LM configuration and how its checkpoints name them on disk."""

    def __init__(self, config):
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

        try:
            with torch.device("meta"):  # shapes and names only: no memory, no initialisation
                model = AutoModelForCausalLM.from_config(config)
        except ValueError as error:  # transformers': "Unrecognized configuration class ..."
            raise ValueError(f"config {type(config).__name__} (model_type {getattr(config, 'model_type', None)!r}): "
                             f"transformers builds no causal LM from it ({str(error).splitlines()[0]})") from None
        self.model_class = type(model).__name__
        self.meta = model.state_dict()
        # DeepSeek-V3's MTP layers (config.num_nextn_predict_layers), stored after the model's layers: known
        # to load and save, not required in a checkpoint (twinpipe.hf.mtp).
        from twinpipe.hf.mtp_layer import checkpoint_meta

        self.optional: set[str] = set()
        for name, tensor in checkpoint_meta(config):
            self.meta[name] = tensor
            self.optional.add(name)
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(v.shape) for k, v in self.meta.items()}
        tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
        self.tied: dict[str, str] = {t: s for t, s in tied.items() if t in self.shapes and s in self.shapes}
        self.prefix = model.base_model_prefix
        # Loading: transformers' order (every renaming, then at most one converter), legacy names included.
        loading = get_model_conversion_mapping(model)
        self.renamings = [t for t in loading if isinstance(t, WeightRenaming)]
        self.converters = [t for t in loading if isinstance(t, WeightConverter)]
        # Saving: as save_pretrained reverts it (no legacy names, no prefix change, reversed order).
        saving = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)][::-1]
        self._save_renamings = [t.reverse_transform() for t in saving if isinstance(t, WeightRenaming)]
        self._save_converters = [(t, t.reverse_transform()) for t in saving if isinstance(t, WeightConverter)]
        self.fused: dict[str, Fused] = {}
        self._unsupported: dict[str, str] = {}
        for name in self.shapes:
            for forward, backward in self._save_converters:
                if backward.rename_source_key(name)[1] is None:
                    continue
                ops = _ops(forward)
                if isinstance(ops, str):
                    self._unsupported[name] = ops
                else:
                    self.fused[name] = Fused(tuple(forward.source_patterns), ops[1])
                break

    # ---- model side
    def canonical(self, name: str) -> str:
        """The name a tensor is stored under: a tied weight's source, else ``name``."""
        return self.tied.get(name, name)

    def stored(self) -> list[str]:
        """Every tensor a checkpoint of this model holds (tied weights once), in the model's order; not the
        optional ones (MTP layers)."""
        return [n for n in self.shapes if n not in self.tied and n not in self.optional]

    def refuse_unsupported(self, name: str, where: str) -> None:
        if name in self._unsupported:
            raise ValueError(f"{where}: tensor {name!r} is stored through a transformers conversion this loader does "
                             f"not read ({self._unsupported[name]}); only MergeModulelist(dim=0) [+ Concatenate] are")

    # ---- disk -> model (loading)
    def from_disk(self, key: str) -> tuple[str, str | None, int | None]:
        """(model name, converter source pattern or None, expert index or None) of a key on disk, as
        ``from_pretrained`` renames it; the model name is not in ``self.shapes`` for a key it ignores."""
        from transformers.core_model_loading import apply_renamings, rename_source_key

        name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.meta)
        if name not in self.meta and key in self.meta:  # transformers' own fallback: the key as it is
            name, pattern = rename_source_key(key, [], [], self.prefix, self.meta)
        if pattern is None:
            return name, None, None
        found = _index_pattern(pattern).search(apply_renamings(key, self.renamings))
        return name, pattern, (int(found.group(1)) if found else None)

    # ---- model -> disk (saving)
    def disk_key(self, name: str, source: int | None = None, expert: int | None = None) -> str:
        """The key ``save_pretrained`` writes for tensor ``name`` (for a fused one: its ``source``-th
        part of expert ``expert``), checked to read back as that tensor; a plain name is kept as it is
        when its renamed form would not read back."""
        from transformers.core_model_loading import apply_renamings

        if source is None:
            key = apply_renamings(name, self._save_renamings)
            return key if self.from_disk(key) == (name, None, None) else name
        fused = self.fused[name]
        for forward, backward in self._save_converters:
            renamed, pattern = backward.rename_source_key(name)
            if pattern is None:
                continue
            # rename_source_key put the first source in; the source-th is the same key with that one swapped
            first, wanted = backward.target_patterns[0], backward.target_patterns[source]
            key = apply_renamings(renamed.replace(first, wanted, 1).replace("*", str(expert), 1), self._save_renamings)
            if self.from_disk(key) == (name, fused.sources[source], expert):
                return key
            raise ValueError(f"tensor {name!r}: the per-expert key {key!r} would not load back as expert {expert} "
                             f"of it (transformers' conversion mapping changed?)")
        raise KeyError(name)
