"""nccl-tests-style bandwidth sweep over moecomm and its peers (runs on every rank).

Conventions follow NVIDIA/nccl-tests (src/*.cu, doc/PERFORMANCE.md; see ../shared/ANCHORS.md):

- ``size`` is the bytes of the full buffer (all_reduce, broadcast: the tensor; all_gather: the
  gathered output; reduce_scatter: the input; all_to_all: what one rank sends), ``count`` the
  per-rank element count of the op's parameter (all_gather/reduce_scatter/all_to_all: one block).
- ``time`` is the mean time per call over the timed iterations, averaged across ranks;
  algbw = size / time (GB/s = 1e9 B/s) and busbw = algbw * :func:`bus_factor`.
- Out-of-place and in-place are both measured; in-place uses nccl-tests' buffer layouts:
  all_reduce/broadcast/all_to_all send from and receive into one buffer, all_gather sends from
  this rank's block of the output, reduce_scatter receives into this rank's block of the input.
  As in nccl-tests, in-place all_to_all is timed but not checked (#wrong ``N/A``).
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
  that machine drift hits all alike.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ALL_OPS = OPS + ("broadcast",)
REDUCING = ("all_reduce", "reduce_scatter")
REDOPS = ("sum", "prod", "max", "min", "avg")

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
# nccl-tests' names for -d
DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
                 "int": "int32", "int32_t": "int32", "int64_t": "int64", "uint8_t": "uint8"}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (src/*.cu): busbw = algbw * factor."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"no bus factor for {op!r}")


def parse_size(text: str) -> int:
    """'8', '64K', '1M', '2G' -> bytes (powers of 1024, like nccl-tests)."""
    t = str(text).strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional K/M/G suffix") from None


def format_size(nbytes: float) -> str:
    """1024 -> '1 KiB', 4194304 -> '4 MiB', 12 -> '12 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{int(nbytes)} B"


def sizes(min_bytes: int, max_bytes: int, factor: int = 2, step: int = 0) -> list[int]:
    """Byte sizes from min to max, multiplying by ``factor`` (or adding ``step`` when > 0)."""
    out, s = [], max(min_bytes, 0)
    while s <= max_bytes:
        out.append(s)
        nxt = s + step if step > 0 else s * factor
        s = nxt if nxt > s else s + 1
    return out


def parse_dtypes(text: str) -> list[str]:
    """'-d float,half' / '-d all' -> moecomm dtype names (nccl-tests' aliases accepted)."""
    if text.strip() == "all":
        return list(DTYPES)
    out = []
    for d in (t.strip() for t in text.split(",") if t.strip()):
        name = DTYPE_ALIASES.get(d, d)
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {d!r}; one of {', '.join(DTYPES)} "
                             f"(or nccl-tests' {', '.join(DTYPE_ALIASES)}), or 'all'")
        out.append(name)
    return out


def parse_redops(text: str) -> list[str]:
    """'-o sum' / '-o sum,max' / '-o all' -> reduction ops."""
    if text.strip() == "all":
        return list(REDOPS)
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [o for o in out if o not in REDOPS]
    if bad:
        raise ValueError(f"unknown reduction op(s) {bad}; one of {', '.join(REDOPS)}, or 'all'")
    return out


@dataclass
class Row:
    """One line of the table: one op, size, dtype and redop through one peer.

    ``transport`` is the peer's label (moecomm transports: shm, mpi, auto; peers: mpi4py, gloo,
    nccl); ``library`` who implements it. Times in microseconds, bandwidths in GB/s (1e9 B/s);
    ``wrong``/``ip_wrong``: -1 = not checked. The ``ip_`` fields are the in-place variant.
    """

    op: str
    transport: str
    size: int
    count: int
    dtype: str
    redop: str
    time_us: float
    algbw: float
    busbw: float
    wrong: int
    algorithm: str = ""
    root: int = -1
    ip_time_us: float = 0.0
    ip_algbw: float = 0.0
    ip_busbw: float = 0.0
    ip_wrong: int = -1
    p50_us: float = 0.0
    p99_us: float = 0.0
    ip_p50_us: float = 0.0
    ip_p99_us: float = 0.0
    library: str = "moecomm"
    nranks: int = 0
    device: str = "cpu"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        """Inverse of :meth:`as_dict`; also takes CSV's all-string values."""
        kw = {}
        for f in fields(cls):
            if f.name in d and d[f.name] not in (None, ""):
                kw[f.name] = _FIELD_TYPES[f.name](d[f.name])
        return cls(**kw)


_FIELD_TYPES = {f.name: {"str": str, "int": int, "float": float}[f.type if isinstance(f.type, str) else f.type.__name__]
                for f in fields(Row)}
ROW_FIELDS = tuple(f.name for f in fields(Row))


