"""Point-to-point over the gloo transport (:class:`GlooChannel`): :class:`transports._p2p.MessageChannel`'s
protocol on ``ProcessGroupGloo.send``/``recv``, whose works complete only through a ``wait()``
(threads of :class:`_Waiters` make them).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from typing import Any

import torch

from ._p2p import _CANCEL_GRACE, HDR_LEN, MessageChannel, dead_local, local_pid_failure, naming_the_dead
from .base import PeerFailedError

log = logging.getLogger("transports._p2p")

_CANCEL_WAIT = datetime.timedelta(milliseconds=1)  # GlooChannel.close: the wait that expires


class _Waiting:
    __slots__ = ("done", "error", "work")

    def __init__(self, work: Any):
        self.work, self.done, self.error = work, False, None


class _Waiters:
    """Threads that block in gloo works' ``wait()`` (which releases the GIL): torch's gloo send/recv works
    report ``is_completed()`` only after a ``wait()``, and a ``wait(timeout)`` that times out fails the work.
    Each submitted work gets a thread, an idle one when there is one (threads are kept)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self.done = 0  # works completed: a waiter sleeps until it changes (:meth:`GlooChannel.sleep`)
        self.changed = threading.Condition()

    def submit(self, work: Any) -> _Waiting:
        w = _Waiting(work)
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if spawn:
            threading.Thread(target=self._loop, name="moecomm-gloo-p2p", daemon=True).start()
        self._q.put(w)
        return w

    def _loop(self) -> None:
        while True:
            w = self._q.get()
            try:
                w.work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the polling thread
                w.error = e
            w.work = None
            w.done = True
            with self._lock:
                self._idle += 1
            with self.changed:
                self.done += 1
                self.changed.notify_all()


_WAITERS = _Waiters()


class GlooChannel(MessageChannel):
    """Point-to-point over the gloo transport's ProcessGroupGloo (``send``/``recv`` of tensors)."""

    name = "gloo"
    _BASE = 1 << 24  # gloo's collectives use slots with a prefix byte; ours stay clear of any small tag

    def __init__(self, transport: Any):
        super().__init__(transport.rank, transport.size, list(transport._ranks))
        self.t = transport

    def _tag(self, kind, tag):
        return self._BASE + 4 * tag + kind

    def _isend(self, peer, kind, tag, buf):
        try:
            return _WAITERS.submit(self.t.pg.send([buf], peer, self._tag(kind, tag)))
        except RuntimeError as e:  # gloo refuses to post on a pair whose peer has gone
            raise self._failed(peer, e) from e

    def _irecv(self, peer, kind, tag, buf):
        try:
            return _WAITERS.submit(self.t.pg.recv([buf], peer, self._tag(kind, tag)))
        except RuntimeError as e:
            raise self._failed(peer, e) from e

    def _failed(self, peer: int, e: BaseException) -> BaseException:
        """The error to raise for gloo's ``e`` on the pair with ``peer``: the peer's own news if it closed or
        died (gloo says only "connection closed" or "reset"), else a PeerFailedError quoting gloo."""
        told = self.peer_failure(peer)
        if told is not None:
            return told
        text = str(e).splitlines()[0].split(" This is typically")[0]
        return PeerFailedError(f"gloo point-to-point with rank {self.ranks[peer]} failed on rank "
                               f"{self.ranks[self.rank]}: {text}", [self.ranks[peer]])

    def _test(self, req, peer):
        if not req.done:
            return False
        if req.error is not None:
            raise self._failed(peer, req.error) from req.error
        return True

    def token(self) -> int:
        """Works completed so far (read before a progress pass, for :meth:`sleep`)."""
        return _WAITERS.done

    def sleep(self, token: int, seconds: float) -> None:
        """Sleep until a gloo work completes after ``token`` was read, or ``seconds`` pass."""
        with _WAITERS.changed:
            if _WAITERS.done == token:
                _WAITERS.changed.wait(seconds)

    def _words(self):
        return torch.zeros(HDR_LEN, dtype=torch.int64)

    def _bytes(self, t):
        return t.reshape(-1).view(torch.uint8)

    def _as_np(self, buf):
        return buf.numpy()

    def peer_failure(self, peer: int) -> BaseException | None:
        t = self.t
        if t.pg is None:
            return PeerFailedError(f"the gloo transport is closed ({t._broken})", [self.ranks[peer]])
        t._poll_notices()
        note = t._notes.get(peer)
        what = f"rank {self.ranks[self.rank]} waited for it in a point-to-point call"
        if note is not None:
            how = "closed its communicator" if note["kind"] == "closed" else "aborted after a failure"
            return naming_the_dead(PeerFailedError(f"rank {self.ranks[peer]} {how} while {what}", [self.ranks[peer]]),
                                   self, peer)
        return local_pid_failure(what, peer, self.ranks, t._local_pids)

    def dead_peers(self) -> list[tuple[int, int]]:
        return dead_local(self.t._local_pids)

    def close(self) -> None:
        """Before the transport drops its process group: fail the gloo works of unfinished operations.

        A gloo send/recv cannot be cancelled one by one, and a waiter thread would stay blocked in one for
        gloo's own timeout, keeping the process group (its sockets) alive and aborting the process at exit
        ("terminate called without an active exception"). A wait with a timeout that expires closes every
        pair of the group's gloo context, which fails every pending work at once; then their waiters end.
        The peers' works with this rank fail too, as a close should make them.
        """
        pending = [w for op in self.ops for w in op.reqs if isinstance(w, _Waiting) and not w.done]
        super().close()
        for w in pending:
            work = w.work  # None once its waiter is done
            if work is None or w.done:
                continue
            try:
                work.wait(_CANCEL_WAIT)
            except Exception as e:  # noqa: BLE001 - the expected outcome: gloo's timeout error
                log.debug("gloo point-to-point close: %s", str(e).splitlines()[0] if str(e) else e)
                break  # one expiry closes every pair
        end = time.monotonic() + _CANCEL_GRACE
        while any(not w.done for w in pending) and time.monotonic() < end:
            with _WAITERS.changed:
                _WAITERS.changed.wait(0.01)
        if any(not w.done for w in pending):
            log.warning("gloo point-to-point close: %d work(s) still pending after %.1fs",
                        sum(not w.done for w in pending), _CANCEL_GRACE)
