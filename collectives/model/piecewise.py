"""Alpha-beta lines through measured (size, time) points: the fit :mod:`collectives.model.calibrate`
makes of each algorithm of a ``moecomm bench`` run, one line or one per cache regime.

Why relative error: sizes span six decades (8 B .. 32 MiB) and times four. Ordinary least squares
on absolute time lets the few largest sizes decide everything and leaves the small sizes' latency
(the alpha that decides small-message choices) at the mercy of a millisecond's noise at 32 MiB. So
the fit minimises ``sum(((alpha + beta s_i - t_i) / t_i)^2)``: every size counts by its relative
miss, as the predictions are judged. Both terms are kept >= 0 (a negative latency or bandwidth
has no meaning): if the free fit makes one negative, it is refitted with that term at 0, which
is the exact constrained optimum for two parameters.

Piecewise: one line cannot follow a CPU's cache regimes (this VM's busbw peaks at 1.5-6 MiB and
falls to about half at 24 MiB, benchmarks/results/model-local-check.md), so each group's sorted
sizes are split into at most :data:`MAX_SEGMENTS` contiguous segments of at least
:data:`MIN_SEGMENT_SIZES` distinct sizes, each its own line. The breakpoints are found by exact
search (dynamic programming over the ~12 sizes of a sweep) minimising the total squared relative
residual; the number of segments by an information criterion whose charge per segment was set by
simulation (:func:`fit_segments`), so noise does not buy segments. The paths of one op and transport
that a run measured at disjoint sizes (the transport chose one per size: at a switch point, or by
timing, when the label flips back and forth) are one series for this search: its breakpoints are
found on all their rows, then each path is fitted within them (:func:`fit_within`), and the number of
segments is judged on those per-path lines (:func:`fit_series`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


def fit_alpha_beta(sizes: Sequence[float], times_us: Sequence[float]) -> tuple[float, float]:
    """Non-negative alpha-beta fit minimising the squared relative error.

    Args:
        sizes: bytes per point (``[P]``, >= 0), at least two distinct values.
        times_us: measured times, us (``[P]``, > 0).

    Returns:
        ``(alpha_us, beta_us_per_byte)``, both >= 0.
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times_us, dtype=np.float64)
    if s.shape != t.shape or s.ndim != 1 or len(s) < 2:
        raise ValueError(f"fit_alpha_beta: need matching 1-D sizes and times with >= 2 points, "
                         f"got {s.shape}, {t.shape}")
    if not np.all(np.isfinite(t)) or np.any(t <= 0) or np.any(s < 0):
        raise ValueError("fit_alpha_beta: times must be finite and > 0, sizes >= 0")
    if len(np.unique(s)) < 2:
        raise ValueError("fit_alpha_beta: need at least two distinct sizes to separate latency from bandwidth")
    # Rows scaled by 1/t: minimise ||(A x - t) / t||^2, i.e. A/t x ~ 1.
    design = np.stack([1.0 / t, s / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if alpha >= 0 and beta >= 0:
        return float(alpha), float(beta)
    # One term at its bound 0: the best of the two one-parameter fits (closed forms).
    candidates = []
    for column in (0, 1):
        a = design[:, column]
        value = max(0.0, float(a @ np.ones_like(t) / (a @ a))) if a @ a > 0 else 0.0
        params = (value, 0.0) if column == 0 else (0.0, value)
        residual = float(np.sum((design @ np.array(params) - 1.0) ** 2))
        candidates.append((residual, params))
    return min(candidates)[1]


MAX_SEGMENTS = 3  # cache regimes of a CPU: in L2, in the last-level cache, in DRAM
MIN_SEGMENT_SIZES = 3  # a line through 2 sizes has no residual: its fit error would say nothing
# Below this RMS relative error two fits are equally exact: no timing repeats to 0.1% between runs
# (the local runs' small sizes vary by 10-30%), so a split that only removes rounding error is noise.
RMS_FLOOR = 1e-3
# ln(points) per extra segment: false splits ~3% at 12 sizes, 0.3% at 23 (simulation in fit_segments).
# 8 (0.5%) left this VM's gradual cache transitions as one line (2-rank two_shot all_reduce 0.5-128 MiB
# at 30% rms, cma_push all_gather 2-128 MiB at 38%) and missed the local check's 24 and 96 MiB rows by
# 40-50%; with 6 the mean |error| at >= 64 KiB over 3 calibration x 3 prediction runs went from
# 19.4 / 16.0 / 8.8% to 11.4 / 11.7 / 8.8% (medians, before gaps were chords; model-local-check.md).
# Tried instead: choosing the segment count by leave-one-size-out prediction error. Over six calibration
# runs it matched 6 on five and beat it on one (largest miss 45 -> 30%: a 7-size group that 6 left one
# line by a hair), but it split 25-29% of simulated noisy single lines; the one-standard-error variant
# of it stopped finding cliffs. Not adopted.
SEGMENT_PENALTY = 6.0


@dataclass(frozen=True)
class Segment:
    """One line of a piecewise fit: ``time_us = alpha_us + beta_us_per_byte * size`` on its sizes."""

    alpha_us: float
    beta_us_per_byte: float
    min_bytes: int
    max_bytes: int
    points: int
    rms_relative_error: float
    # a path's size that timing chose among other paths' sizes: their line there, scaled through it
    # (fit_within); rms_relative_error is then that line's on their points
    from_other_paths: bool = False


def _fit_line(sizes: np.ndarray, times_us: np.ndarray) -> tuple[float, Segment]:
    """One line over these points (two or more distinct sizes): (squared relative residual, segment)."""
    alpha, beta = fit_alpha_beta(sizes, times_us)
    misses = (alpha + beta * sizes - times_us) / times_us
    rss = float(misses @ misses)
    return rss, Segment(alpha, beta, int(sizes.min()), int(sizes.max()), len(sizes), math.sqrt(rss / len(misses)))


def _criterion(rss: float, points: int, segments: int, penalty: float) -> float:
    """Information criterion of a piecewise fit: ``P ln(RSS / P) + penalty (k - 1) ln P``."""
    rss = max(rss, points * RMS_FLOOR ** 2)
    return points * math.log(rss / points) + penalty * (segments - 1) * math.log(points)


def fit_segments(sizes: Sequence[float], times_us: Sequence[float], *, max_segments: int = MAX_SEGMENTS,
                 min_sizes: int = MIN_SEGMENT_SIZES, penalty: float = SEGMENT_PENALTY) -> list[Segment]:
    """Piecewise alpha-beta fit: contiguous size segments, each fitted by :func:`fit_alpha_beta`.

    For each number of segments k = 1 .. ``max_segments`` the breakpoints minimising the total
    squared relative residual (RSS) are found exactly (dynamic programming over the distinct
    sizes; a segment holds every point of its sizes). The k kept minimises
    ``P ln(RSS / P) + penalty (k - 1) ln P`` over the ``P`` points (relative residuals ~ log
    residuals), the fewest segments on a tie: each extra segment must cut the RSS by
    ``P ** (penalty / P)``, with 12 points and the default 6: 3.5x (the RMS 1.9x), with 23 points
    2.3x. BIC would charge 3 ln P per segment (two coefficients and a breakpoint), but the exact
    search over breakpoints with 3-size segments (one residual degree of freedom each) fits noise
    far better than 3 free parameters would: on one line with 2-10% log-normal noise, 12 sizes of
    a x4 sweep, BIC's 3 split 34% of 400 simulated runs, 6 split 3%, 8 split 0.5% (6: 0.3% of 300
    runs of a 23-size x2 sweep), while a bandwidth halving above 2 MiB on the x2 sweep was split at
    2 MiB in every run with 2% noise. A false split costs little (each side still fits its own
    sizes); a transition left unsplit misses by tens of percent (:data:`SEGMENT_PENALTY`). RSS under
    :data:`RMS_FLOOR` counts as the floor.

    Args:
        sizes: bytes per point (``[P]``, >= 0), at least two distinct values.
        times_us: measured times, us (``[P]``, > 0).
        max_segments: most segments, >= 1.
        min_sizes: fewest distinct sizes per segment, >= 2.
        penalty: the criterion's charge per extra segment, in units of ln P.

    Returns:
        The segments, smallest sizes first; one segment when fewer than ``2 * min_sizes`` sizes.
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times_us, dtype=np.float64)
    if max_segments < 1 or min_sizes < 2:
        raise ValueError(f"fit_segments: max_segments >= 1 and min_sizes >= 2, got {max_segments}, {min_sizes}")
    if s.shape != t.shape or s.ndim != 1:
        raise ValueError(f"fit_segments: need matching 1-D sizes and times, got {s.shape}, {t.shape}")
    fits = [(_criterion(rss, len(s), len(segments), penalty), len(segments), segments)
            for rss, segments in _best_splits(s, t, max_segments, min_sizes)]
    return min(fits, key=lambda f: (f[0], f[1]))[2]


def _best_splits(s: np.ndarray, t: np.ndarray, max_segments: int, min_sizes: int) -> list[tuple[float, list[Segment]]]:
    """For k = 1 .. ``max_segments`` (as many as ``min_sizes`` allows), the split of the points into k
    contiguous size segments with the least total squared relative residual: ``[(rss, segments)]``,
    k ascending. Exact: dynamic programming over the distinct sizes (a segment holds every point of
    its sizes); one segment only when there are fewer than ``2 * min_sizes`` distinct sizes."""
    distinct = np.unique(s)
    m = len(distinct)

    @functools.lru_cache(maxsize=None)
    def line(i: int, j: int) -> tuple[float, Segment]:
        """The fit of distinct sizes i .. j-1: (squared relative residual, segment)."""
        inside = (s >= distinct[i]) & (s <= distinct[j - 1])
        return _fit_line(s[inside], t[inside])

    if m < 2 * min_sizes:
        rss, whole = line(0, m)
        return [(rss, [whole])]
    # best[k][j]: (rss, segments) of the best split of distinct sizes 0 .. j-1 into k segments
    best: list[dict[int, tuple[float, list[Segment]]]] = [{}, {j: (line(0, j)[0], [line(0, j)[1]])
                                                              for j in range(min_sizes, m + 1)}]
    for k in range(2, max_segments + 1):
        best.append({})
        for j in range(k * min_sizes, m + 1):
            options = [(best[k - 1][i][0] + line(i, j)[0], best[k - 1][i][1] + [line(i, j)[1]])
                       for i in range((k - 1) * min_sizes, j - min_sizes + 1) if i in best[k - 1]]
            if options:
                best[k][j] = min(options, key=lambda o: o[0])
    return [best[k][m] for k in range(1, len(best)) if m in best[k]]


# A point more than this many times slower than a point of a larger size of its group is left out
# of the fit. With alpha, beta >= 0 no line is slower at a smaller size, so such a point is a glitch
# of the machine, not of the algorithm. Seen in this repo's runs: the shipped host calibration's first
# timed row (8-byte shm one_shot all_reduce, bench-2) took a median 36 us against 2.1 us at 16 B,
# a 94% miss of any line that alone made most of its group's residual (rms 27% -> 20% without it);
# the local calibration run's 128 B pull all_gather (12.6 us against 1.7-1.9 around it, its group's
# rms 20.8% -> 4.7%); 2 kB rows of the 4-rank compare run. 2x: a factor no repeat of a size on this
# VM reaches at >= 64 KiB (model-local-check.md, repeat table), and below that a point is only
# dropped when a larger size was measured more than 2x faster, which no line can fit.
SLOWER_THAN_LARGER_LIMIT = 2.0
# Above this share of a group's points, the timings are inconsistent as a whole (or one larger size
# was measured too fast): nothing is dropped and the group is fitted as measured, with a warning.
MOST_DROPPED_SHARE = 0.25


def fit_within(bounds: Sequence[tuple[int, int]], sizes: Sequence[float], times_us: Sequence[float], *,
               series: tuple[Sequence[float], Sequence[float]] | None = None) -> list[Segment]:
    """One line per given size range over the points that fall in it (:func:`fit_segments`' lines,
    with breakpoints found elsewhere). A range that holds a single size of these points joins the
    nearer neighbouring range that holds any (a line needs two sizes; one_shot's last size before the
    switch point, cut off by a breakpoint found on the op's whole series, stays on one_shot's line).

    Except where the path came back to that size past sizes other paths took (``series``: every
    path's points; a label flipping by timing): its nearest sizes of its own lie in another cache
    regime, so joining them drew one line across the regimes in between. The single size keeps a
    segment of its own instead, on the line of the other paths' points in the range (two sizes or
    more; the paths' speeds differ, so not a line through its own point as well) scaled to pass
    through its time, over its size and the sizes of the range it skipped; the gap to its
    neighbour is then a chord (:func:`~collectives.model.segments.fitted_segment`). The local
    check's calibration run of 16ceb64 timed all_to_all's staged_pairwise at 2, 4, 8 and 128 MiB
    and cma_pull at 16-64 MiB: staged_pairwise's one line from 2 to 128 MiB (21% rms) missed its
    24 MiB row by 33%.

    Args:
        bounds: ``(min_bytes, max_bytes)`` per range, ascending, not overlapping.
        sizes: bytes per point (``[P]``); times_us: measured times (``[P]``, > 0).
        series: ``(sizes, times_us)`` of every path of the series, these points included; None: a
            path measured on its own.

    Returns:
        The segments, smallest sizes first; none when the points have fewer than two sizes and no
        other paths' line takes their size (a path of one size, which timing chose there alone, gets
        that line as a path that came back does). A single size on the other paths' line is a segment
        of one point (``points`` 1, or its repeats) whose ``rms_relative_error`` is that line's on
        their points.
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times_us, dtype=np.float64)
    ranges = []
    for low, high in bounds:
        mask = (s >= low) & (s <= high)
        if mask.any():
            ranges.append((mask, (low, high)))
    # each range's segment on the other paths' line, where the path came back to its one size there
    placed = [None if series is None else _on_series_line(s, t, mask, where, series) for mask, where in ranges]
    parts = [mask for (mask, _), segment in zip(ranges, placed) if segment is None]
    on_series = [segment for segment in placed if segment is not None]
    while len(parts) > 1:
        lone = [i for i, mask in enumerate(parts) if len(np.unique(s[mask])) < 2]
        if not lone:
            break
        i = lone[0]
        at = max(float(s[parts[i]][0]), 1.0)
        gaps = {j: abs(math.log(max(float(edge(s[parts[j]])), 1.0) / at))
                for j, edge in ((i - 1, np.max), (i + 1, np.min)) if 0 <= j < len(parts)}
        j = min(gaps, key=lambda j: (gaps[j], j))
        parts[j] = parts[j] | parts[i]
        del parts[i]
    lines = [_fit_line(s[mask], t[mask])[1] for mask in parts if len(np.unique(s[mask])) >= 2]
    return sorted(lines + on_series, key=lambda seg: seg.min_bytes)


def _on_series_line(s: np.ndarray, t: np.ndarray, mask: np.ndarray, where: tuple[int, int],
                    series: tuple[Sequence[float], Sequence[float]]) -> Segment | None:
    """:func:`fit_within`'s segment for a range holding one size of the path, on the other paths'
    line there, when the path came back to it past other paths' sizes; else None."""
    own = np.unique(s[mask])
    if len(own) != 1:
        return None
    size, others = float(own[0]), np.unique(s[~mask])
    all_sizes = np.asarray(series[0], dtype=np.float64)
    all_times = np.asarray(series[1], dtype=np.float64)
    if len(others):
        nearest = others[np.argmin(np.abs(np.log(np.maximum(others, 1.0) / max(size, 1.0))))]
        low, high = sorted((size, float(nearest)))
        skipped = (all_sizes > low) & (all_sizes < high)
        if not skipped.any():
            return None  # its own neighbour comes next in the series: it stays on that line
    else:  # the path's only size: timing chose it there alone
        skipped = np.zeros(all_sizes.shape, dtype=bool)
    # the other paths' points in the range: the series' points less this path's own
    inside = (all_sizes >= where[0]) & (all_sizes <= where[1]) & ~np.isin(all_sizes, s)
    if len(np.unique(all_sizes[inside])) < 2:
        return None
    _, line = _fit_line(all_sizes[inside], all_times[inside])
    predicted = line.alpha_us + line.beta_us_per_byte * size
    if predicted <= 0:
        return None
    scale = float(np.mean(t[mask])) / predicted
    # It holds over the sizes the path skipped in this range too (the other paths' line there).
    span = np.append(all_sizes[skipped & inside], size)
    return Segment(line.alpha_us * scale, line.beta_us_per_byte * scale, int(span.min()), int(span.max()),
                   int(mask.sum()), line.rms_relative_error, from_other_paths=True)


def fit_series(paths: Mapping[str, Sequence[tuple[float, float]]], *, max_segments: int = MAX_SEGMENTS,
               min_sizes: int = MIN_SEGMENT_SIZES, penalty: float = SEGMENT_PENALTY) -> dict[str, list[Segment]]:
    """Piecewise fit of the paths one op took at disjoint sizes (one series, :func:`is_one_series`).

    The best breakpoints for each number of segments are searched on the series, all paths' points
    together (:func:`_best_splits`); each path is then fitted within them (:func:`fit_within`), and
    the number of segments is the one whose per-path lines, the ones predictions use, minimise
    :func:`fit_segments`' criterion. Judged on one line through the series instead, the sizes where
    the paths take turns (their speeds differ by tens of percent there) leave a residual that no
    breakpoint removes and that hides a real cliff elsewhere: the local check's calibration run
    (benchmarks/results/model-local-check.md) kept all_gather's pull on one line from 8 B to 8 MiB,
    11% rms, across the step between 1 and 2 MiB, and missed 384 KiB by 25%.

    Args:
        paths: ``{path: [(size bytes, time us), ...]}``.
        max_segments, min_sizes, penalty: as for :func:`fit_segments`.

    Returns:
        ``{path: segments}`` (smallest sizes first) for every path with two or more sizes, and for a
        path of one size whose range holds two sizes of the other paths: one segment on their line
        there, scaled through its time (as :func:`fit_within` places a size a path came back to).
    """
    series = sorted(p for points in paths.values() for p in points)
    s = np.array([p[0] for p in series], dtype=np.float64)
    t = np.array([p[1] for p in series], dtype=np.float64)
    fitted = [p for p in paths.items() if len({size for size, _ in p[1]}) >= 2]
    if not fitted:
        return {}
    best: tuple[float, int, dict[str, list[Segment]], list[tuple[int, int]]] | None = None
    for _, split in _best_splits(s, t, max_segments, min_sizes):
        bounds = [(seg.min_bytes, seg.max_bytes) for seg in split]
        lines = {name: fit_within(bounds, [p[0] for p in points], [p[1] for p in points], series=(s, t))
                 for name, points in fitted}
        used = [seg for segs in lines.values() for seg in segs]
        rss = sum(seg.rms_relative_error ** 2 * seg.points for seg in used)
        count = sum(seg.points for seg in used)
        if count:
            option = (_criterion(rss, count, len(split), penalty), len(split), lines, bounds)
            best = option if best is None or option[:2] < best[:2] else best
    if best is None:
        return {}
    out = dict(best[2])
    for name, points in paths.items():  # a path of one size: on the other paths' line in its range, if any
        if name not in out:
            lone = fit_within(best[3], [p[0] for p in points], [p[1] for p in points], series=(s, t))
            if lone:
                out[name] = lone
    return out


def is_one_series(labels: Mapping[str, list[tuple[float, float]]]) -> bool:
    """Whether several algorithms' points form one series: each size measured by exactly one of them,
    as when the transport chose at each size (by timing or at a switch point), not when a run
    measured them side by side (``tools/tune_shm.py``: both at every size)."""
    if len(labels) < 2:
        return False
    sizes = [{p[0] for p in points} for points in labels.values()]
    return sum(map(len, sizes)) == len(set().union(*sizes))


def inconsistent_points(sizes: Sequence[float], times_us: Sequence[float], *,
                        limit: float = SLOWER_THAN_LARGER_LIMIT) -> list[int]:
    """Indices of the points more than ``limit`` times slower than some point of a larger size.

    Args:
        sizes: bytes per point (``[P]``).
        times_us: measured times (``[P]``, > 0).
        limit: the factor, > 1.

    Returns:
        The indices, ascending. Points of the same size are not compared with each other: which of
        two repeats is the glitch cannot be told from them.
    """
    if limit <= 1:
        raise ValueError(f"inconsistent_points: limit must be > 1, got {limit}")
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    flagged: list[int] = []
    fastest_larger = math.inf  # the fastest time of the sizes above the current one
    k = 0
    while k < len(order):
        same = [i for i in order[k:] if sizes[i] == sizes[order[k]]]
        flagged += [i for i in same if times_us[i] > limit * fastest_larger]
        fastest_larger = min([fastest_larger] + [times_us[i] for i in same])
        k += len(same)
    return sorted(flagged)
