"""The zero-bubble paper's bubble-rate table (Qi et al., ICLR 2024, Table 5), recomputed by twinpipe.

    PYTHONPATH=src python docs/zb_paper_table.py          # print the markdown table
    PYTHONPATH=src python docs/zb_paper_table.py --write  # put it into docs/schedules.md

Inputs are the paper's profiled times (Table 6, tests/data/zb_paper_table.json), fed to twinpipe's
generators and simulator with the paper's conventions:

- times in integer microseconds (the authors' simulator works in them); T_comm on every hop;
- memory M_B = 34h + 5as and M_W = 32h per layer (Table 1, s = 1024), so mw = M_W / M_B;
  ZB-1p may hold p·M_B per rank, ZB-2p 2p·M_B;
- 1F1B-I: one transformer layer per chunk (§5.1). The first and last stage hold one layer fewer
  than the others (§5.1), so a pipeline of L layers has L+2 layer slots and v = (L+2)/p chunks per
  rank, each taking T/v;
- bubble rate = (cost - m(T_F+T_B+T_W)) / cost, cost = the largest per-rank span (§5.3).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from twinpipe.schedule.registry import build
from twinpipe.sim import CostModel, simulate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "zb_paper_table.json"
DOC = ROOT / "docs" / "schedules.md"
START, END = "<!-- zb-paper-table:start -->", "<!-- zb-paper-table:end -->"

COLUMNS = ("1F1B", "1F1B-I", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p")


@dataclass(frozen=True)
class Setup:
    """One row of the paper's Table 6 in twinpipe's terms (times in microseconds)."""

    model: str
    p: int
    m: int
    chunks: int  # v of 1F1B-I
    t_f: int
    t_b: int
    t_w: int
    t_comm: int
    mw: float  # M_W / M_B

    @property
    def ideal(self) -> int:
        """m(T_F+T_B+T_W): one rank's compute, the cost of a pipeline without bubbles."""
        return self.m * (self.t_f + self.t_b + self.t_w)


def load(path: Path = DATA) -> tuple[list[Setup], list[dict[str, float]]]:
    """The paper's settings and, for each, its published bubble rates by column."""
    data = json.loads(path.read_text())
    s = data["sequence_length"]
    setups, published = [], []
    for row in data["rows"]:
        model = data["models"][row["model"]]
        p, h, a = model["p"], model["hidden"], model["heads"]
        us = {name: round(row[name] * 1000) for name in ("t_f", "t_b", "t_w", "t_comm")}
        setups.append(Setup(row["model"], p, row["m"], (model["layers"] + 2) // p, mw=32 * h / (34 * h + 5 * a * s), **us))
        published.append(row["bubble"])
    return setups, published


def simulated_cost(setup: Setup, column: str) -> float:
    """Build the schedule of ``column`` for ``setup`` and return its simulated cost."""
    times = {"t_f": setup.t_f, "t_b": setup.t_b, "t_w": setup.t_w, "t_comm": setup.t_comm, "mw": setup.mw}
    costs = CostModel(**times)
    if column == "1F1B-I":
        v = setup.chunks
        schedule = build("interleaved-1f1b", setup.p, setup.m, stages_per_rank=v)
        costs = CostModel(t_f=setup.t_f / v, t_b=setup.t_b / v, t_w=setup.t_w / v, t_comm=setup.t_comm)
    elif column in ("ZB-1p", "ZB-2p"):
        limit = setup.p * (1 if column == "ZB-1p" else 2)  # units of M_B
        schedule = build("zb-auto", setup.p, setup.m, mem_limit=limit, **times)
    else:
        schedule = build({"1F1B": "1f1b", "ZB-H1": "zb-h1", "ZB-H2": "zb-h2"}[column], setup.p, setup.m)
    return simulate(schedule, costs).cost


def bubble_rate(setup: Setup, cost: float) -> float:
    return (cost - setup.ideal) / cost


def twinpipe_rates(setup: Setup) -> dict[str, float]:
    return {column: bubble_rate(setup, simulated_cost(setup, column)) for column in COLUMNS}


def markdown_table(setups: list[Setup], published: list[dict[str, float]], rates: list[dict[str, float]]) -> str:
    """Published / twinpipe (``rates``) per cell, the 1F1B-I difference and the largest other one."""
    header = ["model", "p", "m", *COLUMNS, "1F1B-I diff", "max abs diff, other columns"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for setup, paper, ours in zip(setups, published, rates):
        cells = [f"{paper[c]:.4f} / {ours[c]:.4f}" for c in COLUMNS]
        others = max(abs(ours[c] - paper[c]) for c in COLUMNS if c != "1F1B-I")
        diff = ours["1F1B-I"] - paper["1F1B-I"]
        lines.append(f"| {setup.model} | {setup.p} | {setup.m} | " + " | ".join(cells) + f" | {diff:+.4f} | {others:.5f} |")
    return "\n".join(lines)


def write(doc: Path, table: str) -> None:
    """Replace the text between the START and END markers of ``doc`` with ``table``."""
    text = doc.read_text()
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"{doc}: needs exactly one {START} and one {END} line")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    doc.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the table in {DOC.relative_to(ROOT)}")
    args = parser.parse_args()
    setups, published = load()
    table = markdown_table(setups, published, [twinpipe_rates(setup) for setup in setups])
    if args.write:
        write(DOC, table)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
