"""Every table the benchmarks print, in one format: fixed-width columns, header lines starting
with ``#`` (so ``grep -v '^#'`` or ``pandas.read_csv(comment="#", sep=r"\\s+")`` keep the rows),
data lines starting with a space.

:data:`SWEEP` is nccl-tests' table (``src/common.cu``): op, size, count, type, redop, root, then
time/algbw/busbw/#wrong out-of-place and in-place, and beyond nccl-tests p50/p99 and the
peer/algorithm that ran. ``bench-moe``, ``bench-tp``, ``report`` and ``doctor`` build their
tables from the same :class:`Table`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .common import Row, has_in_place


@dataclass(frozen=True)
class Column:
    """One column: header ``name`` (and ``unit`` on a second header line), width, alignment, and
    the format spec of numeric cells (strings are printed as they are)."""

    name: str
    width: int = 0
    fmt: str = ""
    unit: str = ""
    align: str = ">"
    gap: int = 1  # spaces before the column (the first column's gap holds the header's "#")

    @property
    def span(self) -> int:
        """Characters the column takes: its width, or more for a longer header."""
        return max(self.width, len(self.name), len(self.unit))

    def cell(self, value: Any) -> str:
        """``value`` formatted and padded to the column's span."""
        text = value if isinstance(value, str) else format(value, self.fmt)
        return f"{text:{self.align}{self.span}}"


class Table:
    """Fixed-width text table.

    Args:
        columns: the columns, left to right.
        groups: titles over runs of columns, ``(title, first column index, last column index)``
            (nccl-tests' "out-of-place" / "in-place").
    """

    def __init__(self, columns: Sequence[Column], groups: Sequence[tuple[str, int, int]] = ()) -> None:
        if not columns or columns[0].gap < 1:
            raise ValueError("a table needs columns, the first with a gap for the header's '#'")
        self.columns, self.groups = list(columns), list(groups)

    @property
    def names(self) -> list[str]:
        """The header names, left to right."""
        return [c.name for c in self.columns]

    def _join(self, cells: Sequence[str]) -> str:
        return "".join(" " * c.gap + text for c, text in zip(self.columns, cells)).rstrip()

    def header(self) -> list[str]:
        """The header lines: group titles (if any), names, units (if any); each starts with ``#``."""
        lines = []
        if self.groups:
            starts, pos = [], 0
            for c in self.columns:
                starts.append(pos + c.gap)
                pos += c.gap + c.span
            chars = [" "] * pos
            for title, first, last in self.groups:
                lo, hi = starts[first], starts[last] + self.columns[last].span
                at = lo + max((hi - lo - len(title)) // 2, 0)
                chars[at : at + len(title)] = title
            lines.append("".join(chars).rstrip())
        lines.append(self._join([f"{c.name:{c.align}{c.span}}" for c in self.columns]))
        if any(c.unit for c in self.columns):
            lines.append(self._join([f"{c.unit:{c.align}{c.span}}" for c in self.columns]))
        return ["#" + line[1:] for line in lines]

    def line(self, *values: Any) -> str:
        """One data line; ``values`` left to right (numbers formatted by the column's ``fmt``)."""
        if len(values) != len(self.columns):
            raise ValueError(f"{len(values)} values for {len(self.columns)} columns")
        return self._join([c.cell(v) for c, v in zip(self.columns, values)])


# ---- nccl-tests' sweep table --------------------------------------------------------------------
def _variant(gap: int = 2) -> list[Column]:
    """time, algbw, busbw, #wrong of one variant (out-of-place or in-place)."""
    return [Column("time", 10, ".2f", "(us)", gap=gap), Column("algbw", 9, ".3f", "(GB/s)"),
            Column("busbw", 9, ".3f", "(GB/s)"), Column("#wrong", 7)]


SWEEP = Table([Column("op", 14), Column("size", 12, unit="(B)"), Column("count", 12, unit="(elements)"),
               Column("type", 9), Column("redop", 6), Column("root", 5), *_variant(), *_variant(),
               Column("p50", 10, ".2f", "(us)", gap=2), Column("p99", 10, ".2f", "(us)"),
               Column("peer/algorithm", align="<", gap=2)],
              groups=[("out-of-place", 6, 9), ("in-place", 10, 13), ("out-of-place", 14, 15)])


def _wrong(w: int) -> str:
    return "N/A" if w < 0 else str(w)


def format_row(r: Row) -> str:
    """One line of :data:`SWEEP` for a row (#wrong -1 printed ``N/A``, as nccl-tests does; so are the
    in-place cells of an op without an in-place variant, the memcpy reference, and of CUDA-graph
    rows, which time out-of-place only). A CUDA-graph row's last cell ends in ``[graph:N]`` (N calls
    per graph; no space, so the line still splits into the header's columns)."""
    measured = has_in_place(r.op) and r.mode == "eager"
    in_place = [r.ip_time_us, r.ip_algbw, r.ip_busbw, _wrong(r.ip_wrong)] if measured else ["N/A"] * 4
    mode = f"[graph:{r.graph_calls}]" if r.mode == "graph" else ""
    return SWEEP.line(r.op, r.size, r.count, r.dtype, r.redop, r.root,
                      r.time_us, r.algbw, r.busbw, _wrong(r.wrong), *in_place,
                      r.p50_us, r.p99_us, f"{r.transport}/{r.algorithm}{mode}")


def summary(rows: Sequence[Row]) -> list[str]:
    """nccl-tests' footer per peer: wrong values, and busbw averaged over out-of-place and in-place
    (out-of-place alone for the memcpy reference, which has no in-place variant).

    Returns:
        Two ``#`` lines per peer, in the order the peers first appear in ``rows``.
    """
    lines = []
    for name in dict.fromkeys(r.transport for r in rows):
        rs = [r for r in rows if r.transport == name]
        bws = [r.busbw for r in rs] + [r.ip_busbw for r in rs if has_in_place(r.op) and r.mode == "eager"]
        avg = float(np.mean(bws)) if bws else 0.0
        bad = sum(max(r.wrong, 0) + max(r.ip_wrong, 0) for r in rs)
        lines.append(f"# {name}: Out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}")
        lines.append(f"# {name}: Avg bus bandwidth    : {avg:.4f}")
    return lines
