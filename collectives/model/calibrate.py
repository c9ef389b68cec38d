"""Fit this machine's collectives from a ``moecomm bench --json`` run: alpha-beta per algorithm.

For every (op, transport, algorithm, ranks) of the run, least squares over the sweep gives::

    time_us = alpha_us + beta_us_per_byte * size

with ``size`` the nccl-tests size column of the row (what :func:`~collectives.model.predict_collective`
takes). The bytes an algorithm really moves are a fixed multiple of ``size`` at a given rank count
(one_shot all_reduce reads ``(n-1) size`` per rank, two_shot and ring ``2(n-1)/n size``, the
others ``size x`` nccl-tests' bus factor), so the fit is the same line in either unit; each term
also records that multiple and the bandwidth in moved bytes it implies (``bandwidth_gbps``).

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

Times: each row's median call time (:func:`row_time_us`), not nccl-tests' mean, which one descheduled
call moves on a shared VM. Rows used: the library's own transports (``library == "moecomm"``), not the peers (gloo, mpi4py:
the library cannot choose them) and not ``auto`` (its rows repeat a transport's under another
name); rows that failed their check (``wrong > 0``) are dropped, and so are rows more than 2x slower
than a larger size of their group (:func:`inconsistent_points`: no line with alpha, beta >= 0 is). ``tune_shm --json`` runs carry
non-default slot sizes as their own transport (``shm/slot 1M``), so they are fitted apart.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .collective import OPS, bus_factor
from .segments import fitted_range, fitted_segment, segment_line
from .systems import Link, System

logger = logging.getLogger(__name__)

SCHEMA = "moecomm-bench/1"  # benchmarks/output.py SCHEMA (not imported: the model stays below benchmarks/)


def traffic_factor(op: str, algorithm: str, ranks: int) -> float:
    """Bytes one rank moves per byte of the nccl-tests ``size``, for an algorithm's traffic.

    Args:
        op: one of :data:`~collectives.model.OPS`.
        algorithm: the bench row's algorithm (``one_shot``, ``two_shot``, ``pull``, ``Iallreduce``...).
        ranks: number of ranks.

    Returns:
        ``ranks - 1`` for a one_shot all_reduce (every rank reads every peer's whole buffer), else
        nccl-tests' bus factor (ring and two_shot all_reduce ``2(n-1)/n``; all_gather,
        reduce_scatter, all_to_all ``(n-1)/n``; broadcast 1), the traffic of a bandwidth-optimal
        algorithm, which is what MPI libraries and our pull algorithms run.
    """
    if op == "all_reduce" and algorithm == "one_shot":
        return float(ranks - 1)
    return float(bus_factor(op, ranks))


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
        return [(line(0, m)[0], [line(0, m)[1]])]
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


def fit_within(bounds: Sequence[tuple[int, int]], sizes: Sequence[float], times_us: Sequence[float]) -> list[Segment]:
    """One line per given size range over the points that fall in it (:func:`fit_segments`' lines,
    with breakpoints found elsewhere). A range that holds a single size of these points joins the
    nearer neighbouring range that holds any (a line needs two sizes; one_shot's last size before the
    switch point, cut off by a breakpoint found on the op's whole series, stays on one_shot's line).

    Args:
        bounds: ``(min_bytes, max_bytes)`` per range, ascending, not overlapping.
        sizes: bytes per point (``[P]``); times_us: measured times (``[P]``, > 0).

    Returns:
        The segments, smallest sizes first; none when the points have fewer than two sizes.
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times_us, dtype=np.float64)
    parts = [mask for mask in ((s >= low) & (s <= high) for low, high in bounds) if mask.any()]
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
    return [_fit_line(s[mask], t[mask])[1] for mask in parts if len(np.unique(s[mask])) >= 2]


