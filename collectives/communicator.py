"""The Communicator: one object, every collective, a transport picked per call."""

from __future__ import annotations

import atexit
import json
import logging
import os
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from transports import transport_class
from transports.base import (
    DTYPE_CODES,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    ReduceOp,
    Rendezvous,
    Transport,
    error_meta,
    make_meta,
)

from .selection import Plan, choose_transport
from .topology import Topology

log = logging.getLogger("collectives")

Array = Any  # torch.Tensor | numpy.ndarray

_SUPPORTED = ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES)
_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Tell peers we are gone so they raise at once instead of waiting for their timeout.
    for comm in list(_live):
        try:
            comm.close()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class Communicator:
    """A group of ranks and the collectives between them.

    Create one with :func:`collectives.init` (or receive one from :func:`collectives.launch`);
    sub-groups come from :meth:`split`. Every collective is called by all ranks of the group in
    the same order, takes a torch tensor (CPU) or NumPy array, returns a new tensor (NumPy in,
    NumPy out) or writes ``out=``, and raises instead of hanging: ``ValueError`` when ranks pass
    different shapes/dtypes/ops, ``TimeoutError`` naming the ranks that never arrived.
    """

    def __init__(self, rendezvous: Rendezvous, topology: Topology, *, timeout: float, transport: str = "auto",
                 global_ranks: Sequence[int] | None = None, mpi_comm=None):
        self._rdv = rendezvous
        self.topology = topology
        self.timeout = float(timeout)
        self.rank = topology.rank
        self.size = topology.size
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(self.size))
        self._mpi_comm = mpi_comm
        forced = transport if transport not in (None, "auto") else os.environ.get("MOECOMM_TRANSPORT") or None
        self._forced = None if forced == "auto" else forced
        self._closed = False
        self._warned_staging = False
        self.transports: dict[str, Transport] = {}
        self._make_transports()
        if self._forced and self._forced not in self.transports:
            self.close()
            raise ValueError(
                f"transport {self._forced!r} is not available here (available: {sorted(self.transports)}): "
                "shm needs all ranks on one node; mpi needs a launch by mpirun/mpiexec")
        _live.add(self)

    def _make_transports(self) -> None:
        group = GroupInfo(rank=self.rank, size=self.size, timeout=self.timeout, rendezvous=self._rdv,
                          global_ranks=self.global_ranks, pids=list(self.topology.pids),
                          hosts=list(self.topology.node_ids), mpi_comm=self._mpi_comm)
        wanted = []
        if self.topology.single_node:
            wanted.append("shm")
        if self._mpi_comm is not None:
            wanted.append("mpi")
        for name in wanted:
            try:
                self.transports[name] = transport_class(name)(group)
            except Exception as e:  # noqa: BLE001 - creation is collective; every rank sees the same failure
                log.warning("transport %s unavailable on rank %d: %s", name, self.global_ranks[self.rank], e)

    # ---- properties -------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        return self.topology.local_rank

    @property
    def local_size(self) -> int:
        return self.topology.local_size

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, transports={sorted(self.transports)}, "
                f"forced={self._forced})")

    # ---- selection ----------------------------------------------------------------------------
    def _select(self, opcode: OpCode, device: str, nbytes: int, dtype: torch.dtype, name: str) -> tuple[Transport, Plan]:
        if self._closed:
            raise CommunicatorBrokenError("this communicator is closed")
        tname, reason = choose_transport(opcode, device, self.topology.single_node, self.transports, self._forced)
        t = self.transports[tname]
        staged = device not in t.devices
        plan = Plan(name, tname, t.algorithm(opcode, nbytes, dtype), nbytes, reason, staged)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: %s", self.global_ranks[self.rank], plan)
        if staged and not self._warned_staging:
            self._warned_staging = True
            log.warning("no transport for %s tensors is available; %s copies them through host memory "
                        "(slow). Install the GPU transports to avoid this.", device, tname)
        return t, plan

    def plan(self, collective: str, x: Array, *, op: str = "sum", send_counts: Sequence[int] | None = None,
             src: int = 0) -> Plan:
        """Which transport and algorithm ``getattr(comm, collective)(x, ...)`` would use on this rank."""
        opcode = _OPCODE_BY_NAME.get(collective)
        if opcode is None:
            raise ValueError(f"unknown collective {collective!r}; one of {sorted(_OPCODE_BY_NAME)}")
        t, _, _ = _as_tensor(x)
        return self._select(opcode, t.device.type, t.numel() * t.element_size(), t.dtype, collective)[1]

    # ---- shared call machinery --------------------------------------------------------------
    def _fail_locally(self, opcode: OpCode, device: str, err: Exception) -> None:
        """Tell the peers this rank rejected its input (so they raise too), then raise ``err``."""
        try:
            t, _ = self._select(opcode, device, 0, torch.float32, opcode.name.lower())
            t.exchange_meta(error_meta())
        except Exception:  # noqa: BLE001 - the local error is what the caller needs to see
            pass
        raise err

    def _prepare(self, opcode: OpCode, name: str, x: Array, op: str | None = None):
        try:
            t, was_numpy, orig = _as_tensor(x)
        except TypeError as e:
            self._fail_locally(opcode, "cpu", TypeError(f"{name}: {e}"))
        device = t.device.type
        try:
            if t.dtype not in DTYPE_CODES:
                raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of {_SUPPORTED}")
            rop = None
            if op is not None:
                rop = ReduceOp.parse(op)
                if t.dtype == torch.bool and rop not in (ReduceOp.MAX, ReduceOp.MIN):
                    raise TypeError(f"{name}: op {op!r} is not defined for bool; use 'max' (any) or 'min' (all)")
                if rop == ReduceOp.AVG and t.dtype not in _FLOATS:
                    raise TypeError(f"{name}: op 'avg' needs a floating dtype, got {t.dtype}; "
                                    "use op='sum' and divide")
        except (TypeError, ValueError) as e:
            self._fail_locally(opcode, device, e)
        return t, was_numpy, orig, rop

    def _finish(self, result: torch.Tensor, out: Array | None, was_numpy: bool, device: torch.device):
        if result.device != device:
            result = result.to(device)
        if out is not None:
            out_t = out if isinstance(out, torch.Tensor) else torch.from_numpy(out)
            if out_t.data_ptr() != result.data_ptr():
                out_t.copy_(result.view(out_t.shape))
            return out
        return result.numpy() if was_numpy else result

    def _output(self, name: str, opcode: OpCode, device: torch.device, shape, dtype, out, src_t: torch.Tensor):
        """A contiguous tensor the transport may write to: ``out`` itself when possible."""
        if out is None:
            return None
        out_t = out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))
        if tuple(out_t.shape) != tuple(shape) or out_t.dtype != dtype:
            self._fail_locally(opcode, device.type, ValueError(
                f"{name}: out has shape {tuple(out_t.shape)} and dtype {out_t.dtype}; "
                f"expected shape {tuple(shape)} and dtype {dtype}"))
        if out_t.device != device:
            self._fail_locally(opcode, device.type, ValueError(
                f"{name}: out is on {out_t.device} but the input is on {device}; put both on one device"))
        if out_t.is_contiguous() and not _overlaps(out_t, src_t):
            return out_t
        return None  # write into a temporary, then copy into out

    def _staged(self, t: torch.Tensor, transport: Transport) -> torch.Tensor:
        return t.cpu() if t.device.type not in transport.devices else t

    # ---- collectives --------------------------------------------------------------------------
    def all_reduce(self, x: Array, op: str = "sum", *, out: Array | None = None) -> Array:
        """Reduce ``x`` over all ranks; every rank gets the result.

        x: any shape, any supported dtype (sum/avg/prod need a numeric dtype, avg a floating one;
        bool only with max/min). Returns a new tensor of x's shape and dtype (or ``out``).
        16-bit floats accumulate in float32; every rank gets bitwise-identical results.
        """
        opcode = OpCode.ALL_REDUCE
        t, was_numpy, orig, rop = self._prepare(opcode, "all_reduce", x, op)
        nbytes = t.numel() * t.element_size()
        tr, _ = self._select(opcode, t.device.type, nbytes, t.dtype, "all_reduce")
        dst = self._output("all_reduce", opcode, t.device, t.shape, t.dtype, out, orig)
        meta = make_meta(opcode, dtype=t.dtype, shape=t.shape, op=rop)
        src = self._staged(t, tr)
        res = dst if (dst is not None and dst.device == src.device) else torch.empty_like(src)
        tr.all_reduce(src, res, rop, meta)
        return self._finish(res, out, was_numpy, t.device)

    def all_gather(self, x: Array, *, out: Array | None = None) -> Array:
        """Concatenate every rank's ``x`` along dim 0 in rank order.

        x: [n, *rest] (a 0-d x counts as [1]), same shape and dtype on every rank.
        Returns [size * n, *rest].
        """
        opcode = OpCode.ALL_GATHER
        t, was_numpy, orig, _ = self._prepare(opcode, "all_gather", x)
        if t.dim() == 0:
            t = t.reshape(1)
        out_shape = (self.size * t.shape[0], *t.shape[1:])
        tr, _ = self._select(opcode, t.device.type, t.numel() * t.element_size(), t.dtype, "all_gather")
        dst = self._output("all_gather", opcode, t.device, out_shape, t.dtype, out, orig)
        meta = make_meta(opcode, dtype=t.dtype, shape=t.shape)
        src = self._staged(t, tr)
        res = dst if (dst is not None and dst.device == src.device) else torch.empty(
            out_shape, dtype=t.dtype, device=src.device)
        tr.all_gather(src, res, meta)
        return self._finish(res, out, was_numpy, t.device)

    def reduce_scatter(self, x: Array, op: str = "sum", *, out: Array | None = None) -> Array:
        """Reduce ``x`` over all ranks and keep this rank's block of dim 0.

        x: [size * n, *rest], same on every rank. Returns [n, *rest]: rows
        [rank * n, (rank + 1) * n) of the reduction.
        """
        opcode = OpCode.REDUCE_SCATTER
        t, was_numpy, orig, rop = self._prepare(opcode, "reduce_scatter", x, op)
        if t.dim() == 0 or t.shape[0] % self.size:
            self._fail_locally(opcode, t.device.type, ValueError(
                f"reduce_scatter: x.shape[0] must be divisible by the group size {self.size}; "
                f"rank {self.global_ranks[self.rank]} passed shape {tuple(t.shape)}"))
        out_shape = (t.shape[0] // self.size, *t.shape[1:])
        tr, _ = self._select(opcode, t.device.type, t.numel() * t.element_size(), t.dtype, "reduce_scatter")
        dst = self._output("reduce_scatter", opcode, t.device, out_shape, t.dtype, out, orig)
        meta = make_meta(opcode, dtype=t.dtype, shape=t.shape, op=rop)
        src = self._staged(t, tr)
        res = dst if (dst is not None and dst.device == src.device) else torch.empty(
            out_shape, dtype=t.dtype, device=src.device)
        tr.reduce_scatter(src, res, rop, meta)
        return self._finish(res, out, was_numpy, t.device)

    def all_to_all(self, x: Array, send_counts: Sequence[int] | None = None, *, out: Array | None = None,
                   return_counts: bool = False) -> Array:
        """Exchange rows: ``send_counts[i]`` rows of ``x`` (in rank order) go to rank i.

        x: [sum(send_counts), *rest]; rest and dtype agree across ranks, row counts need not.
        send_counts: [size] ints (None = x.shape[0] split evenly). The receiver needs no prior
        knowledge: counts are exchanged here. Returns [sum(recv_counts), *rest], rows in source-rank
        order; with ``return_counts=True`` returns ``(result, recv_counts)`` (recv_counts: [size] int64
        tensor, or NumPy for NumPy input). ``out=`` must then already have the received row count.
        """
        opcode = OpCode.ALL_TO_ALL
        t, was_numpy, orig, _ = self._prepare(opcode, "all_to_all", x)
        me = self.global_ranks[self.rank]
        try:
            if t.dim() == 0:
                raise ValueError("all_to_all: x needs at least 1 dim (rows)")
            if send_counts is None:
                if t.shape[0] % self.size:
                    raise ValueError(f"all_to_all: rank {me} has {t.shape[0]} rows, not divisible by the group "
                                     f"size {self.size}; pass send_counts for an uneven split")
                counts = np.full(self.size, t.shape[0] // self.size, dtype=np.int64)
            else:
                if isinstance(send_counts, torch.Tensor):
                    send_counts = send_counts.cpu().tolist()
                counts = np.asarray(list(send_counts), dtype=np.int64)
                if counts.shape != (self.size,):
                    raise ValueError(f"all_to_all: rank {me} passed {counts.size} send_counts; "
                                     f"need one per rank ({self.size})")
                if (counts < 0).any() or int(counts.sum()) != t.shape[0]:
                    raise ValueError(f"all_to_all: rank {me} send_counts {counts.tolist()} must be >= 0 and sum to "
                                     f"x.shape[0] = {t.shape[0]}")
        except ValueError as e:
            self._fail_locally(opcode, t.device.type, e)
        row_numel = int(np.prod(t.shape[1:])) if t.dim() > 1 else 1
        tr, _ = self._select(opcode, t.device.type, t.numel() * t.element_size(), t.dtype, "all_to_all")
        meta = make_meta(opcode, dtype=t.dtype, shape=t.shape, compare_first_dim=False, rows=t.shape[0])
        src = self._staged(t, tr)
        rest = tuple(t.shape[1:])
        holder: dict[str, Any] = {}

        def alloc(recv_counts: np.ndarray) -> torch.Tensor:
            rows = int(recv_counts.sum())
            holder["counts"] = recv_counts.copy()
            if out is not None:
                out_t = out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))
                if tuple(out_t.shape) == (rows, *rest) and out_t.dtype == t.dtype and out_t.is_contiguous() \
                        and out_t.device == src.device and not _overlaps(out_t, orig):
                    return out_t.reshape(-1)
            return torch.empty(rows * row_numel, dtype=t.dtype, device=src.device)

        flat = tr.all_to_all(src.reshape(-1), counts, row_numel, alloc, meta)
        rows = int(holder["counts"].sum())
        if out is not None:
            out_t = out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))
            if tuple(out_t.shape) != (rows, *rest):
                raise ValueError(f"all_to_all: out has shape {tuple(out_t.shape)} but rank {me} received "
                                 f"{rows} rows of {rest}")
        result = self._finish(flat.view(rows, *rest), out, was_numpy, t.device)
        if return_counts:
            rc = holder["counts"]
            return result, (rc if was_numpy else torch.from_numpy(rc))
        return result

    def broadcast(self, x: Array, src: int = 0, *, out: Array | None = None) -> Array:
        """Every rank gets rank ``src``'s ``x``.

        x: same shape and dtype on every rank (its values matter only on ``src``). Returns a new tensor.
        """
        opcode = OpCode.BROADCAST
        t, was_numpy, orig, _ = self._prepare(opcode, "broadcast", x)
        if not (isinstance(src, (int, np.integer)) and 0 <= src < self.size):
            self._fail_locally(opcode, t.device.type, ValueError(
                f"broadcast: src={src!r} is not a rank of this group of size {self.size}"))
        tr, _ = self._select(opcode, t.device.type, t.numel() * t.element_size(), t.dtype, "broadcast")
        dst = self._output("broadcast", opcode, t.device, t.shape, t.dtype, out, orig)
        meta = make_meta(opcode, dtype=t.dtype, shape=t.shape, root=int(src))
        s = self._staged(t, tr)
        res = dst if (dst is not None and dst.device == s.device) else torch.empty_like(s)
        tr.broadcast(s, res, int(src), meta)
        return self._finish(res, out, was_numpy, t.device)

    def barrier(self) -> None:
        """Return once every rank of the group has called barrier (bounded by the timeout)."""
        tr, _ = self._select(OpCode.BARRIER, "cpu", 0, torch.uint8, "barrier")
        tr.barrier(make_meta(OpCode.BARRIER))

    def using(self, transport: str) -> "Communicator":
        """A view of this communicator that routes every call to ``transport`` ("shm", "mpi", ...).

        Shares this communicator's transports and state; closing the view does nothing. Collective
        calls on a view and on its parent interleave like calls on one communicator.
        """
        if transport != "auto" and transport not in self.transports:
            raise ValueError(f"transport {transport!r} is not available here (available: {sorted(self.transports)})")
        view = object.__new__(Communicator)
        view.__dict__.update(self.__dict__)
        view._forced = None if transport == "auto" else transport
        view._is_view = True
        return view

    # ---- groups -------------------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None) -> "Communicator | None":
        """Sub-communicator of the ranks that pass the same ``color`` (MPI_Comm_split semantics).

        Collective over this group. Ranks are ordered by ``key`` (default: current rank), then by
        current rank. ``color`` None or negative: this rank joins no group and gets None.
        """
        if self._closed:
            raise CommunicatorBrokenError("this communicator is closed")
        c = -1 if color is None else int(color)
        k = self.rank if key is None else int(key)
        entries = [json.loads(b) for b in self._rdv.allgather_bytes(json.dumps([c, k]).encode())]
        members = sorted((r for r in range(self.size) if entries[r][0] == c and c >= 0),
                         key=lambda r: (entries[r][1], r))
        new_rank = members.index(self.rank) if c >= 0 else -1
        rdv = self._rdv.split(c, k, new_rank, len(members), members)
        mpi_sub = getattr(rdv, "comm", None) if self._mpi_comm is not None else None
        if c < 0:
            return None
        topo = self.topology.subset(members, new_rank)
        return Communicator(rdv, topo, timeout=self.timeout, transport=self._forced or "auto",
                            global_ranks=[self.global_ranks[m] for m in members], mpi_comm=mpi_sub)

    def close(self) -> None:
        """Release transports and shared memory; peers still waiting on this rank raise at once."""
        if self._closed or getattr(self, "_is_view", False):
            return
        self._closed = True
        for t in self.transports.values():
            try:
                t.close()
            except Exception as e:  # noqa: BLE001
                log.debug("closing %s: %s", t.name, e)
        self.transports.clear()
        self._rdv.close()
        _live.discard(self)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_OPCODE_BY_NAME = {"all_reduce": OpCode.ALL_REDUCE, "all_gather": OpCode.ALL_GATHER,
                   "reduce_scatter": OpCode.REDUCE_SCATTER, "all_to_all": OpCode.ALL_TO_ALL,
                   "broadcast": OpCode.BROADCAST, "barrier": OpCode.BARRIER}


def _as_tensor(x: Array) -> tuple[torch.Tensor, bool, torch.Tensor]:
    """(contiguous tensor, input was NumPy, tensor view of the original input)."""
    if isinstance(x, torch.Tensor):
        orig = x
        was_numpy = False
    elif isinstance(x, np.ndarray):
        was_numpy = True
        arr = x if x.flags.c_contiguous or all(s >= 0 for s in x.strides) else np.ascontiguousarray(x)
        try:
            orig = torch.from_numpy(arr)
        except TypeError as e:
            raise TypeError(f"NumPy dtype {x.dtype} is not supported; use one of {_SUPPORTED}") from e
    else:
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    return (orig if orig.is_contiguous() else orig.contiguous()), was_numpy, orig


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.untyped_storage().nbytes()
    b1 = b0 + b.untyped_storage().nbytes()
    return a0 < b1 and b0 < a1
