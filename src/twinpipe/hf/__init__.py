"""Hugging Face ``transformers`` causal LMs through every twinpipe schedule (``pip install twinpipe[hf]``).

``build(model, schedule, num_ranks, rank, layout=...)`` gives one rank its stage modules, the
criterion and the batch split (docs/hf.md); ``twinpipe.hf.weights`` reads and writes the
model's safetensors checkpoints per stage (``load``, ``load_into``, ``save``); ``twinpipe.hf.mtp`` holds
DeepSeek-V3's multi-token prediction layers (``build(..., mtp_depth=D)``). Importing ``twinpipe`` does not import
``transformers``; the stages import it when they first run.
"""

from twinpipe.hf.layer import Context, DecoderLayer
from twinpipe.hf.layout import balanced_layout, format_layout, parse_layout
from twinpipe.hf.stages import CausalLMLoss, HFPartedStage, HFRankStages, HFStage, build, count_items
from twinpipe.hf.self_check import model_parts
from twinpipe.hf.support import TESTED, UnsupportedModelError, UntestedModelWarning
from twinpipe.hf.training import HFSource, TokenLoss, parameter_names

__all__ = [
    "build", "HFRankStages", "HFStage", "HFPartedStage", "CausalLMLoss", "count_items",
    "Context", "DecoderLayer", "parse_layout", "format_layout", "balanced_layout",
    "TESTED", "UnsupportedModelError", "UntestedModelWarning", "model_parts", "HFSource", "TokenLoss", "parameter_names",
]

# Earlier names of HFSource and HFRankStages, kept so scripts written against them still run (not in __all__).
HFStages, HFPipelineStages = HFSource, HFRankStages