def best_algbw(row: Row | dict, bus: bool = False) -> float | None:
    """The peer's better of out-of-place and in-place bandwidth, counting only variants whose
    results were checked correct (out-of-place also when checking was off); None if neither.

    This is what comparisons use: torch.distributed has no out-of-place all_reduce (its
    out-of-place variant is a copy plus the in-place call) and moecomm's in-place all_gather
    stages through a temporary, so each library is compared the way it runs best.
    """
    g = row.get if isinstance(row, dict) else lambda k: getattr(row, k)
    cands = []
    if int(g("wrong")) <= 0:
        cands.append(float(g("busbw" if bus else "algbw")))
    if int(g("ip_wrong")) == 0:
        cands.append(float(g("ip_busbw" if bus else "ip_algbw")))
    return max(cands) if cands else None


# ---- inputs and reference -------------------------------------------------------------------
def counts_for(op: str, size: int, n: int, itemsize: int) -> int:
    """Per-rank element count of the op's parameter for a sweep size (0 = too small to run)."""
    elems = size // itemsize
    return elems if op in ("all_reduce", "broadcast") else elems // n


def in_numel(op: str, count: int, n: int) -> int:
    return count if op in ("all_reduce", "all_gather", "broadcast") else count * n


def out_numel(op: str, count: int, n: int) -> int:
    return count * n if op in ("all_gather", "all_to_all") else count


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
    """Elements of this rank's result that differ from the reference (shape mismatch: all of them)."""
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
def time_each(bound, iters: int, warmup: int, barrier: Callable[[], None]) -> list[float]:
    """Seconds of each timed call on this rank (``bound``: a peers.Bound); ranks start together."""
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


def _check(bound, checks: int, op: str, count: int, n: int, rank: int, dtype, seed: int, redop: str,
           root: int) -> int:
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


def measure(peer, stats, op: str, dtype_name: str, redop: str, count: int, *, iters: int, warmup: int,
            checks: int, seed: int, root: int = 0) -> Row:
    """Out-of-place and in-place measurement of one (op, size, dtype, redop) through ``peer``.

    Collective over the ranks of ``peer`` and of ``stats`` (the moecomm communicator that
    aggregates times and error counts across ranks; the same ranks).
    """
    dtype = DTYPES[dtype_name]
    n, rank = stats.size, stats.rank
    itemsize = torch.empty(0, dtype=dtype).element_size()
    x = _inputs(op, count, n, rank, dtype, seed)
    per_rank, per_iter, wrong = [], [], []
    for in_place in (False, True):
        bound = peer.bind(op, x, count, redop, root, in_place=in_place)
        # nccl-tests does not check in-place all_to_all ("We don't support in-place alltoall")
        unchecked = in_place and op == "all_to_all"
        wrong.append(-1 if unchecked else _check(bound, checks, op, count, n, rank, dtype, seed, redop, root))
        times = time_each(bound, iters, warmup, stats.barrier)
        per_rank.append(sum(times) / max(len(times), 1))
        per_iter.append(times)
    tot = stats.all_reduce(torch.tensor(per_rank + [max(w, 0) for w in wrong], dtype=torch.float64))
    across = stats.all_reduce(torch.tensor(per_iter[0] + per_iter[1], dtype=torch.float64), op="avg").numpy()
    t_oop, t_ip = float(tot[0]) / n, float(tot[1]) / n
    w_oop = int(tot[2]) if wrong[0] >= 0 else -1
    w_ip = int(tot[3]) if wrong[1] >= 0 else -1
    nbytes = count * itemsize * (1 if op in ("all_reduce", "broadcast") else n)
    f = bus_factor(op, n)
    bw_oop = nbytes / t_oop / 1e9 if t_oop > 0 else 0.0
    bw_ip = nbytes / t_ip / 1e9 if t_ip > 0 else 0.0
    k = len(per_iter[0])
    p = [float(np.percentile(a, q)) * 1e6 if len(a) else 0.0
         for a in (across[:k], across[k:]) for q in (50, 99)]
    return Row(op, peer.name, nbytes, count, dtype_name, redop if op in REDUCING else "none",
               t_oop * 1e6, bw_oop, bw_oop * f, w_oop, peer.algorithm(op, x), root if op == "broadcast" else -1,
               t_ip * 1e6, bw_ip, bw_ip * f, w_ip, p[0], p[1], p[2], p[3], peer.library, n, peer.device)


