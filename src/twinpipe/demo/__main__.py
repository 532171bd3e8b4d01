"""``python -m twinpipe.demo``: the demos, as ``twinpipe demo`` runs them (also under torchrun)."""

from twinpipe.demo import main
from twinpipe.launch import exit_worker

if __name__ == "__main__":  # not when a spawned rank imports this module as __mp_main__
    exit_worker(main())  # not through the interpreter's teardown (exit_worker says why)
