"""The planner: a model and a cluster (or a traced run's op times) -> every schedule and pipeline
size simulated by the one engine -> step time, memory and what limits each, ranked. No torch.
"""

from twinpipe.plan.predict import Prediction, plan, predict_one
from twinpipe.plan.spec import Cluster, Model

__all__ = ["Model", "Cluster", "Prediction", "plan", "predict_one"]
