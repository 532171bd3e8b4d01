"""The names the official ``dualpipe.utils`` exports, so migrating is an import change:
``from dualpipe.utils import WeightGradStore, run_backward`` becomes
``from twinpipe.utils import WeightGradStore, run_backward``."""

from twinpipe.runtime.executor import run_backward
from twinpipe.runtime.weight_grad import WeightGradStore

__all__ = ["WeightGradStore", "run_backward"]
