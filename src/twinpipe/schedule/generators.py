"""Imports every built-in generator module so that each registers itself."""

from twinpipe.schedule import dualpipe  # noqa: F401
from twinpipe.schedule import gpipe, interleaved, one_f_one_b, zb_auto, zbv, zero_bubble  # noqa: F401
from twinpipe.schedule import vshape_memory  # noqa: F401
