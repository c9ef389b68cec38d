"""What every benchmark shares: the ops, dtypes and reduction ops a sweep knows, nccl-tests' bus
factors, size parsing, and the row type of the results table.

Conventions are nccl-tests' (https://github.com/NVIDIA/nccl-tests, ``src/*.cu`` and
``doc/PERFORMANCE.md``): sizes in bytes with K/M/G meaning powers of 1024, bandwidths in
GB/s = 1e9 B/s. Nothing here imports another module of ``benchmarks``, so :mod:`benchmarks.sweep`
and :mod:`benchmarks.peers` both build on it without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Iterable, Mapping, Sequence

import torch

# nccl-tests' bus-bandwidth factors (busbw = algbw * factor): one table, the performance model's
from collectives.model.collective import bus_factor as _collective_bus_factor

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ALL_OPS = OPS + ("broadcast",)
REDUCING = ("all_reduce", "reduce_scatter")
# The memory-bandwidth reference of ``bench --compare`` (peers.MemcpyPeer): every rank copies
# ``size`` bytes locally, at the same time. Its rows have op MEMCPY and library REFERENCE; it has
# no in-place variant and is never a peer of the ratio tables.
MEMCPY = "memcpy"
REFERENCE = "reference"
# ops whose sweep size is one rank's whole buffer (no per-rank blocks)
WHOLE_BUFFER = ("all_reduce", "broadcast", MEMCPY)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (``collectives.model.collective.bus_factor``), and 1 for
    the memcpy reference (its bytes cross the memory bus once: busbw = algbw = size / time).

    Args:
        op: a collective of :data:`ALL_OPS`, ``"reduce"`` or :data:`MEMCPY`; n: number of ranks.

    Returns:
        busbw / algbw. Raises ValueError for an unknown op.
    """
    return 1.0 if op == MEMCPY else _collective_bus_factor(op, n)


def has_in_place(op: str) -> bool:
    """Whether the sweep measures an in-place variant of ``op`` (every collective; not the memcpy
    reference, whose in-place columns are printed ``N/A`` and saved as 0 with ``ip_wrong`` -1)."""
    return op != MEMCPY
REDOPS = ("sum", "prod", "max", "min", "avg")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}
# nccl-tests' names for -d
DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
                 "int": "int32", "int32_t": "int32", "int64_t": "int64", "uint8_t": "uint8"}
_SIZE_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def itemsize(dtype_name: str) -> int:
    """Bytes per element of a dtype of :data:`DTYPES` (``"bfloat16"`` -> 2)."""
    return torch.empty(0, dtype=DTYPES[dtype_name]).element_size()


def parse_size(text: str | int) -> int:
    """A byte count as nccl-tests writes it.

    Args:
        text: ``"8"``, ``"64K"``, ``"1M"``, ``"2G"`` (powers of 1024; a trailing ``B`` and
            fractions that come out whole, like ``"1.5K"``, are accepted).

    Returns:
        The number of bytes (>= 0). Raises ValueError for anything else, including negative
        and fractional byte counts.
    """
    t = str(text).strip().upper().removesuffix("B")
    mult = _SIZE_SUFFIXES.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in _SIZE_SUFFIXES else t
    try:
        value = float(number) * mult
    except ValueError:
        raise ValueError(f"size {text!r} is not a number of bytes with an optional K/M/G suffix") from None
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise ValueError(f"size {text!r} is not a whole, non-negative number of bytes")
    return int(value)


def format_size(nbytes: float, digits: int = 3) -> str:
    """A byte count for people: 1024 -> ``"1 KiB"``, 4194304 -> ``"4 MiB"``, 12 -> ``"12 B"``.

    Args:
        nbytes: bytes.
        digits: significant digits of a value that is not a whole number of its unit.

    Returns:
        The size in the largest binary unit (B, KiB, MiB, GiB) it reaches.
    """
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.{digits}g} {unit}"
    return f"{int(nbytes)} B"


