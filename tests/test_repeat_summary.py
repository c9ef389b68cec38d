"""tools.repeat_summary: the cells it prints are each run's auto/mpi4py ratio per op and size
range, recomputed here from the rows (best checked variant per size, geometric mean per range)."""

from __future__ import annotations

import math
from pathlib import Path

from click.testing import CliRunner

from benchmarks.common import best_algbw
from benchmarks.output import load_run
from benchmarks.report import RANGES
from tools.repeat_summary import main

RUN = Path(__file__).parent.parent / "benchmarks" / "results" / "cpu-compare-mpiexec.json"


def _expected(rows: list[dict]) -> dict[tuple[str, str], float]:
    by = {}
    for r in rows:
        if r["transport"] in ("auto", "mpi4py") and r["size"] > 0 and r["dtype"] == "float32":
            by.setdefault((r["op"], r["size"]), {})[r["transport"]] = best_algbw(r)
    out = {}
    for name, lo, hi in RANGES:
        for op in {k[0] for k in by}:
            ratios = [d["auto"] / d["mpi4py"] for (o, size), d in by.items()
                      if o == op and lo <= size <= hi and d.get("auto") and d.get("mpi4py")]
            if ratios:
                out[(op, name)] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return out


def test_cells_are_each_runs_ratio_and_their_median():
    res = CliRunner().invoke(main, [str(RUN), str(RUN), str(RUN)])
    assert res.exit_code == 0, res.output
    expected = _expected(load_run(str(RUN))["rows"])
    ratio_block = res.output.split("busbw as %")[0]
    seen = 0
    for line in ratio_block.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and (cells[0], cells[1]) in expected:
            want = f"{expected[(cells[0], cells[1])]:.2f}"
            assert cells[2:] == [want] * 4, line  # three runs of one file, and their median
            seen += 1
    assert seen == len(expected) >= 10
