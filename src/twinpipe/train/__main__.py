"""``python -m twinpipe.train``: the same as ``twinpipe train`` (the form torchrun starts)."""

from twinpipe.launch import exit_worker
from twinpipe.train_command.cli import main

if __name__ == "__main__":
    exit_worker(main())  # not through the interpreter's teardown (exit_worker says why)