def sizes(min_bytes: int, max_bytes: int, factor: int = 2, step: int = 0) -> list[int]:
    """The sizes of a sweep, nccl-tests' ``-b``/``-e``/``-f``/``-i``.

    Args:
        min_bytes, max_bytes: first and largest size in bytes.
        factor: multiply by this each step (used when ``step`` is 0).
        step: add this many bytes each step when > 0.

    Returns:
        Byte sizes from ``min_bytes`` up to ``max_bytes`` inclusive (empty if min > max).
    """
    out, s = [], max(min_bytes, 0)
    while s <= max_bytes:
        out.append(s)
        nxt = s + step if step > 0 else s * factor
        s = nxt if nxt > s else s + 1
    return out


def _parse_list(text: str, known: Iterable[str], what: str, aliases: Mapping[str, str] | None = None) -> list[str]:
    """Comma-separated names (or ``all``) checked against ``known``; ValueError names the bad ones."""
    known = list(known)
    if text.strip() == "all":
        return known
    aliases = aliases or {}
    given = [t.strip() for t in text.split(",") if t.strip()]
    names = [aliases.get(t, t) for t in given]
    bad = [t for t, name in zip(given, names) if name not in known]
    if bad:
        also = f" (or nccl-tests' {', '.join(aliases)})" if aliases else ""
        raise ValueError(f"unknown {what} {', '.join(map(repr, bad))}; one of {', '.join(known)}{also}, or 'all'")
    if not names:
        raise ValueError(f"no {what} given; one of {', '.join(known)}, or 'all'")
    return list(dict.fromkeys(names))


def parse_dtypes(text: str) -> list[str]:
    """``-d float,half`` / ``-d all`` -> dtype names of :data:`DTYPES` (nccl-tests' aliases accepted).

    Returns:
        The names in the order given, without repeats. Raises ValueError for unknown or no names.
    """
    return _parse_list(text, DTYPES, "dtype", DTYPE_ALIASES)


def parse_redops(text: str) -> list[str]:
    """``-o sum`` / ``-o sum,max`` / ``-o all`` -> reduction ops of :data:`REDOPS`.

    Returns:
        The ops in the order given, without repeats. Raises ValueError for unknown or no names.
    """
    return _parse_list(text, REDOPS, "reduction op")


def parse_ops(text: str, *, also: Sequence[str] = ()) -> list[str]:
    """``--ops all_reduce,broadcast`` / ``--ops all`` -> collectives of :data:`ALL_OPS`.

    Args:
        text: comma-separated op names, or ``all`` (every op of :data:`ALL_OPS`).
        also: further names accepted by name (``moecomm predict``'s moe_dispatch/moe_combine).

    Returns:
        The ops in the order given, without repeats. Raises ValueError for unknown or no names.
    """
    if text.strip() == "all":
        return list(ALL_OPS)
    return _parse_list(text, ALL_OPS + tuple(also), "op")


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int | None, step: int) -> list[int]:
    """The sizes of nccl-tests' ``-b``/``-e``/``-f``/``-i`` as the commands take them.

    Args:
        min_bytes, max_bytes: first and largest size in bytes.
        factor: ``-f`` (None: 4, or 1 when ``step`` is given); steps multiply when > 1.
        step: ``-i`` bytes added each step, used when ``factor`` is 1 or None.

    Returns:
        The sizes (:func:`sizes`). Raises ValueError, saying which flag to change, when
        min > max or neither -f > 1 nor -i > 0 steps.
    """
    if min_bytes > max_bytes:
        raise ValueError(f"-b {format_size(min_bytes)} is larger than -e {format_size(max_bytes)}: no size")
    if factor is None:
        factor = 1 if step > 0 else 4
    if factor <= 1 and step <= 0:
        raise ValueError("need -f > 1 or -i > 0 to step from -b to -e")
    return sizes(min_bytes, max_bytes, factor if factor > 1 else 0, step if factor <= 1 else 0)


