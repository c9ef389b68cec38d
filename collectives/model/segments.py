"""Which fitted term predicts a size: the size segments of calibrated algorithms (collectives.model.calibrate).

A fitted term holds over the sizes it was fitted on (``min_bytes`` .. ``max_bytes``); an algorithm
fitted piecewise has one term per size segment. :func:`fitted_segment` picks the term of one
algorithm for a size, :func:`span_distance` says how far a size lies outside an algorithm's whole
fitted span (``predict_collective`` keeps the algorithms whose span is nearest).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence


def _log_distance(low: int, high: int | None, size: int) -> float:
    """How far ``size`` lies outside ``[low, high]`` in log(size) (0 inside; ``high`` None: unbounded)."""
    at, low = max(1, size), max(1, low)
    if at < low:
        return math.log(low / at)
    if high is not None and at > high:
        return math.log(at / high)
    return 0.0


def fitted_range(term: Mapping[str, Any]) -> tuple[int, int | None]:
    """The sizes a term was fitted on: (``min_bytes``, at least 1; ``max_bytes``, None: unbounded)."""
    high = term.get("max_bytes")
    return int(term.get("min_bytes", 0) or 1), None if high is None else int(high)


def segment_line(term: Mapping[str, Any]) -> tuple[float, float]:
    """(alpha us, beta us per byte) of one fitted term, negative coefficients counted as 0; a chord
    between two segments (:func:`fitted_segment`) keeps its own (its alpha may be negative)."""
    if term.get("chord"):
        return float(term["alpha_us"]), float(term["beta_us_per_byte"])
    return max(0.0, float(term["alpha_us"])), max(0.0, float(term["beta_us_per_byte"]))


def segment_time(term: Mapping[str, Any], size: int) -> float:
    """``alpha + beta * size`` (us) of one fitted term (:func:`segment_line`), kept >= 0."""
    alpha, beta = segment_line(term)
    return max(0.0, alpha + beta * size)


def _chord(lower: Mapping[str, Any], high: int, upper: Mapping[str, Any], low: int) -> dict[str, Any]:
    """The line from ``lower``'s prediction at its last fitted size ``high`` to ``upper``'s at its
    first ``low`` (never falling: a larger size never predicts a shorter time inside the gap)."""
    start, end = segment_time(lower, high), segment_time(upper, low)
    beta = max(0.0, (end - start) / (low - high))
    return {**lower, "alpha_us": start - beta * high, "beta_us_per_byte": beta, "min_bytes": high,
            "max_bytes": low, "chord": True}


def fitted_segment(segments: Sequence[Mapping[str, Any]], size: int) -> Mapping[str, Any]:
    """Of one algorithm's fitted terms (its size segments), the one that predicts ``size``.

    Args:
        segments: the terms of one op, rank count and algorithm (``min_bytes``/``max_bytes`` each;
            a term without them holds everywhere), at least one.
        size: bytes (the nccl-tests size column), >= 0.

    Returns:
        The term whose range holds ``size`` (the lowest-starting one if several do). In the gap
        between two segments, their chord: a term (``"chord": True``, its alpha may be negative) that
        joins the lower segment's prediction at its last size to the upper one's at its first. A CPU's
        cache transition is gradual (this VM's 2-rank all_reduce: 65 us/MB at 8 MiB, 85 at 16, 111 at
        32), so a gap's sizes lie between its two sides; on the local check's runs
        (benchmarks/results/model-local-check.md) taking the faster side instead missed 24 MiB by
        40-53%, the chord by up to 22%. Below or above every range: the nearest one (the first or
        last segment, extrapolated).
    """
    if not segments:
        raise ValueError("fitted_segment: no terms given")
    at = max(1, size)
    ranges = [(t, *fitted_range(t)) for t in segments]
    holding = [(low, i) for i, (t, low, high) in enumerate(ranges) if _log_distance(low, high, size) == 0.0]
    if holding:
        return segments[min(holding)[1]]
    below = [(high, i) for i, (t, low, high) in enumerate(ranges) if high is not None and high < at]
    above = [(low, i) for i, (t, low, high) in enumerate(ranges) if low > at]
    if below and above:
        (high, lower), (low, upper) = max(below), min(above)
        return _chord(segments[lower], high, segments[upper], low)
    return segments[max(below)[1]] if below else segments[min(above)[1]]


def span_distance(segments: Sequence[Mapping[str, Any]], size: int) -> float:
    """How far ``size`` lies outside one algorithm's fitted span (its lowest ``min_bytes`` .. highest
    ``max_bytes``), in log(size); 0 inside it, gaps between segments included."""
    ranges = [fitted_range(t) for t in segments]
    highs = [high for _, high in ranges]
    return _log_distance(min(low for low, _ in ranges), None if None in highs else max(highs), size)
