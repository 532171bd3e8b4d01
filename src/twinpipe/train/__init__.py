"""Training on a pipeline: split a model, a (dp, pp) mesh, reductions, optimizer, checkpoints, data.

Built on ``twinpipe.runtime``; see docs/train.md.
"""

from twinpipe.train.data import BatchSampler, stdlib_corpus
from twinpipe.train.mesh import TrainMesh, build_mesh
from twinpipe.train.model import GPT, GPTConfig, lm_loss
from twinpipe.train.reference import ReferenceTrainer
from twinpipe.train.stage_source import StageSource
from twinpipe.train.stages import Stage, model_layers, split, stage_modules
from twinpipe.train.trainer import NonFiniteStepError, StepResult, TrainConfig, Trainer

__all__ = [
    "split", "stage_modules", "model_layers", "Stage", "StageSource",
    "TrainMesh", "build_mesh", "TrainConfig", "Trainer", "StepResult", "NonFiniteStepError", "ReferenceTrainer",
    "BatchSampler", "stdlib_corpus", "GPT", "GPTConfig", "lm_loss",
]