# ---- per-rank element counts (nccl-tests' definitions) ---------------------------------------
def counts_for(op: str, size: int, n: int, item_bytes: int) -> int:
    """Per-rank element count of the op's parameter for a sweep size.

    Args:
        op: a collective of :data:`ALL_OPS`, or :data:`MEMCPY` (like all_reduce: the whole buffer).
        size: the sweep size in bytes (the full buffer, see :mod:`benchmarks.sweep`).
        n: number of ranks.
        item_bytes: bytes per element.

    Returns:
        Elements per rank (all_reduce/broadcast: the tensor; the others: one rank's block);
        0 means the size is too small to give every rank an element.
    """
    elems = size // item_bytes
    return elems if op in WHOLE_BUFFER else elems // n


def in_numel(op: str, count: int, n: int) -> int:
    """Elements of one rank's input.

    Args:
        op: a collective of :data:`ALL_OPS` or :data:`MEMCPY`; count: elements per rank; n: number of ranks.

    Returns:
        ``count``, or ``n * count`` for reduce_scatter/all_to_all (n blocks).
    """
    return count if op in ("all_gather", *WHOLE_BUFFER) else count * n


def out_numel(op: str, count: int, n: int) -> int:
    """Elements of one rank's output.

    Args:
        op: a collective of :data:`ALL_OPS`; count: elements per rank; n: number of ranks.

    Returns:
        ``count``, or ``n * count`` for all_gather/all_to_all (n blocks).
    """
    return count * n if op in ("all_gather", "all_to_all") else count


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of the positive, finite ``values``; nan if there are none."""
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


# ---- the row type -----------------------------------------------------------------------------
@dataclass(kw_only=True)
class Row:
    """One line of the results table: one op, size, dtype and redop through one peer.

    ``transport`` is the peer's label (moecomm transports: shm, mpi, auto; peers: mpi4py, gloo,
    nccl); ``library`` who implements it. Times in microseconds, bandwidths in GB/s (1e9 B/s);
    ``wrong``/``ip_wrong``: -1 = not checked. The ``ip_`` fields are the in-place variant.
    ``memcpy_busbw``: the memcpy reference measured at the same size in the same run (GB/s, 0 when
    the run has none), so ``busbw / memcpy_busbw`` is the op's fraction of the local copy rate.
    Built by keyword only (``Row(op="all_reduce", transport="shm", ...)``).
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
    memcpy_busbw: float = 0.0  # the memcpy reference's busbw at this size in the same run (0: none measured)
    # "eager": each call launched and timed on its own; "graph": timed as replays of a CUDA graph of
    # ``graph_calls`` calls (nccl-tests' -G), time per call = replay time / graph_calls, out-of-place only
    mode: str = "eager"
    graph_calls: int = 0
    # ``bench --path P``: the path the row's bytes were verified to take (transports.paths.PATHS); "" when
    # no path was asked for
    path: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The row as a plain dict (what JSON and CSV files hold)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Row":
        """Inverse of :meth:`as_dict`; also takes CSV's all-string values (empty = the default)."""
        kw = {}
        for f in fields(cls):
            if f.name in d and d[f.name] not in (None, ""):
                kw[f.name] = _FIELD_TYPES[f.name](d[f.name])
        return cls(**kw)


_FIELD_TYPES = {f.name: {"str": str, "int": int, "float": float}[f.type if isinstance(f.type, str) else f.type.__name__]
                for f in fields(Row)}
ROW_FIELDS = tuple(f.name for f in fields(Row))


def best_algbw(row: Row | Mapping[str, Any], bus: bool = False) -> float | None:
    """The peer's better of out-of-place and in-place bandwidth, counting only variants whose
    results were checked correct (out-of-place also when checking was off).

    This is what comparisons use: torch.distributed has no out-of-place all_reduce (its
    out-of-place variant is a copy plus the in-place call) and moecomm's in-place all_gather
    stages through a temporary, so each library is compared the way it runs best.

    Args:
        row: a :class:`Row` or its dict.
        bus: busbw instead of algbw.

    Returns:
        GB/s, or None if neither variant counts.
    """
    g = row.get if isinstance(row, Mapping) else lambda k: getattr(row, k)
    cands = []
    if int(g("wrong")) <= 0:
        cands.append(float(g("busbw" if bus else "algbw")))
    if int(g("ip_wrong")) == 0:
        cands.append(float(g("ip_busbw" if bus else "ip_algbw")))
    return max(cands) if cands else None
