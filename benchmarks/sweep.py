"""nccl-tests-style bandwidth sweep over moecomm and its peers (runs on every rank).

Conventions follow nccl-tests (https://github.com/NVIDIA/nccl-tests: ``src/*.cu`` and
``doc/PERFORMANCE.md``):

- ``size`` is the bytes of the full buffer (all_reduce, broadcast: the tensor; all_gather: the
  gathered output; reduce_scatter: the input; all_to_all: what one rank sends), ``count`` the
  per-rank element count of the op's parameter (all_gather/reduce_scatter/all_to_all: one block).
- ``time`` is the mean time per call over the timed iterations, averaged across ranks;
  algbw = size / time (GB/s = 1e9 B/s) and busbw = algbw * :func:`common.bus_factor`.
- Out-of-place and in-place are both measured; in-place uses nccl-tests' buffer layouts:
  all_reduce/broadcast/all_to_all send from and receive into one buffer, all_gather sends from
  this rank's block of the output, reduce_scatter receives into this rank's block of the input.
  In-place all_to_all is checked only for libraries that define one (moecomm's ``out=x``, MPI's
  ``MPI_IN_PLACE``); for the others it is timed but not checked (#wrong ``N/A``), as nccl-tests
  does for every library (NCCL has no in-place all-to-all).
- ``#wrong`` counts elements that differ from a NumPy/torch reference computed from the same
  deterministic random inputs, summed over ranks (``-1`` = not checked, printed ``N/A``).

Beyond nccl-tests:

- every iteration is timed on its own on every rank; ``p50``/``p99`` are percentiles over
  iterations of the per-iteration time averaged across ranks (the quantity whose mean is the
  ``time`` column; the slowest rank's time would include waiting for ranks that arrived late);
- in-place buffers are restored before each iteration, outside the timed region, so repeated
  reductions stay in range (nccl-tests does not restore; on CPUs overflow to inf or a slide
  into denormals would change the speed of the reduction itself);
- one invocation measures several peers (:mod:`benchmarks.peers`), interleaved size by size so
  that machine drift hits all alike;
- ``cycles`` > 1 makes the whole sweep that many times and pools each row's timed calls of every
  cycle, so a row's samples are spread over the run instead of taken in one burst (on a shared
  or virtual machine a slow phase of a few milliseconds can otherwise move one row by 2x);
- ``graph_calls`` N > 0 (``bench --cuda-graph N``, nccl-tests' ``-G N``): each step's calls are
  captured N at a time into one CUDA graph and the graph's replays are timed (time per call =
  replay time / N); out-of-place only, the result checked after the timed replays. This is how
  inference engines issue small collectives, and how custom all-reduces are compared;
- with a reference peer (:class:`peers.MemcpyPeer`), each size starts with one ``memcpy`` row:
  every rank copies ``size`` bytes (uint8) locally at the same time, timed like the ops, checked
  bitwise, busbw = algbw (bus factor 1), out-of-place only; every row of that size carries its
  busbw as ``memcpy_busbw``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from .common import (DTYPES, MEMCPY, REDUCING, WHOLE_BUFFER, Row, bus_factor, counts_for, has_in_place, in_numel,
                     itemsize)
from .peers import Bound, MoecommPeer, Peer


# ---- inputs and reference -------------------------------------------------------------------
def _inputs(op: str, count: int, n: int, rank: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic random input of `rank` for this op and size (any rank can regenerate it)."""
    numel = in_numel(op, count, n)
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(0, 100, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _reduce(xs: Sequence[torch.Tensor], dtype: torch.dtype, redop: str) -> torch.Tensor:
    """Reference reduction: floats in float64, integers in their own dtype (wrapping like C)."""
    if dtype.is_floating_point:
        xs = [x.double() for x in xs]
    acc = xs[0].clone()
    for x in xs[1:]:
        if redop in ("sum", "avg"):
            acc += x
        elif redop == "prod":
            acc *= x
        elif redop == "max":
            acc = torch.maximum(acc, x)
        elif redop == "min":
            acc = torch.minimum(acc, x)
        else:
            raise ValueError(f"unknown reduction op {redop!r}")
    return acc / len(xs) if redop == "avg" else acc


def _reference(op: str, count: int, n: int, rank: int, dtype: torch.dtype, seed: int, redop: str = "sum",
               root: int = 0) -> torch.Tensor:
    """What ``rank`` must receive: computed from every rank's regenerated input."""
    if op == MEMCPY:  # a local copy: this rank's own input
        return _inputs(op, count, n, rank, dtype, seed)
    xs = [_inputs(op, count, n, r, dtype, seed) for r in range(n)]
    if op == "all_reduce":
        return _reduce(xs, dtype, redop)
    if op == "all_gather":
        return torch.cat(xs)
    if op == "reduce_scatter":
        return _reduce(xs, dtype, redop)[rank * count : (rank + 1) * count]
    if op == "all_to_all":
        return torch.cat([x[rank * count : (rank + 1) * count] for x in xs])
    if op == "broadcast":
        return xs[root]
    raise ValueError(op)


_EPS = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-6, torch.float64: 1e-12}


