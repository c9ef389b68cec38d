"""State a communicator shares with its ``using()`` views: transports, closed state, the one-call lock."""

from __future__ import annotations

import logging
import threading
import weakref
import time
from typing import Any, NoReturn

from transports.base import CollectiveTimeoutError, CommunicatorBrokenError, Rendezvous

log = logging.getLogger("collectives")

# Open communicators, closed at interpreter exit so that peers raise at once instead of timing out.
live: "weakref.WeakSet[Any]" = weakref.WeakSet()


# Errors every rank raises at the same point of a call (argument checks exchanged with the peers,
# signature mismatches, no transport for the device) or after which the transport is already broken.
# Anything else leaving a call (KeyboardInterrupt, SystemExit, an exception from a signal handler, a
# failed allocation) may have left this rank one call behind or ahead of its peers.
_IN_STEP: tuple[type[BaseException], ...] = (ValueError, TypeError, CollectiveTimeoutError, CommunicatorBrokenError)


def leaves_out_of_step(error: BaseException) -> bool:
    """Whether ``error``, leaving a call, may have left this rank out of step with its peers."""
    return not isinstance(error, _IN_STEP) and not getattr(error, "in_step", False)


class SharedState:
    """What a communicator shares with its :meth:`Communicator.using` views: they move data
    through the same transports, so one call at a time among all of them, and one closed state."""

    __slots__ = ("busy", "conflict", "closed", "members", "transports", "rdv")

    def __init__(self, transports: dict, rdv: Rendezvous):
        self.busy = threading.Lock()  # held by the thread inside a call
        self.conflict: str | None = None  # set by a thread that found ``busy`` held (see refuse)
        self.closed: str | None = None  # why the communicator is closed; None while it is open
        self.members: "weakref.WeakSet[Any]" = weakref.WeakSet()  # it and its views
        self.transports = transports
        self.rdv = rdv

    def interrupted(self, error: BaseException, rank: int, what: str) -> None:
        """``error`` left a call that may be half done on this rank (see :func:`leaves_out_of_step`):
        break the communicator so every later call raises, and abort the transports so the peers
        raise instead of pairing their calls one step apart with this rank's. The caller holds
        ``busy`` and re-raises ``error``."""
        if self.closed is None:
            self.shut(f"{type(error).__name__} interrupted {what} on rank {rank}", abort=True)

    def shut(self, why: str, *, abort: bool = False) -> None:
        """Close (``abort``: abort) the transports (peers waiting on this rank raise) and forget
        every cached call, so that no fast path reaches a closed transport. The caller holds ``busy``."""
        if self.closed is not None:
            return
        self.closed = why
        self.conflict = None
        for comm in list(self.members):
            comm._forget_calls()
            comm._barrier_entry = None
            live.discard(comm)
        for t in self.transports.values():
            try:
                t.abort(why) if abort else t.close()
            except Exception as e:  # noqa: BLE001
                log.debug("closing %s: %s", t.name, e)
        self.transports.clear()
        leave = getattr(self.rdv, "leave", None)  # a store rendezvous tells peers waiting in it why
        if leave is not None:
            leave(why)
        self.rdv.close()

    # ---- one call at a time (see the Communicator docstring) ---------------------------------
    def raise_closed(self) -> NoReturn:
        raise CommunicatorBrokenError(f"this communicator is closed ({self.closed}); create a new one")

    def refuse(self, rank: int, timeout: float, what: str) -> NoReturn:
        """Another thread is inside a call of this communicator: refuse, and break the communicator.

        The two threads' calls cannot be matched with the peers' reliably any more, so the thread
        inside raises too when its call ends (instead of returning possibly mixed data), and the
        communicator closes, which makes the peers raise instead of waiting for calls that will
        not come. Whoever holds the lock closes it: the thread inside, or this one once it ends.

        Args:
            rank: this rank's world rank, for the message.
            timeout: the communicator's timeout: how long to wait for the thread inside to end.
            what: the refused call's name.
        """
        if self.closed is not None:
            self.raise_closed()
        msg = (f"rank {rank}: {what} was called from thread "
               f"{threading.current_thread().name!r} while another thread was inside a call of this "
               "communicator (or of a using() view of it). A communicator serves one thread at a time: give "
               "each thread its own communicator (every rank calls comm.split(0) once per thread, in the same "
               "order) or hold a lock around every call and issue the calls in the same order on every rank. "
               "This communicator is now closed, so its peers raise too; create a new one")
        if self.conflict is None:
            self.conflict = msg
        deadline = time.monotonic() + timeout + 1.0
        while self.closed is None and time.monotonic() < deadline:
            if self.busy.acquire(timeout=0.05):
                try:
                    self.shut("it was used from two threads at once")
                finally:
                    self.busy.release()
        raise RuntimeError(msg)

    def end_after_conflict(self) -> NoReturn:
        """Called with ``busy`` held by the thread whose call overlapped another thread's attempt."""
        msg = self.conflict or "this communicator was used from two threads at once"
        try:
            self.shut("it was used from two threads at once")
        finally:
            self.busy.release()
        raise RuntimeError(msg)
