"""Colours of the timeline pictures: one hue per op kind, a light and a dark shade per direction.

Pure data (no matplotlib), so that other tools can reuse the palette.
"""

from __future__ import annotations

from types import MappingProxyType

from twinpipe.schedule.placement import Placement

__all__ = ["KIND_COLOURS", "KIND_NAMES", "WAIT_COLOUR", "WAIT_EDGE", "direction", "direction_names", "text_colour"]

# (light, dark): the light shade is direction 0 (DualPipe's chain 0, a V's first leg).
KIND_COLOURS: MappingProxyType[str, tuple[str, str]] = MappingProxyType({
    "F": ("#f8c471", "#d9822b"),  # orange
    "B": ("#a3d9a5", "#3f9a4f"),  # green
    "W": ("#a9c8ec", "#3c78c3"),  # blue
    "BW": ("#d5b8e8", "#8a4fb5"),  # purple
})
KIND_NAMES = MappingProxyType({"F": "F forward", "B": "B backward (inputs)", "W": "W backward (weights)", "BW": "BW full backward"})
WAIT_COLOUR = "#e3e3e3"
WAIT_EDGE = "#9a9a9a"
_DARK = frozenset({dark for _, dark in KIND_COLOURS.values()})


def direction(placement: Placement | None, stage: int) -> int:
    """0 (light) or 1 (dark): which direction or leg ``stage`` belongs to.

    DualPipe, Chimera ("dual") and BitPipe ("dual-v"): the chain (0 forward, 1 reverse). V placements: the leg (first p stages
    of the chain go down the ranks, the rest come back up). Looped (interleaved): alternate
    model chunks. Linear: always 0.
    """
    if placement is None or not 0 <= stage < placement.num_stages:
        return 0
    if placement.kind in ("dual", "dual-v"):
        return placement.chain_of_stage(stage) % 2
    if placement.kind in ("v", "looped"):
        return (placement.stage_chain_position(stage) // placement.num_ranks) % 2
    return 0


def direction_names(placement: Placement | None) -> tuple[str, str] | None:
    """Legend words for the two shades, or None where there is one direction only."""
    kind = placement.kind if placement is not None else None
    if kind == "dual" and len(placement.chains) > 2:  # Chimera with k pairs: even chains go down, odd ones up
        return ("down chains (even)", "up chains (odd)")
    if kind == "dual":
        return ("chain 0 (rank 0 -> p-1)", "chain 1 (rank p-1 -> 0)")
    if kind == "dual-v":
        return ("down V (starts on rank 0)", "up V (starts on rank p-1)")
    if kind == "v":
        return ("first leg (down)", "second leg (up)")
    if kind == "looped" and placement.num_stages > placement.num_ranks:
        return ("even model chunks", "odd model chunks")
    return None


def text_colour(face: str) -> str:
    """Black on light shades, white on dark ones."""
    return "white" if face in _DARK else "black"
