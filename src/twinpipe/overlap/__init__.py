"""Part-level F&B overlap: a stage as an ordered list of compute and communication parts, and an
engine that runs one micro-batch's forward parts against another's backward parts."""

from twinpipe.overlap.comm import Then, all_to_all
from twinpipe.overlap.engine import forward_backward
from twinpipe.overlap.parts import Comm, Compute, Done, Pending
from twinpipe.overlap.report import comm_hidden, fb_chrome_trace, fb_spans
from twinpipe.overlap.stage import PartedSequential, PartedStage
from twinpipe.sim.overlap import Step, fb_order, predict_fb

__all__ = [
    "Comm", "Compute", "Done", "Pending", "Then", "PartedStage", "PartedSequential", "forward_backward", "all_to_all",
    "fb_order", "predict_fb", "Step", "comm_hidden", "fb_chrome_trace", "fb_spans",
]
