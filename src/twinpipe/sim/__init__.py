"""Pure-Python simulation of pipeline schedules: a cost model in, a Timeline out (no torch)."""

from twinpipe.sim.costs import CostModel
from twinpipe.sim.engine import Summary, simulate, summarize
from twinpipe.sim.overlap import fb_order, predict_fb

__all__ = ["CostModel", "Summary", "simulate", "summarize", "fb_order", "predict_fb"]