def fit_series(paths: Mapping[str, Sequence[tuple[float, float]]], *, max_segments: int = MAX_SEGMENTS,
               min_sizes: int = MIN_SEGMENT_SIZES, penalty: float = SEGMENT_PENALTY) -> dict[str, list[Segment]]:
    """Piecewise fit of the paths one op took at disjoint sizes (one series, :func:`_one_series`).

    The best breakpoints for each number of segments are searched on the series, all paths' points
    together (:func:`_best_splits`); each path is then fitted within them (:func:`fit_within`), and
    the number of segments is the one whose per-path lines, the ones predictions use, minimise
    :func:`fit_segments`' criterion. Judged on one line through the series instead, the sizes where
    the paths take turns (their speeds differ by tens of percent there) leave a residual that no
    breakpoint removes and that hides a real cliff elsewhere: the local check's calibration run
    (benchmarks/results/model-local-check.md) kept all_gather's pull on one line from 8 B to 8 MiB,
    11% rms, across the 1-2 MiB cache step, and missed 384 KiB by 25%.

    Args:
        paths: ``{path: [(size bytes, time us), ...]}``.
        max_segments, min_sizes, penalty: as for :func:`fit_segments`.

    Returns:
        ``{path: segments}`` (smallest sizes first) for every path with two or more sizes.
    """
    series = sorted(p for points in paths.values() for p in points)
    s = np.array([p[0] for p in series], dtype=np.float64)
    t = np.array([p[1] for p in series], dtype=np.float64)
    fitted = [p for p in paths.items() if len({size for size, _ in p[1]}) >= 2]
    if not fitted:
        return {}
    best: tuple[float, int, dict[str, list[Segment]]] | None = None
    for _, split in _best_splits(s, t, max_segments, min_sizes):
        bounds = [(seg.min_bytes, seg.max_bytes) for seg in split]
        lines = {name: fit_within(bounds, [p[0] for p in points], [p[1] for p in points]) for name, points in fitted}
        rss = sum(seg.rms_relative_error ** 2 * seg.points for segs in lines.values() for seg in segs)
        points = sum(seg.points for segs in lines.values() for seg in segs)
        if points:
            option = (_criterion(rss, points, len(split), penalty), len(split), lines)
            best = option if best is None or option[:2] < best[:2] else best
    return {} if best is None else best[2]


def _one_series(labels: Mapping[str, list[tuple[float, float]]]) -> bool:
    """Whether several algorithms' points form one series: each size measured by exactly one of them,
    as when the transport chose at each size (by timing or at a switch point), not when a run
    measured them side by side (``tune_shm``: both at every size)."""
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


def _load(run: Mapping[str, Any] | str | Path) -> tuple[Mapping[str, Any], str]:
    if isinstance(run, (str, Path)):
        path = Path(run)
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise ValueError(f"cannot read bench run {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ValueError(f"bench run {path} is not valid JSON: {exc}") from exc
        where = str(path)
    else:
        data, where = run, "bench run"
    if not isinstance(data, Mapping) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, Mapping) else type(data).__name__
        raise ValueError(f"{where}: schema {got!r}, expected {SCHEMA!r} (a `moecomm bench --json` file)")
    if not isinstance(data.get("rows"), list):
        raise ValueError(f"{where}: no rows list")
    return data, where


def _usable(row: Mapping[str, Any]) -> bool:
    return (row.get("library", "moecomm") == "moecomm" and row.get("transport") != "auto"
            and row.get("op") in OPS and int(row.get("wrong", -1)) <= 0)


def row_time_us(row: Mapping[str, Any]) -> float:
    """The time a bench row is fitted on (and a prediction checked against): its median call time.

    ``p50_us`` where the row has one (> 0; ``tune_shm`` rows too: the median call of its median
    repetition), else ``time_us`` (nccl-tests' mean over the timed calls).
    On the shared 2-vCPU VM one call descheduled for a few ms moves a 20-call mean by tens of percent,
    the median hardly: fitted on means, the local check's predictions missed by 24% on average at
    >= 64 KiB, on medians by 17% (same runs; benchmarks/results/model-local-check.md).
    """
    p50 = float(row.get("p50_us") or 0.0)
    return p50 if p50 > 0 and math.isfinite(p50) else float(row.get("time_us", 0.0))


def _terms(op: str, transport: str, algorithm: str, ranks: int, segments: Sequence[Segment]) -> list[dict[str, Any]]:
    """One algorithm's fitted segments as calibration terms (:func:`fit_run`)."""
    factor = traffic_factor(op, algorithm, ranks)
    return [{
        "algorithm": f"{transport}/{algorithm}", "ranks": ranks, "alpha_us": seg.alpha_us,
        "beta_us_per_byte": seg.beta_us_per_byte, "protocol": "fitted", "transport": transport,
        "min_bytes": seg.min_bytes, "max_bytes": seg.max_bytes, "segment": index, "points": seg.points,
        "rms_relative_error": seg.rms_relative_error, "moved_bytes_per_size": factor,
        # moved bytes per us / 1e3 = GB/s; None where the fit found no size dependence
        "bandwidth_gbps": factor / seg.beta_us_per_byte / 1e3 if seg.beta_us_per_byte > 0 else None,
    } for index, seg in enumerate(segments)]


