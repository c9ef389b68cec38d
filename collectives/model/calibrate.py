"""Fit this machine's collectives from a ``moecomm bench --json`` run: alpha-beta per algorithm.

For every (op, transport, algorithm, ranks) of the run, least squares over the sweep gives::

    time_us = alpha_us + beta_us_per_byte * size

with ``size`` the nccl-tests size column of the row (what :func:`~collectives.model.predict_collective`
takes). The bytes an algorithm really moves are a fixed multiple of ``size`` at a given rank count
(one_shot all_reduce reads ``(n-1) size`` per rank, two_shot and ring ``2(n-1)/n size``, the
others ``size x`` nccl-tests' bus factor), so the fit is the same line in either unit; each term
also records that multiple and the bandwidth in moved bytes it implies (``bandwidth_gbps``).

The line fit itself, every size weighed by its relative miss, piecewise over a CPU's cache regimes,
is :mod:`collectives.model.piecewise`: :func:`~collectives.model.piecewise.fit_segments` per
algorithm; the paths of one op and transport that a run measured at disjoint sizes (the transport
chose one per size: at a switch point, or by timing, when the label flips back and forth) are one
series (:func:`~collectives.model.piecewise.fit_series`).

Times: each row's median call time (:func:`row_time_us`), not nccl-tests' mean, which one descheduled
call moves on a shared VM. Rows used: the library's own transports (``library == "moecomm"``), not the peers (gloo, mpi4py:
the library cannot choose them) and not ``auto`` (its rows repeat a transport's under another
name); rows that failed their check (``wrong > 0``) are dropped, and so are rows more than 2x slower
than a larger size of their group (:func:`~collectives.model.piecewise.inconsistent_points`: no line
with alpha, beta >= 0 is). Runs of ``tools/tune_shm.py --json`` carry non-default slot sizes as their own
transport (``shm/slot 1M``), so they are fitted apart.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from .collective import OPS, bus_factor
from .piecewise import (
    MOST_DROPPED_SHARE,
    SLOWER_THAN_LARGER_LIMIT,
    Segment,
    fit_segments,
    fit_series,
    inconsistent_points,
    is_one_series,
)
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

    ``p50_us`` where the row has one (> 0; rows of ``tools/tune_shm.py`` too: the median call of its
    median repetition), else ``time_us`` (nccl-tests' mean over the timed calls). One call descheduled
    on a shared VM moves a mean by tens of percent, the median hardly.
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
        **({"from_other_paths": True} if seg.from_other_paths else {}),
    } for index, seg in enumerate(segments)]


def fit_run(run: Mapping[str, Any] | str | Path) -> dict[str, list[dict[str, Any]]]:
    """The fitted terms of a run, in :attr:`System.calibration`'s form.

    Args:
        run: a ``moecomm bench --json`` run (dict) or its path.

    Returns:
        ``{op: [term, ...]}``; a term is ``{"algorithm": "transport/algorithm", "ranks",
        "alpha_us", "beta_us_per_byte", "protocol": "fitted", "transport", "min_bytes",
        "max_bytes", "segment", "points", "rms_relative_error", "moved_bytes_per_size",
        "bandwidth_gbps"}``. An algorithm fitted piecewise (:func:`~collectives.model.piecewise.fit_segments`) has one term per
        size segment (``segment`` 0, 1, ... smallest sizes first; ``min_bytes`` .. ``max_bytes``
        the sizes it was fitted on, ``points`` its rows, ``rms_relative_error`` its own fit's; with
        ``"from_other_paths": True``, a size timing chose this path at among other paths' sizes, on their
        line there: ``rms_relative_error`` is that line's, :func:`~collectives.model.piecewise.fit_within`).
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
            left_out = set(dropped)
            points = [p for i, p in enumerate(points) if i not in left_out]
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
        series = fit_series(labels) if is_one_series(labels) else None
        for algorithm, points in sorted(labels.items()):
            sizes = [p[0] for p in points]
            if len(set(sizes)) < 2 and not (series and algorithm in series):
                logger.warning("%s: %s %s/%s on %d ranks has one size only (and no other path of the op's series "
                               "beside it to take a line from); not fitted",
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
    intra = Link(str(shown["transport"]), shown["bandwidth_gbps"] or 1.0, shown["alpha_us"])  # shm, moecomm-nccl, ...
    device = str(env.get("device", "cpu"))
    described = (f"fitted from {where}: {env.get('hostname', '?')} ({env.get('cpu_model', '?')}), "
                 f"{ranks} ranks, {device}")
    return System(
        name=name, description=described, gpus_per_node=ranks, arch="host", intra=intra, nic=None,
        nics_per_node=0, nvls=False, cpu_vendor=_cpu_vendor(env),
        sources={"calibration": f"least squares in relative error over {where} ({env.get('command', 'moecomm bench')})",
                 "intra": f"fitted term {shown['algorithm']} (display only: predictions use the calibration)"},
        calibration=calibration)


def _cpu_vendor(env: Mapping[str, Any]) -> str:
    """The run's CPU vendor as System.cpu_vendor spells it: ``"amd"`` for an AMD ``cpu_model``, else
    ``"intel"`` (the field's default). It only moves network terms, which a fitted single-node System
    has none of; it is set so that the saved System does not contradict its own description."""
    return "amd" if "amd" in str(env.get("cpu_model", "")).lower() else "intel"


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
