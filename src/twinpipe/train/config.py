"""What a training run is configured with: ``TrainConfig`` (every field checked when it is made) and
the record of a model's own configuration that the trainer agrees on and checkpoints store.

Pure Python (no torch at import), so the command line can check a configuration before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, is_dataclass

from twinpipe.checks import DEFAULT_TIMEOUT, bad, check_bool, check_choice, check_float, check_int, check_ints, checked_timeout
from twinpipe.precisions import PRECISIONS, PURE  # what each means, and the model dtype it needs

__all__ = ["TrainConfig", "DP_REDUCE", "ON_NONFINITE", "BALANCE", "PRECISIONS", "ZERO", "MAX_SEED", "EPLB_THRESHOLD", "check_eplb", "check_eplb_mesh", "model_record", "record_differences"]

DP_REDUCE = ("all-reduce", "ordered")  # the same names as grads.DataParallelReducer takes
ON_NONFINITE = ("skip", "raise")
BALANCE = ("params", "time")  # or a sequence of layer counts per stage (stages.split)
ZERO = (0, 1)  # 0: every data-parallel rank holds all optimizer state; 1: each a shard (zero.py)
# torch's CPU generator keeps the low 32 bits of a seed (and train/data.py mixes seeds modulo 2**32):
# a larger seed would silently repeat a smaller one's run.
MAX_SEED = 2**32 - 1
EPLB_THRESHOLD = 1.1  # twinpipe.eplb.Balancer's default


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What a run trains with. ``batch_size`` rows per step in all, ``microbatch_size`` per micro-batch.

    Every field is checked when the config is made (``ValueError`` naming the field, its value and
    what is allowed). ``max_norm``: None (no clipping) or a finite number > 0. ``on_nonfinite``: what
    a step whose loss or gradient norm is not finite does: ``"skip"`` (no update on any rank, the step
    is counted in ``Trainer.skipped_steps``) or ``"raise"`` (``NonFiniteStepError`` on every rank).
    ``bias_update_speed`` (gamma >= 0): after each step every MoE router's bias moves by gamma
    against its expert's load (``twinpipe.moe.bias``; 0: the biases stay): a ``twinpipe.moe``
    router's ``bias``, a ``transformers`` DeepSeek-V3 gate's ``e_score_correction_bias``.
    ``balance_alpha`` (alpha >= 0): DeepSeek-V3's sequence-wise balance loss on a ``transformers``
    DeepSeek-V3 model's gates (``Trainer(stages=...)``; ``twinpipe.moe.balance_loss``), its gradient
    only (the losses reported are the criterion's); a ``twinpipe.moe`` model sets its routers' own
    (``GPTConfig.balance_alpha``). ``mtp_depth`` (D >= 0),
    ``mtp_weight`` (lambda >= 0): the loss is ``L_main + lambda / D * sum_k L_MTP^k``, the model
    holding D multi-token-prediction modules (docs/deepseek-v3.md).
    ``precision``: ``"pure"`` (everything in the model's dtype, ``Trainer(dtype=...)``) or
    ``"bf16-mixed"`` (bf16 compute, FP32 masters, gradients and optimizer state; ``precision.py``).
    ``zero``: 0 (every data-parallel rank updates every parameter) or 1 (ZeRO-1: each updates and
    keeps optimizer state for its shard; ``zero.py``).
    ``ep``: the expert-parallel size, dividing the data-parallel size: each stage's MoE experts spread
    over EP groups of ``ep`` data-parallel ranks, replicated over the ``dp/ep`` groups
    (``mesh.TrainMesh.expert_groups``); None: ``dp`` (one EP group, no expert replicas).
    ``eplb_every`` (N >= 0; 0: off): EPLB in the loop (``live_eplb.py``): every N steps the experts of
    each MoE block whose max/mean EP-rank load over the last ``eplb_window`` steps (default N) is above
    ``eplb_threshold`` are re-placed, weights and optimizer state; ``redundant_experts`` (R >= 0, a
    multiple of the EP size): extra slots per block for replicas of the busiest experts.
    """

    schedule: str = "dualpipev"
    batch_size: int = 32
    microbatch_size: int = 4
    max_norm: float | None = None
    balance: str | tuple[int, ...] = "params"
    seed: int = 0
    timeout: float = DEFAULT_TIMEOUT
    dp_reduce: str = "all-reduce"  # or "ordered": bitwise the same for any number of replicas (grads.py)
    overlap_dp: bool = True  # start a stage's data-parallel reduction inside the pipeline step (one chain only)
    schedule_options: tuple = ()  # (name, value) pairs
    on_nonfinite: str = "skip"
    bias_update_speed: float = 0.0  # DeepSeek-V3's gamma: routing biases moved after each step (twinpipe.moe.bias)
    mtp_depth: int = 0  # multi-token prediction modules the model holds (GPTConfig.mtp_depth)
    mtp_weight: float = 0.0  # lambda: the MTP losses' weight, lambda / depth each
    precision: str = PURE
    zero: int = 0
    balance_alpha: float = 0.0  # DeepSeek-V3's sequence-wise balance loss on a transformers model's gates
    ep: int | None = None  # expert-parallel size (None: the data-parallel size)
    eplb_every: int = 0  # steps between rebalances (0: the placement never changes)
    redundant_experts: int = 0  # replica slots per MoE block, beyond one per expert
    eplb_window: int | None = None  # steps of loads a rebalance decides from (None: eplb_every)
    eplb_threshold: float = EPLB_THRESHOLD  # max/mean rank load above which a block is re-placed

    def __post_init__(self):
        from twinpipe.schedule import registry

        info = registry.get(self.schedule) if isinstance(self.schedule, str) else None
        if info is None:
            raise bad("schedule", self.schedule, f"must be a schedule name ({', '.join(registry.names())})")
        check_int(self.batch_size, "batch_size", low=1)
        check_int(self.microbatch_size, "microbatch_size", low=1)
        if self.max_norm is not None:
            allowed = "must be None (no clipping) or a finite number > 0 (the largest global gradient norm)"
            try:
                check_float(self.max_norm, "max_norm", low=0.0, low_open=True)
            except ValueError:
                raise bad("max_norm", self.max_norm, allowed) from None
        object.__setattr__(self, "balance", _checked_balance(self.balance))
        check_int(self.seed, "seed", low=0, high=MAX_SEED)
        checked_timeout(self.timeout, "timeout")
        check_choice(self.dp_reduce, "dp_reduce", DP_REDUCE)
        check_bool(self.overlap_dp, "overlap_dp")
        check_choice(self.on_nonfinite, "on_nonfinite", ON_NONFINITE)
        check_float(self.bias_update_speed, "bias_update_speed", low=0.0)
        check_float(self.balance_alpha, "balance_alpha", low=0.0)
        check_int(self.mtp_depth, "mtp_depth", low=0)
        check_float(self.mtp_weight, "mtp_weight", low=0.0)
        if self.mtp_weight and not self.mtp_depth:
            raise bad("mtp_weight", self.mtp_weight, "must be 0 without multi-token prediction (mtp_depth=0)")
        check_choice(self.precision, "precision", PRECISIONS)
        check_int(self.zero, "zero", low=0, high=1)  # ZERO
        if self.ep is not None:
            check_int(self.ep, "ep", low=1, why="None: the data-parallel size")
        object.__setattr__(self, "schedule_options", _checked_options(self.schedule_options, info))
        check_eplb(self.eplb_every, self.redundant_experts, self.eplb_window, self.eplb_threshold)

    def expert_parallel(self, dp: int) -> int:
        """The expert-parallel size on ``dp`` data-parallel ranks: ``ep``, or ``dp`` when None."""
        return dp if self.ep is None else self.ep

    def num_microbatches(self, dp: int) -> int:
        """Micro-batches per pipeline per step."""
        if self.batch_size % (dp * self.microbatch_size):
            raise ValueError(
                f"batch_size={self.batch_size}: must be a multiple of dp={dp} x microbatch_size={self.microbatch_size}"
            )
        return self.batch_size // (dp * self.microbatch_size)


