"""The runtime's early releases, each on by default.

One is turned off (removed from ``EARLY_RELEASE``) only to measure what it saves
(``bench/bench_memory.py --no-release``): "losses" (the kept losses are copies, not views of an
output-sized buffer), "input grad" (a received input drops its gradient once it is handed
upstream; W may keep the input itself), "last message" (the executor's loop drops the last message
it received) and "sends" (process-group sends are waited once the peer's next packet arrived, not
only polled).
"""

from __future__ import annotations

__all__ = ["RELEASES", "EARLY_RELEASE", "early_release"]

RELEASES = ("losses", "input grad", "last message", "sends")
EARLY_RELEASE = set(RELEASES)


def early_release(name: str) -> bool:
    return name in EARLY_RELEASE
