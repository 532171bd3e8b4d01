"""Recording real runs as Timelines, exporting Chrome/Perfetto traces, measured vs predicted.

Imports torch only inside ``gather_timeline`` (and matplotlib only when drawing a report).
"""

from twinpipe.trace.chrome import chrome_trace, write_chrome_trace
from twinpipe.trace.compare import compare_numbers, predict, write_run_report
from twinpipe.trace.costs import estimate_comm, estimate_costs, mean_op_times
from twinpipe.trace.record import build_timeline, gather_timeline

__all__ = [
    "gather_timeline", "build_timeline", "chrome_trace", "write_chrome_trace", "estimate_costs",
    "estimate_comm", "mean_op_times", "predict", "compare_numbers", "write_run_report",
]
