"""The Communicator: one object, every collective, a transport picked per call."""

from __future__ import annotations

import atexit
import json
import logging
import math
import weakref
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from transports import transport_class
from transports.settings import SETTINGS, agreed_items
from transports.settings import resolve as resolve_settings
from transports.base import (
    SUPPORTED_DTYPES,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    ReduceOp,
    Rendezvous,
    Signature,
    Transport,
    error_meta,
)

from .selection import Plan, choose_transport
from .topology import Topology

log = logging.getLogger("collectives")

Array = Any  # torch.Tensor | numpy.ndarray

_SUPPORTED = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
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


class _Entry(NamedTuple):
    transport: Transport
    sig: Signature
    rop: ReduceOp | None
    out_shape: torch.Size
    staged: bool  # device tensors copied through host memory (no transport for that device)


class Communicator:
    """A group of ranks and the collectives between them.

    Create one with :func:`collectives.init` (or receive one from :func:`collectives.launch`);
    sub-groups come from :meth:`split`. Every collective is called by all ranks of the group in
    the same order, takes a torch tensor (CPU) or NumPy array, returns a new tensor (NumPy in,
    NumPy out) or writes ``out=``, and raises instead of hanging: ``ValueError`` when ranks pass
    different shapes/dtypes/ops, ``TimeoutError`` naming the ranks that never arrived.
    """

    def __init__(self, rendezvous: Rendezvous, topology: Topology, *, timeout: float, transport: str = "auto",
                 global_ranks: Sequence[int] | None = None, mpi_comm=None,
                 settings: Mapping[str, Any] | None = None):
        self._rdv = rendezvous
        self.topology = topology
        self.timeout = float(timeout)
        self.rank = topology.rank
        self.size = topology.size
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(self.size))
        self._mpi_comm = mpi_comm
        # resolved transports.settings values; transport= overrides MOECOMM_TRANSPORT
        self.settings: dict[str, Any] = dict(settings) if settings is not None else resolve_settings()
        if transport not in (None, "auto"):
            self.settings["transport"] = SETTINGS["transport"].parse(transport, source="transport=")
        forced = self.settings["transport"]
        self._forced = None if forced == "auto" else forced
        self._closed = False
        self._warned_staging = False
        self._cache: dict = {}
        self._barrier_entry = None
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
                          hosts=list(self.topology.node_ids), mpi_comm=self._mpi_comm,
                          oversubscribed=self.topology.oversubscribed, settings=dict(self.settings))
        wanted = []
        if self.topology.single_node:
            wanted.append("shm")
        if self._mpi_comm is not None:
            wanted.append("mpi")
        from transports.nccl import nccl_module

        # One exchange: the settings every rank must share, and whether NCCL is there (its creation
        # is collective, so only if every rank has it).
        mine = {"settings": agreed_items(self.settings), "nccl": nccl_module() is not None}
        facts = [json.loads(b) for b in self._rdv.allgather_bytes(json.dumps(mine, sort_keys=True).encode())]
        _check_settings_agree([f["settings"] for f in facts], self.global_ranks)
        if all(f["nccl"] for f in facts):
            wanted.append("nccl")
        for name in wanted:
            try:
                self.transports[name] = transport_class(name)(group)
            except Exception as e:  # noqa: BLE001 - reported below; peers drop it too
                log.warning("transport %s unavailable on rank %d: %s", name, self.global_ranks[self.rank], e)
        # A transport that failed on some rank (out of memory, a bad setting) must not be used by the
        # others: they would pick different transports for one call and wait for each other forever.
        up = [set(json.loads(b)) for b in self._rdv.allgather_bytes(json.dumps(sorted(self.transports)).encode())]
        for name in sorted(self.transports):
            missing = [self.global_ranks[r] for r, names in enumerate(up) if name not in names]
            if missing:
                log.warning("transport %s is not used: it did not come up on rank(s) %s", name, missing)
                self.transports.pop(name).close()

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
    def _select(self, opcode: OpCode, device: str, nbytes: int, dtype: torch.dtype, name: str
                ) -> tuple[Transport, Plan]:
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
            t.exchange_meta(Signature(error_meta()))
        except Exception:  # noqa: BLE001 - the local error is what the caller needs to see
            pass
        raise err

    def reject(self, error: Exception, *, device: str = "cpu") -> None:
        """Raise ``error`` here and make the peers' matching collective raise ``ValueError`` at once.

        For libraries that validate their own arguments on one rank while the other ranks go
        on into the next collective (on tensors of ``device``): instead of leaving them to wait
        for the timeout, they learn that this rank rejected its input. Never returns.
        """
        self._fail_locally(OpCode.ALL_TO_ALL, device, error)

    def _entry(self, opcode: OpCode, t: torch.Tensor, op, src: int) -> _Entry:
        """Validated, cached description of a call (transport, signature, output shape)."""
        shape = t.shape[1:] if opcode == OpCode.ALL_TO_ALL else t.shape
        key = (opcode, shape, t.dtype, t.device, op, src)
        ent = self._cache.get(key)
        if ent is not None:
            return ent
        name = opcode.name.lower()
        device = t.device.type
        me = self.global_ranks[self.rank]
        rop = None
        try:
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of {_SUPPORTED}")
            if opcode in (OpCode.ALL_REDUCE, OpCode.REDUCE_SCATTER):
                rop = ReduceOp.parse(op)
                if t.dtype == torch.bool and rop not in (ReduceOp.MAX, ReduceOp.MIN):
                    raise TypeError(f"{name}: op {op!r} is not defined for bool; use 'max' (any) or 'min' (all)")
                if rop == ReduceOp.AVG and t.dtype not in _FLOATS:
                    raise TypeError(f"{name}: op 'avg' needs a floating dtype, got {t.dtype}; use op='sum' and divide")
            if opcode in (OpCode.REDUCE_SCATTER, OpCode.ALL_TO_ALL) and t.dim() == 0:
                raise ValueError(f"{name}: x needs at least 1 dim (rows); rank {me} passed a 0-d tensor")
            if opcode == OpCode.REDUCE_SCATTER and t.shape[0] % self.size:
                raise ValueError(f"reduce_scatter: x.shape[0] must be divisible by the group size {self.size}; "
                                 f"rank {me} passed shape {tuple(t.shape)}")
            if opcode == OpCode.BROADCAST and not (isinstance(src, (int, np.integer)) and 0 <= src < self.size):
                raise ValueError(f"broadcast: src={src!r} is not a rank of this group of size {self.size}")
        except (TypeError, ValueError) as e:
            self._fail_locally(opcode, device, e)
        nbytes = t.numel() * t.element_size()
        tr, plan = self._select(opcode, device, nbytes, t.dtype, name)
        if opcode == OpCode.ALL_GATHER:
            out_shape = torch.Size((self.size * (t.shape[0] if t.dim() else 1), *t.shape[1:]))
        elif opcode == OpCode.REDUCE_SCATTER:
            out_shape = torch.Size((t.shape[0] // self.size, *t.shape[1:]))
        else:
            out_shape = t.shape
        sig = Signature.of(opcode, dtype=t.dtype, shape=t.shape if t.dim() or opcode != OpCode.ALL_GATHER else (1,),
                           op=rop, root=int(src) if opcode == OpCode.BROADCAST else 0,
                           compare_first_dim=opcode != OpCode.ALL_TO_ALL)
        ent = _Entry(tr, sig, rop, out_shape, device not in tr.devices)
        if len(self._cache) > 512:
            self._cache.clear()
        self._cache[key] = ent
        return ent

    def _input(self, opcode: OpCode, x: Array) -> tuple[torch.Tensor, bool, torch.Tensor]:
        try:
            return _as_tensor(x)
        except TypeError as e:
            self._fail_locally(opcode, "cpu", TypeError(f"{opcode.name.lower()}: {e}"))

    def _check_out(self, opcode: OpCode, out: Array, t: torch.Tensor, shape) -> torch.Tensor:
        out_t = out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))
        name = opcode.name.lower()
        if tuple(out_t.shape) != tuple(shape) or out_t.dtype != t.dtype:
            self._fail_locally(opcode, t.device.type, ValueError(
                f"{name}: out has shape {tuple(out_t.shape)} and dtype {out_t.dtype}; "
                f"expected shape {tuple(shape)} and dtype {t.dtype}"))
        if out_t.device != t.device:
            self._fail_locally(opcode, t.device.type, ValueError(
                f"{name}: out is on {out_t.device} but the input is on {t.device}; put both on one device"))
        return out_t

    def _hot(self, opcode: OpCode, x, op, out, *, in_place_ok: bool) -> tuple[_Entry, torch.Tensor] | None:
        """(entry, tensor to write) for a repeated call on a plain contiguous tensor, else None.

        The latency path: a cache hit skips validation (done when the entry was made) and every
        conversion; anything unusual (NumPy, strides, grads, odd ``out``) takes :meth:`_run`.
        """
        if type(x) is not torch.Tensor or x.requires_grad or not x.is_contiguous():
            return None
        ent = self._cache.get((opcode, x.shape, x.dtype, x.device, op, 0))
        if ent is None or ent.staged:
            return None
        if out is None:
            return ent, torch.empty(ent.out_shape, dtype=x.dtype, device=x.device)
        if _direct_out(out, x, ent.out_shape, in_place_ok=in_place_ok):
            return ent, out
        return None

    def _run(self, opcode: OpCode, x: Array, out: Array | None, op=None, src: int = 0) -> Array:
        """General path: any input kind, out= of any layout, host staging. Same semantics as the fast paths."""
        t, was_numpy, orig = self._input(opcode, x)
        ent = self._entry(opcode, t, op, src)
        out_t = self._check_out(opcode, out, t, ent.out_shape) if out is not None else None
        s = t.cpu() if ent.staged else t
        if t.dim() == 0 and opcode == OpCode.ALL_GATHER:
            s = s.reshape(1)
        in_place_ok = opcode in (OpCode.ALL_REDUCE, OpCode.BROADCAST)
        if out_t is not None and not ent.staged and out_t.is_contiguous() and (
                not _overlaps(out_t, orig) or (in_place_ok and out_t.data_ptr() == s.data_ptr()
                                               and out_t.shape == s.shape)):
            res = out_t
        else:
            res = torch.empty(ent.out_shape, dtype=t.dtype, device=s.device)
        tr = ent.transport
        if opcode == OpCode.ALL_REDUCE:
            tr.all_reduce(s, res, ent.rop, ent.sig)
        elif opcode == OpCode.ALL_GATHER:
            tr.all_gather(s, res, ent.sig)
        elif opcode == OpCode.REDUCE_SCATTER:
            tr.reduce_scatter(s, res, ent.rop, ent.sig)
        elif opcode == OpCode.BROADCAST:
            tr.broadcast(s, res, int(src), ent.sig)
        if res.device != t.device:
            res = res.to(t.device)
        if out is not None:
            if res.data_ptr() != out_t.data_ptr():
                out_t.copy_(res)
            return out
        return res.numpy() if was_numpy else res

    # ---- collectives --------------------------------------------------------------------------
    def all_reduce(self, x: Array, op: str = "sum", *, out: Array | None = None) -> Array:
        """Reduce ``x`` over all ranks; every rank gets the result.

        x: any shape, any supported dtype (sum/avg/prod need a numeric dtype, avg a floating one;
        bool only with max/min). Returns a new tensor of x's shape and dtype (or ``out``, which may
        be x itself). 16-bit floats accumulate in float32; all ranks get bitwise-identical results.
        """
        hot = self._hot(OpCode.ALL_REDUCE, x, op, out, in_place_ok=True)
        if hot is not None:
            hot[0].transport.all_reduce(x, hot[1], hot[0].rop, hot[0].sig)
            return hot[1]
        return self._run(OpCode.ALL_REDUCE, x, out, op)

    def all_gather(self, x: Array, *, out: Array | None = None) -> Array:
        """Concatenate every rank's ``x`` along dim 0 in rank order.

        x: [n, *rest] (a 0-d x counts as [1]), same shape and dtype on every rank.
        Returns [size * n, *rest].
        """
        hot = self._hot(OpCode.ALL_GATHER, x, None, out, in_place_ok=False)
        if hot is not None:
            hot[0].transport.all_gather(x, hot[1], hot[0].sig)
            return hot[1]
        return self._run(OpCode.ALL_GATHER, x, out)

    def reduce_scatter(self, x: Array, op: str = "sum", *, out: Array | None = None) -> Array:
        """Reduce ``x`` over all ranks and keep this rank's block of dim 0.

        x: [size * n, *rest], same on every rank. Returns [n, *rest]: rows
        [rank * n, (rank + 1) * n) of the reduction.
        """
        hot = self._hot(OpCode.REDUCE_SCATTER, x, op, out, in_place_ok=False)
        if hot is not None:
            hot[0].transport.reduce_scatter(x, hot[1], hot[0].rop, hot[0].sig)
            return hot[1]
        return self._run(OpCode.REDUCE_SCATTER, x, out, op)

    def broadcast(self, x: Array, src: int = 0, *, out: Array | None = None) -> Array:
        """Every rank gets rank ``src``'s ``x``.

        x: same shape and dtype on every rank (its values matter only on ``src``). Returns a new
        tensor (or ``out``, which may be x itself).
        """
        return self._run(OpCode.BROADCAST, x, out, None, src)

    def all_to_all(self, x: Array, send_counts: Sequence[int] | None = None, *, out: Array | None = None,
                   return_counts: bool = False) -> Array:
        """Exchange rows: ``send_counts[i]`` rows of ``x`` (in rank order) go to rank i.

        x: [sum(send_counts), *rest]; rest and dtype agree across ranks, row counts need not.
        send_counts: [size] ints or int tensor (None = x.shape[0] split evenly). The receiver needs
        no prior knowledge: counts are exchanged here. Returns [sum(recv_counts), *rest], rows in
        source-rank order; with ``return_counts=True`` returns ``(result, recv_counts)``
        (recv_counts: [size] int64, a tensor, or NumPy for NumPy input). ``out=`` must have the
        received row count.
        """
        opcode = OpCode.ALL_TO_ALL
        t, was_numpy, orig = self._input(opcode, x)
        ent = self._entry(opcode, t, None, 0)
        n, rows_in = self.size, (t.shape[0] if t.dim() else 0)
        if send_counts is None and rows_in % n == 0:
            counts = [rows_in // n] * n
        elif type(send_counts) in (list, tuple) and len(send_counts) == n and \
                all(type(c) is int and c >= 0 for c in send_counts) and sum(send_counts) == rows_in:
            counts = list(send_counts)
        else:
            counts = self._checked_counts(t, send_counts)
        rest = tuple(t.shape[1:])
        row_numel = math.prod(rest)
        s = t.cpu() if ent.staged else t
        holder: list[list[int]] = []

        def alloc(recv_counts: list[int]) -> torch.Tensor:
            holder.append(recv_counts)
            rows = sum(recv_counts)
            if out is not None and type(out) is torch.Tensor and out.shape == (rows, *rest) and \
                    out.dtype == t.dtype and out.is_contiguous() and out.device == s.device and not _overlaps(out, orig):
                return out.view(-1)
            return torch.empty(rows * row_numel, dtype=t.dtype, device=s.device)

        flat = ent.transport.all_to_all(s.view(-1), counts, row_numel, alloc, ent.sig)
        recv_counts = holder[0]
        rows = sum(recv_counts)
        res = flat.view(rows, *rest)
        if res.device != t.device:
            res = res.to(t.device)
        if out is not None:
            out_t = out if isinstance(out, torch.Tensor) else torch.from_numpy(np.asarray(out))
            if tuple(out_t.shape) != (rows, *rest) or out_t.dtype != t.dtype:
                raise ValueError(f"all_to_all: out has shape {tuple(out_t.shape)} and dtype {out_t.dtype} but rank "
                                 f"{self.global_ranks[self.rank]} received {rows} rows of {rest} {t.dtype}")
            if out_t.data_ptr() != res.data_ptr():
                out_t.copy_(res)
            result = out
        else:
            result = res.numpy() if was_numpy else res
        if return_counts:
            rc = np.array(recv_counts, dtype=np.int64)
            return result, (rc if was_numpy else torch.from_numpy(rc))
        return result

    def _checked_counts(self, t: torch.Tensor, send_counts) -> list[int]:
        """send_counts of any accepted kind as a list of ints, or a collective ValueError."""
        me = self.global_ranks[self.rank]
        try:
            if t.dim() == 0:
                raise ValueError("all_to_all: x needs at least 1 dim (rows)")
            if send_counts is None:
                raise ValueError(f"all_to_all: rank {me} has {t.shape[0]} rows, not divisible by the group "
                                 f"size {self.size}; pass send_counts for an uneven split")
            if isinstance(send_counts, torch.Tensor):
                send_counts = send_counts.cpu().numpy()
            arr = np.asarray(send_counts).reshape(-1)
            if arr.shape != (self.size,) or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"all_to_all: rank {me} passed send_counts {arr.tolist()}; need {self.size} "
                                 "integers, one per rank")
            counts = [int(c) for c in arr]
            if min(counts) < 0 or sum(counts) != t.shape[0]:
                raise ValueError(f"all_to_all: rank {me} send_counts {counts} must be >= 0 and sum to "
                                 f"x.shape[0] = {t.shape[0]}")
        except ValueError as e:
            self._fail_locally(OpCode.ALL_TO_ALL, t.device.type, e)
        return counts


    def barrier(self) -> None:
        """Return once every rank of the group has called barrier (bounded by the timeout)."""
        ent = self._barrier_entry
        if ent is None or self._closed:
            tr, _ = self._select(OpCode.BARRIER, "cpu", 0, torch.uint8, "barrier")
            ent = self._barrier_entry = (tr, Signature.of(OpCode.BARRIER))
        ent[0].barrier(ent[1])

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
        view._cache = {}
        view._barrier_entry = None
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
                            global_ranks=[self.global_ranks[m] for m in members], mpi_comm=mpi_sub,
                            settings=self.settings)

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


