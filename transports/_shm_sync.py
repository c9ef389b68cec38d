"""The shm transport's synchronisation: rounds, arrivals, bounded waits, and failure detection.

A mixin of :class:`transports.shm.SharedMemoryTransport` (it uses the transport's control blocks,
compiled helper and settings); split out because it is one responsibility: every rank publishes its
epoch (with the call's signature, counts and addresses beside it), waits for its peers' (spin, yield,
then sleep, bounded by the communicator's timeout), and turns a peer that aborted, closed or died
into an error naming it. See the module docstring of transports/shm.py for the layout and the rounds.
"""

from __future__ import annotations

import array
import os
import platform
import threading
import time

import numpy as np

from ._host import pid_alive
from ._shm_latency import ARRIVED, PENDING
from .base import META_LEN, CollectiveTimeoutError, CommunicatorBrokenError, PeerFailedError, Signature, check_agreement

# Control block layout (int64 words).
_EPOCH, _STATE = 0, 1
_SIG0 = 2  # two parities of the signature digest
_META0 = 4  # two parities of META_LEN words, then two parities of `size` all-to-all send counts, then of
# `size` declared receive counts
_STATE_ABORTED, _STATE_CLOSED = 1, 2  # 0: running
# Longest futex sleep of a wait: a peer's arrival wakes it at once; the bound keeps the timeout and
# dead-peer checks of _wait running (they look every 50 ms).
_FUTEX_SLEEP_US = 10_000

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
_fence_lock = threading.Lock()


def _fence() -> None:
    """Order our data stores before the epoch store that publishes them.

    x86-64 is TSO (stores and loads are not reordered with each other), so plain stores in
    program order suffice there. Elsewhere a lock round trip issues the acquire/release
    barriers that the architecture needs.
    """
    if not _X86:
        with _fence_lock:
            pass