def fit_run(run: Mapping[str, Any] | str | Path) -> dict[str, list[dict[str, Any]]]:
    """The fitted terms of a run, in :attr:`System.calibration`'s form.

    Args:
        run: a ``moecomm bench --json`` run (dict) or its path.

    Returns:
        ``{op: [term, ...]}``; a term is ``{"algorithm": "transport/algorithm", "ranks",
        "alpha_us", "beta_us_per_byte", "protocol": "fitted", "transport", "min_bytes",
        "max_bytes", "segment", "points", "rms_relative_error", "moved_bytes_per_size",
        "bandwidth_gbps"}``. An algorithm fitted piecewise (:func:`fit_segments`) has one term per
        size segment (``segment`` 0, 1, ... smallest sizes first; ``min_bytes`` .. ``max_bytes``
        the sizes it was fitted on, ``points`` its rows, ``rms_relative_error`` its own fit's).
        Algorithms fastest-at-their-largest-size first, each algorithm's segments together.
    """
    data, where = _load(run)
    groups: dict[tuple[str, str, str, int], list[tuple[float, float]]] = defaultdict(list)
    default_ranks = int(data.get("env", {}).get("nranks", 0) or 0)
    for row in data["rows"]:
        if not isinstance(row, Mapping) or not _usable(row):
            continue
        ranks = int(row.get("nranks") or default_ranks)
        time_us = row_time_us(row)
        if ranks < 1 or not math.isfinite(time_us) or time_us <= 0:
            continue
        key = (row["op"], str(row["transport"]), str(row.get("algorithm") or row["transport"]), ranks)
        groups[key].append((float(row["size"]), time_us))
    kept: dict[tuple[str, str, int], dict[str, list[tuple[float, float]]]] = defaultdict(dict)
    for (op, transport, algorithm, ranks), points in sorted(groups.items()):
        dropped = inconsistent_points([p[0] for p in points], [p[1] for p in points])
        if len(dropped) > MOST_DROPPED_SHARE * len(points):
            logger.warning("%s: %s %s/%s on %d ranks: %d of %d rows are over %gx slower than a larger size; "
                           "fitted as measured", where, op, transport, algorithm, ranks, len(dropped), len(points),
                           SLOWER_THAN_LARGER_LIMIT)
        elif dropped:
            logger.info("%s: %s %s/%s on %d ranks: left out %s, over %gx slower than a larger size", where, op,
                        transport, algorithm, ranks, ", ".join(f"{points[i][1]:.1f} us at {points[i][0]:.0f} B"
                                                              for i in dropped), SLOWER_THAN_LARGER_LIMIT)
            points = [p for i, p in enumerate(points) if i not in set(dropped)]
        kept[(op, transport, ranks)][algorithm] = points
    calibration: dict[str, list[list[dict[str, Any]]]] = defaultdict(list)  # op -> one term list per group
    for (op, transport, ranks), labels in kept.items():
        # Paths the transport picks by timing (all_gather's staged pull against single-copy push above
        # the slot) take turns as its choice flips with the machine's phase, so each path's rows are a
        # scattered subset of the sweep: too few in a cache regime to place its breakpoints, and one
        # line then spans L3 and DRAM (the local check's 96 MiB pull all_gather: -65%). Their rows
        # together are one series, the op's time as run; the regimes are found on it and each path
        # fitted within them (fit_series). Paths split at a switch point are a series too (same fits, as a lone
        # size joins its neighbour); paths measured side by side are not.
        series = fit_series(labels) if _one_series(labels) else None
        for algorithm, points in sorted(labels.items()):
            sizes = [p[0] for p in points]
            if len(set(sizes)) < 2:
                logger.warning("%s: %s %s/%s on %d ranks has one size only; not fitted",
                               where, op, transport, algorithm, ranks)
                continue
            segments = series[algorithm] if series is not None else fit_segments(sizes, [p[1] for p in points])
            calibration[op].append(_terms(op, transport, algorithm, ranks, segments))
    if not calibration:
        raise ValueError(f"{where}: no moecomm rows with two or more sizes to fit (peers and `auto` are not fitted)")

    def at_largest(group: list[dict[str, Any]]) -> tuple[int, float]:
        last = group[-1]
        return last["ranks"], last["alpha_us"] + last["beta_us_per_byte"] * last["max_bytes"]

    return {op: [t for group in sorted(groups_, key=at_largest) for t in group] for op, groups_ in calibration.items()}


