"""Point-to-point messages of the shm transport: one channel per ordered pair of ranks in the
transport's segment (the area after the slots, :func:`area_bytes`), written by both ends without
locks (each word has one writer).

Channel (sender s -> receiver d)::

    [sender block: sent, stage_ready][header ring: RING x HDR_LEN words]
    [receiver block: stage_req][ack ring: RING x HDR_LEN words]
    [inline data: RING x EAGER_BYTES][staging area: stage_bytes]

The sender writes a header (transports/_p2p.py's layout) into ring entry ``seq % RING`` and then
bumps ``sent``; the receiver reads every published header (they wait in the ring until a receive
matches them: that is the unexpected-message queue, so a receive posted late or out of tag order
costs no copy), matches them to its receives in posting order, and answers in the ack ring
(status, its own dtype and shape, an acknowledgement number for external data). The data:

- eager (up to EAGER_BYTES): in the entry's inline area; the send completes once published;
- single copy (process_vm_readv allowed by the transport's start-up probe): the header carries the
  sender's address and the receiver reads the tensor straight into its own, in one copy. The sender's
  state word (its control block's, which its close and abort set before they return) is read before
  and after the copy: a sender that closed, or whose call was interrupted, withdrew the message, and
  the receiver raises ``PeerFailedError`` instead of reading (or keeping) memory the sender may have
  reused or freed since. The address is read from the ring entry, not the receiver's copy of the
  header, before and after the copy too: a blocking send that timed out points it at a copy of the
  tensor before it returns (:meth:`ShmChannel.own_copy`), and a copy that raced that is read again;
- staged: the receiver asks for chunk k of message seq (``stage_req``), the sender copies it into
  half k % 2 of the staging area and says so (``stage_ready``); the receiver asks for chunk k + 1
  before it copies chunk k out, so both copies overlap. Both ends must be in a point-to-point call;
- external (CUDA over NCCL): the handshake only.

A ring entry is reused only after its message was acknowledged, so at most RING messages per
pair are outstanding; more wait on the sender's side, in order.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import sys
import time

import numpy as np

from . import _cma
from ._host import pid_alive
from ._p2p import (
    EAGER_BYTES,
    FLAG_CMA,
    FLAG_EAGER,
    FLAG_EXTERNAL,
    H_AUX,
    H_FLAGS,
    H_TAG,
    HDR_LEN,
    MISMATCH,
    OK,
    R_ACK,
    R_STATUS,
    Channel,
    Op,
    dead_local,
    naming_the_dead,
    same_spec,
)
from ._shm_sync import _STATE, _STATE_ABORTED, _STATE_CLOSED, _fence
from .base import CommunicatorBrokenError, PeerFailedError

RING = 16
_BELLS = 4096  # the area starts with one doorbell word per rank (int64, futex on the low 32 bits)
_BLOCK = 16  # words of a sender / receiver block (their own cache lines)
_WORDS = 2 * (_BLOCK + RING * HDR_LEN)
_SENT, _READY = 0, 1  # sender block
_REQ = 0  # receiver block


def stage_bytes(n: int) -> int:
    """Bytes of each channel's staging area (two halves; n * n channels, pages touched only when staged):
    512 KiB up to 4 ranks (halves of 256 KiB: a copy stays in the CI VM's 1 MiB L2), 256 KiB up to 8, 64 KiB above."""
    return (512 << 10) if n <= 4 else (256 << 10) if n <= 8 else (64 << 10)


def _channel_bytes(n: int) -> int:
    raw = _WORDS * 8 + RING * EAGER_BYTES + stage_bytes(n)
    return (raw + 4095) // 4096 * 4096


def area_bytes(n: int) -> int:
    """Bytes the point-to-point channels of ``n`` ranks take in the segment (pages are touched only when used)."""
    return _BELLS + n * n * _channel_bytes(n) if n > 1 else 0


def _futex():
    """libc's syscall() and SYS_futex for this machine, or None (then waits sleep with backoff)."""
    nr = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
    if nr is None or not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn, nr


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_FUTEX = _futex()
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class ShmChannel(Channel):
    """The point-to-point channel of a :class:`~transports.shm.SharedMemoryTransport` (module docstring).

    Args:
        transport: the shm transport (its mapping, pids, control blocks and probe result).
        offset: where the area of :func:`area_bytes` starts in the mapping.
        single_copy: whether process_vm_readv was allowed between every pair at start-up.
    """

    name = "shm"
    supports_any_source = True

    def __init__(self, transport, offset: int, single_copy: bool):
        n = transport.size
        super().__init__(transport.rank, n, list(transport._ranks))
        self.t = transport
        self.single_copy = single_copy
        self.chan = _channel_bytes(n)
        self.stage = stage_bytes(n)
        self.bell_addr = transport._ctrl.ctypes.data + offset
        self.bells = np.frombuffer(transport._map, dtype=np.int64, count=n, offset=offset)
        self._rings = 0  # this rank's doorbell writes: each writes a value no earlier write wrote
        offset += _BELLS
        self.base = transport._ctrl.ctypes.data + offset
        self.words = [np.frombuffer(transport._map, dtype=np.int64, count=_WORDS, offset=offset + c * self.chan)
                      for c in range(n * n)]
        self.pids = list(transport._pids)
        self._send_seq = [0] * n
        self._inflight: list[dict[int, Op]] = [{} for _ in range(n)]  # dst -> {ring entry: op awaiting its ack}
        self._by_seq: list[dict[int, Op]] = [{} for _ in range(n)]  # dst -> {seq: staged send}
        self._seen = [0] * n  # src -> headers read
        self._unexpected: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        self._staging: list[Op | None] = [None] * n  # src -> the receive being staged

    # ---- layout ------------------------------------------------------------------------------
    def _w(self, s: int, d: int) -> np.ndarray:
        return self.words[s * self.size + d]

    def _hdr(self, w: np.ndarray, i: int) -> np.ndarray:
        o = _BLOCK + i * HDR_LEN
        return w[o:o + HDR_LEN]

    def _ack(self, w: np.ndarray, i: int) -> np.ndarray:
        o = 2 * _BLOCK + RING * HDR_LEN + i * HDR_LEN
        return w[o:o + HDR_LEN]

    def _recv_block(self, w: np.ndarray) -> int:
        return _BLOCK + RING * HDR_LEN  # index of the receiver block's first word

    def _inline_addr(self, s: int, d: int, i: int) -> int:
        return self.base + (s * self.size + d) * self.chan + _WORDS * 8 + i * EAGER_BYTES

    def _stage_addr(self, s: int, d: int) -> int:
        return self.base + (s * self.size + d) * self.chan + _WORDS * 8 + RING * EAGER_BYTES

    # ---- doorbells: a rank that waits sleeps on its word (futex); every write for it rings it ----
    def _ring(self, r: int) -> None:
        self._rings += 1
        self.bells[r] = (self._rings * self.size + self.rank) & 0x7FFFFFFF
        if _FUTEX is not None:
            fn, nr = _FUTEX
            fn(nr, ctypes.c_void_p(self.bell_addr + 8 * r), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)

    def token(self) -> int:
        """The value of this rank's doorbell now (read before a progress pass, for :meth:`sleep`)."""
        return int(self.bells[self.rank]) & 0xFFFFFFFF

    def sleep(self, token: int, seconds: float) -> None:
        """Sleep until a peer rings this rank's doorbell after ``token`` was read, or ``seconds`` pass."""
        if _FUTEX is None:
            time.sleep(min(seconds, 1e-3))
            return
        fn, nr = _FUTEX
        ts = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
        fn(nr, ctypes.c_void_p(self.bell_addr + 8 * self.rank), _FUTEX_WAIT, ctypes.c_uint32(token),
           ctypes.byref(ts), None, 0)

    # ---- posting -----------------------------------------------------------------------------
    def post(self, op: Op) -> None:
        op.channel = self
        op.state = 0
        self.ops.append(op)
        if op.kind == "send":
            self._publish(op.peer)

    def _publish(self, d: int) -> bool:
        """Publish the waiting sends to ``d`` in order while ring entries are free."""
        moved = False
        for op in self.ops:
            if op.kind != "send" or op.peer != d or op.state != 0:
                continue
            seq = self._send_seq[d]
            i = seq % RING
            if i in self._inflight[d]:
                break
            w = self._w(self.rank, d)
            h = op.spec.copy()
            flags = (FLAG_EAGER if op.eager else 0) | (FLAG_EXTERNAL if op.external else 0)
            if op.eager:
                ctypes.memmove(self._inline_addr(self.rank, d, i), op.buf.data_ptr(), op.nbytes)
            elif not op.external and self.single_copy:
                flags |= FLAG_CMA
                h[H_AUX] = op.buf.data_ptr()
            else:
                self._by_seq[d][seq] = op
            h[H_FLAGS] = flags
            hw = self._hdr(w, i)
            hw[1:] = h[1:]
            hw[0] = seq + 1
            _fence()
            w[_SENT] = seq + 1
            self._ring(d)
            op.seq = seq
            op.state = 1
            self._send_seq[d] = seq + 1
            self._inflight[d][i] = op
            if op.eager:
                op.complete()
            moved = True
        return moved

    # ---- progress ----------------------------------------------------------------------------
    def poll(self) -> bool:
        if self.t._map is None:
            raise CommunicatorBrokenError("the shm transport of this communicator is closed")
        moved = False
        for d in range(self.size):
            if d == self.rank:
                continue
            if self._inflight[d]:
                moved |= self._poll_acks(d)
                if self._by_seq[d]:
                    moved |= self._serve_stage(d)
            moved |= self._publish(d)
        moved |= self._read_headers()
        for op in list(self.ops):
            if op.kind == "recv":
                if op.state == 0:
                    moved |= self._match(op)
                elif op.state == 2:
                    moved |= self._poll_stage(op)
        return moved

    def _poll_acks(self, d: int) -> bool:
        w = self._w(self.rank, d)
        moved = False
        for i, op in list(self._inflight[d].items()):
            a = self._ack(w, i)
            if int(a[0]) != op.seq + 1:
                continue
            a = a.copy()
            del self._inflight[d][i]
            self._by_seq[d].pop(op.seq, None)
            self.ops.remove(op)
            moved = True
            if self.take_reply(op, a, d):
                if not op.external:
                    op.complete()
            elif not op.eager:
                op.complete()
        return moved

    def _serve_stage(self, d: int) -> bool:
        w = self._w(self.rank, d)
        rb = self._recv_block(w)
        req = int(w[rb + _REQ])
        if req == 0 or req == int(w[_READY]):
            return False
        seq, chunk = req >> 32, (req & 0xFFFFFFFF) - 1
        op = self._by_seq[d].get(seq)
        if op is None:
            return False
        half = self.stage // 2
        lo = chunk * half
        n = min(half, op.nbytes - lo)
        ctypes.memmove(self._stage_addr(self.rank, d) + (chunk & 1) * half, op.buf.data_ptr() + lo, n)
        _fence()
        w[_READY] = req
        self._ring(d)
        return True

    def _read_headers(self) -> bool:
        moved = False
        for s in range(self.size):
            if s == self.rank:
                continue
            w = self._w(s, self.rank)
            sent = int(w[_SENT])
            while self._seen[s] < sent:
                seq = self._seen[s]
                h = self._hdr(w, seq % RING).copy()
                self._unexpected[s].append((seq, h))
                self._seen[s] = seq + 1
                moved = True
        return moved

    def _match(self, op: Op) -> bool:
        srcs = [op.peer] if op.peer is not None else [s for s in range(self.size) if s != self.rank]
        for s in srcs:
            q = self._unexpected[s]
            for k, (seq, h) in enumerate(q):
                if int(h[H_TAG]) == op.tag:
                    del q[k]
                    op.seq, op.source, op.other = seq, s, h
                    self._matched(op, s, seq, h)
                    return True
        return False

    def _matched(self, op: Op, s: int, seq: int, h: np.ndarray) -> None:
        flags = int(h[H_FLAGS])
        ok = same_spec(h, op.spec) and bool(flags & FLAG_EXTERNAL) == op.external
        if not ok:
            self._answer(s, seq, MISMATCH, op)
            op.error = self.mismatch(op, h, op.spec, s, self.rank)
            self.ops.remove(op)
            op.complete()
            return
        if op.external:
            op.ack_no = self._next_ack(s)
            self._answer(s, seq, OK, op, op.ack_no)
            self.ops.remove(op)
            op.handshaken = True
            return
        n = op.nbytes
        if flags & FLAG_EAGER:
            ctypes.memmove(op.buf.data_ptr(), self._inline_addr(s, self.rank, seq % RING), n)
        elif flags & FLAG_CMA:
            try:
                self._read(s, self._hdr(self._w(s, self.rank), seq % RING), op.buf.data_ptr(), n, op.tag)
            except PeerFailedError as e:  # this receive's own error (its wait raises it); nothing to answer
                self.ops.remove(op)
                op.error = e
                op.complete()
                return
        else:
            op.state = 2
            op.chunk = -1
            self._start_stage(s)
            return
        self._answer(s, seq, OK, op)
        self.ops.remove(op)
        op.complete()

    def _answer(self, s: int, seq: int, status: int, op: Op, ack_no: int = 0) -> None:
        a = self._ack(self._w(s, self.rank), seq % RING)
        v = op.spec.copy()
        v[R_STATUS] = status
        v[R_ACK] = ack_no
        v[H_AUX] = int(op.external)
        a[1:] = v[1:]
        _fence()
        a[0] = seq + 1
        self._ring(s)

    def _read(self, s: int, entry: np.ndarray, local: int, n: int, tag: int) -> None:
        """Read rank ``s``'s message (``n`` bytes at the address in its ring ``entry``) into ``local``,
        unless ``s`` withdrew it."""
        err = self._withdrawn(s, tag)
        if err is not None:
            raise err
        remote = int(entry[H_AUX])
        try:
            _cma.read(self.pids[s], remote, local, n)
            _fence()
            moved = int(entry[H_AUX])
            if moved != remote:  # its send timed out meanwhile and points at its copy now (which nobody rewrites)
                _cma.read(self.pids[s], moved, local, n)
        except OSError as e:
            err = self._withdrawn(s, tag)  # EFAULT: freed after the sender closed
            if err is not None:
                raise err from e
            if e.errno == errno.ESRCH:
                raise PeerFailedError(f"rank {self.ranks[s]} (pid {self.pids[s]}) exited while rank "
                                      f"{self.ranks[self.rank]} received its message", [self.ranks[s]]) from e
            raise CommunicatorBrokenError(f"shm point-to-point: rank {self.ranks[self.rank]} could not read rank "
                                          f"{self.ranks[s]}'s memory ({e}); set MOECOMM_SHM_SINGLE_COPY=off") from e
        _fence()
        # still sending after the copy, so it was during the copy: the sender marks the state before it returns
        err = self._withdrawn(s, tag)
        if err is not None:
            raise err

    def _withdrawn(self, s: int, tag: int) -> PeerFailedError | None:
        """The error of a message whose sender ``s`` closed its communicator or aborted (an interrupted
        call), which withdraws its unfinished sends; None while it runs."""
        t = self.t
        state = int(t._q[t._bases[s] + _STATE])
        if state not in (_STATE_ABORTED, _STATE_CLOSED):
            return None
        how = "closed its communicator" if state == _STATE_CLOSED else "aborted (its call failed or was interrupted)"
        who = self.ranks[s]
        return PeerFailedError(f"rank {who} {how} before rank {self.ranks[self.rank]} received its message "
                               f"(tag {tag}), which withdrew it: a receiver never reads a sender's tensor after the "
                               "send ended", [who])

    def dead_peers(self) -> list[tuple[int, int]]:
        return dead_local({r: pid for r, pid in enumerate(self.pids) if r != self.rank})

    def own_copy(self, op: Op) -> None:
        """See :meth:`Channel.own_copy`; a published single-copy send points its ring entry at the copy
        (the entry stays this message's until the receiver answers, and the op keeps the copy until then)."""
        super().own_copy(op)
        if op.state != 1 or op.kind != "send" or op.done or op.eager or op.external:
            return
        hw = self._hdr(self._w(self.rank, op.peer), op.seq % RING)
        if int(hw[0]) == op.seq + 1 and int(hw[H_FLAGS]) & FLAG_CMA:
            hw[H_AUX] = op.buf.data_ptr()
            _fence()

    # ---- staged data -------------------------------------------------------------------------
    def _start_stage(self, s: int) -> None:
        if self._staging[s] is not None:
            return
        for op in self.ops:
            if op.kind == "recv" and op.state == 2 and op.source == s and op.chunk < 0:
                self._staging[s] = op
                self._request(op, s, 0)
                return

    def _request(self, op: Op, s: int, chunk: int) -> None:
        op.chunk = chunk
        w = self._w(s, self.rank)
        w[self._recv_block(w) + _REQ] = (op.seq << 32) | (chunk + 1)
        self._ring(s)

    def _poll_stage(self, op: Op) -> bool:
        s = op.source
        if self._staging[s] is not op:
            return False
        w = self._w(s, self.rank)
        req = (op.seq << 32) | (op.chunk + 1)
        if int(w[_READY]) != req:
            return False
        chunk = op.chunk
        half = self.stage // 2
        lo = chunk * half
        n = min(half, op.nbytes - lo)
        more = lo + n < op.nbytes
        if more:  # the sender fills the other half while we copy this one out
            self._request(op, s, chunk + 1)
        ctypes.memmove(op.buf.data_ptr() + lo, self._stage_addr(s, self.rank) + (chunk & 1) * half, n)
        if more:
            return True
        self._answer(s, op.seq, OK, op)
        self._staging[s] = None
        self.ops.remove(op)
        op.complete()
        self._start_stage(s)
        return True

    # ---- failures ----------------------------------------------------------------------------
    def peer_failure(self, peer: int) -> BaseException | None:
        t = self.t
        if t._map is None:
            return CommunicatorBrokenError("the shm transport of this communicator is closed")
        state = int(t._q[t._bases[peer] + _STATE])
        me, who = self.ranks[self.rank], self.ranks[peer]
        if state in (_STATE_ABORTED, _STATE_CLOSED):
            how = "closed its communicator" if state == _STATE_CLOSED else "aborted after a failure"
            return naming_the_dead(PeerFailedError(f"rank {who} {how} while rank {me} waited for it in a "
                                                   "point-to-point call", [who]), self, peer)
        if not pid_alive(self.pids[peer]):
            return PeerFailedError(f"rank {who} (pid {self.pids[peer]}) died while rank {me} waited for it in a "
                                   "point-to-point call", [who])
        return None

    def close(self) -> None:
        super().close()
        self.words = []
        self.bells = None


def attach(transport, offset: int) -> None:
    """Give the shm transport its point-to-point channel (``transport.p2p``), after its single-copy probe."""
    if transport.size > 1:
        transport.p2p = ShmChannel(transport, offset, bool(getattr(transport, "cma_readable", False)))
    else:
        transport.p2p = None


