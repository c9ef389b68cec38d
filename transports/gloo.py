"""``gloo``: collectives through torch.distributed's gloo, for CPU tensors across nodes when there is no MPI.

Under torchrun without mpiexec this is the transport that spans nodes: a ``ProcessGroupGloo`` made over the
torch store the ranks already met on (the rendezvous's TCPStore, under a key prefix of its own), used as an
object (no ``init_process_group``, so the caller's default group is untouched). Gloo binds to the address
this host uses to reach the store (the torchrun master), so traffic goes where the rendezvous went; set
``GLOO_SOCKET_IFNAME`` to pick an interface instead, as for torch.distributed.

Like the other transports it fails loudly instead of hanging:

- every call first compares the call signatures (an allreduce of their digests; an allgather only when
  they differ) and raises ``ValueError`` on every rank naming the ranks whose shape, dtype or op differ
  (:func:`check_agreement`);
- every wait is bounded by the communicator's timeout (gloo's own timeout is set later, so ours fires
  first and can name who is missing);
- gloo reports a peer that went away ("Connection closed by peer") at once to the ranks that talk to it;
  the others learn it from *notices* in the store, which waiting ranks poll: "closed after N steps",
  "failed in step N (ranks ...)", and "who is here?", which every waiting rank answers, so a rank that
  times out or loses a connection names the ranks that did not answer. Peers on this node are also
  watched through /proc, as in the mpi transport.

A *step* is one wait (a signature exchange, a count exchange, a data transfer); every rank waits the same
steps in the same order, so step numbers agree across ranks and a peer that closed after finishing our
step is no failure.

Numerics match the other host transports: 16-bit floats are reduced in float32 and rounded once; floating
max/min are computed from an allgather in rank order by :func:`transports._host.reduce_into`, so NaN
propagates with the same bits on every rank and every transport (gloo's own max/min do not propagate NaN).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
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

# gloo's own per-operation timeout is ours plus this, so that ours fires first and names the missing ranks
_GLOO_SLACK_SECONDS = 30.0
_CHECK_EVERY = 0.01  # seconds between notice polls while waiting (after the spin window)
_CHECK_INTERVAL = datetime.timedelta(seconds=_CHECK_EVERY)
_PID_CHECK_EVERY = 0.05
_FAILURE_GRACE = 0.05  # seconds a wait may still complete after a peer was seen gone
# Requests and tensors of calls abandoned after a failure: gloo's threads may still write into them.
_ABANDONED: list = []


def gloo_usable(rendezvous: Any) -> str | None:
    """Why the gloo transport cannot be made over ``rendezvous``, or None when it can (no side effects).

    Args:
        rendezvous: the group's :class:`~transports.base.Rendezvous`.
    Returns:
        None, or a sentence saying what is missing.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch.distributed is not available in this torch build"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch build has no gloo (torch.distributed.is_gloo_available() is False)"
    if getattr(rendezvous, "store", None) is None:
        return ("gloo needs a torch store rendezvous (torchrun or collectives.launch); under mpiexec the mpi "
                "transport serves instead")
    return None


def local_address_towards(host: str, port: int) -> str:
    """The address of this host's interface that reaches ``host`` (a route lookup; nothing is sent).

    Args:
        host: a peer's (the store's) name or address.
        port: its port (any; only the route matters).
    Returns:
        This host's address on that route, e.g. "10.77.0.2"; "127.0.0.1" for a loopback peer.
    """
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)  # UDP connect: picks the route and source address, sends nothing
        return s.getsockname()[0]


