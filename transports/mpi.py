"""``mpi``: collectives through mpi4py, zero-copy through the buffer protocol.

The transport of choice across nodes and the fallback for anything the node-local
transports cannot serve. MPI calls block without a deadline, so every call here is
posted non-blocking and then polled, which bounds it by the communicator's timeout.
The call signature travels by point-to-point messages on a private duplicate of the
group's communicator, so a rank that never arrives is named in the timeout error.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from ._host import as_numpy, reduce_into
from .base import (
    F_ROWS,
    META_LEN,
    Allocator,
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    ReduceOp,
    Signature,
    Transport,
    check_agreement,
)

log = logging.getLogger(__name__)

# Above this group size the signature goes through one Iallgather instead of n point-to-point
# messages (which is what lets us name a missing rank).
_P2P_META_MAX_RANKS = 64
_META_TAG = 7


def _mpi():
    from mpi4py import MPI

    return MPI


class MPITransport(Transport):
    name = "mpi"
    devices = ("cpu",)

    def __init__(self, group: GroupInfo):
        super().__init__(group)
        if group.mpi_comm is None:
            raise RuntimeError("the mpi transport needs an MPI launch (run under mpiexec/mpirun)")
        MPI = _mpi()
        self.MPI = MPI
        self.comm = group.mpi_comm.Dup()  # private: our traffic never matches the user's
        self.timeout = group.timeout
        self._ranks = list(group.global_ranks)
        self._broken: str | None = None
        self._types = {
            torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT, torch.int64: MPI.INT64_T,
            torch.int32: MPI.INT32_T, torch.uint8: MPI.UINT8_T, torch.bool: MPI.C_BOOL,
        }
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PROD: MPI.PROD,
                     ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN}
        self._meta_recv = np.zeros((self.size, META_LEN), dtype=np.int64)
        self._meta_send = np.zeros(META_LEN, dtype=np.int64)
        self._peers = [r for r in range(self.size) if r != self.rank]
        if 1 < self.size <= _P2P_META_MAX_RANKS:
            self._meta_rreqs = [self.comm.Recv_init(self._meta_recv[r], source=r, tag=_META_TAG) for r in self._peers]
            self._meta_reqs = self._meta_rreqs + [self.comm.Send_init(self._meta_send, dest=r, tag=_META_TAG)
                                                  for r in self._peers]
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = sum(1 for h in group.hosts if h == group.hosts[group.rank]) if group.hosts else 1
        # poll flat out for 5 ms when every local rank has a core, 50 us when oversubscribed
        self._spin_seconds = 5e-3 if local <= cpus else 5e-5

    def algorithm(self, opcode: OpCode, nbytes: int, dtype: torch.dtype) -> str:
        names = {OpCode.ALL_REDUCE: "Iallreduce", OpCode.ALL_GATHER: "Iallgather",
                 OpCode.REDUCE_SCATTER: "Ireduce_scatter_block", OpCode.ALL_TO_ALL: "Ialltoallv",
                 OpCode.BROADCAST: "Ibcast", OpCode.BARRIER: "meta-exchange"}
        return names.get(opcode, "?")

    # ---- waiting --------------------------------------------------------------------------
    def _wait(self, reqs, what: str, pending_ranks=None) -> None:
        """Drive MPI progress (it advances only inside Test) until done or the timeout.

        Polls flat out for a short window, as a blocking MPI call would, then yields the core
        between polls, then sleeps with backoff, so a slow or absent peer does not burn a core.
        """
        MPI = self.MPI
        reqs = list(reqs)
        if MPI.Request.Testall(reqs):
            return
        start = time.monotonic()
        deadline = start + self.timeout
        spin_until = start + self._spin_seconds
        yield_until = spin_until + 0.01
        sleep = 20e-6
        i = 0
        while not MPI.Request.Testall(reqs):
            i += 1
            if i & 63:
                continue
            now = time.monotonic()
            if now < spin_until:
                continue
            if now >= deadline:
                missing = pending_ranks(reqs) if pending_ranks else []
                self._broken = f"{what} timed out"
                who = f"rank(s) {missing} never arrived" if missing else \
                    "some rank never arrived (MPI cannot say which once the signatures matched)"
                raise CollectiveTimeoutError(
                    f"mpi {what} timed out after {self.timeout:.1f}s on rank {self._ranks[self.rank]}: {who}", missing)
            if now < yield_until:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, 1e-3)

    def _check_usable(self) -> None:
        if self._broken:
            raise CommunicatorBrokenError(
                f"mpi communicator is unusable after an earlier failure ({self._broken}); create a new one")

    def exchange_meta(self, sig: Signature) -> np.ndarray:
        self._check_usable()
        n, me = self.size, self.rank
        recv = self._meta_recv
        if n == 1:
            return sig.meta.reshape(1, -1).copy()
        if n > _P2P_META_MAX_RANKS:
            recv[me] = sig.meta
            self._wait([self.comm.Iallgather(sig.meta, recv)], "signature exchange")
            return recv.copy()
        # persistent point-to-point requests: cheap to restart, and they tell who never arrived
        self._meta_send[:] = sig.meta
        recv[me] = sig.meta
        self.MPI.Prequest.Startall(self._meta_reqs)

        def missing(_):
            return [self._ranks[r] for r, q in zip(self._peers, self._meta_rreqs) if not q.Test()]

        self._wait(self._meta_reqs, "signature exchange", missing)
        return recv.copy()

    def _agree(self, sig: Signature) -> None:
        metas = self.exchange_meta(sig)
        if not (metas[:, :F_ROWS] == sig.meta[:F_ROWS]).all():
            check_agreement(metas, self._ranks)

    def barrier(self, sig: Signature) -> None:
        check_agreement(self.exchange_meta(sig), self._ranks)

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        self._reduce(send, out, op, lambda s, r, mop: self.comm.Iallreduce(s, r, op=mop), "all_reduce")

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        self._reduce(send, out, op, lambda s, r, mop: self.comm.Ireduce_scatter_block(s, r, op=mop),
                     "reduce_scatter")

    def _reduce(self, send, out, op, post, what):
        dtype = send.dtype
        MPI = self.MPI
        if dtype in (torch.float16, torch.bfloat16):
            # no portable MPI 16-bit float reductions: accumulate in float32, round once
            s32 = send.float()
            r32 = torch.empty(out.shape, dtype=torch.float32)
            mop = self._ops[op]
            self._wait([post([s32.numpy(), MPI.FLOAT], [r32.numpy(), MPI.FLOAT], mop)], what)
            if op == ReduceOp.AVG:
                r32.div_(self.size)
            out.copy_(r32)
            return
        mtype = self._types[dtype]
        mop = self._ops[op]
        if dtype == torch.bool:
            mop = {ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND}[op]
        y = as_numpy(out)
        x = self.MPI.IN_PLACE if send.data_ptr() == out.data_ptr() else [as_numpy(send), mtype]
        self._wait([post(x, [y, mtype], mop)], what)
        if op == ReduceOp.AVG:
            reduce_into(y, [y], op, dtype, self.size)

    def all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        self._agree(sig)
        B = self.MPI.BYTE
        self._wait([self.comm.Iallgather([as_numpy(send).view(np.uint8), B], [as_numpy(out).view(np.uint8), B])],
                   "all_gather")

    def broadcast(self, send: torch.Tensor, out: torch.Tensor, src: int, sig: Signature) -> None:
        self._agree(sig)
        if self.rank == src:
            out.copy_(send)
        self._wait([self.comm.Ibcast([as_numpy(out).view(np.uint8), self.MPI.BYTE], root=src)], "broadcast")

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], row_numel: int, alloc: Allocator,
                   sig: Signature) -> torch.Tensor:
        self._agree(sig)
        recv_counts = np.zeros(self.size, dtype=np.int64)
        self._wait([self.comm.Ialltoall(np.ascontiguousarray(send_counts, dtype=np.int64), recv_counts)],
                   "all_to_all count exchange")
        out = alloc(recv_counts.tolist())
        row_bytes = row_numel * send.element_size()
        sc = np.asarray(send_counts, dtype=np.int64) * row_bytes
        rc = recv_counts * row_bytes
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        B = self.MPI.BYTE
        self._wait([self.comm.Ialltoallv([as_numpy(send).view(np.uint8), (sc.tolist(), sd.tolist()), B],
                                         [as_numpy(out).view(np.uint8), (rc.tolist(), rd.tolist()), B])],
                   "all_to_all")
        return out

    def close(self) -> None:
        if self.comm is not None:
            try:
                for q in getattr(self, "_meta_reqs", []):
                    q.Free()
                if not self._broken:
                    self.comm.Free()
            except Exception:  # noqa: BLE001 - MPI may already be finalized at exit
                pass
            self.comm = None
