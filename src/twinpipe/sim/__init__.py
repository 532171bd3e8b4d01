"""Pure-Python simulation of pipeline schedules: a cost model in, a Timeline out (no torch)."""

from twinpipe.sim.costs import CostModel
from twinpipe.sim.engine import simulate

__all__ = ["CostModel", "simulate"]
