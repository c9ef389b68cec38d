"""Point-to-point over the mpi transport (:class:`MPIChannel`): :class:`transports._p2p.MessageChannel`'s
protocol on ``Isend``/``Irecv`` of the transport's private communicator.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from ._p2p import _CANCEL_GRACE, HDR_LEN, MAX_TAG, MessageChannel, Op, dead_local, local_pid_failure, naming_the_dead
from .base import PeerFailedError

log = logging.getLogger("transports._p2p")


class MPIChannel(MessageChannel):
    """Point-to-point over the mpi transport's private communicator (``Isend``/``Irecv``)."""

    name = "mpi"

    def __init__(self, transport: Any):
        super().__init__(transport.rank, transport.size, list(transport._ranks))
        self.t = transport
        self.MPI = transport.MPI
        ub = transport.comm.Get_attr(self.MPI.TAG_UB) or 32767
        self.max_tag = min(MAX_TAG, (int(ub) - 16) // 4)

    def _tag(self, kind: int, tag: int) -> int:
        if tag > self.max_tag:
            raise ValueError(f"tag {tag} is too large for this MPI (largest: {self.max_tag})")
        return 16 + 4 * tag + kind  # below 16: the transport's own tags

    def _isend(self, peer, kind, tag, buf):
        return self.t.comm.Isend([buf, self.MPI.BYTE], dest=peer, tag=self._tag(kind, tag))

    def _irecv(self, peer, kind, tag, buf):
        return self.t.comm.Irecv([buf, self.MPI.BYTE], source=peer, tag=self._tag(kind, tag))

    def _test(self, req, peer):
        try:
            return bool(req.Test())
        except self.MPI.Exception as e:
            raise PeerFailedError(f"mpi point-to-point with rank {self.ranks[peer]} failed: {e}",
                                  [self.ranks[peer]]) from e

    def _words(self):
        return np.zeros(HDR_LEN, dtype=np.int64)

    def _bytes(self, t):
        return t.reshape(-1).view(torch.uint8).numpy()

    def _as_np(self, buf):
        return buf

    def peer_failure(self, peer: int) -> BaseException | None:
        t = self.t
        if t.comm is None or t._broken:
            return PeerFailedError(f"the mpi transport is unusable ({t._broken})", [self.ranks[peer]])
        t._poll_notices()
        what = f"rank {self.ranks[self.rank]} waited for it in a point-to-point call"
        if peer in t._closed_after:
            return naming_the_dead(PeerFailedError(f"rank {self.ranks[peer]} closed its communicator while {what}",
                                                   [self.ranks[peer]]), self, peer)
        if peer in t._failed_at:
            return naming_the_dead(PeerFailedError(f"rank {self.ranks[peer]} aborted after a failure while {what}",
                                                   [self.ranks[peer]]), self, peer)
        return local_pid_failure(what, peer, self.ranks, t._local_pids)

    def dead_peers(self) -> list[tuple[int, int]]:
        return dead_local(self.t._local_pids)

    def close(self) -> None:
        """Before the transport frees its communicator: end the requests of unfinished operations.

        Receives are cancelled; every request is then waited for, up to _CANCEL_GRACE. One still pending
        keeps its buffers for good (_ABANDONED_MPI): mpi4py finalizes MPI after the interpreter has freed
        its objects, and MPI completing a receive into a freed buffer then corrupted the heap at exit."""
        pending = [(op, r) for op in self.ops for r in op.reqs if r is not None]
        keep = [op.keep for op in self.ops]
        super().close()
        if not pending:
            return
        for op in {id(op): op for op, _ in pending}.values():
            for r in _receives(op):  # sends to live peers complete; a receive may wait for ever
                try:
                    r.Cancel()
                except self.MPI.Exception as e:
                    log.debug("mpi point-to-point close: cancel: %s", e)
        reqs = [r for _, r in pending]
        end = time.monotonic() + _CANCEL_GRACE
        try:
            while not self.MPI.Request.Testall(reqs) and time.monotonic() < end:
                time.sleep(1e-3)
            if self.MPI.Request.Testall(reqs):
                return
        except self.MPI.Exception as e:
            log.debug("mpi point-to-point close: %s", e)
        _ABANDONED_MPI.append((reqs, keep))
        log.warning("mpi point-to-point close: request(s) still pending after %.1fs; their buffers are kept",
                    _CANCEL_GRACE)


# Requests an MPIChannel.close left pending, with their buffers: MPI may still write into them.
_ABANDONED_MPI: list = []


def _receives(op: Op) -> list:
    """The receive requests among ``op.reqs`` (MessageChannel's layout): a send's reply receive (index 1);
    a receive's header receive (state 1), then its data receive before its reply send (state 2)."""
    if op.kind == "send":
        return [op.reqs[1]] if len(op.reqs) > 1 and op.reqs[1] is not None else []
    reqs = op.reqs if op.state == 1 else op.reqs[:-1]
    return [r for r in reqs if r is not None]
