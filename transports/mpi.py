"""``mpi``: collectives through mpi4py, zero-copy through the buffer protocol.

The transport of choice across nodes and the fallback for anything the node-local
transports cannot serve. MPI calls block without a deadline, so every call here is
posted non-blocking and then polled, which bounds it by the communicator's timeout.
The call signature travels by point-to-point messages on a private duplicate of the
group's communicator, so a rank that never arrives is named in the timeout error.

**Notices.** MPI tells a waiting rank neither which peer a collective still needs nor that a peer
has left. So every transport keeps, on a second private communicator, one posted receive per peer
for small notices, polls them while it waits, and sends them:

- on ``close()``: "closed after N steps": a peer waiting in a later step raises PeerFailedError at once;
- on a timeout: first "who is here?" to every peer (a peer waiting in any call answers at once), then
  "timed out waiting for ranks [...]", so the silent ranks are named, and every waiting peer raises too;
- on any other failure: "failed in step N", so no peer waits for its own timeout.

A *step* is one wait of this transport (a signature exchange, a count exchange, a data transfer).
Every rank waits the same steps in the same order, so step numbers agree across ranks and a notice
from a peer that finished our step (then closed) is no failure. Peers on this node are also watched
through /proc: a dead one fails the wait at once, a stopped one is named at the timeout.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

import numpy as np
import torch

from ._host import as_numpy, pid_alive, process_state, reduce_into
from .base import (
    F_ROWS,
    META_LEN,
    Allocator,
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    PeerFailedError,
    ReduceOp,
    Signature,
    Transport,
    check_agreement,
    check_recv_counts,
)

log = logging.getLogger(__name__)

# Above this group size the signature goes through one Iallgather instead of n point-to-point
# messages (which is what lets us name a missing rank).
_P2P_META_MAX_RANKS = 64
_META_TAG = 7
_NOTICE_TAG = 8
# A notice: [token of this transport, kind, step, number of ranks, up to _NOTICE_RANKS ranks]
_NOTICE_RANKS = 8
_NOTICE_LEN = 4 + _NOTICE_RANKS
_CLOSED, _TIMED_OUT, _FAILED, _QUERY, _PRESENT = 1, 2, 3, 4, 5
_BLAME = 6  # post_blame: the ranks a failure in a communicator built over this one named (no failure here)
_CHECK_EVERY = 0.01  # seconds between notice polls while waiting (after the spin window)
_PID_CHECK_EVERY = 0.05
_FAILURE_GRACE = 0.05  # seconds a wait may still complete after a peer was seen gone


def _mpi():
    from mpi4py import MPI

    return MPI


def _listed(ranks: list[int], count: int) -> str:
    """``[1, 2]``, or ``[1, 2] and 5 more`` when a notice carried only the first of ``count`` ranks."""
    return f"{ranks}" + (f" and {count - len(ranks)} more" if count > len(ranks) else "")


# Requests and buffers of calls abandoned after a failure (see MPITransport._wait): never freed.
_ABANDONED: list = []


def wait_posted(req: Any, timeout: float, what: str, rank: int, *keep: Any) -> None:
    """Poll one posted non-blocking MPI collective until it completes or ``timeout`` seconds pass.

    On a timeout the request stays posted (MPI cannot cancel a collective) and a late peer may still
    complete it, writing into ``keep``: the request and ``keep`` are held for good instead of being
    freed under MPI, and CollectiveTimeoutError says ``what`` timed out on world rank ``rank``.
    """
    deadline = time.monotonic() + timeout
    sleep = 1e-5
    while not req.Test():
        if time.monotonic() >= deadline:
            _ABANDONED.append((req, keep))
            raise CollectiveTimeoutError(
                f"{what} timed out after the timeout of {timeout:.1f}s on rank {rank}: a peer never reached it "
                "(stuck, dead, or calling something else)")
        time.sleep(sleep)
        sleep = min(2 * sleep, 1e-2)


_NAN_OPS: dict = {}


def _nan_propagating(MPI, op: ReduceOp):
    """An MPI op for floating max/min that propagates NaN, like torch.maximum/minimum.

    MPI's MAX/MIN compare with ``>``/``<``, so a NaN survives or not depending on the operand order,
    and ranks that combine in different orders disagree (rank 0 ``[nan, 1]``, rank 1 ``[1, nan]``).
    This op applies np.maximum/np.minimum and is declared non-commutative, so MPI combines in rank
    order and every rank computes the same bits (as the shm transport does). Created once per
    process (MPI allows only a few user ops); float32 and float64 only (16-bit floats are reduced
    through float32).
    """
    mop = _NAN_OPS.get(op)
    if mop is None:
        ufunc = np.maximum if op == ReduceOp.MAX else np.minimum

        def combine(inbuf, inoutbuf, datatype):
            dt = np.float64 if datatype == MPI.DOUBLE else np.float32
            acc = np.frombuffer(inoutbuf, dtype=dt)
            ufunc(np.frombuffer(inbuf, dtype=dt), acc, out=acc)

        mop = _NAN_OPS[op] = MPI.Op.Create(combine, commute=False)
    return mop


class MPITransport(Transport):
    name = "mpi"
    devices = ("cpu",)

    def __init__(self, group: GroupInfo):
        super().__init__(group)
        if group.mpi_comm is None:
            raise RuntimeError("the mpi transport needs an MPI launch (run under mpiexec/mpirun)")
        MPI = _mpi()
        self.MPI = MPI
        me = group.global_ranks[group.rank]
        # private: our traffic never matches the user's. Idup, polled: a peer that never makes its
        # transport makes this one raise after the timeout instead of hanging in MPI_Comm_dup.
        self.comm, req = group.mpi_comm.Idup()
        wait_posted(req, group.timeout, "mpi transport set-up (MPI_Comm_idup)", me)
        self.timeout = group.timeout
        self._ranks = list(group.global_ranks)
        self._broken: str | None = None  # why this transport is unusable (a failure, or "closed")
        self._types = {
            torch.float64: MPI.DOUBLE, torch.float32: MPI.FLOAT, torch.int64: MPI.INT64_T,
            torch.int32: MPI.INT32_T, torch.uint8: MPI.UINT8_T, torch.bool: MPI.C_BOOL,
        }
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PROD: MPI.PROD,
                     ReduceOp.MAX: MPI.MAX, ReduceOp.MIN: MPI.MIN}
        self._float_ops = {**self._ops, ReduceOp.MAX: _nan_propagating(MPI, ReduceOp.MAX),
                           ReduceOp.MIN: _nan_propagating(MPI, ReduceOp.MIN)}
        self._meta_recv = np.zeros((self.size, META_LEN), dtype=np.int64)
        self._meta_send = np.zeros(META_LEN, dtype=np.int64)
        self._peers = [r for r in range(self.size) if r != self.rank]
        if 1 < self.size <= _P2P_META_MAX_RANKS:
            self._meta_rreqs = [self.comm.Recv_init(self._meta_recv[r], source=r, tag=_META_TAG) for r in self._peers]
            self._meta_reqs = self._meta_rreqs + [self.comm.Send_init(self._meta_send, dest=r, tag=_META_TAG)
                                                  for r in self._peers]
        # poll flat out for 5 ms when every local rank has a core, 50 us when oversubscribed
        self._spin_seconds = 5e-5 if group.oversubscribed else 5e-3
        self._step = 0  # waits started (see the module docstring: steps agree across ranks)
        self._done = 0  # waits completed
        here = group.hosts[self.rank] if group.hosts else None
        self._local_pids = {r: group.pids[r] for r in self._peers
                            if here is not None and r < len(group.pids) and group.hosts[r] == here}
        # notices (module docstring), on a communicator of their own
        self._notes, req = group.mpi_comm.Idup()
        wait_posted(req, group.timeout, "mpi transport set-up (MPI_Comm_idup of the notices)", me)
        # tells this transport's notices from those of an earlier one that MPI gave the same context id
        token = np.array([secrets.randbits(62) if self.rank == 0 else 0], dtype=np.int64)
        wait_posted(self._notes.Ibcast(token, root=0), group.timeout, "mpi transport set-up (token)", me, token)
        self._token = int(token[0])
        self._note_in = np.zeros((self.size, _NOTICE_LEN), dtype=np.int64)
        self._note_reqs = [self._notes.Irecv(self._note_in[r], source=r, tag=_NOTICE_TAG) for r in self._peers]
        self._note_sends: list = []  # (request, buffer, peer) of notices not yet sent
        self._closed_after: dict[int, int] = {}  # group rank -> steps it completed before it closed
        self._failed_at: dict[int, tuple[int, int, list[int], int]] = {}  # rank -> (step, kind, ranks, count)
        self._heard: dict[int, int] = {}  # rank -> step it waited in when it asked or answered "who is here?"
        self._blamed: dict[int, list[int]] = {}  # rank -> the global ranks its post_blame named
        # peers MPI refused to send a notice to (a dead process on another node: OFI reports an error)
        self._unreachable: set[int] = set()

    def algorithm(self, opcode: OpCode, nbytes: int, dtype: torch.dtype) -> str:
        names = {OpCode.ALL_REDUCE: "Iallreduce", OpCode.ALL_GATHER: "Iallgather",
                 OpCode.REDUCE_SCATTER: "Ireduce_scatter_block", OpCode.ALL_TO_ALL: "Ialltoallv",
                 OpCode.BROADCAST: "Ibcast", OpCode.BARRIER: "meta-exchange"}
        return names.get(opcode, "?")

    # ---- waiting --------------------------------------------------------------------------
    def _wait(self, reqs, what: str, pending_ranks=None, keep=()) -> None:
        """Drive MPI progress (it advances only inside Test) until done, a peer's failure, or the timeout.

        Polls flat out for a short window, as a blocking MPI call would, then yields the core
        between polls, then sleeps with backoff, so a slow or absent peer does not burn a core.
        After the spin window it also reads the peers' notices and watches local peers' processes.
        ``pending_ranks(reqs)``, if given, names the group ranks the requests still wait for.
        ``keep``: the arrays and tensors the requests read or write. MPI cannot cancel a collective,
        so when the wait ends in an error (or an interrupt) they are kept for good: a late peer may
        still complete the call, and MPI would write into freed memory.
        """
        MPI = self.MPI
        self._step += 1
        reqs = list(reqs)
        if MPI.Request.Testall(reqs):
            self._done = self._step
            return
        try:
            self._wait_slowly(reqs, what, pending_ranks)
        except BaseException:
            _ABANDONED.append((reqs, keep))
            raise
        self._done = self._step

    def _wait_slowly(self, reqs, what: str, pending_ranks) -> None:
        MPI = self.MPI
        start = time.monotonic()
        deadline = start + self.timeout
        spin_until = start + self._spin_seconds
        yield_until = spin_until + 0.01
        next_check = next_pid_check = spin_until
        sleep = 20e-6
        i = 0
        while not MPI.Request.Testall(reqs):
            i += 1
            if i & 63:
                continue
            now = time.monotonic()
            if now < spin_until:
                continue
            if now >= next_check:
                check_pids = now >= next_pid_check
                if self._peer_failure(reqs, what, check_pids):
                    break  # it completed after all
                next_check = now + _CHECK_EVERY
                if check_pids:
                    next_pid_check = now + _PID_CHECK_EVERY
            if now >= deadline:
                self._time_out(what, pending_ranks(reqs) if pending_ranks else None)
            if now < yield_until:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, 1e-3)

    def _peer_failure(self, reqs, what: str, check_pids: bool) -> bool:
        """Raise if a peer closed, failed or died without taking part in the current step.

        Returns True when the step completed meanwhile (a peer that left after sending its part is no
        failure); False to go on waiting.
        """
        self._poll_notices()
        me, step = self._ranks[self.rank], self._step
        causes = []  # (priority, error): a root cause (a timeout, a close, a death) before a peer's abort
        for r, (at, kind, ranks, count) in self._failed_at.items():
            if step >= at and kind == _TIMED_OUT and ranks:
                causes.append((0, CollectiveTimeoutError(
                    f"mpi {what} cannot complete on rank {me}: rank {self._ranks[r]} timed out waiting for "
                    f"rank(s) {_listed(ranks, count)}, which never arrived, and gave up", ranks)))
            elif step >= at and ranks:  # it named the cause (a rank that died, e.g. on its node)
                causes.append((2, PeerFailedError(
                    f"rank(s) {_listed(ranks, count)} failed (rank {self._ranks[r]} saw it and aborted) while rank "
                    f"{me} waited in mpi {what}", ranks)))
            elif step >= at:
                causes.append((3, PeerFailedError(f"rank {self._ranks[r]} aborted after a failure while rank {me} "
                                                  f"waited for it in mpi {what}", [self._ranks[r]])))
        for r, done in self._closed_after.items():
            # a peer that failed and then closed: its failure notice names the rank that failed, not itself
            failed = self._failed_at.get(r)
            if step > done and not (failed is not None and step >= failed[0] and failed[2]):
                causes.append((1, PeerFailedError(f"rank {self._ranks[r]} closed its communicator while rank {me} "
                                                  f"waited for it in mpi {what}", [self._ranks[r]])))
        if check_pids:
            for r, pid in self._local_pids.items():
                if r not in self._closed_after and not pid_alive(pid):  # a clean exit says how far it got
                    causes.append((2, PeerFailedError(f"rank {self._ranks[r]} (pid {pid}) died while rank {me} "
                                                      f"waited for it in mpi {what}", [self._ranks[r]])))
        failure = min(causes, key=lambda c: c[0])[1] if causes else None
        if failure is None:
            return False
        # Its part of this step may be in flight already (it finished the step, then left): let it land.
        end = time.monotonic() + _FAILURE_GRACE
        while time.monotonic() < end:
            if self.MPI.Request.Testall(reqs):
                return True
            time.sleep(1e-3)
        self._fail(str(failure), _FAILED, failure.missing_ranks)  # the peers learn who failed, not just that we did
        raise failure

    def _time_out(self, what: str, known_missing: list[int] | None) -> None:
        """Name who never arrived, tell every peer, and raise CollectiveTimeoutError."""
        me, step = self._ranks[self.rank], self._step
        states = {r: process_state(pid) for r, pid in self._local_pids.items()}
        gone = {r for r, st in states.items() if st in ("T", "t", "X", "Z")}  # stopped or dead: will not answer
        # Who is here? A peer waiting in any call answers at once; the silent ones never arrived.
        for r in self._peers:
            if r not in self._closed_after and r not in gone:
                self._send(r, _QUERY, step)
        gone |= self._unreachable
        grace_end = time.monotonic() + min(1.0, max(0.2, 0.1 * self.timeout))

        def silent() -> list[int]:
            return [r for r in self._peers
                    if r not in self._heard and r not in self._failed_at and r not in self._closed_after]

        while [r for r in silent() if r not in gone] and time.monotonic() < grace_end:
            time.sleep(2e-3)
            self._poll_notices()
        missing = list(known_missing) if known_missing else sorted(set(silent()) | self._unreachable)
        if not missing:  # everyone is waiting; those in an earlier call hold the others up
            missing = sorted(r for r, at in self._heard.items() if at < step)
        why = {"T": "is stopped", "t": "is stopped by a debugger", "X": "is gone", "Z": "is gone"}
        notes = [f"rank {self._ranks[r]}: pid {self._local_pids[r]} {why[states[r]]}" for r in missing
                 if states.get(r) in why]
        notes += [f"rank {self._ranks[r]}: MPI cannot reach it (its process is probably gone)" for r in missing
                  if r in self._unreachable]
        names = [self._ranks[r] for r in missing]
        self._fail(f"{what} timed out", _TIMED_OUT, names)
        who = f"rank(s) {names} never arrived" if names else \
            "every rank is waiting, so the call itself is stuck (calling different collectives?)"
        raise CollectiveTimeoutError(
            f"mpi {what} timed out after the timeout of {self.timeout:.1f}s on rank {me}: {who}"
            + (f" ({'; '.join(notes)})" if notes else ""), names)

    def _fail(self, why: str, kind: int, ranks: list[int] = ()) -> None:
        """Mark this transport broken and tell every peer, so none waits for its own timeout."""
        self._broken = why
        for r in self._peers:
            if r not in self._closed_after:
                self._send(r, kind, self._step, ranks)

    # ---- notices --------------------------------------------------------------------------
    def _send(self, peer: int, kind: int, step: int, ranks=()) -> None:
        """Post one notice to ``peer``. A peer MPI cannot reach (its process died on another node;
        MPICH over OFI raises, where over shared memory the pid check finds it) is recorded in
        ``_unreachable`` and named by :meth:`_time_out` instead of the MPI error escaping."""
        if peer in self._unreachable:
            return
        msg = np.zeros(_NOTICE_LEN, dtype=np.int64)
        ranks = list(ranks)
        msg[:4] = (self._token, kind, step, len(ranks))
        msg[4 : 4 + min(len(ranks), _NOTICE_RANKS)] = ranks[:_NOTICE_RANKS]
        self._note_sends = [(q, m, to) for q, m, to in self._note_sends if not self._sent(q, to)]
        try:
            self._note_sends.append((self._notes.Isend(msg, dest=peer, tag=_NOTICE_TAG), msg, peer))
        except self.MPI.Exception as e:
            self._mark_unreachable(peer, e)

    def _sent(self, request: Any, peer: int) -> bool:
        """Whether a notice's send is done (or failed: then its peer is unreachable)."""
        try:
            return bool(request.Test())
        except self.MPI.Exception as e:
            self._mark_unreachable(peer, e)
            return True

    def _mark_unreachable(self, peer: int, error: Exception) -> None:
        self._unreachable.add(peer)
        log.debug("mpi notice to rank %d failed: %s", self._ranks[peer], error)

    def _poll_notices(self) -> None:
        reqs = self._note_reqs
        while reqs:
            done = self.MPI.Request.Testsome(reqs)
            if not done:
                return
            for i in done:
                r = self._peers[i]
                msg = [int(v) for v in self._note_in[r]]
                reqs[i] = self._notes.Irecv(self._note_in[r], source=r, tag=_NOTICE_TAG)
                if msg[0] == self._token:
                    self._on_notice(r, msg[1], msg[2], msg[4 : 4 + min(msg[3], _NOTICE_RANKS)], msg[3])

    def _on_notice(self, peer: int, kind: int, step: int, ranks: list[int], count: int) -> None:
        if kind == _CLOSED:
            self._closed_after[peer] = step
        elif kind in (_TIMED_OUT, _FAILED):
            self._failed_at.setdefault(peer, (step, kind, ranks, count))
        elif kind == _QUERY:
            self._heard[peer] = step
            self._send(peer, _PRESENT, self._step)
        elif kind == _PRESENT:
            self._heard[peer] = step
        elif kind == _BLAME:
            self._blamed[peer] = ranks

    def post_blame(self, ranks: list[int]) -> None:
        """Tell every peer which (global) ranks a failure on this rank named, where the failure was in a
        collective of a communicator built over this one (collectives/hierarchical.py: a failed stage), so
        that they can name the rank that failed instead of a bystander. Unlike a failure notice it leaves
        this transport usable (up to _NOTICE_RANKS ranks travel)."""
        for r in self._peers:
            if r not in self._closed_after:
                self._send(r, _BLAME, self._step, [int(x) for x in ranks])

    def blames(self) -> dict[int, list[int]]:
        """The peers' :meth:`post_blame` so far: global rank of the peer -> the global ranks it named."""
        self._poll_notices()
        return {self._ranks[r]: list(v) for r, v in self._blamed.items()}

    def _check_usable(self) -> None:
        if self._broken:
            if self.comm is None:
                raise CommunicatorBrokenError(
                    "the mpi transport of this communicator is closed; create a new communicator")
            raise CommunicatorBrokenError(
                f"mpi communicator is unusable after an earlier failure ({self._broken}); create a new one")

    def exchange_meta(self, sig: Signature) -> np.ndarray:
        self._check_usable()
        n, me = self.size, self.rank
        recv = self._meta_recv
        if n == 1:
            return sig.meta.reshape(1, -1).copy()
        if n > _P2P_META_MAX_RANKS:
            recv[me] = sig.meta
            self._wait([self.comm.Iallgather(sig.meta, recv)], "signature exchange", keep=(sig.meta, recv))
            return recv.copy()
        # persistent point-to-point requests: cheap to restart, and they tell who never arrived
        self._meta_send[:] = sig.meta
        recv[me] = sig.meta
        self.MPI.Prequest.Startall(self._meta_reqs)

        def missing(_):
            return [r for r, q in zip(self._peers, self._meta_rreqs) if not q.Test()]

        self._wait(self._meta_reqs, "signature exchange", missing, keep=(self._meta_send, recv))
        return recv.copy()

    def _agree(self, sig: Signature) -> None:
        metas = self.exchange_meta(sig)
        if not (metas[:, :F_ROWS] == sig.meta[:F_ROWS]).all():
            check_agreement(metas, self._ranks)

    def barrier(self, sig: Signature) -> None:
        check_agreement(self.exchange_meta(sig), self._ranks)

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        self._reduce(send, out, op, lambda s, r, mop: self.comm.Iallreduce(s, r, op=mop), "all_reduce")

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        self._reduce(send, out, op, lambda s, r, mop: self.comm.Ireduce_scatter_block(s, r, op=mop),
                     "reduce_scatter")

    def _reduce(self, send, out, op, post, what):
        dtype = send.dtype
        MPI = self.MPI
        if dtype in (torch.float16, torch.bfloat16):
            # no portable MPI 16-bit float reductions: accumulate in float32, round once
            s32 = send.float()
            r32 = torch.empty(out.shape, dtype=torch.float32)
            mop = self._float_ops[op]
            self._wait([post([s32.numpy(), MPI.FLOAT], [r32.numpy(), MPI.FLOAT], mop)], what, keep=(s32, r32))
            if op == ReduceOp.AVG:
                r32.div_(self.size)
            out.copy_(r32)
            return
        mtype = self._types[dtype]
        mop = (self._float_ops if dtype.is_floating_point else self._ops)[op]
        if dtype == torch.bool:
            mop = {ReduceOp.MAX: MPI.LOR, ReduceOp.MIN: MPI.LAND}[op]
        y = as_numpy(out)
        x = self.MPI.IN_PLACE if send.data_ptr() == out.data_ptr() else [as_numpy(send), mtype]
        self._wait([post(x, [y, mtype], mop)], what, keep=(send, out, x, y))
        if op == ReduceOp.AVG:
            reduce_into(y, [y], op, dtype, self.size)

    def all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        self._agree(sig)
        B = self.MPI.BYTE
        x, y = as_numpy(send).view(np.uint8), as_numpy(out).view(np.uint8)
        self._wait([self.comm.Iallgather([x, B], [y, B])], "all_gather", keep=(send, out, x, y))

    def broadcast(self, send: torch.Tensor, out: torch.Tensor, src: int, sig: Signature) -> None:
        self._agree(sig)
        if self.rank == src:
            out.copy_(send)
        y = as_numpy(out).view(np.uint8)
        self._wait([self.comm.Ibcast([y, self.MPI.BYTE], root=src)], "broadcast", keep=(out, y))

    takes_recv_counts = True

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], row_numel: int, alloc: Allocator,
                   sig: Signature, recv_counts: list[int] | None = None) -> torch.Tensor:
        """See :meth:`Transport.all_to_all`.

        With ``recv_counts`` (the signature check has made sure every rank passed them) the count
        exchange becomes an Iallgather of every rank's send and declared receive counts instead of
        an Ialltoall of the send counts: the same one step (so step numbers still agree across
        ranks), n times the bytes (2 * size int64 from each rank; negligible beside the data up to
        hundreds of ranks), and every rank sees both whole matrices, so every rank raises the same
        ValueError naming each wrong rank and its counts before the Alltoallv. Skipping the
        exchange instead would save that step but leave the check to the Alltoallv, where a short
        message is not an error and a long one fails on the receiver alone.
        """
        self._agree(sig)
        counts = np.ascontiguousarray(send_counts, dtype=np.int64)
        if recv_counts is not None:
            mine = np.ascontiguousarray([send_counts, recv_counts], dtype=np.int64)
            every = np.zeros((self.size, 2, self.size), dtype=np.int64)
            self._wait([self.comm.Iallgather(mine, every)], "all_to_all count exchange", keep=(mine, every))
            sent, declared = every[:, 0], every[:, 1]  # sent[src][dst], declared[dst][src]
            if not (declared == sent.T).all():
                check_recv_counts(sent.tolist(), declared.tolist(), self._ranks)
            recv_counts = np.ascontiguousarray(recv_counts, dtype=np.int64)
        else:
            recv_counts = np.zeros(self.size, dtype=np.int64)
            self._wait([self.comm.Ialltoall(counts, recv_counts)], "all_to_all count exchange",
                       keep=(counts, recv_counts))
        out = alloc(recv_counts.tolist())
        row_bytes = row_numel * send.element_size()
        sc = np.asarray(send_counts, dtype=np.int64) * row_bytes
        rc = recv_counts * row_bytes
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
        B = self.MPI.BYTE
        x, y = as_numpy(send).view(np.uint8), as_numpy(out).view(np.uint8)
        self._wait([self.comm.Ialltoallv([x, (sc.tolist(), sd.tolist()), B], [y, (rc.tolist(), rd.tolist()), B])],
                   "all_to_all", keep=(send, out, x, y))
        return out

    def abort(self, why: str) -> None:
        if self.comm is not None and not self._broken:
            self._broken = why  # close keeps the buffers of requests still under way and skips Free
        self.close()

    def close(self) -> None:
        """Tell every peer how far this rank got (a peer waiting in a later step raises at once), then
        release the private communicators. Any later call on this transport raises CommunicatorBrokenError."""
        if self.comm is None:
            return
        MPI = self.MPI
        try:
            for r in self._peers:
                if r not in self._closed_after:
                    self._send(r, _CLOSED, self._done)
            end = time.monotonic() + 1.0  # small messages leave at once; a vanished peer must not hold us
            while self._note_sends and time.monotonic() < end:
                self._note_sends = [(q, m, to) for q, m, to in self._note_sends if not self._sent(q, to)]
                if self._note_sends:
                    time.sleep(1e-3)
            if getattr(self, "p2p", None) is not None:
                self.p2p.close()  # ends unfinished point-to-point requests (transports/_p2p.py)
            for q in self._note_reqs:
                q.Cancel()
            MPI.Request.Waitall(self._note_reqs)
            _ABANDONED.extend(self._note_sends)  # not sent within the second: keep their buffers
            if self._broken:  # a signature exchange may still be under way: its buffers must stay
                _ABANDONED.append((getattr(self, "_meta_reqs", None), self._meta_recv, self._meta_send))
            for q in getattr(self, "_meta_reqs", []):
                q.Free()
            self._notes.Free()
            if not self._broken:
                self.comm.Free()
        except Exception as e:  # noqa: BLE001 - MPI may already be finalized at exit
            log.debug("closing the mpi transport: %s", e)
        self._note_reqs = []
        self._broken = self._broken or "closed"
        self.comm = None
