"""``Communicator.symmetric_empty``'s argument checks, agreed with the peers before the transport allocates.

The ipc transport's allocation is collective and assumes a valid shape and dtype: a bad one there
raised torch's RuntimeError/AttributeError mid-call, which closes the communicator, and a ``-1``
dimension was filled in from each rank's region size. Here each rank checks its own arguments and
one rendezvous exchange carries the verdicts and shapes, so every rank raises together (the bad
rank its own TypeError/ValueError, the others ValueError naming it) and the communicator stays open.
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np
import torch

from transports.base import Rendezvous

from ._arrays import as_int


def check_symmetric_args(shape: Any, dtype: Any, rank: int,
                         heap_bytes: int | None) -> tuple[tuple[int, ...], torch.dtype]:
    """The checked ``(shape, dtype)`` of a ``symmetric_empty`` call on world rank ``rank``.

    Args:
        shape: an int or a sequence of ints >= 0.
        dtype: a torch.dtype.
        rank: this rank, for messages.
        heap_bytes: the symmetric heap's size per rank, if known (a larger tensor is refused here).

    Raises:
        TypeError: ``dtype`` is no torch.dtype, or ``shape`` holds a non-integer.
        ValueError: a negative dimension, or more bytes than the heap holds.
    """
    where = f"symmetric_empty on rank {rank}"
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{where}: dtype must be a torch.dtype (e.g. torch.float32), got {dtype!r} "
                        f"({type(dtype).__name__})")
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list, torch.Size)):
        raise TypeError(f"{where}: shape must be a tuple of ints, got {shape!r} ({type(shape).__name__})")
    dims = tuple(as_int(d, f"{where}: shape[{i}]") for i, d in enumerate(shape))
    if any(d < 0 for d in dims):
        raise ValueError(f"{where}: shape {dims} has a negative dimension (-1 is not inferred here: "
                         "every rank must allocate the same size)")
    nbytes = math.prod(dims) * dtype.itemsize
    if heap_bytes is not None and nbytes > heap_bytes:
        raise ValueError(f"{where}: shape {dims} of {dtype} needs {nbytes} B, more than the symmetric heap "
                         f"of {heap_bytes} B per rank (setting ipc_symmetric_bytes)")
    return dims, dtype


def agree_symmetric_args(rdv: Rendezvous, global_ranks: list[int], shape: Any, dtype: Any,
                         heap_bytes: int | None) -> tuple[tuple[int, ...], torch.dtype]:
    """Check the arguments here and agree on them with every rank (one rendezvous exchange).

    Returns:
        The checked ``(shape, dtype)``, the same on every rank.

    Raises:
        TypeError, ValueError: this rank's own argument error (after the peers heard of it).
        ValueError: another rank's argument error, or ranks that passed different shapes or dtypes.
    """
    me = global_ranks[rdv.rank]
    error: Exception | None = None
    try:
        dims, dt = check_symmetric_args(shape, dtype, me, heap_bytes)
        mine = {"shape": list(dims), "dtype": str(dt).replace("torch.", "")}
    except (TypeError, ValueError) as e:
        error, mine = e, {"error": str(e)}
    everyone = [json.loads(b) for b in rdv.allgather_bytes(json.dumps(mine).encode())]
    if error is not None:
        raise error
    bad = [(global_ranks[r], e["error"]) for r, e in enumerate(everyone) if "error" in e]
    if bad:
        raise ValueError(f"symmetric_empty: rank(s) {[r for r, _ in bad]} passed invalid arguments "
                         f"({bad[0][1]}); every rank aborted the allocation")
    if any(e != mine for e in everyone):
        calls = "; ".join(f"rank {global_ranks[r]}: {tuple(e['shape'])} {e['dtype']}" for r, e in enumerate(everyone))
        raise ValueError(f"symmetric_empty: the ranks passed different shapes or dtypes ({calls}); every rank "
                         "must allocate the same tensor, in the same order")
    return dims, dt


class SymmetricCalls:
    """symmetric_empty() of :class:`collectives.Communicator`."""

    def symmetric_empty(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized tensor in the ipc transport's symmetric heap (torch calls this
        ``symm_mem.empty``; vLLM registers its CUDA-graph buffers for the same reason).

        Collective: every rank calls it with the same shape and dtype, in the same order. An
        ``all_reduce`` of such a tensor reads it in place on every rank, without the copy into the
        staging buffer (``out=x`` all-reduces it in place). Freed when the tensor is garbage
        collected; free in the same order on every rank (allocations must land at one offset).

        Args:
            shape: the tensor's shape.
            dtype: its dtype.
        Returns:
            [shape] dtype on this communicator's ipc device (CUDA; CPU when ipc is emulated).
        Raises:
            CommunicatorBrokenError: this communicator is closed.
            RuntimeError: this communicator has no ipc transport.
            TypeError, ValueError (every rank; the communicator stays open): a bad shape or dtype
                on some rank (that rank raises its own error), the ranks' calls differ, or the heap
                (setting ``ipc_symmetric_bytes``) is full.
        """
        if self._state.closed is not None:
            self._state.raise_closed()
        t = self.transports.get("ipc")
        if t is None:
            raise RuntimeError("symmetric_empty needs the ipc transport (one node, CUDA and triton, or "
                               f"MOECOMM_IPC_EMULATE=1); this communicator has {sorted(self.transports)}")

        def allocate() -> torch.Tensor:  # arguments agreed first: the transport's exchange assumes valid ones
            dims, dt = agree_symmetric_args(self._rdv, self.global_ranks, shape, dtype,
                                            getattr(t, "symmetric_bytes", None))
            return t.symmetric_empty(dims, dt)

        return self._guarded("symmetric_empty", allocate)
