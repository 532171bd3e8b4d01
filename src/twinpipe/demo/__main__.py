"""``python -m twinpipe.demo``: the demos, as ``twinpipe demo`` runs them (also under torchrun)."""

from twinpipe.demo import main

if __name__ == "__main__":  # not when a spawned rank imports this module as __mp_main__
    raise SystemExit(main())
