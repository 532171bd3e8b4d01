"""Moved: the MoE demo is ``twinpipe demo --moe`` (module ``twinpipe.demo.moe``), on the command
line's layer, so that the library imports no demo. This stub only says so (it imports nothing)."""

import sys

_MOVED = ("twinpipe.moe.demo moved: run `twinpipe demo --moe` (or `python -m twinpipe.demo --moe`); "
          "its code is twinpipe.demo.moe")

if __name__ == "__main__":
    sys.exit(f"error: {_MOVED}")
raise ImportError(_MOVED)