def count_wrong(op: str, result: torch.Tensor, count: int, n: int, rank: int, dtype: torch.dtype, seed: int,
                redop: str = "sum", root: int = 0) -> int:
    """Elements of this rank's result that differ from the reference.

    Args:
        op, count, n, rank, dtype, seed, redop, root: the call that produced ``result``.
        result: this rank's output, any shape with the reference's number of elements.

    Returns:
        How many elements are outside the tolerance (NaN counts as wrong; a wrong number of
        elements: all of them).
    """
    ref = _reference(op, count, n, rank, dtype, seed, redop, root)
    result = result.detach().cpu().reshape(-1) if result.dim() != 1 else result.detach().cpu()
    if result.shape != ref.shape:
        return max(result.numel(), ref.numel())
    if not dtype.is_floating_point:
        return int((result != ref).sum())
    # one rounding per accumulation step (16-bit types accumulate in float32, round once)
    eps = _EPS[dtype]
    scale = ref.abs() if redop == "prod" else ref.abs() + 1
    tol = eps * (n + 1) * scale
    diff = (result.double() - ref).abs()
    return int((~(diff <= tol)).sum())  # NaN counts as wrong


# ---- timing ---------------------------------------------------------------------------------
def time_each(bound: Bound, iters: int, warmup: int, barrier: Callable[[], None]) -> list[float]:
    """Seconds of each timed call on this rank; ranks start the timed calls together.

    Args:
        bound: one variant of one op on fixed buffers (:meth:`peers.Peer.bind`).
        iters: timed calls; warmup: untimed calls first.
        barrier: the ranks' barrier (called once, after the warmup).

    Returns:
        ``iters`` durations in seconds (in-place buffers are restored outside the timed region).
    """
    reset, sync, call = bound.reset, bound.sync, bound.call
    for _ in range(warmup):
        if reset is not None:
            reset()
        call()
    sync()
    barrier()
    times = []
    for _ in range(iters):
        if reset is not None:
            reset()
            sync()
        t0 = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def time_graph(bound: Bound, calls: int, iters: int, warmup: int, barrier: Callable[[], None],
               device: str) -> list[float]:
    """Seconds per call of each timed replay of a CUDA graph that holds ``calls`` calls of ``bound``.

    The calls are warmed up eagerly on a side stream first (a transport's lazy per-signature setup
    must not be captured), then captured into one graph on every rank at once; ``warmup`` untimed
    replays precede the timed ones, and the ranks start the timed replays together.

    Args:
        bound: an out-of-place variant on CUDA buffers (:meth:`peers.Peer.bind`).
        calls: calls per graph; iters: timed replays; warmup: untimed replays (and eager calls).
        barrier: the ranks' barrier; device: the buffers' CUDA device.

    Returns:
        ``iters`` durations in seconds, each a replay's time divided by ``calls``.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            bound.call()
    torch.cuda.current_stream(device).wait_stream(side)
    bound.sync()
    barrier()
    graph = torch.cuda.CUDAGraph()
    # thread_local: a library's helper threads (NCCL's watchdog) may query their events meanwhile
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            bound.call()
    for _ in range(warmup):
        graph.replay()
    bound.sync()
    barrier()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        graph.replay()
        bound.sync()
        times.append((time.perf_counter() - t0) / calls)
    return times


def _check(bound: Bound, checks: int, op: str, count: int, n: int, rank: int, dtype: torch.dtype, seed: int,
           redop: str, root: int) -> int:
    """Max wrong elements over ``checks`` checked calls on this rank (-1: not checked)."""
    if checks <= 0:
        return -1
    worst = 0
    for _ in range(checks):
        if bound.reset is not None:
            bound.reset()
        bound.call()
        bound.sync()
        worst = max(worst, count_wrong(op, bound.result(), count, n, rank, dtype, seed, redop, root))
    return worst


class Timing(NamedTuple):
    """One measurement of one step on this rank, before it is combined across ranks and cycles."""

    times: tuple[list[float], list[float]]  # seconds of each timed call: out-of-place, in-place
    wrong: tuple[int, int]                  # wrong elements per variant on this rank (-1: not checked)
    algorithm: str                          # the peer's label for the path it took


def time_step(peer: Peer, stats, op: str, dtype_name: str, redop: str, count: int, *, iters: int, warmup: int,
              checks: int, seed: int, root: int = 0, graph_calls: int = 0) -> Timing:
    """Check, then time, out-of-place and in-place ``op`` through ``peer`` on this rank (one cycle of
    one step of a sweep; :func:`summarise` makes the row).

    Collective over the ranks of ``peer`` and of ``stats`` (whose barrier starts the timed calls).

    Args:
        peer: the library measured.
        stats: the moecomm communicator (same ranks) that aggregates times and error counts.
        op, dtype_name, redop: what to measure (``redop`` is ignored by ops that do not reduce).
        count: elements per rank (:func:`common.counts_for`).
        iters, warmup: timed and untimed calls per variant; checks: checked calls per variant.
        seed: seed of the inputs; root: broadcast's root.
        graph_calls: > 0: time replays of a CUDA graph of this many calls (:func:`time_graph`),
            out-of-place only, and check the result the replays left (when ``checks`` > 0).
    """
    dtype = DTYPES[dtype_name]
    n, rank = stats.size, stats.rank
    x = _inputs(op, count, n, rank, dtype, seed)
    if graph_calls > 0:
        bound = peer.bind(op, x, count, redop, root, in_place=False)
        times_g = time_graph(bound, graph_calls, iters, warmup, stats.barrier, peer.device)
        wrong_g = count_wrong(op, bound.result(), count, n, rank, dtype, seed, redop, root) if checks > 0 else -1
        return Timing((times_g, []), (wrong_g, -1), peer.algorithm(op, x))
    times, wrong = [], []
    for in_place in (False, True):
        if in_place and not has_in_place(op):  # the memcpy reference: out-of-place only
            times.append([])
            wrong.append(-1)
            continue
        bound = peer.bind(op, x, count, redop, root, in_place=in_place)
        # nccl-tests does not check in-place all_to_all ("We don't support in-place alltoall"): a
        # library that defines one (moecomm, MPI) is checked like any variant, the others are not
        unchecked = in_place and op == "all_to_all" and not peer.defines_in_place_all_to_all
        wrong.append(-1 if unchecked else _check(bound, checks, op, count, n, rank, dtype, seed, redop, root))
        times.append(time_each(bound, iters, warmup, stats.barrier))
    return Timing((times[0], times[1]), (wrong[0], wrong[1]), peer.algorithm(op, x))


def summarise(peer: Peer, stats, op: str, dtype_name: str, redop: str, count: int, timings: Sequence[Timing],
              root: int = 0, graph_calls: int = 0) -> Row:
    """The row of one step from its timings on this rank (one per cycle), pooled over cycles and
    combined across ranks. Collective over the ranks of ``stats``.

    Every timed call of every cycle counts alike: ``time`` is their mean, ``p50``/``p99``
    percentiles over them (each the call's time averaged across ranks); ``#wrong`` is the worst
    cycle's, summed over ranks. The algorithm is the last cycle's label.
    """
    n = stats.size
    oop = [t for timing in timings for t in timing.times[0]]
    ip = [t for timing in timings for t in timing.times[1]]
    wrong = [max(timing.wrong[v] for timing in timings) for v in (0, 1)]
    per_rank = [sum(ts) / max(len(ts), 1) for ts in (oop, ip)]
    tot = stats.all_reduce(torch.tensor(per_rank + [max(w, 0) for w in wrong], dtype=torch.float64))
    across = stats.all_reduce(torch.tensor(oop + ip, dtype=torch.float64), op="avg").numpy()
    t_oop, t_ip = float(tot[0]) / n, float(tot[1]) / n
    nbytes = count * itemsize(dtype_name) * (1 if op in WHOLE_BUFFER else n)
    factor = bus_factor(op, n)
    bw_oop = nbytes / t_oop / 1e9 if t_oop > 0 else 0.0
    bw_ip = nbytes / t_ip / 1e9 if t_ip > 0 else 0.0
    k = len(oop)
    p50, p99, ip_p50, ip_p99 = (float(np.percentile(a, q)) * 1e6 if len(a) else 0.0
                                for a in (across[:k], across[k:]) for q in (50, 99))
    return Row(op=op, transport=peer.name, size=nbytes, count=count, dtype=dtype_name,
               redop=redop if op in REDUCING else "none", algorithm=timings[-1].algorithm,
               root=root if op == "broadcast" else -1, library=peer.library, nranks=n, device=peer.device,
               time_us=t_oop * 1e6, algbw=bw_oop, busbw=bw_oop * factor, wrong=int(tot[2]) if wrong[0] >= 0 else -1,
               p50_us=p50, p99_us=p99,
               ip_time_us=t_ip * 1e6, ip_algbw=bw_ip, ip_busbw=bw_ip * factor,
               ip_wrong=int(tot[3]) if wrong[1] >= 0 else -1, ip_p50_us=ip_p50, ip_p99_us=ip_p99,
               mode="graph" if graph_calls > 0 else "eager", graph_calls=graph_calls)


class Step(NamedTuple):
    """One measurement of a sweep: ``count`` elements per rank of ``op`` at ``size`` bytes through ``peer``."""

    size: int
    op: str
    dtype: str
    redop: str
    count: int
    peer: Peer


def too_small(ops: Iterable[str], dtype_names: Sequence[str], byte_sizes: Sequence[int], n: int) -> list[str]:
    """The (op, dtype) pairs for which no size of the sweep gives every rank an element.

    Args:
        ops, dtype_names: what the sweep measures.
        byte_sizes: the sweep's sizes.
        n: number of ranks.

    Returns:
        One message per such pair, naming the smallest size that would run (empty: all run).
    """
    out = []
    for op in ops:
        for dname in dtype_names:
            if not any(size == 0 or counts_for(op, size, n, itemsize(dname)) > 0 for size in byte_sizes):
                need = itemsize(dname) * (1 if op in ("all_reduce", "broadcast") else n)
                out.append(f"{op} of {dname} on {n} ranks needs at least {need} B")
    return out


def plan_sweep(peers: Sequence[Peer], ops: Iterable[str], dtype_names: Sequence[str], redops: Sequence[str],
               byte_sizes: Sequence[int], n: int, graph: bool = False) -> tuple[list[Step], list[str]]:
    """The measurements a sweep will make, in order, and notes on what each peer skips and why.

    Order: size, op, dtype, redop, peer (innermost), so every peer measures a size back to back.
    Sizes too small to give every rank an element are left out. A reference peer (one with a
    ``reference_op``, :class:`peers.MemcpyPeer`) runs once per size, first, on uint8 (``size``
    elements), whatever the ops and dtypes.

    Args:
        peers: the libraries measured.
        ops, dtype_names, redops, byte_sizes: what to measure.
        n: number of ranks.
        graph: the steps run under CUDA graphs: leave out what a peer cannot capture (a note says why).

    Returns:
        (steps, notes); the same on every rank.
    """
    ops = list(ops)
    references = [p for p in peers if p.reference_op]
    peers = [p for p in peers if not p.reference_op]
    steps, notes = [], {}
    for size in byte_sizes:
        steps += [Step(size, p.reference_op, "uint8", "none", size, p) for p in references
                  if not (graph and p.graph_support(p.reference_op))]
        for op in ops:
            for dname in dtype_names:
                count = counts_for(op, size, n, itemsize(dname))
                if count == 0 and size > 0:
                    continue
                for redop in (redops if op in REDUCING else ["none"]):
                    if redop == "avg" and not DTYPES[dname].is_floating_point:
                        notes.setdefault(f"all peers skip avg for {dname}: avg needs a floating dtype", None)
                        continue
                    for peer in peers:
                        why = peer.supports(op, dname, redop) or (peer.graph_support(op) if graph else None)
                        if why:
                            notes.setdefault(f"{peer.name} skips {op} {dname}"
                                             f"{' ' + redop if op in REDUCING else ''}: {why}", None)
                            continue
                        steps.append(Step(size, op, dname, redop, count, peer))
    return steps, list(notes)


def run_sweep(comms: Mapping[str, Any], ops: Iterable[str], dtype_name: str | Sequence[str],
              byte_sizes: Sequence[int], *, iters: int = 20, warmup: int = 5, check: bool | int = True,
              seed: int = 1, on_row: Callable[[Row], None] | None = None, redops: Sequence[str] = ("sum",),
              root: int = 0, stats=None, on_start: Callable[[int, int, Step], None] | None = None,
              on_notes: Callable[[list[str]], None] | None = None, cycles: int = 1,
              graph_calls: int = 0) -> list[Row]:
    """Sweep sizes x ops x dtypes x redops, each measured through every entry of ``comms`` back to
    back, so machine drift hits all alike. Collective over every entry's ranks.

    Args:
        comms: label -> moecomm Communicator or :class:`peers.Peer`.
        ops, dtype_name, byte_sizes, redops: what to measure (one dtype name or several).
        iters, warmup: timed and untimed calls per variant and cycle; seed: seed of the inputs;
            root: broadcast's.
        check: checked calls per variant and cycle (True = 1, False/0 = off).
        cycles: how many times the whole sweep is made; each row pools its timed calls of every
            cycle (:func:`summarise`). Its samples are then spread over the run, so a slow phase
            of the machine shorter than a cycle moves one cycle's calls, not the whole row.
        stats: the communicator that aggregates across ranks (default: the first moecomm one).
        on_row: called with each row once its last cycle is measured; on_start(i, total, step)
            before each measurement (``total`` counts every cycle's); on_notes(notes) once, with
            what the peers skip.
        graph_calls: > 0: every step timed as replays of a CUDA graph of this many calls
            (:func:`time_graph`); what a peer cannot capture is left out with a note.

    Returns:
        The rows in measurement order, the same on every rank.
    """
    if cycles < 1:
        raise ValueError(f"cycles must be at least 1, got {cycles}")
    peers = [c if isinstance(c, Peer) else MoecommPeer(c, name) for name, c in comms.items()]
    if stats is None:
        stats = next(p.comm for p in peers if isinstance(p, MoecommPeer))
    dnames = [dtype_name] if isinstance(dtype_name, str) else list(dtype_name)
    steps, notes = plan_sweep(peers, ops, dnames, list(redops), byte_sizes, stats.size, graph=graph_calls > 0)
    if on_notes is not None:
        on_notes(notes)
    rows: list[Row] = []
    timings: list[list[Timing]] = [[] for _ in steps]
    memcpy_busbw: dict[int, float] = {}  # size -> the reference's busbw (measured first at each size)
    for cycle in range(cycles):
        for i, step in enumerate(steps):
            if on_start is not None:
                on_start(cycle * len(steps) + i, cycles * len(steps), step)
            timings[i].append(time_step(step.peer, stats, step.op, step.dtype, step.redop, step.count, iters=iters,
                                        warmup=warmup, checks=int(check), seed=seed, root=root,
                                        graph_calls=graph_calls))
            if cycle < cycles - 1:
                continue
            row = summarise(step.peer, stats, step.op, step.dtype, step.redop, step.count, timings[i], root=root,
                            graph_calls=graph_calls)
            if row.op == MEMCPY:
                memcpy_busbw[row.size] = row.busbw
            row.memcpy_busbw = memcpy_busbw.get(row.size, 0.0)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
