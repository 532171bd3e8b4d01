"""twinpipe: DualPipe and friends."""
