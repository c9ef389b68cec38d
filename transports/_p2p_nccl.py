"""The data step of point-to-point messages of CUDA tensors over NCCL (``ncclSend``/``ncclRecv``).

The handshake (header, reply with the dtype/shape check, and an acknowledgement number per
direction) runs over the communicator's host channel (transports/_p2p.py); once a message is
agreed on both sides, its data step is enqueued here. The steps are enqueued once every posted CUDA
message has shaken hands (or a wait saw no new handshake for a second: collectives/_p2p.py), all in
one ``ncclGroupStart``/``ncclGroupEnd``, so a rank's sends and receives of an exchange never wait for
each other in separate launches, and each direction's steps are enqueued in acknowledgement order,
the same order on both ranks (NCCL pairs the sends and receives between two ranks in the order they
were issued).

Streams follow torch's ProcessGroupNCCL. The enqueue runs at some later progress call, perhaps
under another stream or from another thread, so the stream current *then* says nothing about what
produced the tensor. Instead, at post time (:func:`prepare`, :func:`mark_posted`) a CUDA event is recorded on the
caller's current stream, after the ``contiguous()`` copy of a non-contiguous send; the group runs on
one point-to-point stream per transport (:func:`p2p_stream`; all ops of a group go on one stream,
as ``nccl.py`` issues its groups) that first waits on every op's post-time event; a non-contiguous
receive is copied back on that stream after the group; one completion event is recorded after it all
(``Op.event``). Every buffer used on the point-to-point stream gets ``record_stream`` so the caching
allocator does not hand it out while the step runs. ``P2PWork.wait()`` makes the then-current stream
wait on the completion event.

STATUS: GPU-unverified: written against cupy.cuda.nccl's ``NcclCommunicator.send``/``recv``
(as transports/nccl.py's all_to_all uses them), never run; the tests skip without CUDA. The stream
ordering is checked without a GPU by tests/test_p2p_nccl_stream.py (fake streams and events).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._p2p import Op, copy_back

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


def prepare(kind: str, peer: int, tag: int, t: torch.Tensor) -> Op:
    """The op of a send or receive of CUDA tensor ``t`` (a contiguous buffer: ``t`` itself, a
    ``contiguous()`` copy of a send, made now on the current stream, or a fresh one for a receive,
    copied back into ``t`` after the data step). Call :func:`mark_posted` once the batch is prepared."""
    finish = None
    if t.is_contiguous():
        buf = t
    elif kind == "send":
        buf = t.contiguous()
    else:  # nothing to copy in: the data step overwrites it
        buf = torch.empty_like(t, memory_format=torch.contiguous_format)
        finish = _copy_back(t, buf)
    return Op(kind, peer, tag, buf, external=True, finish=finish)


def mark_posted(ops: Sequence[Op], device: torch.device) -> None:
    """Record one event on the current stream (the caller's, at post time) for ``ops``: their data
    steps wait on it, however late and from whichever stream they are enqueued."""
    if not ops:
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    for op in ops:
        op.posted = event


def p2p_stream(transport: Any, device: torch.device) -> Any:
    """The transport's point-to-point stream (made on first use)."""
    stream = getattr(transport, "p2p_stream", None)
    if stream is None:
        stream = transport.p2p_stream = torch.cuda.Stream(device=device)
    return stream


def _copy_back(dst: torch.Tensor, buf: torch.Tensor) -> Callable[[], None]:
    """A non-contiguous receive's copy into ``dst``, run by :func:`enqueue` under the point-to-point stream."""
    copy = copy_back(dst, buf)

    def finish() -> None:
        copy()
        dst.record_stream(torch.cuda.current_stream(dst.device))  # the caller's tensor, written on our stream
    return finish


def enqueue(transport: Any, ops: Sequence[Op]) -> None:
    """Enqueue the data steps of ``ops`` (handshaken, CUDA, posted with :func:`mark_posted`) as one NCCL
    group on the transport's point-to-point stream, after each op's post-time event; each op is then
    complete (its ``event`` follows the group and the copy-back of a non-contiguous receive)."""
    if not ops:
        return
    nccl = transport.nccl
    stream = p2p_stream(transport, ops[0].buf.device)
    waited: list[Any] = []
    for op in ops:
        if op.posted is not None and not any(op.posted is e for e in waited):  # a batch shares one event
            stream.wait_event(op.posted)
            waited.append(op.posted)
        op.buf.record_stream(stream)  # a contiguous() copy may be freed before the step runs
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
    with torch.cuda.stream(stream):
        for op in ops:
            if op.finish is not None:  # ordered after the receive, and before the event a wait() waits on
                op.finish()
                op.finish = None
    event = torch.cuda.Event()
    event.record(stream)
    for op in ops:  # the event is recorded before an op reads as done (another thread's wait() uses it)
        op.event = event
        op.enqueued = True
        op.complete()
