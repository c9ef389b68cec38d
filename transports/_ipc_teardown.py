"""The ipc transport's close and abort (:class:`IPCTeardown`, mixed into
``transports.ipc.IPCTransport``): announce it, abort our kernels, wait for them with a bound, and
only then unmap, leaking what a kernel may still touch rather than unmapping it under it.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from .kernels import layout as L

log = logging.getLogger("transports.ipc")


class IPCTeardown:
    """close() and abort() of :class:`transports.ipc.IPCTransport`."""

    # ---- teardown ------------------------------------------------------------------------------
    def abort(self, why: str) -> None:
        """Mark our STATE aborted (peers waiting for us raise at once), then :meth:`close`."""
        if not self._broken:
            self._broken = why
            try:
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)  # peers' watchdogs raise
            except Exception:  # noqa: BLE001 - closing anyway
                log.debug("ipc: could not mark the abort", exc_info=True)
        self.close()

    # close(): after our ABORT, how long to wait for our kernels to end before unmapping. Aborted waits
    # end at their next turn (microseconds); only kernels queued behind other long work need more.
    _DRAIN_SECONDS = 5.0
    # close() of a healthy transport first lets calls in flight finish this long (peers that are there
    # finish them in microseconds), as ncclCommDestroy completes its operations; abort() does not
    _GRACE_SECONDS = 0.5
    # what close() could not unmap safely (a kernel may still touch it), kept while the process lives
    _leaked: list = []

    def close(self) -> None:
        """Close. Calls still in flight get :attr:`_GRACE_SECONDS` to finish (not after abort());
        then they are abandoned, as ncclCommAbort abandons them (synchronize() first to be sure to
        keep their results). Later calls raise CommunicatorBrokenError.

        In this order, after the grace: announce it in our STATE word (peers waiting for us raise at once), set our
        ABORT word (our kernels' waits give up at their next turn, queued kernels skip their work),
        wait a bounded time for our kernels to end (:meth:`_drain`), stop the watchdog, unmap every
        region. Unmapped first, a kernel still queued would touch unmapped memory: on a GPU a sticky
        error that ends the process's CUDA context (and the free's implicit synchronization would
        wait for kernels spinning on peers that left). Kernels that have not ended by the bound keep
        their memory: it is leaked for the process's life, with a warning, rather than unmapped.
        """
        if self._broken == "closed":
            return
        try:
            probe: Callable[[], bool] | None = self._regions.stream_probe()
        except Exception:  # noqa: BLE001 - e.g. a failed CUDA context: the host's count alone then
            log.debug("ipc: no stream probe at close", exc_info=True)
            probe = None
        try:
            in_flight = self._in_flight(probe)
        except Exception:  # noqa: BLE001 - an earlier asynchronous error: assume the worst
            in_flight = True
        if in_flight and not self._broken:
            in_flight = not self._drain(probe, self._GRACE_SECONDS)
        try:
            if not self._broken:
                # a close that abandons kernels is an abort to the peers: aborted kernels still advance
                # their epochs, which a peer's watchdog would take for a closed rank's finished call
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED if in_flight else L.STATE_CLOSED)
            self._regions.write(self.rank, L.ABORT, 1)
        except Exception:  # noqa: BLE001 - closing anyway
            log.debug("ipc: could not mark the close", exc_info=True)
        self._broken = "closed"
        drained = self._drain(probe)
        self._stop.set()
        self._watchdog.join(timeout=1.0)
        regions = [*getattr(self, "_more_regions", []), self._regions]
        self._more_regions = []
        if drained:
            for r in regions:
                r.close()
        else:
            # what a late kernel may still use: the mappings, the pinned status block and the pointer
            # tables (the providers), and the cached argument tensors
            IPCTeardown._leaked.append((regions, self._lam_ptrs, list(self._meta_cache.values()),
                                         list(self._heap_tables.values())))
            log.warning("ipc rank %d: kernels were still running %.1fs after close() aborted them; their "
                        "memory stays mapped (leaked) until this process exits", self._ranks[self.rank],
                        self._DRAIN_SECONDS)
        self._meta_cache.clear()

    def _in_flight(self, probe: Callable[[], bool] | None) -> bool:
        """Whether a kernel of ours may still run (see :meth:`_drain`): the host's count ahead of DONE
        (a launch that raised, an interrupted one included, is uncounted where it raised), or the
        stream probe not done."""
        return self._busy() or (probe is not None and not probe())

    def _drain(self, probe: Callable[[], bool] | None, seconds: float | None = None) -> bool:
        """Wait up to ``seconds`` (after our ABORT: :attr:`_DRAIN_SECONDS`) for our kernels to end;
        whether they did.

        It sees the kernels launched eagerly, on any stream (the host's count against the status
        block's DONE: host-mapped, no stream synchronization), and, through ``probe`` (on a GPU an
        event recorded at close), all work queued on the current stream before close began, CUDA-graph
        replays included. It cannot see graph replays on other streams; unrelated long work queued on
        the current stream delays it, and past the bound makes close() leak the regions.
        """
        deadline = time.monotonic() + (self._DRAIN_SECONDS if seconds is None else seconds)
        pause = 1e-4
        while True:
            try:
                if not self._in_flight(probe):
                    return True
            except Exception:  # noqa: BLE001 - the event reports an earlier asynchronous error
                log.warning("ipc: could not tell whether kernels still run at close()", exc_info=True)
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)
