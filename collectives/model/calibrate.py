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

Rows used: the library's own transports (``library == "moecomm"``), not the peers (gloo, mpi4py:
the library cannot choose them) and not ``auto`` (its rows repeat a transport's under another
name); rows that failed their check (``wrong > 0``) are dropped. ``tune_shm --json`` runs carry
non-default slot sizes as their own transport (``shm/slot 1M``), so they are fitted apart.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .collective import OPS, bus_factor
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


def fit_run(run: Mapping[str, Any] | str | Path) -> dict[str, list[dict[str, Any]]]:
    """The fitted terms of a run, in :attr:`System.calibration`'s form.

    Args:
        run: a ``moecomm bench --json`` run (dict) or its path.

    Returns:
        ``{op: [term, ...]}``; a term is ``{"algorithm": "transport/algorithm", "ranks",
        "alpha_us", "beta_us_per_byte", "protocol": "fitted", "transport", "min_bytes",
        "max_bytes", "points", "rms_relative_error", "moved_bytes_per_size", "bandwidth_gbps"}``,
        fastest-at-the-largest-size first.
    """
    data, where = _load(run)
    groups: dict[tuple[str, str, str, int], list[tuple[float, float]]] = defaultdict(list)
    default_ranks = int(data.get("env", {}).get("nranks", 0) or 0)
    for row in data["rows"]:
        if not isinstance(row, Mapping) or not _usable(row):
            continue
        ranks = int(row.get("nranks") or default_ranks)
        time_us = float(row.get("time_us", 0.0))
        if ranks < 1 or not math.isfinite(time_us) or time_us <= 0:
            continue
        key = (row["op"], str(row["transport"]), str(row.get("algorithm") or row["transport"]), ranks)
        groups[key].append((float(row["size"]), time_us))
    calibration: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for (op, transport, algorithm, ranks), points in sorted(groups.items()):
        sizes = [p[0] for p in points]
        if len(set(sizes)) < 2:
            logger.warning("%s: %s %s/%s on %d ranks has one size only; not fitted",
                           where, op, transport, algorithm, ranks)
            continue
        times = [p[1] for p in points]
        alpha, beta = fit_alpha_beta(sizes, times)
        misses = [(alpha + beta * s - t) / t for s, t in points]
        factor = traffic_factor(op, algorithm, ranks)
        calibration[op].append({
            "algorithm": f"{transport}/{algorithm}", "ranks": ranks, "alpha_us": alpha, "beta_us_per_byte": beta,
            "protocol": "fitted", "transport": transport, "min_bytes": int(min(sizes)), "max_bytes": int(max(sizes)),
            "points": len(points), "rms_relative_error": math.sqrt(sum(m * m for m in misses) / len(misses)),
            "moved_bytes_per_size": factor,
            # moved bytes per us / 1e3 = GB/s; None where the fit found no size dependence
            "bandwidth_gbps": factor / beta / 1e3 if beta > 0 else None,
        })
    if not calibration:
        raise ValueError(f"{where}: no moecomm rows with two or more sizes to fit (peers and `auto` are not fitted)")
    return {op: sorted(terms, key=lambda t: (t["ranks"], t["alpha_us"] + t["beta_us_per_byte"] * t["max_bytes"]))
            for op, terms in calibration.items()}


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


def _term(system: System, op: str, algorithm: str, ranks: int) -> Mapping[str, Any]:
    terms = [t for t in system.calibration.get(op, ()) if int(t.get("ranks", -1)) == ranks]
    exact = [t for t in terms if t["algorithm"] == algorithm]
    bare = [t for t in terms if str(t["algorithm"]).rsplit("/", 1)[-1] == algorithm]
    found = exact or bare
    if len(found) != 1:
        names = ", ".join(str(t["algorithm"]) for t in terms) or "none"
        why = "is ambiguous" if found else "is not fitted"
        raise ValueError(f"system {system.name!r}: algorithm {algorithm!r} {why} for {op} on {ranks} ranks "
                         f"(fitted: {names}); name it as transport/algorithm")
    return found[0]


def crossover_bytes(system: System, op: str, algorithm_a: str, algorithm_b: str, *, ranks: int) -> int | None:
    """Size where two fitted algorithms' predicted times cross.

    Args:
        system: a calibrated System (:func:`calibrate`).
        op: the op.
        algorithm_a: fitted algorithm, ``transport/algorithm`` or a bare name when unique
            (``"one_shot"``).
        algorithm_b: the other one.
        ranks: rank count of the fits.

    Returns:
        The smallest integer size (bytes) from which the algorithm with the lower latency is no
        longer faster (the lines' intersection, rounded up), or None when the lines do not cross
        at a positive size (one algorithm is faster, or as fast, everywhere).

    Raises:
        ValueError: an algorithm not fitted for that op and rank count.
    """
    a = _term(system, op, algorithm_a, ranks)
    b = _term(system, op, algorithm_b, ranks)
    d_alpha = float(b["alpha_us"]) - float(a["alpha_us"])
    d_beta = float(a["beta_us_per_byte"]) - float(b["beta_us_per_byte"])
    if d_beta == 0.0 or d_alpha / d_beta <= 0.0:
        return None
    return math.ceil(d_alpha / d_beta)
