"""``TrainConfig`` checks every field when it is made, and the model configuration record."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from twinpipe.checks import DEFAULT_TIMEOUT
from twinpipe.train import TrainConfig

NORM = "must be None (no clipping) or a finite number > 0"


@pytest.mark.parametrize("field, value, message", [
    ("max_norm", -1, f"max_norm=-1: {NORM}"),  # was taken: the update changed direction
    ("max_norm", 0, f"max_norm=0: {NORM}"),  # was taken: every update zeroed
    ("max_norm", 0.0, f"max_norm=0.0: {NORM}"),
    ("max_norm", float("nan"), f"max_norm=nan: {NORM}"),  # silently meant "no clipping"
    ("max_norm", float("inf"), f"max_norm=inf: {NORM}"),
    ("max_norm", "1", f"max_norm='1': {NORM}"),
    ("max_norm", True, f"max_norm=True: {NORM}"),
    ("batch_size", 0, "batch_size=0: must be >= 1"),
    ("batch_size", 8.0, "batch_size=8.0: must be an int >= 1"),
    ("batch_size", True, "batch_size=True: must be an int >= 1"),
    ("microbatch_size", -2, "microbatch_size=-2: must be >= 1"),
    ("timeout", 0, "timeout=0: must be a finite number >= 0.001"),
    ("timeout", float("nan"), "timeout=nan: must be a finite number"),
    ("timeout", 1e300, "timeout=1e+300: must be a finite number"),
    ("timeout", "60", "timeout='60': must be a finite number"),
    ("seed", -1, "seed=-1: must be >= 0"),
    ("seed", 1.5, "seed=1.5: must be an int"),
    ("seed", 2**64, "seed=18446744073709551616: must be >= 0 and <= "),
    # torch's CPU generator keeps 32 bits of a seed: 2**32 would silently rerun seed 0
    ("seed", 2**32, "seed=4294967296: must be >= 0 and <= 4294967295"),
    ("dp_reduce", "sum", "dp_reduce='sum': allowed are 'all-reduce', 'ordered'"),
    ("overlap_dp", "yes", "overlap_dp='yes': must be True or False"),
    ("overlap_dp", 1, "overlap_dp=1: must be True or False"),
    ("balance", "flops", "balance='flops': must be 'params' or 'time' or a sequence of layer counts per stage"),
    ("balance", (0, 2), "balance=(0, 2): must be 'params' or 'time' or a sequence"),
    ("balance", [], "balance=[]: must be"),
    ("balance", 3, "balance=3: must be"),
    ("on_nonfinite", "ignore", "on_nonfinite='ignore': allowed are 'skip', 'raise'"),
    ("schedule", "zigzag", "schedule='zigzag': allowed are "),
    ("schedule", 3, "schedule=3: must be a schedule name"),
    ("schedule_options", (("pairs", 2),), "schedule_options=(('pairs', 2),): dualpipev takes no options (not pairs)"),
    ("schedule_options", ("pairs",), "schedule_options=('pairs',): must be a sequence of (name, value) pairs"),
    ("schedule_options", 5, "schedule_options=5: must be a sequence of (name, value) pairs"),
])
def test_every_field_is_checked_when_the_config_is_made(field, value, message):
    with pytest.raises(ValueError) as error:
        TrainConfig(**{field: value})
    assert str(error.value).startswith(message), str(error.value)


def test_good_values_are_kept_and_normalised():
    config = TrainConfig(max_norm=1, balance=[2, 3], schedule="chimera", schedule_options=[["pairs", 1]], on_nonfinite="raise")
    assert config.max_norm == 1 and config.balance == (2, 3) and config.schedule_options == (("pairs", 1),)
    assert TrainConfig().timeout == DEFAULT_TIMEOUT and TrainConfig().on_nonfinite == "skip" and TrainConfig().max_norm is None
    assert TrainConfig(schedule="1F1B").schedule == "1F1B"  # any case and aliases, as the registry takes them


def test_batch_sizes_that_need_dp_are_checked_with_it():
    with pytest.raises(ValueError, match=r"batch_size=10: must be a multiple of dp=2 x microbatch_size=4"):
        TrainConfig(batch_size=10, microbatch_size=4).num_microbatches(2)


@dataclass(frozen=True)
class _Config:
    heads: int = 2
    width: int = 8


class _WithConfig:
    def __init__(self, config):
        self.config = config


class _ToDict:
    def __init__(self, heads):
        self.heads = heads

    def to_dict(self):
        return {"heads": self.heads}


def test_the_model_record_is_its_config_or_a_digest_of_its_repr():
    import torch

    from twinpipe.train.config import model_record, record_differences

    assert model_record(_WithConfig(_Config())) == {"config": {"heads": 2, "width": 8}}
    assert model_record(_WithConfig(_ToDict(4))) == {"config": {"heads": 4}}
    a, b = model_record(torch.nn.Linear(2, 3)), model_record(torch.nn.Linear(2, 3, bias=False))
    assert set(a) == {"repr_sha256"} and a != b
    assert record_differences(model_record(_WithConfig(_Config(heads=2))), model_record(_WithConfig(_Config(heads=4)))) == [
        "heads: 2 in the checkpoint, 4 here"]
    assert record_differences(a, a) == [] and len(record_differences(a, b)) == 1
