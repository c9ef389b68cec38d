"""Point-to-point messages over a transport's own channel: the pieces every transport shares.

A message is matched by (source, destination, tag), in the order the messages were posted, as in
MPI. Every message starts with a small header (:data:`HDR_LEN` int64 words: tag, dtype, shape,
bytes); the receiver compares it with what it posted and answers with a reply (ok, or its own
dtype and shape). A size or dtype that differs makes *both* ranks raise ``ValueError`` with the
same text (:func:`mismatch_message`). Data then moves by the transport's own means:

- up to :data:`EAGER_BYTES` the data travels with the header (the send completes at once, a
  ring of blocking sends works); a mismatch found by the receiver then reaches the sender at its
  next point-to-point call on that communicator (``deferred``), since its send already returned;
- larger: after the reply (rendezvous), so nothing lands that the receiver did not ask for;
- "external" messages (CUDA tensors over NCCL) only shake hands here; the reply carries an
  acknowledgement number per direction so both ranks enqueue the NCCL calls in the same order.

This module holds the header layout, the operation state (:class:`Op`), the channel interface
(:class:`Channel`), and :class:`MessageChannel`, the protocol over transports whose native calls
are tagged non-blocking messages (mpi: ``Isend``/``Irecv`` in transports/_p2p_mpi.py; gloo:
``ProcessGroupGloo.send``/``recv`` in transports/_p2p_gloo.py; ``channel_of`` in
transports/_p2p_channels.py picks one). The shm channel is in transports/_p2p_shm.py, NCCL's data
step in transports/_p2p_nccl.py, the Communicator's calls in collectives/_p2p.py.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ._host import pid_alive
from .base import DTYPE_CODES, MAX_META_DIMS, PeerFailedError, _tail_digest, dtype_name

log = logging.getLogger(__name__)

EAGER_BYTES = 8192  # messages up to this size travel with their header; the send completes at once
HDR_LEN = 16
MAGIC = 0x7032702D6D6F65  # "moe-p2p"
# header words; the reply uses the same positions for the spec (dtype .. nbytes)
H_MAGIC, H_TAG, H_DTYPE, H_NDIM, H_DIMS, H_TAIL, H_NBYTES, H_FLAGS, H_AUX = 0, 1, 2, 3, 4, 12, 13, 14, 15
R_STATUS, R_ACK = 1, 14
SPEC = slice(H_DTYPE, H_NBYTES + 1)
FLAG_EAGER, FLAG_EXTERNAL, FLAG_CMA = 1, 2, 4
OK, MISMATCH = 1, 2
MAX_TAG = (1 << 22) - 1
_CANCEL_GRACE = 2.0  # seconds a channel's close waits for the requests of unfinished operations to end


def spec_words(t: torch.Tensor) -> np.ndarray:
    """[HDR_LEN] int64 with ``t``'s dtype, shape and bytes at the spec positions (shapes of more than
    :data:`~transports.base.MAX_META_DIMS` dims fold their tail into a product and a digest)."""
    w = np.zeros(HDR_LEN, dtype=np.int64)
    w[H_MAGIC] = MAGIC
    w[H_DTYPE] = DTYPE_CODES.get(t.dtype, 1000)
    dims = [int(d) for d in t.shape]
    w[H_NDIM] = len(dims)
    if len(dims) > MAX_META_DIMS:
        tail = dims[MAX_META_DIMS - 1:]
        w[H_TAIL] = _tail_digest(tail)
        dims = dims[: MAX_META_DIMS - 1] + [math.prod(tail)]
    w[H_DIMS:H_DIMS + len(dims)] = dims
    w[H_NBYTES] = t.numel() * t.element_size()
    return w


def describe(w: np.ndarray) -> str:
    """``float32 (3, 4)`` from a header's or reply's spec words."""
    ndim = int(w[H_NDIM])
    dims = [str(int(d)) for d in w[H_DIMS:H_DIMS + min(ndim, MAX_META_DIMS)]]
    if ndim > MAX_META_DIMS:
        dims[-1] = f"<last {ndim - MAX_META_DIMS + 1} dims: {dims[-1]} elements>"
    shape = "(" + ", ".join(dims) + ("," if ndim == 1 else "") + ")"
    return f"{dtype_name(int(w[H_DTYPE]))} {shape}"


def same_spec(a: np.ndarray, b: np.ndarray) -> bool:
    return bool((a[SPEC] == b[SPEC]).all())


def mismatch_message(tag: int, sender: int, receiver: int, send_spec: np.ndarray, recv_spec: np.ndarray,
                     send_cuda: bool = False, recv_cuda: bool = False) -> str:
    """The one text both ranks raise for a message whose dtype, shape or device kind differs (world ranks;
    ``*_cuda``: that side's tensor moves over NCCL)."""
    where = ""
    if send_cuda != recv_cuda:
        kind = {True: "a CUDA tensor (NCCL)", False: "a host tensor"}
        where = f" (rank {sender} passed {kind[send_cuda]}, rank {receiver} {kind[recv_cuda]})"
    return (f"send/recv mismatch (tag {tag}): rank {sender} sends {describe(send_spec)} "
            f"({int(send_spec[H_NBYTES])} bytes) to rank {receiver}, which receives {describe(recv_spec)} "
            f"({int(recv_spec[H_NBYTES])} bytes){where}; both ranks raise. Send and receive tensors of the same "
            "dtype and shape (and both on CUDA or both on the host).")


class Op:
    """One posted send or receive of a channel.

    ``buf``: the contiguous tensor sent from or received into (CPU; CUDA for external messages);
    ``peer``: the group rank (None: a receive from any source, shm only); ``done``: complete from
    the caller's view (an eager send is done once posted); ``error``: why it failed;
    ``finish``: called once when it completes (copies a staged receive back); ``posted`` and ``event``
    (external): CUDA events on the caller's stream at post time and after the data step.
    """

    __slots__ = (
        "ack_no",
        "buf",
        "channel",
        "chunk",
        "done",
        "eager",
        "enqueued",
        "error",
        "event",
        "external",
        "finish",
        "handshaken",
        "keep",
        "kind",
        "order",
        "other",
        "peer",
        "posted",
        "posted_at",
        "reqs",
        "seq",
        "source",
        "spec",
        "state",
        "tag",
    )

    def __init__(self, kind: str, peer: int | None, tag: int, buf: torch.Tensor, *, external: bool = False,
                 finish: Callable[[], None] | None = None):
        self.kind, self.peer, self.tag, self.buf = kind, peer, tag, buf
        self.spec = spec_words(buf)
        self.spec[H_TAG] = tag
        self.external = external
        self.eager = kind == "send" and not external and int(self.spec[H_NBYTES]) <= EAGER_BYTES
        self.done = False
        self.error: BaseException | None = None
        self.state = 0
        self.reqs: list = []
        self.order = 0
        self.ack_no = -1
        self.handshaken = False  # external: both sides agreed; the data step may be enqueued
        self.enqueued = False
        self.finish = finish
        self.seq = -1
        self.keep: list = []  # buffers a request in flight reads or writes
        self.other: np.ndarray | None = None  # the peer's header or reply
        self.chunk = 0
        self.source = peer  # a receive from any source: who sent it
        self.event = None  # external: the CUDA event after the data step
        self.posted = None  # external: a CUDA event on the caller's stream at post time; the data step waits on it
        self.channel: Any = None
        self.posted_at = time.monotonic()

    def complete(self) -> None:
        if not self.done:
            self.done = True
            if self.finish is not None and self.error is None:
                self.finish()

    @property
    def nbytes(self) -> int:
        return int(self.spec[H_NBYTES])

    def waiting_for(self) -> str:
        """What this op still waits for, for a timeout's message."""
        if self.kind == "recv":
            return "a matching send" if self.state <= 1 else "the rest of the message"
        return "a matching receive" if self.state <= 1 else "the receiver to take the data"


class Channel:
    """Point-to-point messages of one transport (see the module docstring).

    Subclasses implement :meth:`post` (start an op without blocking), :meth:`poll` (advance every
    op of this channel without blocking; True when anything moved) and :meth:`peer_failure`.
    """

    name = "?"
    supports_any_source = False

    def __init__(self, rank: int, size: int, ranks: list[int]):
        self.rank, self.size, self.ranks = rank, size, ranks
        self.ops: list[Op] = []  # posted, not finished (eager sends stay until their reply)
        self.deferred: list[BaseException] = []  # errors of eager sends found after they completed
        self._posted: dict[tuple, int] = {}
        self._next: dict[tuple, int] = {}
        self._ext_ack: dict[int, int] = {}  # src -> acknowledgement numbers given (external receives)

    def _ordered(self, op: Op, key: tuple) -> None:
        op.order = self._posted.get(key, 0)
        self._posted[key] = op.order + 1

    def _turn(self, op: Op, key: tuple) -> bool:
        return self._next.get(key, 0) == op.order

    def _advance(self, key: tuple) -> None:
        self._next[key] = self._next.get(key, 0) + 1

    def _next_ack(self, src: int) -> int:
        a = self._ext_ack.get(src, 0)
        self._ext_ack[src] = a + 1
        return a

    def take_reply(self, op: Op, reply: np.ndarray, peer: int) -> bool:
        """A send's reply from its receiver. A mismatch becomes the op's error (an eager send has
        returned: the sender's next point-to-point call raises it, ``deferred``); an external (NCCL)
        send keeps the receiver's ack. Returns whether the receiver took the message."""
        if int(reply[R_STATUS]) != OK:
            err = self.mismatch(op, op.spec, reply, self.rank, peer)
            if op.eager:
                self.deferred.append(err)
            else:
                op.error = err
            return False
        if op.external:
            op.ack_no = int(reply[R_ACK])
            op.handshaken = True
        return True

    def mismatch(self, op: Op, send_spec: np.ndarray, recv_spec: np.ndarray, src: int, dst: int) -> ValueError:
        """The error of ``op``: ``send_spec`` is a header (its flags say whether it is external), ``recv_spec`` a
        reply (its H_AUX word says whether the receive is), or either is ``op``'s own spec."""
        send_cuda = op.external if op.kind == "send" else bool(int(send_spec[H_FLAGS]) & FLAG_EXTERNAL)
        recv_cuda = op.external if op.kind == "recv" else bool(int(recv_spec[H_AUX]))
        return ValueError(mismatch_message(op.tag, self.ranks[src], self.ranks[dst], send_spec, recv_spec,
                                           send_cuda, recv_cuda))

    def post(self, op: Op) -> None:
        raise NotImplementedError

    def poll(self) -> bool:
        raise NotImplementedError

    def peer_failure(self, peer: int) -> BaseException | None:
        raise NotImplementedError

    def dead_peers(self) -> list[tuple[int, int]]:
        """(group rank, pid) of the peers on this node whose process is gone (checked only on an error's path)."""
        return []

    def own_copy(self, op: Op) -> None:
        """A posted send whose caller gets its tensor back before the message went (a blocking send that
        timed out): the data still to move comes from a copy taken now. Data a transfer already in flight
        reads (a gloo/mpi data message posted before) is not redirected."""
        if op.kind == "send" and not op.done and not op.external and not op.eager:
            op.buf = op.buf.clone()

    def close(self) -> None:
        self.ops.clear()


class MessageChannel(Channel):
    """The protocol over tagged non-blocking messages (mpi, gloo): per message a header, a reply,
    and the data (with the header when eager). Tags: four per user tag (:meth:`_tag`)."""

    HDR, REPLY, DATA, EAGER = 0, 1, 2, 3

    def _isend(self, peer: int, kind: int, tag: int, buf: Any) -> Any:
        raise NotImplementedError

    def _irecv(self, peer: int, kind: int, tag: int, buf: Any) -> Any:
        raise NotImplementedError

    def _test(self, req: Any, peer: int) -> bool:
        raise NotImplementedError

    def _words(self) -> Any:
        """A fresh [HDR_LEN] int64 buffer of this channel's kind."""
        raise NotImplementedError

    def _bytes(self, t: torch.Tensor) -> Any:
        """``t``'s bytes as this channel's buffer kind."""
        raise NotImplementedError

    def _as_np(self, buf: Any) -> np.ndarray:
        raise NotImplementedError

    def post(self, op: Op) -> None:
        if op.peer is None:
            raise NotImplementedError(f"a receive from any source is not supported over {self.name}")
        op.channel = self
        p, t = op.peer, op.tag
        if op.kind == "send":
            self._ordered(op, (p, t, "s"))
            hdr = self._words()
            w = op.spec.copy()
            w[H_FLAGS] = (FLAG_EAGER if op.eager else 0) | (FLAG_EXTERNAL if op.external else 0)
            self._as_np(hdr)[:] = w
            reply = self._words()
            op.keep = [hdr, reply]
            op.reqs = [self._isend(p, self.HDR, t, hdr), None]
            op.other = reply
            op.reqs[1] = self._irecv(p, self.REPLY, t, reply)
            if op.eager and op.nbytes:
                data = self._bytes(op.buf.clone())  # the caller may reuse its tensor at once
                op.keep.append(data)
                op.reqs.append(self._isend(p, self.EAGER, t, data))
            if op.eager:
                op.complete()
        else:
            self._ordered(op, (p, t, "r"))
            hdr = self._words()
            op.keep = [hdr]
            op.other = hdr
            op.reqs = [self._irecv(p, self.HDR, t, hdr)]
        op.state = 1
        self.ops.append(op)

    def poll(self) -> bool:
        moved = False
        for op in list(self.ops):
            try:
                if op.kind == "send":
                    moved |= self._poll_send(op)
                else:
                    moved |= self._poll_recv(op)
            except PeerFailedError as e:
                # the op's own error, raised by its own wait: raised from here it would end whichever call
                # polled, perhaps one that had just posted an op to another rank (a retry would post it twice)
                self.ops.remove(op)
                if not op.done:
                    op.error = e
                    op.complete()
                moved = True
        return moved

    def flush(self, seconds: float) -> None:
        """Before the transport closes: let eager sends still in flight reach their receivers (their
        sends returned at once; gloo moves a message only once the peer posted its receive), for up
        to ``seconds``. Failures are ignored: the receiver will name this rank."""
        end = time.monotonic() + seconds
        eager = [op for op in self.ops if op.kind == "send" and op.eager]
        while time.monotonic() < end:
            try:
                for op in eager:  # only these: the others are withdrawn, none starts its data now
                    if op in self.ops:
                        self._poll_send(op)
                busy = [op for op in eager if op in self.ops and not all(
                    r is None or self._test(r, op.peer) for i, r in enumerate(op.reqs) if i != 1)]
            except Exception:  # noqa: BLE001 - a peer that left: nothing more to deliver
                return
            if not busy:
                return
            time.sleep(1e-3)

    def _all_done(self, op: Op) -> bool:
        return all(r is None or self._test(r, op.peer) for r in op.reqs)

    def _poll_send(self, op: Op) -> bool:
        p, key = op.peer, (op.peer, op.tag, "s")
        if op.state == 1:
            if not self._turn(op, key) or not self._test(op.reqs[1], p):
                return False
            self._advance(key)
            op.reqs[1] = None
            if self.take_reply(op, self._as_np(op.other), p) and not op.external and not op.eager and op.nbytes:
                data = self._bytes(op.buf)
                op.keep.append(data)
                op.reqs.append(self._isend(p, self.DATA, op.tag, data))
            op.state = 3
            return True
        if op.state == 3 and self._all_done(op):
            self.ops.remove(op)
            if op.external and op.error is None:
                return True  # done when its NCCL step is enqueued (collectives/_p2p.py)
            op.complete()
            return True
        return False

    def _poll_recv(self, op: Op) -> bool:
        p, key = op.peer, (op.peer, op.tag, "r")
        if op.state == 1:
            if not self._turn(op, key) or not self._test(op.reqs[0], p):
                return False
            self._advance(key)
            hdr = self._as_np(op.other).copy()
            op.other = hdr
            reply = self._words()
            rw = self._as_np(reply)
            rw[:] = op.spec
            flags = int(hdr[H_FLAGS])
            eager = bool(flags & FLAG_EAGER)
            ok = same_spec(hdr, op.spec) and bool(flags & FLAG_EXTERNAL) == op.external
            rw[R_STATUS] = OK if ok else MISMATCH
            rw[H_AUX] = int(op.external)
            if ok and op.external:
                op.ack_no = rw[R_ACK] = self._next_ack(p)
            op.reqs = []
            op.keep = [reply]
            if eager and int(hdr[H_NBYTES]):
                if ok:
                    data = self._bytes(op.buf)
                else:  # drain it: the sender's data is on its way
                    data = self._bytes(torch.empty(int(hdr[H_NBYTES]), dtype=torch.uint8))
                op.keep.append(data)
                op.reqs.append(self._irecv(p, self.EAGER, op.tag, data))
            elif ok and not op.external and op.nbytes:
                data = self._bytes(op.buf)
                op.keep.append(data)
                op.reqs.append(self._irecv(p, self.DATA, op.tag, data))
            op.reqs.append(self._isend(p, self.REPLY, op.tag, reply))
            if not ok:
                op.error = self.mismatch(op, hdr, op.spec, p, self.rank)
            op.state = 2
            return True
        if op.state == 2 and self._all_done(op):
            self.ops.remove(op)
            if op.external and op.error is None:
                op.handshaken = True
                return True
            op.complete()
            return True
        return False


def copy_back(dst: torch.Tensor, buf: torch.Tensor) -> Callable[[], None]:
    """An ``Op.finish`` that copies a receive's contiguous (or staged) buffer into its ``dst``."""
    def finish() -> None:
        with torch.no_grad():
            dst.copy_(buf)
    return finish


def dead_local(pids: dict[int, int]) -> list[tuple[int, int]]:
    """(group rank, pid) of the processes in ``pids`` (group rank -> pid, this node's) that are gone."""
    return [(r, pid) for r, pid in sorted(pids.items()) if pid and not pid_alive(pid)]


def naming_the_dead(err: PeerFailedError, channel: Channel, peer: int) -> PeerFailedError:
    """``err`` (``peer`` closed its communicator or aborted), naming first the ranks on this node that died,
    if any did: a peer that closed after a failure (a ring's next rank) is a bystander, the dead rank the cause."""
    dead = [(r, pid) for r, pid in channel.dead_peers() if r != peer]
    if not dead:
        return err
    ranks = [channel.ranks[r] for r, _ in dead]
    what = ", ".join(f"rank {channel.ranks[r]} (pid {pid})" for r, pid in dead)
    return PeerFailedError(f"{what} died; that is likely why {err}",
                           ranks + [r for r in err.missing_ranks if r not in ranks])


def local_pid_failure(what: str, peer: int, ranks: list[int], pids: dict[int, int]) -> BaseException | None:
    pid = pids.get(peer)
    if pid is not None and not pid_alive(pid):
        return PeerFailedError(f"rank {ranks[peer]} (pid {pid}) died while {what}", [ranks[peer]])
    return None
