"""Read a [layers, experts] table from .csv, .json or .pt."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checks import EplbArgumentError

SUFFIXES = (".csv", ".json", ".pt")
MAX_BYTES = 64 << 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def read_table(path: str | Path, argument: str = "loads") -> torch.Tensor:
    """A 2-D tensor from ``path``; errors name ``argument``.

    .csv: one row per layer, comma-separated numbers; blank lines and lines starting with '#' are
    skipped, and so is the first other line when none of its cells is a number (a header). Any
    other cell that is not a number, an integer outside int64, or another separator is an error
    naming the line (and column).
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
    size = path.stat().st_size
    if size > MAX_BYTES:  # checked before reading: a table of every layer's experts is far smaller
        raise EplbArgumentError(argument, f"{argument} file {str(path)!r} holds {size} bytes; allowed: at most "
                                          f"{MAX_BYTES >> 20} MiB (a [layers, experts] table)")
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
    rows, line_numbers = [], []
    header_allowed = True
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        _check_separator(number, line)
        cells = [c.strip() for c in line.split(",")]
        values = [_number(c) for c in cells]
        if header_allowed and all(v is None for v in values):
            header_allowed = False  # one header, the first line, and only if it holds no number at all
            continue
        header_allowed = False
        for column, (cell, value) in enumerate(zip(cells, values), start=1):
            if value is None:
                raise ValueError(f"line {number}, column {column}: {cell!r} is not a number")
            if isinstance(value, int) and not _INT64_MIN <= value <= _INT64_MAX:
                raise ValueError(
                    f"line {number}, column {column}: {cell} is outside the int64 range "
                    f"[{_INT64_MIN}, {_INT64_MAX}]"
                )
        rows.append(values)
        line_numbers.append(number)
    if not rows:
        raise ValueError("no data rows (only blank lines, '#' comments or a header)")
    for number, row in zip(line_numbers, rows):
        if len(row) != len(rows[0]):
            raise ValueError(
                f"rows have different lengths: line {number} has {len(row)} values, "
                f"line {line_numbers[0]} has {len(rows[0])}"
            )
    if all(isinstance(v, int) for r in rows for v in r):
        return torch.tensor(rows, dtype=torch.int64)
    table = torch.tensor(rows, dtype=torch.float64)
    # Whole numbers written as floats ("3.0") still make an integer table, when int64 holds them.
    if bool((table == table.round()).all()) and bool((table.abs() < 2.0**63).all()):
        table = table.long()
    return table


def _number(cell: str) -> int | float | None:
    """The cell as an int (exact, any size) or a float; None when it is not a number."""
    for parse in (int, float):
        try:
            return parse(cell)
        except ValueError:
            pass
    return None


def _check_separator(number: int, line: str) -> None:
    """Semicolon- or tab-separated files would be misread (decimal commas): refuse them by name."""
    if ";" in line:
        name = "';'"
    elif "\t" in line and "," not in line:
        name = "tabs"
    else:
        return
    raise ValueError(
        f"line {number} is separated by {name}; allowed: comma-separated numbers with '.' as the decimal point"
    )
