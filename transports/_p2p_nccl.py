"""The data step of point-to-point messages of CUDA tensors over NCCL (``ncclSend``/``ncclRecv``).

The handshake (header, reply with the dtype/shape check, and an acknowledgement number per
direction) runs over the communicator's host channel (transports/_p2p.py); once a message is
agreed on both sides, its data step is enqueued here on the caller's current CUDA stream. The steps
are enqueued once every posted CUDA message has shaken hands (or a wait saw no new handshake for a
second: collectives/_p2p.py), all in one ``ncclGroupStart``/``ncclGroupEnd``, so a rank's sends and
receives of an exchange never wait for each other in separate launches, and each direction's steps
are enqueued in acknowledgement order, the same order on both ranks (NCCL pairs the sends and
receives between two ranks in the order they were issued).

STATUS: GPU-unverified: written against cupy.cuda.nccl's ``NcclCommunicator.send``/``recv``
(as transports/nccl.py's all_to_all uses them), never run; the tests skip without CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._p2p import Op

_NCCL_UINT8 = 1  # ncclUint8: messages move as bytes


class NcclOrder:
    """Which handshaken external ops may be enqueued now: per peer and direction, acknowledgement
    numbers in sequence (the receiver hands them out in the order it matched the messages)."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, str], int] = {}

    def ready(self, ops: Sequence[Op]) -> list[Op]:
        waiting = sorted((op for op in ops if op.handshaken and not op.enqueued and op.error is None),
                         key=lambda o: (o.kind, o.source, o.ack_no))
        out = []
        for op in waiting:
            key = (op.source, op.kind)
            if self._next.get(key, 0) == op.ack_no:
                self._next[key] = op.ack_no + 1
                out.append(op)
        return out


def enqueue(transport: Any, ops: Sequence[Op]) -> None:
    """Enqueue the data steps of ``ops`` (handshaken, CUDA, contiguous) as one NCCL group on the
    current stream; each op is then complete (its ``event`` follows the group)."""
    if not ops:
        return
    nccl = transport.nccl
    stream = torch.cuda.current_stream()
    nccl.groupStart()
    try:
        for op in ops:
            n = op.nbytes
            if n == 0:
                continue
            if op.kind == "send":
                transport.comm.send(op.buf.data_ptr(), n, _NCCL_UINT8, op.source, stream.cuda_stream)
            else:
                transport.comm.recv(op.buf.data_ptr(), n, _NCCL_UINT8, op.source, stream.cuda_stream)
    finally:
        nccl.groupEnd()
    event = torch.cuda.Event()
    event.record(stream)
    for op in ops:
        op.event = event
        op.enqueued = True
        op.complete()
