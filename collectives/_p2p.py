"""Point-to-point messages of the Communicator: ``send``/``recv``, ``isend``/``irecv`` and
``batch_isend_irecv`` (a mixin of :class:`collectives.communicator.Communicator`).

Messages travel over a transport's own channel, never the rendezvous store: shm (inline in a
ring up to 8 KiB, else one process_vm_readv copy, else staged chunks: transports/_p2p_shm.py),
mpi (``Isend``/``Irecv`` on the transport's private communicator) or gloo
(``ProcessGroupGloo.send``/``recv``) for CPU tensors (transports/_p2p.py), and NCCL
(``ncclSend``/``ncclRecv``, grouped; the handshake over the host channel: transports/_p2p_nccl.py)
for CUDA tensors. A CUDA tensor without NCCL is copied through host memory. CUDA messages keep
torch's NCCL stream contract: the data step is ordered after the work the caller's current stream
had queued when it posted the message (not the stream current when the step is enqueued), runs on
the communicator's point-to-point stream, and ``wait()`` makes the then-current stream wait for it.

Matching is MPI's: a receive from rank s with tag t takes the earliest unmatched message rank s
sent to this rank with tag t; receives are served in the order they were posted. Every message
is checked: a dtype or shape that differs between the send and the receive raises ``ValueError``
on both ranks, naming them and both values. Sends of up to 8 KiB complete at once (the data goes
with the header; a mismatch then raises at the start of the sender's next ``send``/``recv``/
``isend``/``irecv``/``batch_isend_irecv``, before that call posts anything, so the call had no
effect and may simply be retried; a mismatch that arrives while a call waits is kept for the next
call); larger sends
complete when the receiver has the data, so a blocking ``send`` of a large tensor returns only
once the peer receives it: post the receive first (``irecv``) or use ``batch_isend_irecv``,
which never deadlocks whatever order the ranks list their operations in. Every wait is bounded by
the communicator's timeout (``CollectiveTimeoutError`` naming the silent peer); a peer that died
or closed raises ``PeerFailedError``. A wait that timed out leaves its operation posted: waiting
again may still complete it (a blocking ``send`` that timed out goes on from a copy of its tensor
taken then, since its caller owns the tensor again).

A receiver never reads a sender's tensor after the sender's call returned or raised, or after its
communicator closed: ``close()`` (or an interrupted call, which closes the communicator) withdraws
this rank's unfinished operations instead of completing them (as ``ncclCommAbort`` drops them; MPI
requires them completed before the communicator is freed): ``wait()`` every ``isend`` first. The
receiver of a withdrawn send above 8 KiB raises ``PeerFailedError`` naming the sender; sends of up to
8 KiB had completed and are still delivered.

Point-to-point calls hold the communicator's one-call-at-a-time lock while they run (``isend``
and ``irecv`` only to post; ``wait`` and ``is_completed`` while they drive progress), and use
channels of their own, so collectives between them are unaffected.
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from transports._p2p import MAX_TAG, Op, copy_back
from transports._p2p_channels import channel_of
from transports.base import CollectiveTimeoutError, PeerFailedError

from ._arrays import Array

_HOST_ORDER = ("shm", "mpi", "gloo")
_CHECK_EVERY = 0.05  # seconds between checks for failed peers while waiting
# A wait enqueues the agreed NCCL steps after this long without a new handshake, even though some posted
# CUDA message has not shaken hands (its peer has not posted it yet). Shorter splits an exchange's send and
# receive into separate NCCL launches when handshakes are merely slow (5 ms did on the loaded CI VM over
# gloo), which deadlocks the two ranks' streams; longer delays a wait that does not need the late message.
_NCCL_GRACE = 1.0


@dataclass
class P2POp:
    """One operation of :meth:`PointToPoint.batch_isend_irecv`.

    Args:
        op: "isend" or "irecv" (or the communicator's ``isend``/``irecv`` methods, or
            ``torch.distributed.isend``/``irecv``: recognised by name).
        tensor: the tensor sent, or received into (a dense tensor of any dtype and shape).
        peer: the group rank sent to or received from.
        tag: matches sends with receives (0 <= tag < 2**22).
    """

    op: str | Callable
    tensor: torch.Tensor
    peer: int
    tag: int = 0


class P2PWork:
    """The handle of a posted ``isend``/``irecv``.

    ``wait()`` drives progress until the operation completes (bounded by the communicator's
    timeout) and returns the received tensor (None for a send); ``is_completed()`` drives progress
    once without waiting. For CUDA tensors over NCCL, completion means enqueued (on the
    point-to-point stream, after the stream current at post time): ``wait()`` makes the current
    stream wait for it, as torch's NCCL Work does; ``is_completed()`` is True once the GPU has run
    it (the copy into a non-contiguous ``out`` included), so no stream needs to wait then.
    """

    def __init__(self, comm: Any, op: Op, result: torch.Tensor | np.ndarray | None):
        self._comm, self._op, self.result = comm, op, result

    @property
    def source(self) -> int | None:
        """The group rank a receive took its message from (a receive from any source), else the peer."""
        return self._op.source

    def is_completed(self) -> bool:
        """Returns: whether the operation is complete (raises its error if it failed)."""
        if not self._op.done:
            self._comm._guarded("is_completed", self._comm._p2p_progress)
        if self._op.done and self._op.error is not None:
            raise self._op.error
        if self._op.done and self._op.event is not None:
            return bool(self._op.event.query())
        return self._op.done

    def wait(self, timeout: float | None = None) -> torch.Tensor | np.ndarray | None:
        """Wait for the operation.

        Args:
            timeout: seconds (default and at most: the communicator's timeout).
        Returns:
            The received tensor (the ``out`` given to ``irecv``, or the one it allocated); None for a send.
        """
        if not self._op.done:
            self._comm._guarded("wait", self._comm._p2p_wait, [self._op], timeout)
        if self._op.error is not None:
            raise self._op.error
        if self._op.event is not None:  # the then-current stream (torch's Work.wait())
            torch.cuda.current_stream(self._op.buf.device).wait_event(self._op.event)
        return self.result


class PointToPoint:
    """Point-to-point calls of the Communicator (see the module docstring)."""

    # ---- public calls -------------------------------------------------------------------------
    def send(self, x: Array, dst: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dst``; returns once it is sent (see the module docstring: up to 8 KiB at
        once, larger once the receiver has it).

        Args:
            x: [*] any dense tensor (any dtype; CPU, or CUDA on ``comm.device``) or NumPy array.
            dst: the receiving group rank (not this rank).
            tag: matches the receiver's tag (0 <= tag < 2**22).
        Returns:
            None. Raises ValueError on both ranks if the receiver posted another dtype or shape.
        """
        self._guarded("send", self._p2p_blocking, "send", x, dst, tag, None, None)

    def recv(self, out: Array | Sequence[int], src: int, tag: int = 0, *, dtype: torch.dtype | None = None,
             device: Any = None) -> torch.Tensor | np.ndarray:
        """Receive the next message from rank ``src`` with ``tag``.

        Args:
            out: the tensor (or NumPy array) to receive into, [*] any dense tensor; or a shape
                (a ``torch.Size``/tuple/list of ints) to allocate one of.
            src: the sending group rank (not this rank).
            tag: matches the sender's tag.
            dtype: with a shape: the dtype to allocate (default float32); must be None with a tensor.
            device: with a shape: where to allocate (default cpu; "cuda[:N]" of a device that exists).
        Returns:
            [*] ``out`` (or the new tensor) holding the message. Raises ValueError on both ranks if
            the sender's dtype or shape differs; TypeError/ValueError on this rank alone, the
            communicator intact, for a bad shape (negative or non-int dims, a str), dtype or device
            or a tensor that cannot be allocated.
        """
        return self._guarded("recv", self._p2p_blocking, "recv", out, src, tag, dtype, device)

    def isend(self, x: Array, dst: int, tag: int = 0) -> P2PWork:
        """Start sending ``x`` to rank ``dst`` (never blocks). Leave ``x`` unchanged until the
        handle's ``wait()`` returns.

        Args: as :meth:`send`.
        Returns:
            A :class:`P2PWork`; its ``wait()`` returns None.
        """
        return self._guarded("isend", self._p2p_start, [("send", x, dst, tag, None, None)])[0]

    def irecv(self, out: Array | Sequence[int], src: int | None, tag: int = 0, *, dtype: torch.dtype | None = None,
              device: Any = None) -> P2PWork:
        """Start receiving the next message from rank ``src`` with ``tag`` (never blocks).

        Args: as :meth:`recv`; ``src=None`` receives from any rank (shm only; the handle's
            ``source`` then says which).
        Returns:
            A :class:`P2PWork`; its ``wait()`` returns the tensor received into.
        """
        return self._guarded("irecv", self._p2p_start, [("recv", out, src, tag, dtype, device)])[0]

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[P2PWork]:
        """Post every operation of ``ops`` (never blocks) and return their handles.

        Sends and receives are matched whatever order each rank lists them in, so a batch in
        which every rank posts its receives before its sends (pipeline parallelism's exchange)
        does not deadlock. CUDA operations whose handshakes complete together go into one NCCL group.

        Args:
            ops: [k] :class:`P2POp` (or any object with ``op``, ``tensor``, ``peer`` and ``tag``).
        Returns:
            [k] :class:`P2PWork`, in the order of ``ops``.
        """
        if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
            raise TypeError(f"batch_isend_irecv on rank {self.global_ranks[self.rank]}: ops must be a sequence "
                            f"of P2POp, got {type(ops).__name__}")
        specs = []
        for o in ops:
            missing = [a for a in ("op", "tensor", "peer") if not hasattr(o, a)]
            if missing:
                raise TypeError(f"batch_isend_irecv on rank {self.global_ranks[self.rank]}: each op must be a P2POp "
                                f"(op, tensor, peer, tag); got a {type(o).__name__} without {', '.join(missing)}")
            name = o.op if isinstance(o.op, str) else getattr(o.op, "__name__", "")
            if name not in ("isend", "irecv", "send", "recv"):
                raise ValueError(f"batch_isend_irecv: op must be isend or irecv, got {o.op!r}")
            kind = "send" if "send" in name else "recv"
            specs.append((kind, o.tensor, o.peer, getattr(o, "tag", 0) or 0, None, None))
        return self._guarded("batch_isend_irecv", self._p2p_start, specs)

    # ---- machinery ----------------------------------------------------------------------------
    def _p2p_blocking(self, kind: str, x: Any, peer: Any, tag: Any, dtype: Any, device: Any) -> Any:
        work = self._p2p_start([(kind, x, peer, tag, dtype, device)])[0]
        try:
            self._p2p_wait([work._op], None)
        except CollectiveTimeoutError as e:
            # the send stays posted (as any timed-out wait leaves its op), but the caller owns its tensor again:
            # the message goes on from a copy taken now, never from memory the caller may rewrite
            if kind == "send" and not isinstance(e, PeerFailedError) and not work._op.done:
                work._op.channel.own_copy(work._op)
            raise
        return work.wait()

    def _p2p_start(self, specs: list[tuple]) -> list[P2PWork]:
        if self._state.closed is not None:
            self._state.raise_closed()
        prepared = [self._p2p_prepare(*s) for s in specs]  # every argument checked before anything is posted
        # An earlier eager send's mismatch is raised now, before this call posts anything: raised after
        # posting, a retried recv would leave the first one to swallow a message, a retried send deliver twice.
        self._p2p_progress()
        self._p2p_raise_deferred()
        cuda_ops = [op for op, _, _, nccl_t in prepared if nccl_t is not None]
        if cuda_ops:  # the data steps follow what the caller's stream has queued now (contiguous() copies too)
            from transports._p2p_nccl import mark_posted

            mark_posted(cuda_ops, self.device)
        works = []
        for op, channel, result, nccl_t in prepared:
            channel.post(op)
            if nccl_t is not None:
                _pending(nccl_t).append(op)
            works.append(P2PWork(self, op, result))
        self._p2p_progress()
        return works

    def _p2p_prepare(self, kind: str, x: Any, peer: Any, tag: Any, dtype: Any, device: Any) -> tuple:
        me = self.global_ranks[self.rank]
        what = f"{kind} on rank {me}"
        if peer is None and kind == "recv":
            pass
        elif isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
            raise TypeError(f"{what}: the peer rank must be an int, got {type(peer).__name__}")
        elif not 0 <= int(peer) < self.size or int(peer) == self.rank:
            raise ValueError(f"{what}: peer rank {peer} is not another rank of this group of {self.size} "
                             f"(this rank is {self.rank})")
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= int(tag) <= MAX_TAG:
            raise ValueError(f"{what}: tag must be an int in [0, {MAX_TAG}], got {tag!r}")
        peer = None if peer is None else int(peer)
        tag = int(tag)
        result: Any = None
        finish = None
        if kind == "recv" and not isinstance(x, (torch.Tensor, np.ndarray)):
            x = _allocate(what, x, dtype, device)
        elif dtype is not None or device is not None:
            raise ValueError(f"{what}: dtype= and device= go with a shape, not with an out tensor")
        elif not isinstance(x, (torch.Tensor, np.ndarray)):
            raise TypeError(f"{what}: x must be a tensor or an array, got {type(x).__name__}")
        numpy_in = isinstance(x, np.ndarray)
        try:
            t = torch.from_numpy(x) if numpy_in else x
        except TypeError as e:  # an object or other dtype torch has no tensor of
            raise TypeError(f"{what}: {str(e).splitlines()[0]}") from None
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
            raise TypeError(f"{what}: sparse, quantized, nested and meta tensors cannot be sent or received "
                            f"(got layout {t.layout}, dtype {t.dtype}, device {t.device})")
        t = t.detach()
        if kind == "recv":
            result = x
        if t.device.type == "cuda" and "nccl" in self.transports and self._forced in (None, "nccl"):
            nccl_t = self.transports["nccl"]
            if t.device != self.device:
                raise ValueError(f"{what}: the tensor is on {t.device}, this communicator on {self.device}")
            from transports._p2p_nccl import prepare

            return prepare(kind, peer, tag, t), self._p2p_channel_for(peer), result, nccl_t
        if t.device.type != "cpu":  # no transport for it: through host memory
            if kind == "send":
                buf = t.cpu()
            else:
                buf = torch.empty(t.shape, dtype=t.dtype)
                finish = copy_back(t, buf)
        elif t.is_contiguous():
            buf = t
        else:
            buf = t.contiguous()
            if kind == "recv":
                finish = copy_back(t, buf)
        return Op(kind, peer, tag, buf, finish=finish), self._p2p_channel_for(peer), result, None

    def _p2p_channel_for(self, peer: int | None) -> Any:
        ch = self._p2p_host_channel()
        if peer is None and not ch.supports_any_source:
            raise _in_step(NotImplementedError(f"a receive from any source runs over shm only; this communicator's "
                                               f"point-to-point channel is {ch.name}: name the source rank"))
        return ch

    def _p2p_host_channel(self) -> Any:
        names = (self._forced,) if self._forced in _HOST_ORDER else _HOST_ORDER
        for name in names:
            t = self.transports.get(name)
            ch = channel_of(t) if t is not None else None
            if ch is not None:
                return ch
        raise _in_step(RuntimeError(f"point-to-point needs a host transport with a channel ({', '.join(_HOST_ORDER)}); "
                                    f"this communicator has {sorted(self.transports)}"
                                    + (f", forced to {self._forced!r}" if self._forced else "")))

    def _p2p_channels(self) -> list[Any]:
        return [ch for t in list(self.transports.values()) if (ch := getattr(t, "p2p", None)) is not None]

    def _p2p_progress(self, flush: bool = False) -> None:
        """Advance every posted operation once (no waiting). A deferred error of an eager send stays
        queued for the next call's start (:meth:`_p2p_start`).

        CUDA messages over NCCL: their data steps are enqueued, as one NCCL group, once every posted
        CUDA message has shaken hands (so a rank's send and receive of an exchange land in one group:
        NCCL would otherwise deadlock the two streams), or with ``flush`` (a wait that saw no
        handshake for _NCCL_GRACE: whatever is agreed goes now).
        """
        for ch in self._p2p_channels():
            if ch.ops:
                ch.poll()
        nccl_t = self.transports.get("nccl")
        if nccl_t is not None:
            pend = _pending(nccl_t)
            if pend and (flush or all(op.handshaken or op.done for op in pend)):
                from transports._p2p_nccl import enqueue

                enqueue(nccl_t, _order(nccl_t).ready(pend))
            pend[:] = [op for op in pend if not op.done]

    def _p2p_raise_deferred(self) -> None:
        for ch in self._p2p_channels():
            if ch.deferred:
                raise ch.deferred.pop(0)

    def _p2p_wait(self, ops: list[Op], timeout: float | None) -> None:
        limit = self.timeout if timeout is None else min(float(timeout), self.timeout)
        start = time.monotonic()
        deadline = start + limit
        # one channel that can sleep until a peer acts (shm: a futex doorbell; gloo: its waiter threads)
        chans = {op.channel for op in ops}
        sleeper = next(iter(chans)) if len(chans) == 1 and hasattr(next(iter(chans)), "token") else None
        spin = 0.0 if getattr(self.topology, "oversubscribed", False) else (2e-4 if sleeper else 2e-3)
        spin_until = start + spin
        next_check = start + _CHECK_EVERY
        sleep = 20e-6
        external = any(op.external for op in ops)
        shaken, shaken_at = -1, start
        while True:
            token = sleeper.token() if sleeper is not None else 0
            flush = False
            if external:  # enqueue the agreed NCCL steps once no handshake moved for _NCCL_GRACE
                n = sum(op.handshaken for op in _pending(self.transports["nccl"]))
                if n != shaken:
                    shaken, shaken_at = n, time.monotonic()
                flush = time.monotonic() - shaken_at > _NCCL_GRACE
            self._p2p_progress(flush)
            pending = [op for op in ops if not op.done]
            failed = [op for op in ops if op.done and op.error is not None]
            if failed:
                raise failed[0].error
            if not pending:
                return
            if self._state.conflict is not None:  # another thread was refused: end now, the communicator closes
                raise RuntimeError(self._state.conflict)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_EVERY
                for op in pending:
                    for peer in _peers_of(op, self.size, self.rank):
                        err = op.channel.peer_failure(peer)
                        if err is not None:
                            self._p2p_progress()  # it may have completed just before the peer left
                            if not op.done:
                                raise err
            if now >= deadline:
                raise _timeout(self, pending, limit)
            if now < spin_until:
                continue
            if sleeper is not None:
                sleeper.sleep(token, max(1e-4, min(_CHECK_EVERY, deadline - now)))
            elif sleep < 1e-4:
                os.sched_yield()
                sleep *= 1.5
            else:
                time.sleep(sleep)
                sleep = min(sleep * 1.5, 1e-3)


def _peers_of(op: Op, size: int, rank: int) -> list[int]:
    return [op.peer] if op.peer is not None else [r for r in range(size) if r != rank]


def _timeout(comm: Any, pending: list[Op], limit: float) -> CollectiveTimeoutError:
    ranks = comm.global_ranks
    me = ranks[comm.rank]
    parts, silent = [], []
    for op in pending:
        peers = [ranks[p] for p in _peers_of(op, comm.size, comm.rank)]
        silent += [p for p in peers if p not in silent]
        who = f"rank {peers[0]}" if len(peers) == 1 else f"any of ranks {peers}"
        verb = "receive from" if op.kind == "recv" else "send to"
        parts.append(f"{verb} {who} (tag {op.tag}, {op.nbytes} bytes) still waits for {op.waiting_for()}")
    deferred = [str(e) for ch in comm._p2p_channels() for e in ch.deferred]
    return CollectiveTimeoutError(
        f"point-to-point on rank {me} timed out after the timeout of {limit:.1f}s over {pending[0].channel.name}: "
        + "; ".join(parts) + f". Silent: rank(s) {silent} (did they post the matching call, with the same tag?)"
        + (f". Meanwhile an earlier send of this rank failed (the next call raises it): {deferred[0]}"
           if deferred else ""), silent)


def _allocate(what: str, shape: Any, dtype: Any, device: Any) -> torch.Tensor:
    """The tensor a receive into a shape allocates; ValueError/TypeError for what torch would refuse
    with a RuntimeError or AssertionError (which would close the communicator as an interrupted call)."""
    if isinstance(shape, (str, bytes, bytearray)) or not isinstance(shape, (torch.Size, tuple, list)):
        raise TypeError(f"{what}: out must be a tensor, an array or a shape (a torch.Size, tuple or list of ints), "
                        f"got {type(shape).__name__}")
    dims = []
    for d in shape:
        try:
            if isinstance(d, bool):
                raise TypeError
            dims.append(operator.index(d))
        except TypeError:
            raise TypeError(f"{what}: a shape's dims must be ints, got {d!r} in {list(shape)!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"{what}: a shape's dims must be >= 0, got {tuple(dims)}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what}: dtype must be a torch.dtype, got {dtype!r}")
    dtype = dtype or torch.float32
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise (ValueError if isinstance(device, str) else TypeError)(
            f"{what}: device must be cpu or cuda[:N], got {device!r} ({str(e).splitlines()[0]})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"{what}: device {dev} does not exist here ({count} CUDA device(s))")
    elif dev.type != "cpu":
        raise ValueError(f"{what}: device must be cpu or cuda[:N], got {dev}")
    try:
        return torch.empty(dims, dtype=dtype, device=dev)
    except RuntimeError as e:  # out of memory
        raise ValueError(f"{what}: cannot allocate the out tensor of shape {tuple(dims)} and dtype {dtype} on {dev}: "
                         f"{str(e).splitlines()[0][:200]}") from None


def _in_step(error: BaseException) -> BaseException:
    """Mark an error raised before anything was posted: it leaves the communicator usable
    (collectives/_shared.py's leaves_out_of_step)."""
    error.in_step = True
    return error


def _pending(nccl_t: Any) -> list[Op]:
    p = getattr(nccl_t, "p2p_pending", None)
    if p is None:
        p = nccl_t.p2p_pending = []
    return p


def _order(nccl_t: Any) -> Any:
    o = getattr(nccl_t, "p2p_order", None)
    if o is None:
        from transports._p2p_nccl import NcclOrder

        o = nccl_t.p2p_order = NcclOrder()
    return o
