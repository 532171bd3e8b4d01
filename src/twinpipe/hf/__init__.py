"""Hugging Face ``transformers`` causal LMs through every twinpipe schedule (``pip install twinpipe[hf]``).

Importing ``twinpipe`` does not import ``transformers``; importing ``twinpipe.hf`` does, where a
module needs it.
"""

from twinpipe.hf.layer import Context, DecoderLayer

__all__ = ["Context", "DecoderLayer"]
