"""Read a [layers, experts] table from .csv, .json or .pt."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checks import EplbArgumentError

SUFFIXES = (".csv", ".json", ".pt")


def read_table(path: str | Path, argument: str = "loads") -> torch.Tensor:
    """A 2-D tensor from ``path``; errors name ``argument``.

    .csv: one row per layer, comma-separated numbers; blank lines and lines starting with '#' are
    skipped, and so is a first line that is not numeric (a header).
    .json: a list of rows, or an object with the rows under "loads" (or "phy2log").
    .pt: a tensor saved with torch.save, or a dict holding one under "loads" (or "phy2log").
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise EplbArgumentError(
            argument, f"{argument} file {str(path)!r} has suffix {suffix!r}; allowed: .csv, .json, .pt"
        )
    if not path.is_file():
        raise EplbArgumentError(argument, f"{argument} file {str(path)!r} does not exist")
    try:
        if suffix == ".csv":
            table = _read_csv(path)
        elif suffix == ".json":
            table = torch.tensor(_unwrap(json.loads(path.read_text())))
        else:
            table = _unwrap(torch.load(path, weights_only=True))
            table = table if isinstance(table, torch.Tensor) else torch.tensor(table)
    except EplbArgumentError:
        raise
    except Exception as exc:  # any parse failure becomes one clear message
        raise EplbArgumentError(argument, f"{argument} file {str(path)!r} could not be read: {exc}") from None
    if table.dim() != 2:
        raise EplbArgumentError(
            argument, f"{argument} file {str(path)!r} holds shape {tuple(table.shape)}; allowed: 2-D [layers, experts]"
        )
    return table


def _unwrap(obj):
    if isinstance(obj, dict):
        for key in ("loads", "phy2log"):
            if key in obj:
                return obj[key]
        raise ValueError(f"no 'loads' or 'phy2log' entry (keys: {sorted(obj)})")
    return obj


def _read_csv(path: Path) -> torch.Tensor:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cells = [c.strip() for c in line.split(",")]
        try:
            rows.append([float(c) for c in cells])
        except ValueError:
            if rows:  # only a first line may be a header
                raise ValueError(f"line {number} is not numeric: {line[:60]!r}") from None
    if len({len(r) for r in rows}) > 1:
        raise ValueError(f"rows have different lengths: {sorted({len(r) for r in rows})}")
    table = torch.tensor(rows, dtype=torch.float64)
    if table.numel() and bool((table == table.round()).all()):
        table = table.long()
    return table