class GlooTransport(Transport):
    """CPU tensors through a ProcessGroupGloo of the group's ranks (see the module docstring).

    Args:
        group: the group; its rendezvous must hold a torch store (``rendezvous.store``) and a key prefix
            no other group uses (``rendezvous.prefix``).
    """

    name = "gloo"
    devices = ("cpu",)
    takes_recv_counts = True

    def __init__(self, group: GroupInfo):
        super().__init__(group)
        why = gloo_usable(group.rendezvous)
        if why:
            raise RuntimeError(f"the gloo transport cannot start: {why}")
        import torch.distributed as dist

        self.dist = dist
        self.timeout = group.timeout
        self._ranks = list(group.global_ranks)
        self._broken: str | None = None
        # A fresh key space per transport: two transports made over one rendezvous never share keys.
        rdv = group.rendezvous
        nonce = rdv.allgather_bytes(secrets.token_hex(8).encode())[0].decode()
        self._store = dist.PrefixStore(f"{getattr(rdv, 'prefix', 'moecomm')}/gloo-{nonce}", rdv.store)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=self.timeout + _GLOO_SLACK_SECONDS)
        opts._devices = [self._device(rdv.store)]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", self._store), self.rank, self.size, opts)
        self._peers = [r for r in range(self.size) if r != self.rank]
        here = group.hosts[self.rank] if group.hosts else None
        self._local_pids = {r: group.pids[r] for r in self._peers
                            if here is not None and r < len(group.pids) and group.hosts[r] == here}
        # no busy polling: gloo's own threads move the data and need the cores (measured on the testbed, 2
        # nodes pinned to one core each: a 1 ms spin tripled the latency); work.wait() wakes the waiter
        self._spin_seconds = 0.0
        self._step = 0  # waits started
        self._done = 0  # waits completed
        self._events_seen = 0
        self._notes: dict[int, dict] = {}  # peer -> its notice (closed / failed / timed_out)
        self._heard: dict[int, int] = {}  # peer -> the step it waited in when it answered "who is here?"
        self._failure_noted = False  # this rank posted a failed / timed_out notice (close keeps it)
        self._agree_buf = torch.zeros(2, dtype=torch.int64)
        self._meta_in = torch.zeros(META_LEN, dtype=torch.int64)
        self._meta_out = torch.zeros(self.size * META_LEN, dtype=torch.int64)

    def _device(self, store: Any) -> Any:
        """The gloo device: GLOO_SOCKET_IFNAME's interface if set, else the address that reaches the store."""
        G = self.dist.ProcessGroupGloo
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        if ifname:
            return G.create_device(interface=ifname.split(",")[0])
        host = getattr(store, "host", None)
        if host:
            try:
                return G.create_device(hostname=local_address_towards(host, int(getattr(store, "port", 0) or 1)))
            except OSError as e:
                log.warning("gloo: no route to the store at %s (%s); using this host's default address", host, e)
        return G.create_default_device()

    def algorithm(self, opcode: OpCode, nbytes: int, dtype: torch.dtype) -> str:
        names = {OpCode.ALL_REDUCE: "allreduce", OpCode.ALL_GATHER: "allgather",
                 OpCode.REDUCE_SCATTER: "reduce_scatter", OpCode.ALL_TO_ALL: "alltoallv",
                 OpCode.BROADCAST: "broadcast", OpCode.BARRIER: "meta-exchange"}
        if opcode in (OpCode.ALL_REDUCE, OpCode.REDUCE_SCATTER) and dtype in (torch.float16, torch.bfloat16):
            return names[opcode] + " (float32)"
        return names.get(opcode, "?")

    # ---- waiting --------------------------------------------------------------------------
    def _wait(self, work: Any, what: str, keep: tuple = ()) -> None:
        """Wait for a gloo work: done, a peer's failure, or the timeout (then the work is abandoned).

        See :meth:`_wait_slowly`. ``keep``: the tensors the work reads or writes, kept for good when the wait
        fails (gloo cannot cancel a work).
        """
        self._step += 1
        try:
            if not work.is_completed():
                self._wait_slowly(work, what)
            try:
                work.wait()  # raises gloo's error if the work failed
            except RuntimeError as e:
                self._gloo_failed(e, what)
        except BaseException:
            _ABANDONED.append((work, keep))
            raise
        self._done = self._step

    def _wait_slowly(self, work: Any, what: str) -> None:
        """Spin briefly (the work may be done in microseconds), then block in the work's own wait for up to
        _CHECK_EVERY at a time, reading notices, watching local peers and checking the deadline in between.
        Gloo's threads move the data, so a blocked waiter costs its peers nothing (MPI, by contrast,
        progresses only inside our polls). Returns when the work is done, successfully or not."""
        start = time.monotonic()
        deadline = start + self.timeout
        spin_until = start + self._spin_seconds
        while not work.is_completed():
            if time.monotonic() >= spin_until:
                break
        else:
            return
        next_pid_check = 0.0
        while True:
            try:
                work.wait(_CHECK_INTERVAL)
                return
            except RuntimeError:  # "Operation timed out!" for this interval; the work goes on
                if work.is_completed():
                    return  # it failed: the caller's wait() raises gloo's error
            now = time.monotonic()
            check_pids = now >= next_pid_check
            if self._peer_failure(work, what, check_pids):
                return  # it completed after all
            if check_pids:
                next_pid_check = now + _PID_CHECK_EVERY
            if now >= deadline:
                self._time_out(what)

    def _failure_seen(self, what: str, check_pids: bool) -> Exception | None:
        """The error a peer's notice or death means for the current step, or None."""
        causes = []  # (priority, error): a root cause (a timeout, a close, a death) before a peer's abort
        try:
            self._poll_notices()
        except PeerFailedError as e:  # the store is gone; the notices read before it may still name the cause
            causes.append((4, e))
        me, step = self._ranks[self.rank], self._step
        for r, note in self._notes.items():
            kind, at, ranks = note["kind"], note["step"], note.get("ranks", [])
            if kind == "closed":
                if step > at:
                    causes.append((1, PeerFailedError(f"rank {self._ranks[r]} closed its communicator while rank "
                                                      f"{me} waited for it in gloo {what}", [self._ranks[r]])))
            elif step >= at and kind == "timed_out" and ranks:
                causes.append((0, CollectiveTimeoutError(
                    f"gloo {what} cannot complete on rank {me}: rank {self._ranks[r]} timed out waiting for "
                    f"rank(s) {ranks}, which never arrived, and gave up", ranks)))
            elif step >= at and kind == "failed" and ranks:
                causes.append((2, PeerFailedError(
                    f"gloo {what} cannot complete on rank {me}: rank(s) {ranks} failed ({note.get('why', '?')}), "
                    f"as rank {self._ranks[r]} found", ranks)))
            elif step >= at:
                causes.append((3, PeerFailedError(f"rank {self._ranks[r]} aborted after a failure while rank {me} "
                                                  f"waited for it in gloo {what}", [self._ranks[r]])))
        if check_pids:
            for r, pid in self._local_pids.items():
                if r not in self._notes and not pid_alive(pid):
                    causes.append((2, PeerFailedError(f"rank {self._ranks[r]} (pid {pid}) died while rank {me} "
                                                      f"waited for it in gloo {what}", [self._ranks[r]])))
        return min(causes, key=lambda c: c[0])[1] if causes else None

    def _peer_failure(self, work: Any, what: str, check_pids: bool) -> bool:
        """Raise if a peer closed, failed or died without taking part in the current step.

        Returns True when the step completed meanwhile (a peer that left after sending its part is no
        failure); False to go on waiting.
        """
        failure = self._failure_seen(what, check_pids)
        if failure is None:
            return False
        end = time.monotonic() + _FAILURE_GRACE
        while time.monotonic() < end:
            if work.is_completed():
                return True
            time.sleep(1e-3)
        self._raise(failure, what)

    def _gloo_failed(self, error: RuntimeError, what: str) -> None:
        """Gloo reported an error (mostly a peer's connection that closed): raise what it means, naming ranks."""
        self._raise(self._failure_seen(what, True), what, error)

    def _raise(self, failure: Exception | None, what: str, error: RuntimeError | None = None) -> None:
        """Ask who is still here, tell every peer, and raise ``failure`` (or, for None, gloo's ``error``)
        naming the ranks that did not answer too: the first sign of a failure is often a bystander (a rank
        its launcher stopped because a rank beside it died), not the rank that died."""
        silent = [self._ranks[r] for r in self._ask_who_is_here()]
        me = self._ranks[self.rank]
        if failure is None:
            text = str(error).split("This is typically")[0].strip()
            who = f"rank(s) {silent} did not answer (they died or left)" if silent else "every rank still answers"
            failure = PeerFailedError(f"gloo {what} failed on rank {me}: {text}; {who}", silent)
        else:
            named = list(getattr(failure, "missing_ranks", []))
            more = [r for r in silent if r not in named]
            if more:
                failure = type(failure)(f"{failure}; rank(s) {more} did not answer either (they died or left)",
                                        named + more)
        self._fail(str(failure), "failed", getattr(failure, "missing_ranks", []))
        if error is not None:
            raise failure from error
        raise failure

    def _ask_who_is_here(self) -> list[int]:
        """Ask every peer "who is here?" through the store; return the group ranks that did not answer
        within the grace period (those that posted a notice did answer). [] when the store is gone before
        the question went out; when it goes while the peers answer, those that had not answered."""
        try:
            self._answer()
            self._post_event()
        except Exception as e:  # noqa: BLE001 - the store's host is gone: nobody can be asked
            log.debug("gloo: cannot ask who is here: %s", e)
            return []
        grace_end = time.monotonic() + min(1.0, max(0.2, 0.1 * self.timeout))
        gone = {r for r, pid in self._local_pids.items() if process_state(pid) in ("T", "t", "X", "Z")}

        def silent() -> list[int]:
            return [r for r in self._peers if r not in self._heard and r not in self._notes]

        while [r for r in silent() if r not in gone] and time.monotonic() < grace_end:
            time.sleep(5e-3)
            try:
                self._poll_notices(read_answers=True)
            except PeerFailedError:  # the store went away: its node's ranks with it; the others had time
                break
        return silent()

    def _time_out(self, what: str) -> None:
        """Name who never arrived, tell every peer, and raise CollectiveTimeoutError."""
        me, step = self._ranks[self.rank], self._step
        states = {r: process_state(pid) for r, pid in self._local_pids.items()}
        missing = self._ask_who_is_here()
        if not missing:  # everyone is waiting; those in an earlier call hold the others up
            missing = sorted(r for r, at in self._heard.items() if at < step)
        why = {"T": "is stopped", "t": "is stopped by a debugger", "X": "is gone", "Z": "is gone"}
        notes = [f"rank {self._ranks[r]}: pid {self._local_pids[r]} {why[states[r]]}" for r in missing
                 if states.get(r) in why]
        names = [self._ranks[r] for r in missing]
        self._fail(f"{what} timed out", "timed_out", names)
        who = f"rank(s) {names} never arrived" if names else \
            "every rank is waiting, so the call itself is stuck (calling different collectives?)"
        raise CollectiveTimeoutError(f"gloo {what} timed out after the timeout of {self.timeout:.1f}s on rank {me}: "
                                     f"{who}"
                                     + (f" ({'; '.join(notes)})" if notes else ""), names)

    # ---- notices in the store ---------------------------------------------------------------
    def _post_event(self) -> None:
        self._store.add("events", 1)

    def _answer(self) -> None:
        self._store.set(f"here/{self.rank}", str(self._step))

    def _note(self, kind: str, step: int, ranks: list[int] = (), why: str = "") -> None:
        self._store.set(f"note/{self.rank}", json.dumps({"kind": kind, "step": step, "ranks": list(ranks),
                                                         "why": why[:300]}))
        self._post_event()

    def _fail(self, why: str, kind: str, ranks: list[int] = ()) -> None:
        """Mark this transport broken and tell every peer, so none waits for its own timeout."""
        self._broken = why
        try:
            self._note(kind, self._step, ranks, why)
            self._failure_noted = True
        except Exception as e:  # noqa: BLE001 - the store may be gone with its host; the error is raised anyway
            log.debug("gloo: could not post a notice: %s", e)

    def _poll_notices(self, read_answers: bool = False) -> None:
        """Read new notices (one store round trip when nothing changed) and answer "who is here?"."""
        try:
            events = int(self._store.add("events", 0))
        except Exception as e:  # noqa: BLE001 - the store's host died: say so where the wait ends
            gone = self._store_node_ranks()
            raise PeerFailedError(f"gloo: the rendezvous store is unreachable from rank {self._ranks[self.rank]} "
                                  f"(its host, the torchrun agent or rank 0, is gone?): {e}" + (
                                      f"; the store lives on the node of rank(s) {gone}, so they are gone with it"
                                      if gone else ""), gone) from e
        if events == self._events_seen and not read_answers:
            return
        self._events_seen = events
        self._answer()  # a peer may be asking who is here
        for r in self._peers:
            if r not in self._notes and self._store.check([f"note/{r}"]):
                self._notes[r] = json.loads(self._store.get(f"note/{r}"))
            if self._store.check([f"here/{r}"]):
                self._heard[r] = int(self._store.get(f"here/{r}"))

    # ---- blame: what a communicator built over this one tells the other ranks ----------------
    def post_blame(self, ranks: list[int]) -> None:
        """Tell every peer which (global) ranks a failure on this rank named, where the failure was in a
        collective of a communicator built over this one (collectives/hierarchical.py: a failed stage), so
        that they can name the rank that failed instead of a bystander. Unlike a failure notice it leaves
        this transport usable; one per rank (a later one replaces it)."""
        self._store.set(f"blame/{self.rank}", json.dumps([int(r) for r in ranks]))

    def blames(self) -> dict[int, list[int]]:
        """The peers' :meth:`post_blame` so far: global rank of the peer -> the global ranks it named."""
        found = {}
        for r in self._peers:
            key = f"blame/{r}"
            if self._store.check([key]):
                found[self._ranks[r]] = json.loads(self._store.get(key))
        return found

    def _store_node_ranks(self) -> list[int]:
        """The (global) ranks of this group on the node that hosts the rendezvous store, which a lost store
        takes with it: under torchrun node 0's agent hosts it (and ends its ranks when it exits), else rank 0
        does; that is global rank 0's node. [] where that is this rank's node (the /proc checks see deaths
        there; under collectives.launch the store's host is the launching process) or global rank 0 is not
        in this group."""
        hosts = self.group.hosts
        if 0 not in self._ranks or len(hosts) != self.size:
            return []
        node = hosts[self._ranks.index(0)]
        if node == hosts[self.rank]:
            return []
        return [self._ranks[r] for r in range(self.size) if hosts[r] == node]

    def _check_usable(self) -> None:
        if self._broken:
            if self.pg is None:
                raise CommunicatorBrokenError("the gloo transport of this communicator is closed; "
                                              "create a new communicator")
            raise CommunicatorBrokenError(
                f"gloo communicator is unusable after an earlier failure ({self._broken}); create a new one")

    # ---- collectives ----------------------------------------------------------------------
    def _allgather(self, out: torch.Tensor, inp: torch.Tensor, what: str) -> None:
        self._wait(self.pg._allgather_base(out, inp), what, keep=(out, inp))

    def exchange_meta(self, sig: Signature) -> np.ndarray:
        """Every rank's call signature: -> [size, META_LEN] int64.

        One allreduce(MAX) of [digest, -digest] (:attr:`Signature.value`, a digest of every field that must
        agree) tells every rank whether all signatures are equal (their maximum equals their minimum); only
        when they differ (the error path) does an allgather bring every rank's, so that
        :func:`check_agreement` names the ranks. Gloo's latency grows with the steps of its algorithm, and
        its ring runs more steps for more elements: measured on the testbed (2 nodes x 2 ranks on 2 cores,
        torch 2.13), an allreduce of 2 int64 took 0.7-2 ms, of 26 int64 about 6 ms, an allgather of 16
        int64 per rank 3.5-4.4 ms. When they agree, the rows returned are this rank's signature (identical
        in every compared field; the ``F_ROWS`` column, which may differ by design and which gloo never
        reads, is this rank's value).
        """
        self._check_usable()
        if self.size == 1:
            return sig.meta.reshape(1, -1).copy()
        both = self._agree_buf.numpy()
        both[0], both[1] = sig.value, -sig.value
        opts = self.dist.AllreduceOptions()
        opts.reduceOp = self.dist.ReduceOp.MAX
        self._wait(self.pg.allreduce([self._agree_buf], opts), "signature exchange", keep=(self._agree_buf,))
        if both[0] == -both[1]:
            return np.tile(sig.meta, (self.size, 1))
        self._meta_in.numpy()[:] = sig.meta
        self._allgather(self._meta_out, self._meta_in, "signature exchange")
        return self._meta_out.numpy().reshape(self.size, META_LEN).copy()

    def _agree(self, sig: Signature) -> None:
        metas = self.exchange_meta(sig)
        if not (metas[:, :F_ROWS] == sig.meta[:F_ROWS]).all():
            check_agreement(metas, self._ranks)

    def barrier(self, sig: Signature) -> None:
        check_agreement(self.exchange_meta(sig), self._ranks)

    def _reduce_op(self, op: ReduceOp) -> Any:
        R = self.dist.ReduceOp
        return {ReduceOp.SUM: R.SUM, ReduceOp.AVG: R.SUM, ReduceOp.PROD: R.PRODUCT, ReduceOp.MAX: R.MAX,
                ReduceOp.MIN: R.MIN}[op]

    def all_reduce(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        self._agree(sig)
        if send.dtype.is_floating_point and op in (ReduceOp.MAX, ReduceOp.MIN):
            # NaN-propagating, in rank order: every rank's input, reduced here like shm does
            every = torch.empty(self.size * send.numel(), dtype=send.dtype)
            self._allgather(every, send.reshape(-1), "all_reduce")
            parts = as_numpy(every).reshape(self.size, -1)
            reduce_into(as_numpy(out), list(parts), op, send.dtype)
            return
        opts = self.dist.AllreduceOptions()
        opts.reduceOp = self._reduce_op(op)
        if send.dtype in (torch.float16, torch.bfloat16):
            acc = send.float()  # accumulate in float32, round once (as the other host transports)
            self._wait(self.pg.allreduce([acc], opts), "all_reduce", keep=(acc,))
            if op == ReduceOp.AVG:
                acc.div_(self.size)
            out.copy_(acc)
            return
        if out.data_ptr() != send.data_ptr():
            out.copy_(send)
        self._wait(self.pg.allreduce([out], opts), "all_reduce", keep=(out,))
        if op == ReduceOp.AVG:
            y = as_numpy(out)
            reduce_into(y, [y], op, send.dtype, self.size)

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        """Every rank's block of this rank arrives by one alltoall, then is reduced here in rank order (as
        shm does: 16-bit floats in float32, NaN propagated, the same bits on every transport). It moves what
        a ring reduce-scatter moves, (n-1)/n of the input per rank. Not gloo's reduce_scatter: its work
        completes only inside wait(), so it cannot be polled against the timeout."""
        self._agree(sig)
        n = out.numel()
        blocks = torch.empty(self.size * n, dtype=send.dtype)
        block_bytes = n * send.element_size()
        ones = [1] * self.size  # one row (this rank's block) to and from every rank
        self._wait(self.pg.alltoall_base(blocks.view(torch.uint8).view(self.size, block_bytes),
                                         send.view(torch.uint8).view(self.size, block_bytes), ones, ones,
                                         self.dist.AllToAllOptions()), "reduce_scatter", keep=(blocks, send))
        reduce_into(as_numpy(out), list(as_numpy(blocks).reshape(self.size, -1)), op, send.dtype, self.size)

    def all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        self._agree(sig)
        self._allgather(out.view(torch.uint8), send.view(torch.uint8), "all_gather")

    def broadcast(self, send: torch.Tensor, out: torch.Tensor, src: int, sig: Signature) -> None:
        self._agree(sig)
        if self.rank == src and out.data_ptr() != send.data_ptr():
            out.copy_(send)
        opts = self.dist.BroadcastOptions()
        opts.rootRank = src
        y = out.view(torch.uint8)
        self._wait(self.pg.broadcast([y], opts), "broadcast", keep=(out, y))

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], row_numel: int, alloc: Allocator,
                   sig: Signature, recv_counts: list[int] | None = None) -> torch.Tensor:
        """See :meth:`Transport.all_to_all`. The counts go in one allgather of every rank's send counts and
        declared receive counts (``recv_counts``, zeros when not given), so every rank sees both matrices
        and, on a wrong declaration, raises the same ValueError before any row moves."""
        self._agree(sig)
        mine = torch.zeros(2 * self.size, dtype=torch.int64)
        mine[: self.size] = torch.as_tensor(send_counts, dtype=torch.int64)
        if recv_counts is not None:
            mine[self.size :] = torch.as_tensor(recv_counts, dtype=torch.int64)
        every = torch.empty(self.size * 2 * self.size, dtype=torch.int64)
        self._allgather(every, mine, "all_to_all count exchange")
        both = every.numpy().reshape(self.size, 2, self.size)
        sent, declared = both[:, 0], both[:, 1]  # sent[src][dst], declared[dst][src]
        if recv_counts is not None and not (declared == sent.T).all():
            check_recv_counts(sent.tolist(), declared.tolist(), self._ranks)
        counts_in = [int(c) for c in sent[:, self.rank]]
        out = alloc(counts_in)
        row_bytes = row_numel * send.element_size()
        if row_bytes == 0:  # rows without elements: nothing to move (every rank has the same row size)
            return out
        x = send.view(torch.uint8).view(-1, row_bytes)
        y = out.view(torch.uint8).view(-1, row_bytes)
        self._wait(self.pg.alltoall_base(y, x, counts_in, [int(c) for c in send_counts],
                                         self.dist.AllToAllOptions()), "all_to_all", keep=(send, out, x, y))
        return out

    def abort(self, why: str) -> None:
        if self.pg is not None and not self._broken:
            self._broken = why  # close aborts the process group and keeps what a work may touch
        self.close()

    def close(self) -> None:
        """Tell every peer how far this rank got (a peer waiting in a later step raises at once), then
        release the process group. Any later call on this transport raises CommunicatorBrokenError."""
        if self.pg is None:
            return
        if getattr(self, "p2p", None) is not None and not self._broken:
            self.p2p.flush(min(self.timeout, 10.0))  # eager point-to-point sends in flight (transports/_p2p.py)
        try:
            # after a failure notice, that notice stays: it names the rank that failed, where "closed" would
            # name this bystander to the peers that had not read it yet (it covers every later step too)
            if not self._failure_noted:
                self._note("closed", self._done)
        except Exception as e:  # noqa: BLE001 - the store may be gone at exit
            log.debug("gloo: could not post the close notice: %s", e)
        if getattr(self, "p2p", None) is not None:
            self.p2p.close()  # fails the gloo works of unfinished point-to-point operations (transports/_p2p.py)
        pg, self.pg = self.pg, None
        if self._broken:  # a work may still be under way: stop gloo, keep what it may touch
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001
                log.debug("gloo: abort: %s", e)
            _ABANDONED.append(pg)
        self._broken = self._broken or "closed"
