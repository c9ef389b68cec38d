"""What the model's two reports (:mod:`tools.validate_model`, :mod:`tools.local_check`)
share: where they are written, and their Markdown pieces."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"
