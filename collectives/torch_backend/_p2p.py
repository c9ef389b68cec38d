"""Point-to-point calls of the moecomm process group: torch's Work objects over the Communicator's
``isend``/``irecv`` (collectives/_p2p.py), so messages travel over the transports' own channels
(shm, mpi, gloo, NCCL), never through the rendezvous store.

A Work is returned as soon as the operation is posted (it never blocks at creation), so
``dist.batch_isend_irecv`` with every rank's receives listed before its sends (pipeline
parallelism's pattern) does not deadlock; ``wait()`` drives the operation to completion, bounded by
the group's timeout. Errors are the Communicator's: a dtype or shape that differs between sender and
receiver raises ValueError on both ranks, a silent peer CollectiveTimeoutError naming it, a dead
one PeerFailedError.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


class P2PTorchWork(dist.Work):
    """torch's view of a posted send or receive (a :class:`collectives.P2PWork`).

    Args:
        work: the communicator's handle.
        tensors: what the future holds once done (torch's ``tensors`` argument).
    """

    def __init__(self, work: Any, tensors: list[torch.Tensor]):
        super().__init__()
        self._work = work
        self._tensors = tensors

    def wait(self, timeout: Any = None) -> bool:
        """Complete the operation (bounded by the group's timeout, or ``timeout`` if shorter).

        Returns:
            True. Raises the operation's error (ValueError, CollectiveTimeoutError, PeerFailedError).
        """
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds() or None
        self._work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Returns: whether the operation is complete (drives progress once, never waits)."""
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return self.is_completed()

    def get_future(self) -> torch.futures.Future:
        """Returns: a finished future holding the tensors (waits for the operation first)."""
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._tensors)
        return fut

    def _source_rank(self) -> int:
        src = self._work.source
        return -1 if src is None else int(src)

    def source_rank(self) -> int:
        """Returns: the group rank the message came from (``recv_anysource``)."""
        self.wait()
        return self._source_rank()
