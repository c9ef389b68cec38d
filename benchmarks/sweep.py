"""nccl-tests-style bandwidth sweep over a Communicator (runs on every rank).

Conventions follow NVIDIA/nccl-tests (see ../shared/ANCHORS.md): ``size`` is the bytes of
the full buffer (all_reduce: the tensor; all_gather: the gathered output; reduce_scatter:
the input; all_to_all: what one rank sends), ``count`` the per-rank element count of that op's
parameter, time is the mean per op over the timed iterations averaged across ranks,
algbw = size / time and busbw = algbw * factor.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

import numpy as np
import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ALL_OPS = OPS + ("broadcast",)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


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
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def sizes(min_bytes: int, max_bytes: int, factor: int = 2, step: int = 0) -> list[int]:
    """Byte sizes from min to max, multiplying by ``factor`` (or adding ``step`` when > 0)."""
    out, s = [], max(min_bytes, 0)
    while s <= max_bytes:
        out.append(s)
        nxt = s + step if step > 0 else s * factor
        s = nxt if nxt > s else s + 1
    return out


@dataclass
class Row:
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

    def as_dict(self) -> dict:
        return asdict(self)


def counts_for(op: str, size: int, n: int, itemsize: int) -> int:
    """Per-rank element count of the op's parameter for a sweep size (0 = too small to run)."""
    elems = size // itemsize
    return elems if op in ("all_reduce", "broadcast") else elems // n


def _inputs(op: str, count: int, n: int, rank: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic random input of `rank` for this op and size (any rank can regenerate it)."""
    numel = count if op in ("all_reduce", "all_gather", "broadcast") else count * n
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + numel)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(0, 100, (numel,), generator=g, dtype=torch.int64).to(dtype)


def _reference(op: str, count: int, n: int, rank: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    xs = [_inputs(op, count, n, r, dtype, seed) for r in range(n)]
    if op == "all_reduce":
        return _sum(xs, dtype)
    if op == "all_gather":
        return torch.cat(xs)
    if op == "reduce_scatter":
        return _sum(xs, dtype)[rank * count : (rank + 1) * count]
    if op == "all_to_all":
        return torch.cat([x[rank * count : (rank + 1) * count] for x in xs])
    if op == "broadcast":
        return xs[0]
    raise ValueError(op)


def _sum(xs, dtype):
    if dtype.is_floating_point:
        return sum(x.double() for x in xs)
    acc = xs[0].clone()
    for x in xs[1:]:
        acc += x
    return acc


def count_wrong(op: str, result: torch.Tensor, count: int, n: int, rank: int, dtype: torch.dtype, seed: int) -> int:
    """Elements of this rank's result that differ from the NumPy/torch reference."""
    ref = _reference(op, count, n, rank, dtype, seed)
    if result.shape != ref.shape:
        return max(result.numel(), ref.numel())
    if not dtype.is_floating_point:
        return int((result != ref).sum())
    # 16-bit types: one rounding of a float32 sum; wider types: float32 rounding of n terms
    eps = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
    tol = eps * (n + 1) * (ref.abs() + 1)
    return int(((result.double() - ref).abs() > tol).sum())


def make_call(comm, op: str, x: torch.Tensor, count: int) -> Callable[[], torch.Tensor]:
    n = comm.size
    if op == "all_reduce":
        out = torch.empty_like(x)
        return lambda: comm.all_reduce(x, out=out)
    if op == "all_gather":
        out = torch.empty(n * x.numel(), dtype=x.dtype)
        return lambda: comm.all_gather(x, out=out)
    if op == "reduce_scatter":
        out = torch.empty(count, dtype=x.dtype)
        return lambda: comm.reduce_scatter(x, out=out)
    if op == "all_to_all":
        out = torch.empty_like(x)
        return lambda: comm.all_to_all(x, out=out)
    if op == "broadcast":
        out = torch.empty_like(x)
        return lambda: comm.broadcast(x, 0, out=out)
    raise ValueError(f"unknown op {op!r}; one of {ALL_OPS}")


def time_calls(comm, call: Callable[[], object], iters: int, warmup: int) -> float:
    """Mean seconds per call on this rank, starting together after a barrier."""
    for _ in range(warmup):
        call()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / max(iters, 1)


def run_sweep(comms: dict, ops: Iterable[str], dtype_name: str, byte_sizes: list[int], *, iters: int = 20,
              warmup: int = 5, check: bool = True, seed: int = 1,
              on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Sweep sizes x ops, each size measured on every communicator in ``comms`` (name -> comm) in turn,
    so machine drift hits all alike. Collective over every comm's ranks."""
    dtype = DTYPES[dtype_name]
    itemsize = torch.empty(0, dtype=dtype).element_size()
    rows: list[Row] = []
    for size in byte_sizes:
        for op in ops:
            for name, comm in comms.items():
                n, rank = comm.size, comm.rank
                count = counts_for(op, size, n, itemsize)
                if count == 0 and size > 0:
                    continue
                x = _inputs(op, count, n, rank, dtype, seed)
                call = make_call(comm, op, x, count)
                wrong = count_wrong(op, call(), count, n, rank, dtype, seed) if check else -1
                t = time_calls(comm, call, iters, warmup)
                stats = comm.all_reduce(torch.tensor([t, max(wrong, 0)], dtype=torch.float64))
                t_avg = float(stats[0]) / n
                total_wrong = int(stats[1]) if check else -1
                nbytes = count * itemsize * (1 if op in ("all_reduce", "broadcast") else n)
                algbw = nbytes / t_avg / 1e9 if t_avg > 0 else 0.0
                plan = comm.plan(op, x)
                row = Row(op, name, nbytes, count, dtype_name, "sum" if op in ("all_reduce", "reduce_scatter") else "none",
                          t_avg * 1e6, algbw, algbw * bus_factor(op, n), total_wrong, plan.algorithm)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


HEADER = ("#{:>12} {:>12} {:>9} {:>6} {:>10} {:>9} {:>9} {:>7}  {}\n"
          "#{:>12} {:>12} {:>9} {:>6} {:>10} {:>9} {:>9} {:>7}").format(
    "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "transport/algorithm",
    "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "")


def format_row(r: Row) -> str:
    wrong = "N/A" if r.wrong < 0 else str(r.wrong)
    return (f" {r.size:>12} {r.count:>12} {r.dtype:>9} {r.redop:>6} {r.time_us:>10.2f} {r.algbw:>9.3f} "
            f"{r.busbw:>9.3f} {wrong:>7}  {r.transport}/{r.algorithm}")


def summary(rows: list[Row]) -> list[str]:
    """nccl-tests' footer, per transport; plus the count of wrong results."""
    lines = []
    for name in dict.fromkeys(r.transport for r in rows):
        rs = [r for r in rows if r.transport == name]
        avg = float(np.mean([r.busbw for r in rs])) if rs else 0.0
        bad = sum(max(r.wrong, 0) for r in rs)
        lines.append(f"# {name}: Out of bounds values : {bad} {'OK' if bad == 0 else 'FAILED'}")
        lines.append(f"# {name}: Avg bus bandwidth    : {avg:.4f}")
    return lines