def calibrate(run: Mapping[str, Any] | str | Path, *, name: str = "local") -> System:
    """A System of this machine fitted from a ``moecomm bench --json`` run.

    Args:
        run: the run (dict) or its path (schema "moecomm-bench/1").
        name: the System's name.

    Returns:
        A single-node System whose ``calibration`` holds :func:`fit_run`'s terms, so that
        ``predict_collective(system, op, size, nodes=1, gpus_per_node=ranks)`` predicts from the
        fits and picks the fastest transport/algorithm. Its ``intra`` link carries the fastest
        fitted all_reduce's figures (or any op's) for display only.

    Raises:
        ValueError: an unreadable file, another schema, or nothing to fit.
    """
    data, where = _load(run)
    calibration = fit_run(data)
    env = data.get("env", {}) if isinstance(data.get("env"), Mapping) else {}
    ranks = max(t["ranks"] for terms in calibration.values() for t in terms)
    # The fitted terms give every prediction; the System's one link only shows the machine: the
    # lowest per-byte cost among the all_reduce fits (any op's if there is no all_reduce).
    at_ranks = [t for terms in calibration.values() for t in terms if t["ranks"] == ranks]
    all_reduce = [t for t in calibration.get("all_reduce", ()) if t["ranks"] == ranks]
    shown = min(all_reduce or at_ranks, key=lambda t: t["beta_us_per_byte"])
    intra = Link("shm", shown["bandwidth_gbps"] or 1.0, shown["alpha_us"])
    device = str(env.get("device", "cpu"))
    described = (f"fitted from {where}: {env.get('hostname', '?')} ({env.get('cpu_model', '?')}), "
                 f"{ranks} ranks, {device}")
    return System(
        name=name, description=described, gpus_per_node=ranks, arch="host", intra=intra, nic=None,
        nics_per_node=0, nvls=False,
        sources={"calibration": f"least squares in relative error over {where} ({env.get('command', 'moecomm bench')})",
                 "intra": f"fitted term {shown['algorithm']} (display only: predictions use the calibration)"},
        calibration=calibration)


def _segments(system: System, op: str, algorithm: str, ranks: int) -> list[Mapping[str, Any]]:
    """The fitted terms (segments) of one algorithm, named ``transport/algorithm`` or bare when unique."""
    terms = [t for t in system.calibration.get(op, ()) if int(t.get("ranks", -1)) == ranks]
    names = list(dict.fromkeys(str(t["algorithm"]) for t in terms))
    found = [algorithm] if algorithm in names else [n for n in names if n.rsplit("/", 1)[-1] == algorithm]
    if len(found) != 1:
        why = "is ambiguous" if found else "is not fitted"
        raise ValueError(f"system {system.name!r}: algorithm {algorithm!r} {why} for {op} on {ranks} ranks "
                         f"(fitted: {', '.join(names) or 'none'}); name it as transport/algorithm")
    return [t for t in terms if t["algorithm"] == found[0]]


def fitted_term(system: System, op: str, algorithm: str, size: int, *, ranks: int) -> Mapping[str, Any]:
    """The term of one fitted algorithm that predicts ``size``: the segment holding it, in a gap the chord
    between its two neighbours (``"chord": True``), beyond all the nearest
    (:func:`collectives.model.segments.fitted_segment`). Arguments and errors as :func:`fitted_time_us`."""
    return fitted_segment(_segments(system, op, algorithm, ranks), size)


def fitted_time_us(system: System, op: str, algorithm: str, size: int, *, ranks: int) -> float:
    """Predicted time of one fitted algorithm (its piecewise prediction, whether or not it is the fastest).

    Args:
        system: a calibrated System (:func:`calibrate`).
        op: the op.
        algorithm: ``transport/algorithm``, or a bare name when one transport has it (``"one_shot"``).
        size: the nccl-tests size column in bytes, >= 0.
        ranks: rank count of the fits.

    Returns:
        ``alpha + beta * size`` (us) of the segment that predicts ``size``
        (:func:`collectives.model.segments.fitted_segment`, as ``predict_collective`` chooses it:
        the one holding ``size``, in a gap the chord between its two neighbours, beyond all the nearest).

    Raises:
        ValueError: an algorithm not fitted (or ambiguous) for that op and rank count.
    """
    alpha, beta = segment_line(fitted_term(system, op, algorithm, size, ranks=ranks))
    return alpha + beta * size