def check_eplb(every: int, redundant: int, window: int | None, threshold: float, *, flags: bool = False) -> None:
    """The EPLB settings' own bounds, named as fields (``flags``: as the command's ``--eplb-every``...);
    what they need of the model and the mesh is checked where those are known (``live_eplb.py``)."""
    name = (lambda field: f"--{field.replace('_', '-')}") if flags else (lambda field: field)
    check_int(every, name("eplb_every"), low=0, why="0: no rebalancing")
    check_int(redundant, name("redundant_experts"), low=0)
    if window is not None:
        check_int(window, name("eplb_window"), low=1, why="steps of loads")
    check_float(threshold, name("eplb_threshold"), low=1.0, why="a max/mean load ratio")
    if not every:
        for field, value, default in (("redundant_experts", redundant, 0), ("eplb_window", window, None),
                                      ("eplb_threshold", threshold, EPLB_THRESHOLD)):
            if value != default:
                raise bad(name(field), value, f"only with {name('eplb_every')} N >= 1 (EPLB in the loop)")


def check_eplb_mesh(*, eplb_every: int, redundant: int, ep: int, dp: int, precision: str, zero: int, mirrored: bool,
               flags: bool = False) -> None:
    """What EPLB in the loop needs of the mesh and the update (ValueError naming the setting, as
    ``--eplb-every`` with ``flags``): experts over more than one rank, one EP group per stage, an
    optimizer over the expert weights themselves, one copy of each stage."""
    if not eplb_every:
        return
    name = (lambda s: f"--{s.replace('_', '-')}") if flags else (lambda s: s)
    if ep < 2:
        raise bad(name("eplb_every"), eplb_every, f"needs the experts spread over EP ranks ({name('ep')} >= 2; it is {ep})")
    if redundant % ep:
        raise bad(name("redundant_experts"), redundant, f"must be a multiple of {name('ep')}={ep} (every EP rank holds "
                  "the same number of slots)")
    if ep != dp:
        raise bad(name("eplb_every"), eplb_every, f"needs {name('ep')} = {name('dp')} ({ep} != {dp}): with several EP "
                  "groups per stage each would place its experts by its own loads")
    refused = [why for hit, why in ((precision != PURE, f"{name('precision')}={precision!r}: the optimizer updates FP32 masters"),
                                    (bool(zero), f"{name('zero')}={zero}: each rank updates a share of the weights"),
                                    (mirrored, "a schedule with mirrored stage copies (DualPipe, Chimera, BitPipe): "
                                               "each copy would move alone")) if hit]
    if refused:
        raise bad(name("eplb_every"), eplb_every, f"is not supported with {refused[0]}; "
                  "EPLB in the loop moves the experts' weights and Adam state together (pure precision, zero 0)")


