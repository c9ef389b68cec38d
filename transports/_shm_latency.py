"""The shm transport's latency paths: each small collective as one call of the compiled helper, by address.

A mixin of :class:`transports.shm.SharedMemoryTransport` (it uses the transport's compiled helper
``_g``, rounds, control blocks and failure handling); split out because it is one responsibility:
closures that make a repeated small call cost the fused compiled call and the round's bookkeeping,
nothing per tensor. The transport's tensor methods call them too, and the communicator keeps them
per cached call (:meth:`Transport.latency_call`, :meth:`Transport.latency_all_to_all`).
"""

from __future__ import annotations

import array
from typing import Callable

import torch

from .base import DTYPE_CODES, Allocator, OpCode, ReduceOp, Signature

# what transports._shmfast's arrive returns (2: a signature differs; DONE: arrived, and a2a_post finished
# the collective); its API_VERSION 7
ARRIVED, PENDING, DONE = 0, 1, 3


class CompiledLatencyPaths:
    """The compiled latency paths of the shm transport (see the module docstring)."""

    def latency_call(self, opcode: OpCode, numel: int, dtype: torch.dtype, op: ReduceOp | None, sig: Signature
                     ) -> Callable[[int, int], None] | None:
        """See :meth:`Transport.latency_call`: the compiled helper's fused call where the message
        takes its latency path, else None."""
        if self._g is None:
            return None
        itemsize = dtype.itemsize
        nbytes = numel * itemsize
        if opcode == OpCode.ALL_GATHER and nbytes <= self._native_gather_max:
            return self._compiled_all_gather(nbytes, sig)
        if opcode == OpCode.ALL_REDUCE and nbytes <= self._native_all_reduce_max:
            return self._compiled_all_reduce(numel, DTYPE_CODES[dtype], int(op), sig)
        if opcode == OpCode.REDUCE_SCATTER and nbytes <= self._native_scatter_max:
            return self._compiled_reduce_scatter(numel // self.size, DTYPE_CODES[dtype], int(op), itemsize, sig)
        return None

    # Each returns call(x_addr, out_addr), with everything else bound: a call then costs the fused
    # compiled call and the round's bookkeeping, nothing per tensor. A closed or broken transport
    # raises in _compiled_round before the Group (whose addresses die with the mapping) is touched.
    def _compiled_all_reduce(self, count: int, code: int, rop: int, sig: Signature) -> Callable[[int, int], None]:
        g, next_round, sig_value, sig_addr = self._g, self._compiled_round, sig.value, sig.addr

        def call(x_addr: int, out_addr: int) -> None:
            b, e = next_round()
            arrived = g.all_reduce(b, e, x_addr, out_addr, count, code, rop, sig_value, sig_addr)
            if arrived != ARRIVED:
                self._finish_arrival(e, sig, arrived)
                g.reduce(b, out_addr, count, code, rop, 0, 0)
        return call

    def _compiled_all_gather(self, nbytes: int, sig: Signature) -> Callable[[int, int], None]:
        g, next_round, sig_value, sig_addr = self._g, self._compiled_round, sig.value, sig.addr

        def call(x_addr: int, out_addr: int) -> None:
            b, e = next_round()
            arrived = g.all_gather(b, e, x_addr, out_addr, nbytes, sig_value, sig_addr)
            if arrived != ARRIVED:
                self._finish_arrival(e, sig, arrived)
                g.gather(b, out_addr, nbytes, 0, nbytes, x_addr)
        return call

    def _compiled_reduce_scatter(self, m: int, code: int, rop: int, itemsize: int, sig: Signature
                                 ) -> Callable[[int, int], None]:
        g, next_round, sig_value, sig_addr = self._g, self._compiled_round, sig.value, sig.addr
        own_block = self.rank * m * itemsize

        def call(x_addr: int, out_addr: int) -> None:
            b, e = next_round()
            arrived = g.reduce_scatter(b, e, x_addr, out_addr, m, code, rop, sig_value, sig_addr)
            if arrived != ARRIVED:
                self._finish_arrival(e, sig, arrived)
                g.reduce(b, out_addr, m, code, rop, own_block, 0)
        return call

    def _a2a_after_post(self, b: int, e: int, arrived: int, x_addr: int, total: int, own_start: int, own_len: int,
                        row_bytes: int, sig: Signature, alloc: Allocator,
                        counts: list[list[int]] | None = None) -> torch.Tensor:
        """The compiled round of all_to_all after ``a2a_post`` returned ``arrived`` (not DONE): wait for
        the peers, read what they send us, allocate, pull (``counts``: the published send counts,
        when the caller read them already)."""
        if arrived != ARRIVED:
            self._finish_arrival(e, sig, arrived)
        me = self.rank
        if counts is None:
            c0 = self._counts0 + (e & 1) * self.size
            recv = [self._q[base + c0 + me] for base in self._bases]
        else:
            recv = [row[me] for row in counts]
        out = alloc(recv)
        if self._g.a2a_pull(b, e, out.data_ptr(), out.nbytes, row_bytes, x_addr, own_start, own_len) == 0:
            return out
        return self._all_to_all_rest(x_addr, total, row_bytes, own_start, own_len, b, False, out, counts)

    def _compiled_all_to_all_declared(self, send_counts: list[int], recv_counts: list[int], row_bytes: int,
                                      total: int, sig: Signature, x_addr: int, alloc: Allocator) -> torch.Tensor:
        """The compiled round of all_to_all for a caller that declared its receive counts: they are
        published beside the send counts before the arrival and compared on every rank after it, so a
        wrong value raises check_recv_counts' ValueError everywhere before any row is read."""
        n, me = self.size, self.rank
        b, e = self._compiled_round()
        d0 = self._my_base + self._recv0 + (e & 1) * n
        self._q[d0 : d0 + n] = array.array("q", recv_counts)  # before a2a_post's release store
        own_start, own_len = sum(send_counts[:me]) * row_bytes, send_counts[me] * row_bytes
        arrived = self._g.a2a_post(b, e, x_addr, total, own_start, own_len, send_counts, sig.value, sig.addr)
        if arrived != ARRIVED:
            self._finish_arrival(e, sig, arrived)
        counts = self._published_counts(e)
        self._check_declared(counts, e)
        return self._a2a_after_post(b, e, ARRIVED, x_addr, total, own_start, own_len, row_bytes, sig, alloc, counts)

    def latency_all_to_all(self, send_counts: list[int], row_bytes: int, total: int, sig: Signature
                           ) -> Callable[[int, torch.Tensor | None, Allocator], torch.Tensor] | None:
        """See :meth:`Transport.latency_all_to_all`: the compiled helper's round for an exchange that
        takes it (small enough to stage, rows of some bytes), else None."""
        if self._g is None or not row_bytes or total >= self._a2a_direct_min:
            return None
        return self._compiled_all_to_all(send_counts, row_bytes, total, sig)

    def _compiled_all_to_all(self, send_counts: list[int], row_bytes: int, total: int, sig: Signature
                             ) -> Callable[[int, torch.Tensor | None, Allocator], torch.Tensor]:
        """call(x_addr, into, alloc): the compiled helper's one-round exchange of ``total`` bytes sent
        ``send_counts`` rows of ``row_bytes`` to each rank; with ``into`` (rows of some bytes only) a
        rank that arrives last and receives rows filling it exactly finishes in one compiled call."""
        g, next_round, sig_value, sig_addr = self._g, self._compiled_round, sig.value, sig.addr
        counts = list(send_counts)
        own_start, own_len = sum(counts[: self.rank]) * row_bytes, counts[self.rank] * row_bytes

        def call(x_addr: int, into: torch.Tensor | None, alloc: Allocator) -> torch.Tensor:
            b, e = next_round()
            if into is not None:
                arrived = g.a2a_post(b, e, x_addr, total, own_start, own_len, counts, sig_value, sig_addr,
                                     into.data_ptr(), into.nbytes, row_bytes)
                if arrived == DONE:
                    return into
            else:
                arrived = g.a2a_post(b, e, x_addr, total, own_start, own_len, counts, sig_value, sig_addr)
            return self._a2a_after_post(b, e, arrived, x_addr, total, own_start, own_len, row_bytes, sig, alloc)
        return call
