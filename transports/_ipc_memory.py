"""The ipc transport's memory beyond its staging buffer (:class:`IPCMemory`, mixed into
``transports.ipc.IPCTransport``): the symmetric heap at the end of every region, whose tensors
are all-reduced where they are, and the extra regions of exchanges with kernels of their own
(``transports/ipc_moe.py``), with their launch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ._ipc_regions import _CudaRegions, _HostRegions
from .base import dtype_code
from .kernels import layout as L

_REGION_ALIGN = 4096


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _SymmetricHeap:
    """First-fit allocation of the symmetric heap's bytes (offsets, 256-byte aligned).

    Every rank runs the same allocations in the same order, so a tensor gets the same offset on
    every rank; :meth:`IPCTransport.symmetric_empty` checks that across ranks.
    """

    ALIGN = 256

    def __init__(self, size: int):
        self.size = size
        self.used: dict[int, int] = {}  # offset -> bytes

    def alloc(self, nbytes: int) -> int | None:
        nbytes = max(self.ALIGN, _align(nbytes, self.ALIGN))
        at = 0
        for off in sorted(self.used):
            if off - at >= nbytes:
                break
            at = off + self.used[off]
        if at + nbytes > self.size:
            return None
        self.used[at] = nbytes
        return at

    def free(self, offset: int) -> None:
        self.used.pop(offset, None)


class IPCMemory:
    """Symmetric tensors and peer regions of :class:`transports.ipc.IPCTransport`."""

    def _symmetric_offset(self, t: torch.Tensor) -> int | None:
        """Offset of ``t`` in our symmetric heap (every rank's tensor of a call sits at the same
        one), or None when ``t`` is not wholly inside it."""
        a = t.data_ptr()
        if self._heap_lo <= a and a + t.numel() * t.element_size() <= self._heap_hi and t.numel():
            return a - self._heap_lo
        return None

    def _heap_table(self, offset: int) -> torch.Tensor:
        """Every rank's address of the symmetric tensor at ``offset`` (a device table, cached)."""
        t = self._heap_tables.get(offset)
        if t is None:
            if len(self._heap_tables) > 64:
                self._heap_tables.clear()
            t = self._heap_tables[offset] = self._regions.sig_ptrs + (self._heap_off + offset)
        return t

    # ---- symmetric memory ----------------------------------------------------------------------
    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor inside our region's symmetric heap (collective: every rank calls
        it with the same shape and dtype, in the same order). The all_reduce of such a tensor
        reads it where it is, on every rank, without a copy into the staging buffer: in place
        when ``out`` is the tensor itself. It is freed when the tensor is garbage collected; keep
        frees in the same order on every rank, since the next allocation's offset must agree.

        Raises ValueError on every rank when the ranks' calls differ or the heap is full.
        """
        if self._broken:
            self._raise_broken()
        nbytes = math.prod(shape) * dtype.itemsize
        off = self._heap.alloc(nbytes)
        mine = np.array([-1 if off is None else off, nbytes, dtype_code(dtype)], dtype=np.int64)
        everyone = [np.frombuffer(b, dtype=np.int64) for b in self.group.rendezvous.allgather_bytes(mine.tobytes())]
        if any((e != mine).any() for e in everyone) or off is None:
            if off is not None:
                self._heap.free(off)
            desc = "; ".join(f"rank {self._ranks[r]}: " + (f"{e[1]} B of dtype code {e[2]} at offset {e[0]}"
                                                            if e[0] >= 0 else f"{e[1]} B, no room")
                             for r, e in enumerate(everyone))
            raise ValueError(f"symmetric_empty: the ranks' allocations differ or the symmetric heap "
                             f"({self.symmetric_bytes} B, setting ipc_symmetric_bytes) is full: {desc}")
        heap = self._heap
        raw = self._regions.tensor(self._heap_off + off, nbytes, lambda: heap.free(off))
        return raw.view(dtype).reshape(shape)

    # ---- exchanges with kernels of their own (transports/ipc_moe.py) ---------------------------
    def peer_region(self, nbytes: int) -> torch.Tensor:
        """Map one more zeroed region of ``nbytes`` per rank, which every rank's kernels read and
        write (collective: every rank calls it with the same size, in the same order). It stays
        mapped until the transport closes.

        Returns:
            int64 [size] on the transport's device: every rank's base address of the region.
        """
        if self._broken:
            self._raise_broken()
        provider = _HostRegions if self.emulate else _CudaRegions
        # at least a signal area: the providers map one at the start of every region they create
        regions = provider(self.group, _align(max(int(nbytes), L.SIGNAL_WORDS * 8), _REGION_ALIGN))
        self._more_regions.append(regions)
        return regions.sig_ptrs

    def launch_exchange(self, *launches: tuple[Any, tuple, dict], finish: bool = True
                        ) -> tuple[int, int, int, int] | None:
        """Launch one call of an exchange: its kernels ``(kernel, args, constexprs)``, back to back,
        each as ``kernel(*args, sig_ptrs, status, max_spins, **constexprs)`` on our programs and
        counted for the watchdog, as :meth:`_launch` does. Earlier failures raise before the first
        kernel only: a call that stopped between its kernels would leave its peers waiting for the
        rest.

        Then, outside CUDA-graph capture, wait for the kernels (the stream), raise failures, and
        return what they recorded of this call's inputs, read and cleared: the status block's
        (S_INPUT, S_PAIRING, S_PAIR_WORD, S_PAIR_MAX), which the caller raises. One rank's refused
        input reaches its peers only through their kernels; raised lazily at a later call, as
        other asynchronous errors are, it would make the ranks leave the exchange at different
        calls, and the next call of one rank would pair with another call of its peers. Waiting
        makes every rank raise in this call. Under capture: None (replays record; the next check
        raises it and closes the transport, see :meth:`_failed`).

        finish: False launches only these kernels (a call's send half) and returns None at once,
        nothing waited for; :meth:`finish_exchange` launches the rest of the call and does the above.
        """
        self._start()
        self._queue_exchange(launches, counted=1)
        return self._exchange_words() if finish else None

    def finish_exchange(self, *launches: tuple[Any, tuple, dict]) -> tuple[int, int, int, int] | None:
        """The rest of a call that ``launch_exchange(..., finish=False)`` began: launch its kernels
        (a receive half), then wait and return the recorded words as :meth:`launch_exchange` does.

        Only a broken transport raises before these kernels: what the status block holds now (an
        error of the call's first kernels, or of other calls since) raises after them, so that no
        peer waits for a half this rank dropped.
        """
        if self._broken:
            self._raise_broken()
        self._queue_exchange(launches, counted=0)
        return self._exchange_words()

    def _queue_exchange(self, launches: tuple[tuple[Any, tuple, dict], ...], counted: int) -> None:
        """Queue ``launches`` back to back; the first ``counted`` of them :meth:`_start` counted."""
        tail = (self._regions.sig_ptrs, self._status_arg, self._max_spins)
        for i, (kernel, args, constexprs) in enumerate(launches):
            if i >= counted and not self._regions.capturing():
                self._launched += 1  # counted as _start counts the first
            self._queue(self._bind(kernel, constexprs), *args, *tail)

    def _exchange_words(self) -> tuple[int, int, int, int] | None:
        """Outside capture: wait for our kernels, raise failures, return (and clear) the call's
        recorded words (see :meth:`launch_exchange`); under capture None."""
        if self._regions.capturing():
            return None
        self._regions.sync()
        st = self._status
        words = tuple(int(st[w]) for w in (L.S_INPUT, L.S_PAIRING, L.S_PAIR_WORD, L.S_PAIR_MAX))
        st[L.S_INPUT] = st[L.S_PAIRING] = 0
        self._check(completed=True)
        return words