def _checked_balance(balance):
    allowed = f"must be {' or '.join(map(repr, BALANCE))} or a sequence of layer counts per stage (ints >= 1)"
    if isinstance(balance, str):
        if balance not in BALANCE:
            raise bad("balance", balance, allowed)
        return balance
    try:
        return check_ints(balance, "balance", low=1)
    except ValueError:
        raise bad("balance", balance, allowed) from None


def _checked_options(options, info) -> tuple:
    allowed = "must be a sequence of (name, value) pairs with distinct names"
    try:
        pairs = tuple(tuple(pair) for pair in options)
    except TypeError:
        raise bad("schedule_options", options, allowed) from None
    if any(len(p) != 2 or not isinstance(p[0], str) for p in pairs) or len({p[0] for p in pairs}) != len(pairs):
        raise bad("schedule_options", options, allowed)
    takes = info.options
    unknown = [name for name, _ in pairs if takes is not None and name not in takes]
    if unknown:
        raise bad("schedule_options", options, f"{info.name} takes {', '.join(takes) if takes else 'no options'} (not {', '.join(unknown)})")
    return pairs


def model_record(model) -> dict:
    """The model's configuration as JSON data: ``{"config": {...}}`` from its ``config`` attribute (its
    ``record()``, a dataclass, or anything with ``to_dict()``), else ``{"repr_sha256": ...}`` of ``repr(model)``."""
    config = getattr(model, "config", None)
    if callable(getattr(config, "record", None)):  # a config that says what of it a record keeps
        value = config.record()
    elif config is not None and is_dataclass(config) and not isinstance(config, type):
        value = asdict(config)
    elif config is not None and callable(getattr(config, "to_dict", None)):
        value = config.to_dict()
    else:
        return {"repr_sha256": hashlib.sha256(repr(model).encode()).hexdigest()}
    return {"config": json.loads(json.dumps(value, sort_keys=True, default=repr))}


def record_differences(saved: dict, mine: dict) -> list[str]:
    """``"heads: 2 in the checkpoint, 4 here"`` for each way two model records differ."""
    if "config" in saved and "config" in mine:
        a, b = saved["config"], mine["config"]
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(set(a) | set(b))
            return [f"{k}: {a.get(k, '(absent)')!r} in the checkpoint, {b.get(k, '(absent)')!r} here" for k in keys if a.get(k) != b.get(k)]
    if saved == mine:
        return []
    return [f"{_describe(saved)} in the checkpoint, {_describe(mine)} here"]


def _describe(record: dict) -> str:
    if "config" in record:
        return "config " + json.dumps(record["config"], sort_keys=True)
    return f"repr digest {str(record.get('repr_sha256'))[:12]}"
