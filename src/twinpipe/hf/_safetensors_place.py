"""Where a rank's tensor sits in the unsplit model (``Place``), and the checks of one against a model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from twinpipe.checks import bad, check_ints
from twinpipe.hf._safetensors_names import ModelNames

__all__ = ["Place", "places", "check_place"]


@dataclass(frozen=True)
class Place:
    """Where a rank's tensor sits in the unsplit model: ``full[name]``, or with ``rows``
    ``full[name][list(rows)]`` (expert indices along dim 0 of a fused expert tensor; a row may
    repeat: a redundant expert)."""

    name: str
    rows: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise bad("Place.name", self.name, "must be a tensor name of the unsplit model (a non-empty str)")
        if self.rows is not None:
            rows = check_ints(self.rows, "Place.rows", low=0, why="expert indices; or None")
            object.__setattr__(self, "rows", rows)


def places(places) -> dict[str, Place]:
    """``{local name: Place}`` from a mapping (values a Place or a name) or an iterable of names."""
    if isinstance(places, (str, bytes)) or places is None:
        raise bad("places", places, "must be a mapping {local name: Place} or an iterable of tensor names")
    if isinstance(places, Mapping):
        items = places.items()
    else:
        items = [(name, name) for name in places]
    out = {}
    for local, place in items:
        place = Place(place) if isinstance(place, str) else place
        if not isinstance(place, Place):
            raise bad(f"places[{local!r}]", type(place).__name__, "must be a Place or a tensor name")
        out[str(local)] = place
    return out


def check_place(names: ModelNames, place: Place, where: str) -> tuple[int, ...]:
    """The shape of the tensor ``place`` names (rows counted); a ValueError for an unknown name or row."""
    shape = names.shapes.get(place.name)
    if shape is None:
        near = [n for n in names.shapes if n.split(".")[-1] == place.name.split(".")[-1]][:3]
        raise ValueError(f"{where}: {place.name!r} is not a tensor of {names.model_class}"
                         + (f" (tensors of that kind: {', '.join(near)}, ...)" if near else ""))
    if place.rows is None:
        return shape
    if not shape or max(place.rows) >= shape[0]:
        raise ValueError(f"{where}: rows {list(place.rows)} of {place.name!r}: it has {shape[0] if shape else 'no'} "
                         f"rows (shape {list(shape)})")
    return (len(place.rows), *shape[1:])
