"""Point-to-point calls of the moecomm process group: torch's Work objects over the Communicator's
``isend``/``irecv`` (collectives/_p2p.py), so messages travel over the transports' own channels
(shm, mpi, gloo, NCCL), never through the rendezvous store.

A Work is returned as soon as the operation is posted (it never blocks at creation), so
``dist.batch_isend_irecv`` with every rank's receives listed before its sends (pipeline
parallelism's pattern) does not deadlock; ``wait()`` drives the operation to completion, bounded by
the group's timeout. Errors are the Communicator's: a dtype or shape that differs between sender and
receiver raises ValueError on both ranks, a silent peer CollectiveTimeoutError naming it, a dead
one PeerFailedError. A ``batch_isend_irecv`` cut short after posting part of its operations closes
the group at this rank's next point-to-point call (:class:`BatchGuard`).
"""

from __future__ import annotations

import datetime
import inspect
import logging
import sys
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from transports.base import CommunicatorBrokenError

log = logging.getLogger("collectives")
# torch's batch_isend_irecv posts its operations one call at a time (for a ProcessGroup subclass,
# as for gloo): its frame, found above ours, tells which batch a send or receive belongs to
_BATCH_CODE = inspect.unwrap(dist.batch_isend_irecv).__code__
_FRAMES_UP = 8  # our method, [torch's dispatcher], dist.isend/irecv, batch_isend_irecv: well within


class BatchGuard:
    """Closes a group whose ``dist.batch_isend_irecv`` was cut short (Ctrl-C, an exception) after
    posting some of its operations.

    Such a batch leaves messages unmatched (a receive posted without its send, or the reverse), so
    that the ranks' next messages pair one step apart: the peer's next receive would return the
    following iteration's data. torch posts a batch's operations one call at a time, so the cut
    cannot be seen where it happens; it is seen at this rank's next point-to-point call on the group
    (one not from the same batch), which closes the communicator and raises
    ``CommunicatorBrokenError`` (its peers' waits raise ``PeerFailedError``), as an interrupted call
    of the communicator does. ``destroy_process_group`` closes it too.
    """

    def __init__(self) -> None:
        # per thread: [batch frame, operations posted, operations in the batch]
        self._open: dict[int, list] = {}

    def before(self, comm: Any, me: int, what: str) -> FrameType | None:
        """Check before posting a send or receive; returns the torch batch it belongs to (or None).

        The batch counts as open from here: Ctrl-C between here and :meth:`posted` may land after the
        operation was posted."""
        frame = _batch_frame()
        key = threading.get_ident()
        open_ = self._open.get(key)
        if open_ is not None and open_[0] is not frame:
            del self._open[key]
            cut = (f"{what}: rank {me}: an earlier dist.batch_isend_irecv on this group was cut short after "
                   f"posting {open_[1]} of its {open_[2]} operations (Ctrl-C or an exception), leaving messages "
                   "unmatched; the group's communicator is closed so that no message pairs with the wrong one "
                   "(its peers raise PeerFailedError)")
            log.warning("moecomm: %s", cut)
            comm.close()
            raise CommunicatorBrokenError(cut)
        if frame is not None and open_ is None:
            ops = frame.f_locals.get("p2p_op_list")
            if isinstance(ops, list) and len(ops) > 1:  # one operation (or a batch we cannot read): no half
                self._open[key] = [frame, 0, len(ops)]
        return frame

    def posted(self, frame: FrameType | None) -> None:
        """Count an operation posted by ``frame``'s batch; forget the batch once all of it is posted."""
        key = threading.get_ident()
        open_ = self._open.get(key)
        if frame is None or open_ is None or open_[0] is not frame:
            return
        open_[1] += 1
        if open_[1] >= open_[2]:
            del self._open[key]

    def refused(self, frame: FrameType | None, error: BaseException) -> None:
        """The batch's first operation raised before posting (a bad argument; the communicator is
        intact): nothing is half-posted. Ctrl-C keeps the batch open (it may have landed after posting)."""
        key = threading.get_ident()
        open_ = self._open.get(key)
        if isinstance(error, Exception) and open_ is not None and open_[0] is frame and open_[1] == 0:
            del self._open[key]

    def clear(self) -> None:
        self._open.clear()


def _batch_frame() -> FrameType | None:
    """torch's ``batch_isend_irecv`` frame that called the caller of the caller, if any."""
    f = sys._getframe(2)
    for _ in range(_FRAMES_UP):
        if f is None:
            return None
        if f.f_code is _BATCH_CODE:
            return f
        f = f.f_back
    return None


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
