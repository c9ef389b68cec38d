"""The ipc transport's failure detection and error paths (:class:`IPCFailures`, mixed into
``transports.ipc.IPCTransport``; the module docstring there has the model).

The watchdog thread aborts our kernels when a peer dies, closes or aborts, or DONE stalls for the
timeout; the host reads the status block (ERROR, MISMATCH, INPUT, PAIRING, DONE) with plain loads
and raises what the kernels left; a rank that rejects its own input meets its peers' call where
that call meets (:meth:`IPCFailures.reject_call`). The low-latency MoE exchange's messages
(:func:`input_error`, :func:`pairing_error`) live here because both it and the fatal path raise them.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from ._host import pid_alive
from .base import (
    F_OPCODE,
    F_REDOP,
    META_LEN,
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    OpCode,
    PeerFailedError,
    ReduceOp,
    Signature,
    check_agreement,
    error_meta,
    rendezvous_metas,
)
from .kernels import layout as L

log = logging.getLogger("transports.ipc")

_WATCH_PERIOD = 0.02  # seconds between the watchdog's looks at the peers during a call


def input_error(word: int, ranks: list[int], me: int, max_tokens: int | None = None, op: str = "dispatch") -> str:
    """The message of a status block's INPUT word (``err * MAX_RANKS + source``; see
    :mod:`transports.kernels.layout`) of a low-latency ``op``, as rank ``me`` reports it."""
    src, err = ranks[word % L.MAX_RANKS], word // L.MAX_RANKS
    code, detail = err & 255, err >> 8
    limit = "" if max_tokens is None else f" {max_tokens}"
    what = {L.INPUT_TOO_MANY_TOKENS: f"{detail} tokens, more than max_tokens_per_rank{limit}",
            L.INPUT_BAD_ID: f"expert id {detail}, outside [-1, num_experts)",
            L.INPUT_DUPLICATE_ID: f"expert {detail} twice in one token's top-k",
            L.INPUT_STALE_HANDLE: "topk_idx that differ from those its handle's dispatch sent (a stale handle?)",
            }.get(code, "inputs of the wrong shape or dtype")
    return f"low-latency {op}: rank {src} passed {what} (seen by rank {me})"


def pairing_error(op: str, source: int, theirs: int, mine: int, ranks: list[int], me: int) -> str:
    """The message of a low-latency call whose source ``source`` (group rank) sent call word
    ``theirs`` where rank ``me`` (group rank) ran ``mine`` (a word is the dispatch's call number
    * 2 + FP8; a combine carries its handle's dispatch word)."""
    def call(w: int) -> str:
        return f"dispatch #{w >> 1} ({'FP8' if w & 1 else 'no FP8'})"

    src, r = ranks[source], ranks[me]
    if op == "combine":
        why = "every rank must combine the handle of the same dispatch"
        return (f"low-latency combine: rank {src} combined the handle of its {call(theirs)}, rank {r} that of "
                f"its {call(mine)}; {why} (seen by rank {r})")
    why = ("the ranks passed different use_fp8" if theirs >> 1 == mine >> 1 else
           "a rank skipped a call its peers made, or made one they did not")
    return (f"low-latency dispatch: the ranks' calls do not pair: rank {src} sent its {call(theirs)}, rank {r} "
            f"is at its {call(mine)}; {why}; no rows of this call were kept (seen by rank {r})")


class IPCFailures:
    """Failure detection, status checks and the rejection path of :class:`transports.ipc.IPCTransport`."""

    # ---- failure detection ----------------------------------------------------------------------
    def _done(self) -> int:
        """Kernels every program has finished (the status block's DONE words)."""
        return int(self._status[L.S_DONE : L.S_DONE + self.programs].min())

    def _busy(self) -> bool:
        """Whether a kernel we launched has not finished yet (read by the host, no copy)."""
        return self._launched + self._extra > self._done()

    def _watch(self) -> None:
        """While our kernels run: abort them when a peer dies, closes or aborts, or when DONE has
        not moved for the timeout; the host raises at its next look (:meth:`_check`)."""
        me = self.rank
        self._regions.bind_thread()
        gone: dict[int, int] = {}  # peer -> DONE when we first saw it gone while in flight
        while not self._stop.wait(_WATCH_PERIOD):
            with self._watch_lock:
                if self._reason is not None:
                    continue
                done = self._done()
                if done > self._launched + self._extra:  # graph replays ran kernels the host did not count
                    self._extra = done - self._launched
                if self._launched + self._extra <= done:
                    self._progress = None
                    gone.clear()
                    continue
                now = time.monotonic()
                if self._progress is None or self._progress[1] != done:
                    self._progress = (now, done)
                reason = aborted = died = None
                try:
                    for r in range(self.size):
                        if r == me:
                            continue
                        dead = r < len(self._pids) and not pid_alive(self._pids[r])
                        if dead and died is None:
                            died = r
                        try:  # a dead exporter's GPU memory may be gone with it
                            state = int(self._regions.read(r, L.STATE, 1)[0])
                        except Exception:  # noqa: BLE001 - then the pid says enough
                            state = L.STATE_RUNNING
                        if state == L.STATE_ABORTED:
                            aborted = aborted if aborted is not None else r
                            continue
                        if (dead or state == L.STATE_CLOSED) and not self._finished_this_call(r):
                            # our kernel may be past its last barrier, ending: a gone peer counts
                            # when DONE has not moved between two looks at it
                            if gone.get(r) != done:
                                gone[r] = done
                                continue
                            why = "closed its communicator" if state == L.STATE_CLOSED else \
                                f"(pid {self._pids[r]}) died"
                            reason = (PeerFailedError, f"rank {self._ranks[r]} {why}", [self._ranks[r]])
                            break
                    if reason is None and aborted is not None:
                        # a peer aborted, usually after another one died: name the dead one, the cause
                        r = aborted if died is None else died
                        why = "aborted after a failure" if died is None else f"(pid {self._pids[r]}) died"
                        reason = (PeerFailedError, f"rank {self._ranks[r]} {why}", [self._ranks[r]])
                    if reason is None and now - self._progress[0] >= self.timeout:
                        reason = (CollectiveTimeoutError, f"timed out after the timeout of {self.timeout:.1f}s", [])
                    if reason is not None:
                        self._reason = reason
                        self._regions.write(me, L.ABORT, 1)
                except Exception:  # noqa: BLE001 - the provider is closing; nothing to watch
                    log.debug("ipc watchdog stopped", exc_info=True)
                    return

    def _finished_this_call(self, r: int) -> bool:
        """Whether peer ``r``, closed or exited, passed a barrier of the running launch that we have
        not, or finished a Lamport all_reduce we have not: it then left after the launch's last
        barrier, or after pushing its data to us, having read all it needs from us; a peer we still
        wait for is another rank (that rank's arrival, death or the timeout decide).

        A peer that closed before it joined the launch is behind or level with us on every program.
        """
        try:
            p = self.programs
            words = (L.EPOCH, L.LAMPORT_CALLS, L.LL_CALLS)
            theirs = np.concatenate([self._regions.read(r, w, p) for w in words])
            ours = np.concatenate([self._regions.read(self.rank, w, p) for w in words])
        except Exception:  # noqa: BLE001 - its memory is gone: treat it as not there
            return False
        return bool((theirs > ours).any())

    def _fail(self, cls: type, message: str, missing: list[int]) -> None:
        self._broken = message
        try:
            self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        raise cls(message, missing)

    def _raise_broken(self) -> None:
        if self._broken == "closed":
            raise CommunicatorBrokenError("the ipc transport of this communicator is closed; create a new communicator")
        raise CommunicatorBrokenError(
            f"ipc communicator is unusable after an earlier failure ({self._broken}); create a new one")

    def _check(self, completed: bool = False) -> None:
        """Raise what our earlier kernels left in the status block, if anything (plain host loads:
        no copy, no stream synchronization). Errors are asynchronous, as NCCL's are: on a GPU a
        failure shows at the next call or at :meth:`synchronize`.

        completed: right after a launch whose kernel has ended (emulation): a peer that failed
        while this call still completed raises at the next call, and this one returns.
        """
        st = self._status
        if st[L.S_ERROR] or st[L.S_MISMATCH] or st[L.S_INPUT] or st[L.S_PAIRING] or self._reason is not None \
                or self._pending is not None:
            self._failed(completed)

    def _failed(self, completed: bool = False) -> None:
        st = self._status
        me = self._ranks[self.rank]
        if self._reason is not None and not st[L.S_ERROR]:
            # the watchdog set ABORT: our kernels end at their next turn; wait for them (bounded)
            deadline = time.monotonic() + max(self.timeout, 1.0)
            while self._busy() and not st[L.S_ERROR] and time.monotonic() < deadline:
                time.sleep(0.001)
        with self._watch_lock:
            reason = self._reason
            error = int(st[L.S_ERROR])
            if error == 0 and reason is not None:  # every call completed all the same
                self._reason = None
                self._progress = None
                self._regions.write(self.rank, L.ABORT, 0)
        if error:
            if error == self.size + 2:  # a Lamport all_reduce met another signature: its slots hold stray data
                self._broken = "signatures differed in a Lamport all_reduce"
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
                st[L.S_MISMATCH] = 0
                check_agreement(self._peer_metas(), self._ranks)
                raise ValueError(f"ipc: call signatures differ across ranks (seen by rank {me} in a Lamport "
                                 "all_reduce); this communicator's ipc transport is closed")
            if error > self.size:  # stopped before it waited for anyone (ABORT was already set)
                cls, msg, missing = reason or (CollectiveTimeoutError, "its abort flag was set", [])
                self._fail(cls, f"{msg}; rank {me} abandoned its ipc collective", missing)
            peer = self._ranks[error - 1]
            if reason is None or reason[0] is CollectiveTimeoutError:
                why = (f"timed out after the timeout of {self.timeout:.1f}s" if reason
                       else "gave up after its bounded wait")
                self._fail(CollectiveTimeoutError,
                           f"ipc collective {why} on rank {me}: rank {peer} never arrived "
                           f"(stuck, deadlocked, or calling a different collective){self._last_calls()}", [peer])
            cls, msg, missing = reason
            self._fail(cls, f"{msg} while rank {me} waited for rank {peer} in an ipc collective", missing)
        if reason is not None and reason[0] is not CollectiveTimeoutError:  # a peer is gone all the same
            self._pending = reason
        if self._pending is not None and not completed:
            cls, msg, missing = self._pending
            self._fail(cls, f"{msg} (seen by rank {me} after its ipc collectives completed)", missing)
        if st[L.S_MISMATCH]:
            st[L.S_MISMATCH] = 0
            if not completed:
                # read at a later call's start (GPU: asynchronous errors): the peers may read theirs at
                # another call, and a rank that skips a call its peers make leaves them waiting, so
                # the transport ends here for every rank (the peers' watchdogs see STATE aborted)
                try:
                    check_agreement(self._peer_metas(), self._ranks)
                    what = "ipc: call signatures differ across ranks"
                except ValueError as e:
                    what = str(e)
                self._broken = what
                self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
                raise ValueError(f"{what} (seen by rank {me} after that call returned, as asynchronous errors "
                                 "are on a GPU; the ranks could no longer raise at one call): this "
                                 "communicator's ipc transport is closed")
            check_agreement(self._peer_metas(), self._ranks)
            raise ValueError("ipc: call signatures differ across ranks")  # digests differ, words equal
        if st[L.S_INPUT] or st[L.S_PAIRING]:
            # recorded by low-latency MoE kernels that no eager call waited for (CUDA-graph replays):
            # raised lazily, the ranks would leave the exchange at different calls, so it ends here
            if st[L.S_INPUT]:
                what = input_error(int(st[L.S_INPUT]), self._ranks, me)
            else:
                what = (f"low-latency exchange: rank {self._ranks[int(st[L.S_PAIRING]) - 1]} sent a call that does "
                        f"not pair with rank {me}'s")
            st[L.S_INPUT] = st[L.S_PAIRING] = 0
            self._broken = f"{what}, in a CUDA-graph replay"
            self._regions.write(self.rank, L.STATE, L.STATE_ABORTED)
            raise ValueError(f"{what}; recorded in a CUDA-graph replay, where the ranks cannot all raise at one "
                             "call: this communicator's ipc transport is closed")

    def _last_calls(self) -> str:
        """After a timeout: the signatures of the calls every rank last started, where they differ
        (each kernel publishes its call's signature in its META words as it starts)."""
        try:
            metas = np.stack([self._regions.read(r, L.META, META_LEN) for r in range(self.size)])
            check_agreement(metas, self._ranks)
        except ValueError as e:
            return f"; the calls the ranks last started differ: {e}"
        except Exception:  # noqa: BLE001 - a peer's memory may be gone: the timeout says enough
            pass
        return ""

    def synchronize(self) -> None:
        """Wait for our kernels on the current stream, then raise what they left (see :meth:`_check`)."""
        if self._broken:
            self._raise_broken()
        self._regions.sync()
        self._check(completed=True)  # a peer that left after our calls ended raises at our next call

    def reject_call(self, sig: Signature, x: torch.Tensor, fused: tuple[int, int] | None = None) -> None:
        """See :meth:`Transport.reject_call`. The peers' call meets us, by its kind:

        - its first call of ``sig`` compares signatures on the host (every all_reduce; every call
          on a GPU): there, with the error signature (every rank makes the same calls, so the
          peers' first call is ours);
        - a Lamport all_reduce (or the fused RMSNorm), which has no barrier: the same kernel on
          ``x`` under a rejecting header (:mod:`transports.kernels.lamport`), so that the slots
          stay in step and the peers record a rejection, not a fatal difference;
        - a barrier kernel: :meth:`exchange_meta`'s, at its first barrier.
        """
        err_sig = Signature(error_meta())
        host_checked = self._agree_on_host or int(sig.meta[F_OPCODE]) == OpCode.ALL_REDUCE
        if host_checked and sig.value not in self._host_agreed:
            rendezvous_metas(self.group.rendezvous, err_sig)
            return
        nbytes = x.numel() * x.element_size()
        if fused is not None and not self.fuses_all_reduce_rmsnorm(x.numel(), fused[1], x.dtype, torch.float32):
            fused = None  # the peers compose it: their all_reduce is the call to meet
        lamport = fused is not None or (int(sig.meta[F_OPCODE]) == OpCode.ALL_REDUCE
                                        and self._lamport_takes(nbytes, x.dtype))
        if not lamport:
            self.exchange_meta(err_sig)
            return
        import triton

        args = (self._lam_ptrs, self._regions.sig_ptrs, self._status_arg, self.rank, self.size,
                (sig.value | 1) ^ 2, self._meta(err_sig), self.lamport_elems, self._max_spins)
        self._start()
        if fused is not None:
            rows, hidden = fused
            a = x.reshape(rows, hidden)
            kernel = self._bind(self._k.lamport.all_reduce_rmsnorm_lamport,
                                {"OUT_BF16": x.dtype == torch.bfloat16, "BLOCK_H": triton.next_power_of_2(hidden)})
            weight = torch.ones(hidden, dtype=torch.float32, device=x.device)
            run = (a, torch.zeros_like(a), weight, torch.empty_like(a), torch.empty_like(a), rows, hidden, 1.0, *args)
        else:
            flat = self._flat(x)
            const = self._lamport_constants(self._reduce_constants(x.dtype, ReduceOp(int(sig.meta[F_REDOP]))))
            kernel = self._bind(self._k.lamport.all_reduce_lamport, const)
            run = (flat, torch.empty_like(flat), flat.numel(), *args)
        self._queue(kernel, *run)
        self._regions.sync()  # an error path: our own view of the rejection is ours to drop
        self._status[L.S_MISMATCH] = 0
        self._check(completed=True)