def _knots(segments: Sequence[Mapping[str, Any]]) -> set[int]:
    """Sizes around which the term predicting a size can change (fitted_segment's rule): the ends of
    every fitted range (a gap between two ranges is one line, their chord)."""
    out: set[int] = set()
    for t in segments:
        low, high = fitted_range(t)
        out.update((low - 1, low))
        if high is not None:
            out.update((high, high + 1))
    return out


def comparison_start(system: System, op: str, algorithm_a: str, algorithm_b: str, *, ranks: int) -> int:
    """Smallest size at which two fitted algorithms are compared: the larger of their smallest fitted sizes.

    Below it one algorithm's fit is extrapolated beyond its data (a term fitted on large sizes only
    can have alpha 0), so "faster at small sizes" means faster here.

    Args:
        system, op, algorithm_a, algorithm_b, ranks: as :func:`crossover_bytes`.

    Returns:
        The size in bytes, >= 1.

    Raises:
        ValueError: an algorithm not fitted (or ambiguous) for that op and rank count.
    """
    return max(1, *(min(fitted_range(t)[0] for t in _segments(system, op, name, ranks))
                    for name in (algorithm_a, algorithm_b)))


def crossover_bytes(system: System, op: str, algorithm_a: str, algorithm_b: str, *, ranks: int) -> int | None:
    """First size at which the algorithm faster at small sizes stops being faster (piecewise fits).

    "Small sizes" start at :func:`comparison_start` (the larger of the two algorithms' smallest
    fitted sizes). Each algorithm predicts with :func:`fitted_time_us`, so segmented fits are followed
    exactly: between the sizes where either algorithm changes segment both are lines, and their
    crossing is solved in closed form.

    Args:
        system: a calibrated System (:func:`calibrate`).
        op: the op.
        algorithm_a: fitted algorithm, ``transport/algorithm`` or a bare name when unique
            (``"one_shot"``).
        algorithm_b: the other one.
        ranks: rank count of the fits.

    Returns:
        The smallest integer size (bytes) >= the start at which the algorithm faster at the start
        is no longer faster (as fast or slower), or None when it stays faster at every larger size.

    Raises:
        ValueError: an algorithm not fitted (or ambiguous) for that op and rank count.
    """
    a = _segments(system, op, algorithm_a, ranks)
    b = _segments(system, op, algorithm_b, ranks)
    start = comparison_start(system, op, algorithm_a, algorithm_b, ranks=ranks)

    def lines(size: int) -> tuple[tuple[float, float], tuple[float, float]]:
        return segment_line(fitted_segment(a, size)), segment_line(fitted_segment(b, size))

    def gap(size: int) -> float:  # > 0: b faster
        (alpha_a, beta_a), (alpha_b, beta_b) = lines(size)
        return (alpha_a + beta_a * size) - (alpha_b + beta_b * size)

    # The faster one at the start (on a tie, the one with the lower per-byte cost there).
    (_, beta_a), (_, beta_b) = lines(start)
    sign = 1.0 if gap(start) < 0 or (gap(start) == 0 and beta_a <= beta_b) else -1.0  # sign * gap < 0: faster
    knots = sorted(k for k in _knots(a) | _knots(b) | {start} if k >= start)
    for low, high in zip(knots, [*knots[1:], None]):
        if sign * gap(low) >= 0 and low > start:
            return low
        # On (low, high) both algorithms keep the segment they have at low + 1: the gap is linear.
        (alpha_a, beta_a), (alpha_b, beta_b) = lines(low + 1)
        d_alpha, d_beta = sign * (alpha_a - alpha_b), sign * (beta_a - beta_b)  # gap = d_alpha + d_beta s < 0
        if d_beta > 0:
            crossing = max(low + 1, math.ceil(-d_alpha / d_beta))
            # the division rounds (by far less than a byte): settle on the first integer where the
            # evaluated times agree
            for _ in range(2):
                if crossing > low + 1 and sign * gap(crossing - 1) >= 0:
                    crossing -= 1
                elif sign * gap(crossing) < 0:
                    crossing += 1
            if high is None or crossing < high:
                return crossing
    return None