def _check_settings_agree(per_rank: list[dict], global_ranks: Sequence[int]) -> None:
    """ValueError naming each rank's value of every agreed setting that differs across ranks."""
    diffs = []
    for name in sorted(set().union(*per_rank)):
        vals = [d.get(name) for d in per_rank]
        if any(v != vals[0] for v in vals):
            shown = ", ".join(f"rank {global_ranks[r]}: {v!r}" for r, v in enumerate(vals))
            diffs.append(f"{SETTINGS[name].env} ({shown})")
    if diffs:
        raise ValueError("ranks disagree on settings that must be equal on every rank: " + "; ".join(diffs)
                         + ". Set them the same way on every rank (environment or init(options=...)).")


_OPCODE_BY_NAME = {"all_reduce": OpCode.ALL_REDUCE, "all_gather": OpCode.ALL_GATHER,
                   "reduce_scatter": OpCode.REDUCE_SCATTER, "all_to_all": OpCode.ALL_TO_ALL,
                   "broadcast": OpCode.BROADCAST, "barrier": OpCode.BARRIER}


def _as_tensor(x: Array) -> tuple[torch.Tensor, bool, torch.Tensor]:
    """(contiguous tensor, input was NumPy, tensor view of the original input)."""
    if isinstance(x, torch.Tensor):
        orig = x.detach() if x.requires_grad else x  # collectives are not differentiable themselves
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
    """Whether the memory spans of two tensors (from first to last element) intersect."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + _span(a)
    b1 = b0 + _span(b)
    return a0 < b1 and b0 < a1


def _span(t: torch.Tensor) -> int:
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _direct_out(out, x: torch.Tensor, shape, *, in_place_ok: bool) -> bool:
    """Whether the transport can write straight into ``out`` (hot-path check, no validation errors)."""
    if type(out) is not torch.Tensor or out.shape != shape or out.dtype != x.dtype or out.device != x.device \
            or not out.is_contiguous():
        return False
    if in_place_ok and out.data_ptr() == x.data_ptr():
        return True
    o0, x0 = out.data_ptr(), x.data_ptr()
    return o0 + out.nbytes <= x0 or x0 + x.nbytes <= o0