class RoundSync:
    """Rounds and waits of the shm transport (see the module docstring)."""

    def _begin_round(self) -> int:
        """Slot index for the next round (see module docstring for why alternation is safe)."""
        if self._broken:
            self._raise_broken()
        b = self._use & 1
        self._use += 1
        return b

    def _compiled_round(self) -> tuple[int, int]:
        """(slot, epoch) of a round whose synchronisation the compiled helper does in its fused call."""
        if self._broken:
            self._raise_broken()
        b = self._use & 1
        self._use += 1
        self._epoch += 1
        return b, self._epoch

    def _raise_broken(self):
        if self._map is None:
            raise CommunicatorBrokenError("the shm transport of this communicator is closed; create a new communicator")
        raise CommunicatorBrokenError(
            f"shm communicator is unusable after an earlier failure ({self._broken}); create a new one")

    def _sync(self, sig: Signature | None = None, counts: list[int] | None = None, check: bool = True,
              recv: list[int] | None = None, addrs: tuple[int, int] | None = None, spin_ns: int = 0,
              choice: int | None = None) -> None:
        """Publish our arrival (with the call signature on a call's first sync) and wait for every peer.

        ``counts``/``recv``: all_to_all's send counts and declared receive counts, published with it.
        ``addrs``: (input address, output address) of this rank's tensors, for the single-copy path.
        ``spin_ns``: how long a wait may busy-poll before it sleeps (``_large_spin_ns`` after large copies).
        ``choice``: the path of a timed call (rank 0's counts, :meth:`_published_path` reads it).

        With ``sig``, afterwards compares the peers' signature digests with ours (one word each) and
        raises the detailed ``ValueError`` of :func:`check_agreement` on any difference.
        """
        e = self._epoch + 1
        self._epoch = e
        q = self._q
        mine = self._my_base
        par = e & 1
        if counts is not None:
            c0 = mine + self._counts0 + par * self.size
            q[c0 : c0 + self.size] = array.array("q", counts)
        if recv is not None:
            r0 = mine + self._recv0 + par * self.size
            q[r0 : r0 + self.size] = array.array("q", recv)
        if addrs is not None:
            a0 = mine + self._addr0 + 2 * par
            q[a0] = addrs[0]
            q[a0 + 1] = addrs[1]
        if choice is not None:
            q[mine + self._choice0 + par] = choice
        g = self._g
        if g is not None:  # the compiled helper publishes (release store) and spins; waits longer in Python
            code = g.arrive(e, sig.value if sig is not None else -1, sig.addr if sig is not None else 0)
            if code != ARRIVED:
                self._finish_arrival(e, sig if check else None, code, spin_ns)
            return
        if sig is not None:
            m0 = mine + _META0 + par * META_LEN
            q[m0 : m0 + META_LEN] = sig.words
            q[mine + _SIG0 + par] = sig.value
        _fence()
        q[mine] = e
        for base in self._peer_bases:
            if q[base] < e:
                self._wait(e)
                break
        _fence()
        if sig is not None and check:
            so = _SIG0 + par
            v = sig.value
            for base in self._peer_bases:
                if q[base + so] != v:
                    check_agreement(self._metas(), self._ranks)

    def _finish_arrival(self, e: int, sig: Signature | None, code: int, spin_ns: int = 0) -> None:
        """After the compiled helper's ``arrive`` returned PENDING or MISMATCH for epoch ``e``: wait
        (bounded, noticing dead peers) and compare the signatures, raising as the Python path does.

        ``sig``: the call's signature when it must be checked, else None.
        """
        if code == PENDING:
            self._wait(e, spin_ns)
            _fence()
            if sig is None or self._g.sigs_match(e, sig.value):
                return
        elif sig is None:  # MISMATCH, but this synchronisation compares nothing (exchange_meta)
            return
        check_agreement(self._metas(), self._ranks)

    def _publish(self) -> int:
        """Publish this rank's arrival at the next epoch and return at once (the first half of a
        split barrier: :meth:`_await` it after work that needs no peer); returns that epoch."""
        if self._broken:
            self._raise_broken()
        e = self._epoch + 1
        self._epoch = e
        if self._g is not None:
            self._g.publish(e)  # also wakes a peer asleep on our epoch
        else:
            _fence()
            self._q[self._my_base] = e
        return e

    def _await(self, e: int, spin_ns: int = 0) -> None:
        """Wait for every peer to publish epoch ``e`` (the second half of :meth:`_publish`)."""
        q = self._q
        for base in self._peer_bases:
            if q[base] < e:
                self._wait(e, spin_ns)
                break
        _fence()

    def _wait(self, e: int, spin_ns: int = 0) -> None:
        """Wait until every peer reached epoch ``e``: spin, yield, then sleep, bounded by the timeout and
        raising when a peer failed. ``spin_ns``: busy-poll up to this long first (compiled helper only)."""
        q = self._q
        bases = self._bases
        pending = [r for r in self._peers if q[bases[r]] < e]
        i = 0
        spin_end = self._spin_iters
        yield_end = spin_end + self._yield_iters
        sleeper = self._sleeper
        if sleeper is not None:
            if pending and spin_ns and self._g.spin(e, spin_ns):
                return
            i = yield_end  # the compiled helper spun and yielded already: sleep on its futex at once
        deadline = None
        next_check = 0.0
        sleep = 20e-6
        while pending:
            if i < spin_end:
                i += 1
            elif i < yield_end:
                i += 1
                os.sched_yield()
            else:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout
                if now >= next_check:
                    pending = self._check_peers(pending, e)
                    next_check = now + 0.05
                    if not pending:
                        break
                if now >= deadline:
                    pending = [r for r in pending if q[bases[r]] < e]  # a late arrival is not missing
                    if not pending:
                        break
                    missing = [self._ranks[r] for r in pending]
                    self._abort(f"timed out after {self.timeout:.1f}s waiting for rank(s) {missing}")
                    raise CollectiveTimeoutError(
                        f"shm collective timed out on rank {self._ranks[self.rank]} after the timeout of "
                        f"{self.timeout:.1f}s: "
                        f"rank(s) {missing} never arrived (stuck, deadlocked, or calling a different collective)",
                        missing,
                    )
                if sleeper is not None:  # woken when the peer publishes; bounded for the checks above
                    sleeper(e, _FUTEX_SLEEP_US)
                else:
                    time.sleep(sleep)
                    sleep = min(sleep * 2, 1e-3)
            pending = [r for r in pending if q[bases[r]] < e]

    def _check_peers(self, pending: list[int], e: int) -> list[int]:
        """Raise PeerFailedError if a rank of ``pending`` closed, aborted or died without arriving at
        epoch ``e``; returns the ranks still pending.

        ``pending`` may be stale: a peer can arrive, finish the collective and close or exit after it
        was computed. A peer publishes its epoch before it closes (and a dead process wrote all it
        ever will), so its epoch is read again after its state: a peer that arrived is no failure.
        """
        q = self._q
        still = []
        for r in pending:
            base = self._bases[r]
            state = q[base + _STATE]
            gone = state == _STATE_ABORTED or state == _STATE_CLOSED
            dead = not gone and r < len(self._pids) and not pid_alive(self._pids[r])
            _fence()
            if q[base] >= e:  # read after the state: it arrived, perhaps then closed or exited
                continue
            if gone:
                why = "aborted after a failure" if state == _STATE_ABORTED else "closed its communicator"
                self._abort(f"rank {self._ranks[r]} {why}")
                raise PeerFailedError(
                    f"rank {self._ranks[r]} {why} while rank {self._ranks[self.rank]} waited for it", [self._ranks[r]])
            if dead:
                self._abort(f"rank {self._ranks[r]} (pid {self._pids[r]}) died")
                raise PeerFailedError(
                    f"rank {self._ranks[r]} (pid {self._pids[r]}) died while rank {self._ranks[self.rank]} "
                    "waited for it in a collective", [self._ranks[r]])
            still.append(r)
        return still

    def _abort(self, why: str) -> None:
        self._broken = why
        self._q[self._my_base + _STATE] = _STATE_ABORTED

    def _metas(self) -> np.ndarray:
        base = _META0 + (self._epoch & 1) * META_LEN
        return self._ctrl[:, base : base + META_LEN].copy()
