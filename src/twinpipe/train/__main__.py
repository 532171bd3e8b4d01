"""``python -m twinpipe.train``: the same as ``twinpipe train``."""

import sys

from twinpipe.train_command.cli import main

if __name__ == "__main__":
    sys.exit(main())
