"""The ``twinpipe train`` command: its options, the checks of ``--model DIR`` and ``--data FILE`` before
any rank starts, and the run. It sits above ``twinpipe.train`` and ``twinpipe.hf``, which it drives."""
