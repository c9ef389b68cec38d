"""Which fitted term predicts a size: the size segments of calibrated algorithms (collectives.model.calibrate).

A fitted term holds over the sizes it was fitted on (``min_bytes`` .. ``max_bytes``); an algorithm
fitted piecewise has one term per size segment. :func:`fitted_segment` picks the term of one
algorithm for a size, :func:`span_distance` says how far a size lies outside an algorithm's whole
fitted span, and :func:`candidate_terms` which algorithms ``predict_collective`` lets compete at a
size.
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


def _transport(name: str, segments: Sequence[Mapping[str, Any]]) -> str:
    """The transport of a fitted algorithm: its terms' ``transport``, else the name before its last '/'."""
    named = segments[0].get("transport") if segments else None
    return str(named) if named else name.rsplit("/", 1)[0]


def candidate_terms(algorithms: Mapping[str, Sequence[Mapping[str, Any]]], size: int) -> list[tuple[str, Mapping[str, Any]]]:
    """Which of one op's fitted algorithms may predict ``size``, each with the term that predicts it
    (``predict_collective`` takes the fastest).

    A term fitted on large sizes only has no meaningful latency (its alpha can be 0), so an algorithm
    is not extrapolated far from the sizes it was fitted on. Algorithms are grouped by transport; the
    transports whose whole span (every algorithm of it, :func:`span_distance`) is nearest in log(size)
    compete, 0 meaning inside. Of one transport:

    - the algorithms whose own span holds ``size``, by :func:`fitted_segment`;
    - if none does but the transport's span does, ``size`` lies where the transport changed path (a
      switch point: one_shot measured up to 128 KiB, two_shot from 512 KiB): the transport's time is
      the chord from the faster path at the gap's lower edge to the faster at its upper edge, as in
      a gap between two segments of one algorithm, under the name of the path nearer in log(size).
      Extrapolated into the gap instead, the upper path's line (alpha ~0) undercut the lower's own
      time at its last size: a larger size predicted a shorter time. And a transport measured on
      both sides of the size is not outranked by one that merely measured the size (the shm gap at
      256 KiB against mpi's line, 3x slower);
    - outside the transport's span: its algorithms whose span is nearest.

    Below its span a transport still competes, as if inside, when its first terms are latency-bound
    at their first size (alpha >= beta x that size): they predict their alpha there, as they would
    at any smaller size. The shipped host model's shm fits start at 64 B, mpi's at 8 B: otherwise
    mpi alone predicted 8-63 B at 11.6 us, and 64 B dropped to shm's 2.2 us.

    Args:
        algorithms: ``{algorithm: its fitted terms}`` (each with ``min_bytes``/``max_bytes``; a term
            without them holds everywhere), at least one.
        size: bytes (the nccl-tests size column), >= 0.

    Returns:
        ``[(algorithm, term)]`` in the mapping's order.
    """
    if not algorithms:
        raise ValueError("candidate_terms: no algorithms given")
    by_transport: dict[str, list[str]] = {}
    for name, segments in algorithms.items():
        by_transport.setdefault(_transport(name, segments), []).append(name)
    at = max(1, size)

    def latency_bound_below(names: list[str]) -> bool:
        """``size`` lies below the transport's span, whose first terms are latency-bound at their
        first size: there they predict their alpha, which smaller sizes keep."""
        firsts = [min(algorithms[name], key=lambda t: fitted_range(t)[0]) for name in names]
        low = min(fitted_range(t)[0] for t in firsts)
        return at < low and all(segment_line(t)[0] >= segment_line(t)[1] * low
                                for t in firsts if fitted_range(t)[0] == low)

    below = {tr: latency_bound_below(names) for tr, names in by_transport.items()}
    reach = {tr: 0.0 if below[tr] else span_distance([t for name in names for t in algorithms[name]], size)
             for tr, names in by_transport.items()}
    nearest = min(reach.values())
    chosen: dict[str, Mapping[str, Any]] = {}
    for tr, names in by_transport.items():
        if reach[tr] > nearest:
            continue
        distance = {name: span_distance(algorithms[name], size) for name in names}
        if below[tr] or reach[tr] > 0.0 or min(distance.values()) == 0.0:
            chosen.update((name, fitted_segment(algorithms[name], size))
                          for name in names if distance[name] == min(distance.values()))
            continue
        # a gap between the transport's paths: every path's span lies wholly below or above the size
        spans = {name: [fitted_range(t) for t in algorithms[name]] for name in names}
        high = max(h for name in names for _, h in spans[name] if h is not None and h < at)
        low = min(lo for name in names for lo, _ in spans[name] if lo > at)
        lower = min((segment_time(fitted_segment(algorithms[name], high), high), name) for name in names
                    if any(h == high for _, h in spans[name]))[1]
        upper = min((segment_time(fitted_segment(algorithms[name], low), low), name) for name in names
                    if any(lo == low for lo, _ in spans[name]))[1]
        term = _chord(fitted_segment(algorithms[lower], high), high, fitted_segment(algorithms[upper], low), low)
        name = lower if math.log(at / high) <= math.log(low / at) else upper
        chosen[name] = {**term, "algorithm": name}
    return [(name, chosen[name]) for name in algorithms if name in chosen]