def plan_sweep(peers: Sequence, ops: Iterable[str], dtype_names: Sequence[str], redops: Sequence[str],
               byte_sizes: Sequence[int], n: int) -> tuple[list[tuple], list[str]]:
    """The measurements a sweep will make, in order, and notes on what each peer skips and why.

    Order: size, op, dtype, redop, peer (innermost), so every peer measures a size back to back.
    """
    ops = list(ops)
    steps, notes = [], {}
    for size in byte_sizes:
        for op in ops:
            for dname in dtype_names:
                itemsize = torch.empty(0, dtype=DTYPES[dname]).element_size()
                count = counts_for(op, size, n, itemsize)
                if count == 0 and size > 0:
                    continue
                for redop in (redops if op in REDUCING else ["none"]):
                    if redop == "avg" and not DTYPES[dname].is_floating_point:
                        notes.setdefault(f"all peers skip avg for {dname}: avg needs a floating dtype", None)
                        continue
                    for peer in peers:
                        why = peer.supports(op, dname, redop)
                        if why:
                            notes.setdefault(f"{peer.name} skips {op} {dname}"
                                             f"{' ' + redop if op in REDUCING else ''}: {why}", None)
                            continue
                        steps.append((size, op, dname, redop, count, peer))
    return steps, list(notes)


def run_sweep(comms: dict, ops: Iterable[str], dtype_name: str | Sequence[str], byte_sizes: list[int], *,
              iters: int = 20, warmup: int = 5, check: bool | int = True, seed: int = 1,
              on_row: Callable[[Row], None] | None = None, redops: Sequence[str] = ("sum",), root: int = 0,
              stats=None, on_start: Callable[[int, int, tuple], None] | None = None,
              on_notes: Callable[[list[str]], None] | None = None) -> list[Row]:
    """Sweep sizes x ops x dtypes x redops, each measured through every entry of ``comms``
    (label -> Communicator or peers.Peer) back to back, so machine drift hits all alike.

    Collective over every entry's ranks. ``stats``: the communicator that aggregates across ranks
    (default: the first moecomm communicator). ``check``: number of checked calls per variant
    (True = 1, False/0 = off). ``on_start(i, total, step)`` fires before each measurement.
    """
    from .peers import MoecommPeer, Peer

    peers = [c if isinstance(c, Peer) else MoecommPeer(c, name) for name, c in comms.items()]
    if stats is None:
        stats = next(p.comm for p in peers if isinstance(p, MoecommPeer))
    dnames = [dtype_name] if isinstance(dtype_name, str) else list(dtype_name)
    steps, notes = plan_sweep(peers, ops, dnames, list(redops), byte_sizes, stats.size)
    if on_notes is not None:
        on_notes(notes)
    checks = int(check)
    rows: list[Row] = []
    for i, (size, op, dname, redop, count, peer) in enumerate(steps):
        if on_start is not None:
            on_start(i, len(steps), (size, op, dname, redop, peer.name))
        row = measure(peer, stats, op, dname, redop, count, iters=iters, warmup=warmup, checks=checks,
                      seed=seed, root=root)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


# ---- the table ------------------------------------------------------------------------------
_W = "{:>14} {:>12} {:>12} {:>9} {:>6} {:>5}  {:>10} {:>9} {:>9} {:>7}  {:>10} {:>9} {:>9} {:>7}  {:>10} {:>10}  {}"
HEADER = "\n".join([
    "#" + " " * 72 + "out-of-place" + " " * 29 + "in-place" + " " * 20 + "out-of-place",
    "#" + _W.format("op", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
                    "time", "algbw", "busbw", "#wrong", "p50", "p99", "peer/algorithm")[1:],
    "#" + _W.format("", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "",
                    "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(us)", "").rstrip()[1:],
])
COLUMNS = HEADER.splitlines()[1].split()[1:]


def _wrong(w: int) -> str:
    return "N/A" if w < 0 else str(w)


def format_row(r: Row) -> str:
    """One table line (the op name first, then nccl-tests' columns, then p50/p99 and peer/algorithm)."""
    return _W.format(r.op, r.size, r.count, r.dtype, r.redop, r.root,
                     f"{r.time_us:.2f}", f"{r.algbw:.3f}", f"{r.busbw:.3f}", _wrong(r.wrong),
                     f"{r.ip_time_us:.2f}", f"{r.ip_algbw:.3f}", f"{r.ip_busbw:.3f}", _wrong(r.ip_wrong),
                     f"{r.p50_us:.2f}", f"{r.p99_us:.2f}", f"{r.transport}/{r.algorithm}")


def summary(rows: Sequence[Row]) -> list[str]:
    """nccl-tests' footer per peer: wrong values, and busbw averaged over out-of-place and in-place."""
    lines = []
    for name in dict.fromkeys(r.transport for r in rows):
        rs = [r for r in rows if r.transport == name]
        bws = [r.busbw for r in rs] + [r.ip_busbw for r in rs]
        avg = float(np.mean(bws)) if bws else 0.0
        bad = sum(max(r.wrong, 0) + max(r.ip_wrong, 0) for r in rs)
        lines.append(f"# {name}: Out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}")
        lines.append(f"# {name}: Avg bus bandwidth    : {avg:.4f}")
    return lines


def geomean(values: Iterable[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")
