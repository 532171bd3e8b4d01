"""The MoE blocks and the multi-token-prediction head of ``twinpipe train``'s GPT, by their sizes
alone (pure Python): their parameter tensors and what one micro-batch of them keeps for backward.

A MoE block (``twinpipe.moe.MoEBlock``, ``GPTConfig(experts=E, top_k=k)``) holds its router, two
RMSNorms, the attention's qkv and proj, and ``local`` experts (``E / dp``: expert parallelism over
the stage's data-parallel ranks), each an up and a down projection of width 4d, without biases.
What it keeps depends on the routing: how many token copies reach this rank's experts. The rule:
with T = b t tokens per micro-batch, S = T k copies sent, and at most ``dp`` T min(k, local) rows
received (each token of each of the ``dp`` ranks sends at most one copy to each expert), every
expert padded to at least 8 rows (``MIN_EXPERT_ROWS``), the block keeps at most
``moe_block_bytes``: so the activations of a MoE run are an **upper bound**, not a prediction.

An MTP head (``GPTConfig(mtp_depth=D)``) is the head and D modules (two RMSNorms, a 2d -> d
projection, a dense block) and the head's copy of the token embedding; depth k runs on t - k
positions (``twinpipe.train.mtp``). What it keeps is fitted to ``measure_stage``'s measurements
(within 1%: ``tests/test_memory_predict.py``).
"""

from __future__ import annotations

__all__ = [
    "MIN_EXPERT_ROWS",
    "moe_block_bytes",
    "moe_block_numels",
    "mtp_head_bytes",
    "mtp_head_numels",
    "received_rows_bound",
]

MIN_EXPERT_ROWS = 8  # twinpipe.moe.block.MIN_EXPERT_ROWS: an expert runs on at least this many rows


def moe_block_numels(cfg, local: int) -> tuple[list[int], list[int]]:
    """(the shared tensors, the ``local`` experts' tensors) of a MoE block, in ``named_parameters`` order:
    router gate, norm1, norm2, qkv, proj; then each expert's up and down."""
    d = cfg.dim
    return [cfg.experts * d, d, d, 3 * d * d, d * d], [4 * d * d, 4 * d * d] * local


def mtp_head_numels(cfg) -> list[int]:
    """The MTP head's tensors: norm weight and bias, the output projection, then each depth's two
    RMSNorms, projection and dense block, then the embedding copy (``mtp_embed``, last)."""
    d, v = cfg.dim, cfg.vocab
    block = [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    return [d, d, v * d, v] + [d, d, 2 * d * d, *block] * cfg.mtp_depth + [v * d]


def received_rows_bound(tokens: int, top_k: int, experts: int, dp: int) -> int:
    """The most token copies a rank's experts can receive in one micro-batch, padding included:
    ``dp`` senders of ``tokens`` tokens, each sending at most min(k, local) copies to this rank,
    at most ``dp * tokens`` to one expert, every expert padded to ``MIN_EXPERT_ROWS`` rows."""
    local = experts // dp
    rows = dp * tokens * min(top_k, local)
    return min(rows + MIN_EXPERT_ROWS * local, local * max(dp * tokens, MIN_EXPERT_ROWS))


def moe_block_bytes(cfg, microbatch_size: int, elsize: int, dp: int) -> tuple[int, int]:
    """(F, W): at most the bytes one micro-batch of a MoE block keeps after F besides its input, and
    after B for its deferred weight gradients. Coefficients of the terms (per token: the attention's
    and norms' tensors, 10 and 9 d values; per received row: the expert's 4d hidden twice and its
    input, 9 and 10 d values; per copy sent: its row, weight and indices; the router's E scores per
    token) are the measured ones rounded up; with expert parallelism (``dp`` > 1) the dispatched and
    combined rows add 2 and 1 d values per received row."""
    b, t, d, e = microbatch_size, cfg.seq_len, cfg.dim, cfg.experts
    tokens = b * t
    sent = tokens * cfg.top_k
    rows = received_rows_bound(tokens, cfg.top_k, e, dp)
    moved = 0 if dp == 1 else rows
    f = (10 * tokens * d * elsize + sent * d * elsize + (9 * rows + 2 * moved) * d * elsize + e * tokens * elsize
         + 2 * tokens * elsize + 24 * sent + 2 * sent * elsize + t * t + 16 * e + 64 * elsize)
    w = (9 * tokens * d * elsize + (10 * rows + moved) * d * elsize + 5 * e * tokens * elsize + 11 * sent * elsize
         + 40 * tokens + 3 * t * t + 32 * e + 256 + 24 * elsize)
    return f, w


def mtp_head_bytes(cfg, microbatch_size: int, elsize: int) -> tuple[int, int]:
    """(F, W) of the MTP head besides its input and its two outputs (logits, hidden states): per depth
    k on L = t - k positions, 23 L d values (its norms, projection and block), the attention
    probabilities (h L L), the token ids (int64), the log-softmax (L vocab, FP32 from bf16; in bf16 the
    norms' FP32 copies, 10 L d bytes, and the main logits' FP32 copy too); W keeps
    20 L d values and the logits' gradient (L vocab) per depth, and the main head's norm output and
    logits' gradient."""
    b, t, d, v = microbatch_size, cfg.seq_len, cfg.dim, cfg.vocab
    loss_el = 8 if elsize == 8 else 4
    half = elsize == 2  # bf16: the norms and the main logits keep FP32 copies too
    f, w = b * t * elsize + half * (2 * b * t * v + 3 * b * t), b * t * d * elsize + b * t * v * elsize
    for k in range(1, cfg.mtp_depth + 1):
        n = b * (t - k)
        f += 23 * n * d * elsize + b * cfg.heads * (t - k) ** 2 * elsize + 9 * n * elsize + n * v * loss_el + 8 * n + 2 * elsize
        f += half * (10 * n * d + 4 * n)
        w += 20 * n * d * elsize + n * v * elsize
    return f, w
