"""Regenerate the schedule pictures of docs/gallery.md (docs/img/schedule-*.png) with ``twinpipe draw``.

    PYTHONPATH=src python docs/make_gallery.py          # all pictures
    PYTHONPATH=src python docs/make_gallery.py --list   # only print the commands

Every picture is one ``twinpipe draw`` command line, printed as it runs, so the gallery can show
exactly how each was made. Unit costs (T_F = T_B = T_W = 1 per 1F1B stage, no communication)
unless a line says otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from twinpipe.cli import main as twinpipe

IMG = Path(__file__).resolve().parent / "img"

# (file name, arguments after "twinpipe draw")
PICTURES = [
    ("schedule-1f1b.png", "1f1b --pp 4 --microbatches 8"),
    ("schedule-zb-h1.png", "zb-h1 --pp 4 --microbatches 8"),
    ("schedule-zb-h2.png", "zb-h2 --pp 4 --microbatches 12"),
    ("schedule-dualpipe.png", "dualpipe --pp 8 --microbatches 20"),
    ("schedule-dualpipev.png", "dualpipev --pp 4 --microbatches 10"),
    ("schedule-compare.png", "--compare 1f1b,zb-h1,zb-h2,dualpipe --pp 4 --microbatches 12"),
    ("schedule-dualpipe-overlap.png", "dualpipe --pp 8 --microbatches 20 --fb 2.2 --comm 0.1"),
    ("schedule-chimera.png", "chimera --pp 4 --microbatches 8 --w 0"),
    ("schedule-bitpipe.png", "bitpipe --pp 4 --microbatches 8"),
    ("schedule-bidirectional.png", "--compare dualpipe,chimera,bitpipe --pp 4 --microbatches 16"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the commands without running them")
    args = parser.parse_args()
    for name, line in PICTURES:
        argv = ["draw", *line.split(), "-o", str(IMG / name)]
        print("twinpipe " + " ".join(argv[:-1]) + f" docs/img/{name}")
        if not args.list and twinpipe(argv) != 0:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
