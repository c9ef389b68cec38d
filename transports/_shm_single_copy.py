"""The shm transport's single-copy paths: peers read each other's tensors with process_vm_readv.

A mixin of :class:`transports.shm.SharedMemoryTransport` (it uses the transport's control blocks,
synchronisation and failure handling); split out because it is one responsibility: whether the
group may read its peers' memory (probed and agreed at start-up), from which sizes that is faster
than staging through the slots, and the collectives that do it; with them the pairwise exchange
through the slots that an all_to_all's single copy is timed against (:data:`STAGED_COPY_CHUNK_BYTES`).
"""

from __future__ import annotations

import errno
import logging
import time
from itertools import accumulate

import numpy as np
import torch

from . import _cma
from ._host import copy_bytes, reduce_into
from ._path_choice import EXPLORE_EVERY, PathChooser, size_class
from ._schedule import part_bounds
from .base import CommunicatorBrokenError, GroupInfo, OpCode, PeerFailedError, ReduceOp, Signature

log = logging.getLogger(__name__)

# Single copy: from these sizes on (bytes of the call's input on each rank; all_to_all: of each
# sender's whole input) peers read each other's tensors with process_vm_readv (transports/_cma.py)
# instead of staging them through the slots, or, where TIME_ALL_GATHER_PATHS / TIME_ALL_TO_ALL_PATHS
# below apply, single copy and staging are timed against each other. From the staged vs single-copy
# sweep on the 2-vCPU CI machine (benchmarks/results/shm-single-copy-tuning.txt, before the staged
# path was compiled in several rounds): at 2 ranks single copy is 1.5-2.0x faster
# for all_gather of 1-4 MiB per rank (equal above) and 1.2-1.9x for all_to_all from 2 MiB per sender;
# the kernel's copy (7-15 GB/s) loses to the cache-resident slots everywhere else: all_reduce,
# reduce_scatter and broadcast ran 0.4-0.8x at every size, so they always stage (the single-copy
# code serves them with MOECOMM_SHM_SINGLE_COPY=always). With more ranks than cores (4 on 2) every op
# lost, so an oversubscribed group stages too.
SINGLE_COPY_MIN_BYTES = {
    OpCode.ALL_GATHER: 1 << 20,
    OpCode.ALL_TO_ALL: 2 << 20,
}
SINGLE_COPY_WHEN_OVERSUBSCRIBED = False
# all_gather writes each rank's block into its peers' outputs (process_vm_writev) instead of reading the
# peers' blocks: the writer's core reads its own block from its own cache, where a reader pulls lines the
# owner has just written out of the owner's cache. In place, with the block rewritten before each call as
# the bench does (benchmarks/results/shm-single-copy-push.txt, 2 ranks, median us), in one phase of the CI
# VM: 2 MiB 78-80 against 126-130, 8 MiB 432-476 against 593-650, 32 MiB 2560-2664 against 2756-3210
# (MPICH, which reads: 123-126, 536-573, 2675-2763); in a later phase the two were equal within ~5%.
# Never slower beyond the noise. Where writes are refused, it reads.
PUSH_ALL_GATHER = True
# From that size on (SINGLE_COPY_MIN_BYTES), all_gather, and an out-of-place all_to_all whose senders
# are all read in one copy, are timed rather than switched: rank 0 times the single-copy and the staged
# path on the first calls of each size and keeps the faster (transports/_path_choice.py). The staged
# path, compiled since the table above was measured, was 1.2-1.6x faster than single copy at 2-32 MiB
# in one phase of the CI VM and 2-2.5x slower in the next (shm-single-copy-tuning.txt, last section);
# no constant is right in both. In-place all_to_all is timed too, between its two swaps (below).
TIME_ALL_GATHER_PATHS = True
TIME_ALL_TO_ALL_PATHS = True  # out of place, and the in-place swap
SINGLE_PATH, STAGED_PATH = 1, 2  # the paths of a timed all_gather or all_to_all, as rank 0 publishes them
ALWAYS_SINGLE_COPY = (OpCode.ALL_REDUCE, OpCode.ALL_GATHER, OpCode.REDUCE_SCATTER, OpCode.ALL_TO_ALL,
                      OpCode.BROADCAST)
# Bytes read from each peer per step of a single-copy reduction: the peers' chunks and ours are
# reduced while they are still in this core's 1 MiB L2 (lscpu of the CI machine).
SINGLE_COPY_CHUNK_BYTES = 256 << 10

# In-place all_to_all swaps blocks pairwise in chunks of this many bytes: read the partner's chunk into
# an L2-resident buffer, wait until the partner has read ours, then copy it over ours. From the in-place
# exchange sweep on the 2-vCPU CI machine (benchmarks/results/shm-in-place-all-to-all.txt), 4 MiB blocks
# over four runs: 128 KiB chunks 474-598 us, 256 KiB 382-462, 512 KiB 375-436, 1 MiB 393-464; MPICH's way
# (copy the block aside, the partner reads the copy) 573-1020, reading into a whole-block buffer 415-633.
# 256 KiB per partner leaves room in the 1 MiB L2 for the rows being copied.
SWAP_CHUNK_BYTES = 256 << 10
# Bytes a rank stages per round where a staged path only copies (all_gather, and the in-place swap
# through the slots: stage our chunk for the partner, synchronise, copy the partner's chunk out of its
# slot over ours); at most a slot. 2 ranks on the CI VM, median us, every variant interleaved with the
# others (benchmarks/results/shm-in-place-all-to-all.txt, last section), 8 / 32 MiB per rank:
# - in-place all_to_all swapped through the slots in chunks of 256 KiB 271 / 1305, 384 KiB 265 / 1225,
#   512 KiB 270 / 1198, 768 KiB 278 / 1052, 1 MiB 482 / 2375 (single-copy swap 724 / 3085, MPICH in place
#   757 / 3093);
# - staged all_gather in place, rounds of 256 KiB 337 / 1848, 512 KiB 305 / 1706, 768 KiB 363 / 1635,
#   1 MiB (the whole slot) 494 / 2577.
# A chunk staged and the partner's chunk read must both stay in the core's 1 MiB L2 between the copies.
STAGED_COPY_CHUNK_BYTES = 512 << 10


# Outputs of failed single-copy all_gathers: the peers write into them (process_vm_writev) and may still
# be writing when this rank has raised, so they are never freed (a write into freed memory corrupted the
# heap: "free(): corrupted unsorted chunks" in a rank of test_a_failed_read_breaks_the_call_on_every_rank
# _naming_it, 2026-11-23). Only a call that failed (a timeout, a failed peer, a broken transport) or was
# interrupted (KeyboardInterrupt) lands here, after which the communicator is unusable: one buffer per
# broken communicator.
_WRITTEN_BY_PEERS: list[torch.Tensor] = []


class SingleCopyPaths:
    """Single-copy collectives of the shm transport (see the module docstring)."""

    def _setup_single_copy(self, group: GroupInfo, mode: str) -> None:
        """Probe (collectively) whether the ranks may read each other's memory; set the switch points.

        Every rank gets the same answer (:func:`_cma.probe` agrees on it), so every rank of a call
        takes the same path. ``single_copy_status`` says what was decided and why, for
        ``comm.plan()`` and ``moecomm doctor``.
        """
        self._copy_min: dict[OpCode, int] = {}
        self._tmp: np.ndarray | None = None
        self._swap_buf: np.ndarray | None = None
        self._swap_buf_addr = 0
        self._push = False  # all_gather writes its block into the peers' outputs (else reads theirs)
        self._timed_gather = False  # all_gather above its switch point is timed (TIME_ALL_GATHER_PATHS)
        self._gather_chooser: PathChooser | None = None  # rank 0's
        self._gather_paths: dict[tuple[int, bool], int] = {}  # (size class, in place) -> rank 0's last path
        self._timed_a2a = False  # out-of-place all_to_all of direct senders is timed (TIME_ALL_TO_ALL_PATHS)
        self._a2a_chooser: PathChooser | None = None  # rank 0's
        self._a2a_paths: dict[int, int] = {}  # size class of rank 0's send -> the path it last chose
        # Bytes per round of a staged path that only copies: STAGED_COPY_CHUNK_BYTES, at most a slot; a whole
        # slot in a group with more ranks than cores, where a round can cost a context switch.
        self._staged_chunk = self.slot_bytes if group.oversubscribed else min(self.slot_bytes, STAGED_COPY_CHUNK_BYTES)
        self._swap_chooser: PathChooser | None = None  # rank 0's, for the in-place swap
        self._swap_paths: dict[int, int] = {}  # size class of rank 0's send -> its last swap's path
        if mode == "off":
            self.single_copy_status = "off (MOECOMM_SHM_SINGLE_COPY=off)"
        elif self.size == 1:
            self.single_copy_status = "not needed (one rank)"
        else:
            refused, writes_refused = _cma.probe(group)
            self.cma_readable = refused is None  # point-to-point reads its peers' tensors (transports/_p2p_shm.py)
            if refused:
                self.single_copy_status = f"unavailable: {refused}; large messages are staged"
                log.info("shm single copy unavailable, staging large messages: %s", refused)
            elif mode == "always":
                self._copy_min = {op: 0 for op in ALWAYS_SINGLE_COPY}
                self.single_copy_status = "process_vm_readv at every size (always)"
            elif group.oversubscribed and not SINGLE_COPY_WHEN_OVERSUBSCRIBED:
                self.single_copy_status = ("available but not used: more ranks than cores here, where staging "
                                           "measured faster")
            else:
                self._copy_min = dict(SINGLE_COPY_MIN_BYTES)
                self.single_copy_status = "process_vm_readv"
                self._timed_gather = TIME_ALL_GATHER_PATHS
                self._timed_a2a = TIME_ALL_TO_ALL_PATHS
            if self._copy_min:
                self._push = writes_refused is None and PUSH_ALL_GATHER
                if writes_refused is not None:
                    self.single_copy_status += f" (all_gather reads: {writes_refused})"
                elif self._push:
                    self.single_copy_status += ", all_gather by process_vm_writev"
        self.single_copy = bool(self._copy_min)
        if self.rank == 0:
            self._gather_chooser = PathChooser((SINGLE_PATH, STAGED_PATH)) if self._timed_gather else None
            self._a2a_chooser = PathChooser((SINGLE_PATH, STAGED_PATH)) if self._timed_a2a else None
            self._swap_chooser = PathChooser((SINGLE_PATH, STAGED_PATH)) if self._timed_a2a else None

    def _use_single_copy(self, opcode: OpCode, nbytes: int) -> bool:
        limit = self._copy_min.get(opcode)
        return limit is not None and nbytes >= limit and nbytes > 0

    def _peer_addrs(self, r: int) -> tuple[int, int]:
        """(input, output) addresses rank ``r`` published at the last synchronisation."""
        a0 = self._bases[r] + self._addr0 + 2 * (self._epoch & 1)
        return self._q[a0], self._q[a0 + 1]

    def _read_peer(self, r: int, remote: int, local: int, nbytes: int) -> None:
        """Copy ``nbytes`` at address ``remote`` of rank ``r``'s process to ``local`` here; a failure
        (the peer died, or the kernel refused) breaks the transport and names the rank."""
        if nbytes > 0:
            self._cross(r, remote, local, nbytes, False)

    def _write_peer(self, r: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``local`` here to address ``remote`` of rank ``r``'s process; failures
        as :meth:`_read_peer`."""
        if nbytes > 0:
            self._cross(r, remote, local, nbytes, True)

    def _cross(self, r: int, remote: int, local: int, nbytes: int, write: bool) -> None:
        try:
            if write:
                _cma.write(self._pids[r], local, remote, nbytes)
            else:
                _cma.read(self._pids[r], remote, local, nbytes)
        except OSError as e:
            who, verb = self._ranks[r], ("write", "wrote to", "writing") if write else ("read", "read", "reading")
            self._check_peers([r], self._epoch + 2)  # raises if it aborted, closed or died meanwhile
            if e.errno == errno.ESRCH:
                self._abort(f"rank {who} (pid {self._pids[r]}) exited")
                raise PeerFailedError(f"rank {who} (pid {self._pids[r]}) exited while rank "
                                      f"{self._ranks[self.rank]} {verb[1]} its memory in a collective", [who]) from e
            self._abort(f"{verb[2]} rank {who}'s memory failed: {e}")
            raise CommunicatorBrokenError(f"shm single copy: rank {self._ranks[self.rank]} could not {verb[0]} rank "
                                          f"{who}'s memory ({e}); set MOECOMM_SHM_SINGLE_COPY=off to stage "
                                          "through shared memory instead") from e

    def _chunk_buffers(self, nbytes: int) -> list[np.ndarray]:
        """``size`` scratch buffers of ``nbytes`` each (kept between calls: no per-call allocation)."""
        n = self.size
        if self._tmp is None or self._tmp.nbytes < n * nbytes:
            self._tmp = np.empty(n * nbytes, dtype=np.uint8)
        return [self._tmp[r * nbytes : (r + 1) * nbytes] for r in range(n)]

    def _reduce_from_peers(self, x: np.ndarray, y: np.ndarray, x_at: int, y_at: int, count: int, op: ReduceOp,
                           dtype: torch.dtype) -> None:
        """y[y_at : y_at + count] = op over ranks (in rank order) of every rank's x[x_at : x_at + count],
        the peers' read in chunks straight from their inputs."""
        n, me, item = self.size, self.rank, x.itemsize
        step = max(1, SINGLE_COPY_CHUNK_BYTES // item)
        bufs = self._chunk_buffers(step * item)
        inputs = [self._peer_addrs(r)[0] for r in range(n)]
        aliased = np.may_share_memory(x, y)  # reduce_into's destination may alias only its first source
        for lo in range(0, count, step):
            hi = min(count, lo + step)
            nb = (hi - lo) * item
            srcs = [bufs[r][:nb].view(x.dtype) for r in range(n)]
            for r in range(n):
                if r != me:
                    self._read_peer(r, inputs[r] + (x_at + lo) * item, srcs[r].ctypes.data, nb)
                elif aliased:
                    np.copyto(srcs[r], x[x_at + lo : x_at + hi])
                else:
                    srcs[r] = x[x_at + lo : x_at + hi]
            reduce_into(y[y_at + lo : y_at + hi], srcs, op, dtype, n)

    def _single_copy_all_reduce(self, x: np.ndarray, y: np.ndarray, op: ReduceOp, dtype: torch.dtype,
                                sig: Signature) -> None:
        """Two-shot over the peers' own tensors: reduce our part from their inputs, then read their
        reduced parts from their outputs (three synchronisations, no staging)."""
        n, me, item = self.size, self.rank, x.itemsize
        self._begin_round()
        self._sync(sig, addrs=(x.ctypes.data, y.ctypes.data), spin_ns=self._large_spin_ns)
        outputs = [self._peer_addrs(r)[1] for r in range(n)]
        bounds = part_bounds(x.size, n)
        self._reduce_from_peers(x, y, bounds[me], bounds[me], bounds[me + 1] - bounds[me], op, dtype)
        self._begin_round()
        self._sync(spin_ns=self._large_spin_ns)  # every part is reduced
        for k in range(1, n):
            r = (me + k) % n
            lo, hi = bounds[r], bounds[r + 1]
            self._read_peer(r, outputs[r] + lo * item, y.ctypes.data + lo * item, (hi - lo) * item)
        self._begin_round()
        self._sync(spin_ns=self._large_spin_ns)  # the peers finished reading our output

    def _gather_label(self, nbytes: int) -> str:
        """all_gather's algorithm above its switch point: the path rank 0 last chose for this size
        out of place (both, before the first call of the size)."""
        single = "cma_push" if self._push else "cma_pull"
        if not self._timed_gather:
            return single
        return _timed_label(single, self._gather_paths.get((size_class(nbytes), False)))

    def _a2a_label(self, nbytes: int) -> str:
        """all_to_all's algorithm for a sender of ``nbytes``: pull below the single-copy size; above it
        cma_pull, or the path rank 0 last chose for its send of that size when it is timed: cma_pull or
        staged_pairwise (``_staged_pairwise_all_to_all``: a lockstep pairwise exchange in chunks, not
        pull's rounds of whole slots, so its own name: the performance model fits each name on its own,
        and one name over both put a false step into pull's fit at the switch point)."""
        if not self.single_copy or not 0 < nbytes or nbytes < self._a2a_direct_min:
            return "pull"
        if not self._timed_a2a:
            return "cma_pull"
        return _timed_label("cma_pull", self._a2a_paths.get(size_class(nbytes)), staged="staged_pairwise")

    def _swap_label(self, nbytes: int) -> str:
        """The in-place swap rank 0 last ran for a send of ``nbytes`` (both, before the first)."""
        return _timed_label("cma_swap", self._swap_paths.get(size_class(nbytes)), staged="staged_swap")

    def _swap_path(self) -> int:
        """After an in-place all_to_all's first synchronisation: the swap to run. Rank 0's published
        choice when it timed the call (it sends in one copy and exchanges in place: it then always
        chooses), else the single-copy swap. The same answer on every rank."""
        x0, in_place0 = self._peer_addrs(0)
        if not self._timed_a2a or not x0 or not in_place0:
            return SINGLE_PATH
        return self._published_path("all_to_all in place")

    def _timed_a2a_path(self) -> int | None:
        """After an all_to_all's first synchronisation: rank 0's path when the call is timed (every
        sender read in one copy, none in place), else None. The same answer on every rank."""
        n = self.size
        if not self._timed_a2a or any(not self._peer_addrs(r)[0] or self._peer_addrs(r)[1] for r in range(n)):
            return None
        return self._published_path("all_to_all")

    def _published_path(self, what: str) -> int:
        """The path rank 0 published for this call in its first synchronisation (just passed)."""
        path = self._q[self._bases[0] + self._choice0 + (self._epoch & 1)]
        if path not in (SINGLE_PATH, STAGED_PATH):
            raise RuntimeError(f"shm {what}: rank 0 published path {path}, not {SINGLE_PATH} or {STAGED_PATH}")
        return path

    def plan_note(self, opcode: OpCode, nbytes: int) -> str:
        limit = self._copy_min.get(opcode)
        if opcode == OpCode.ALL_GATHER and self._timed_gather and limit is not None:
            return (f"single copy ({self.single_copy_status}) or staged from {limit} B, whichever rank 0 timed "
                    f"faster on recent calls of its size class (sizes within 2x; the other is tried every {EXPLORE_EVERY} calls); "
                    f"{'now ' + self._gather_label(nbytes) if self._use_single_copy(opcode, nbytes) else 'staged'}")
        if limit is None:
            return f"single copy {self.single_copy_status}" + (
                "; staged: faster for this op at every size measured" if self.single_copy else "")
        if opcode == OpCode.ALL_TO_ALL:
            timed = (f"; out of place, when every sender is, single copy or staged, whichever rank 0 timed faster "
                     f"(now {self._a2a_label(nbytes)})" if self._timed_a2a else "")
            swap = (f"in place (out=x) such a sender swaps its blocks with its peers chunk by chunk, by single copy or "
                    f"through the slots, whichever rank 0 timed faster (now {self._swap_label(nbytes)})"
                    if self._timed_a2a else f"in place (out=x) such a sender swaps its blocks with its peers in "
                                            f"{SWAP_CHUNK_BYTES >> 10} KiB chunks")
            return f"single copy ({self.single_copy_status}) for senders of >= {limit} B{timed}; {swap}"
        used = "used" if self._use_single_copy(opcode, nbytes) else "not used"
        return f"single copy ({self.single_copy_status}) {used}: from {limit} B"

    def _single_copy_all_gather(self, x_addr: int, y_addr: int, nbytes: int, sig: Signature) -> None:
        """Write our input (``nbytes`` at ``x_addr``) straight into our block of every peer's y (``size *
        nbytes`` at its ``y_addr``), or, where writes were refused, read every peer's input into its
        block of ours; our own block is copied while the peers finish."""
        self._begin_round()
        self._sync(sig, addrs=(x_addr, y_addr), spin_ns=self._large_spin_ns)
        self._gather_copies(x_addr, y_addr, nbytes)

    def _timed_all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        """all_gather by single copy or through the slots, as rank 0 chose (``_gather_chooser``): it
        publishes the path with the addresses in the first synchronisation, every rank reads it
        there, and rank 0 times the whole call for its next choice."""
        x_addr, y_addr, nbytes = send.data_ptr(), out.data_ptr(), send.nbytes
        key = (size_class(nbytes), x_addr == y_addr + self.rank * nbytes)
        chooser = self._gather_chooser
        t0 = time.perf_counter() if chooser is not None else 0.0
        self._begin_round()
        self._sync(sig, addrs=(x_addr, y_addr), spin_ns=self._large_spin_ns,
                   choice=chooser.choose(key) if chooser is not None else None)
        path = self._published_path("all_gather")
        if path == STAGED_PATH:
            self._staged_all_gather(send, out, None)  # the signature was checked above
            self._timing_barrier()
        else:
            self._gather_copies(x_addr, y_addr, nbytes)
        self._gather_paths[key] = path
        if chooser is not None:
            chooser.record(key, path, (time.perf_counter() - t0) / nbytes)

    def _timing_barrier(self) -> None:
        """End a timed call's staged path as its single-copy path ends, when every rank has finished:
        otherwise rank 0's time would leave out the slowest peer's last round, which would land in
        the next call's first synchronisation instead, and the staged path would look faster than it is."""
        self._begin_round()
        self._await(self._publish(), self._large_spin_ns)

    def _keep_written_alive(self, out: torch.Tensor) -> None:
        """After a single-copy all_gather failed: keep ``out`` allocated for good when the peers write
        into it (:data:`_WRITTEN_BY_PEERS`)."""
        if self._push:
            _WRITTEN_BY_PEERS.append(out)

    def _gather_copies(self, x_addr: int, y_addr: int, nbytes: int) -> None:
        """The single-copy all_gather after its first synchronisation (the peers' addresses are published)."""
        n, me, spin = self.size, self.rank, self._large_spin_ns
        for k in range(1, n):
            r = (me + k) % n
            if self._push:
                self._write_peer(r, x_addr, self._peer_addrs(r)[1] + me * nbytes, nbytes)
            else:
                self._read_peer(r, self._peer_addrs(r)[0], y_addr + r * nbytes, nbytes)
        self._begin_round()
        done = self._publish()
        # our own block while the peers finish: it hides the difference in their copy times
        own = y_addr + me * nbytes
        if x_addr != own:  # in place: our block is there already
            copy_bytes(own, x_addr, nbytes)
        self._await(done, spin)  # the peers finished writing our output (reading our input)

    def _single_copy_reduce_scatter(self, x: np.ndarray, y: np.ndarray, op: ReduceOp, dtype: torch.dtype,
                                    sig: Signature) -> None:
        """y ([m]) = our block of the reduction of every rank's x ([size * m]), read from the peers."""
        m = y.size
        self._begin_round()
        self._sync(sig, addrs=(x.ctypes.data, 0), spin_ns=self._large_spin_ns)
        self._reduce_from_peers(x, y, self.rank * m, 0, m, op, dtype)
        self._begin_round()
        self._sync(spin_ns=self._large_spin_ns)  # the peers finished reading our input

    def _single_copy_broadcast(self, x: np.ndarray, y: np.ndarray, src: int, sig: Signature) -> None:
        """y ([nbytes] uint8) = rank ``src``'s x, read from its memory."""
        root = self.rank == src
        self._begin_round()
        self._sync(sig, addrs=(x.ctypes.data if root else 0, 0), spin_ns=self._large_spin_ns)
        if not root:
            self._read_peer(src, self._peer_addrs(src)[0], y.ctypes.data, x.nbytes)
        elif y.ctypes.data != x.ctypes.data:
            np.copyto(y, x)
        self._begin_round()
        self._sync(spin_ns=self._large_spin_ns)  # the ranks finished reading the root's input

    # ---- in-place all_to_all ----------------------------------------------------------------
    def _can_swap(self, counts: list[list[int]]) -> bool:
        """Whether this all_to_all is an in-place swap: some rank exchanges in place, and the swap can
        serve the call (not: a rank that sends rows but was not read in one copy, it staged them; or
        counts that are not symmetric, rank s's block for d would not sit where d's block for s lands).
        Every rank computes the same answer from what all published at the first synchronisation."""
        n = self.size
        published = [self._peer_addrs(r) for r in range(n)]
        if not any(out for _, out in published):
            return False
        for s in range(n):
            if not published[s][0] and any(counts[s]):
                return False
            for d in range(s):
                if counts[s][d] != counts[d][s]:
                    return False
        return True

    def _pairwise_steps(self, counts: list[list[int]], row_bytes: int, chunk: int) -> list[int]:
        """Rounds of ``chunk`` bytes in each step k of a pairwise exchange, in which rank s and its
        partner (k - s) mod size send each other their blocks: the most any pair of that step moves
        one way, so that every rank makes the same rounds."""
        n = self.size
        steps = []
        for k in range(n):
            pairs = [(s, (k - s) % n) for s in range(n) if (k - s) % n != s]
            biggest = max((max(counts[s][p], counts[p][s]) for s, p in pairs), default=0)
            steps.append(-(-biggest * row_bytes // chunk))
        return steps

    def _swap_buffer(self) -> int:
        """Address of the in-place swap's chunk buffer (kept between calls, like _chunk_buffers')."""
        if self._swap_buf is None or self._swap_buf.nbytes < SWAP_CHUNK_BYTES:
            self._swap_buf = np.empty(SWAP_CHUNK_BYTES, dtype=np.uint8)
            self._swap_buf_addr = self._swap_buf.ctypes.data
        return self._swap_buf_addr

    def _swap_all_to_all(self, x_addr: int, out: torch.Tensor, counts: list[list[int]], row_bytes: int
                         ) -> torch.Tensor:
        """all_to_all after its first synchronisation, as pairwise swaps in lockstep: in step k this rank
        and its partner p = (k - rank) mod size read each other's block chunk by chunk; after each chunk
        every rank waits for all (the partner has read that chunk of ours), then a rank in place copies
        the chunk it read over its own. A rank out of place reads straight into ``out``. The blocks sit
        at the same offsets in x and out (symmetric counts: :meth:`_can_swap`)."""
        n, me, spin = self.size, self.rank, self._large_spin_ns
        steps = self._pairwise_steps(counts, row_bytes, SWAP_CHUNK_BYTES)
        y_addr = out.data_ptr()
        in_place = y_addr == x_addr
        # our block for rank r = its block for us: offsets[r] in x and in out
        offsets = list(accumulate((c * row_bytes for c in counts[me]), initial=0))
        inputs = [self._peer_addrs(r)[0] for r in range(n)]  # read now: the parity words move with each round
        if not in_place:
            copy_bytes(y_addr + offsets[me], x_addr + offsets[me], offsets[me + 1] - offsets[me])
        buf = self._swap_buffer() if in_place else 0
        for k in range(n):
            p = (k - me) % n
            size = (offsets[p + 1] - offsets[p]) if p != me else 0
            theirs = inputs[p] + sum(counts[p][:me]) * row_bytes if size else 0
            for lo in range(0, steps[k] * SWAP_CHUNK_BYTES, SWAP_CHUNK_BYTES):
                nb = min(SWAP_CHUNK_BYTES, size - lo)
                if nb > 0:
                    self._read_peer(p, theirs + lo, buf if in_place else y_addr + offsets[p] + lo, nb)
                self._begin_round()
                self._await(self._publish(), spin)  # every rank read this chunk of its partner's block
                if in_place and nb > 0:
                    copy_bytes(x_addr + offsets[p] + lo, buf, nb)
        return out

    def _staged_pairwise_all_to_all(self, x_addr: int, out: torch.Tensor, counts: list[list[int]], row_bytes: int
                                    ) -> torch.Tensor:
        """all_to_all after its first synchronisation as pairwise exchanges in lockstep through the slots
        (the in-place swap's other path, and the timed out-of-place call's staged path): in step k this
        rank and its partner p = (k - rank) mod size exchange their blocks for each other, a chunk per
        round (``_staged_chunk``; the rounds of each step: :meth:`_pairwise_steps`). Per round
        this rank stages the next chunk of its block for p into its slot, every rank synchronises, and it
        copies p's chunk for it out of p's slot into ``out``. Two plain copies a chunk, the slot side
        still in a cache, where single copy pays the kernel's page walk on both sides
        (benchmarks/results/shm-in-place-all-to-all.txt). In place (``out`` at ``x_addr``) the counts are
        symmetric (:meth:`_can_swap`), so each chunk lands where the one just staged left. Rounds
        alternate between the two slots, so a slot is rewritten only after the partner has copied out
        of it (transports/shm.py's module docstring)."""
        n, me, chunk, spin = self.size, self.rank, self._staged_chunk, self._large_spin_ns
        steps = self._pairwise_steps(counts, row_bytes, chunk)
        y_addr = out.data_ptr()
        # our block for rank r in x; its block for us in out
        send_at = list(accumulate((c * row_bytes for c in counts[me]), initial=0))
        recv_at = list(accumulate((counts[r][me] * row_bytes for r in range(n)), initial=0))
        if y_addr != x_addr:
            copy_bytes(y_addr + recv_at[me], x_addr + send_at[me], send_at[me + 1] - send_at[me])
        for k in range(n):
            p = (k - me) % n
            send = send_at[p + 1] - send_at[p] if p != me else 0
            recv = recv_at[p + 1] - recv_at[p] if p != me else 0
            for lo in range(0, steps[k] * chunk, chunk):
                b = self._begin_round()
                if lo < send:
                    self._stage(b, 0, x_addr + send_at[p] + lo, min(chunk, send - lo))
                self._sync(spin_ns=spin)
                if lo < recv:
                    self._pull(b, p, 0, y_addr + recv_at[p] + lo, min(chunk, recv - lo))
        return out


def _timed_label(single: str, path: int | None, *, staged: str = "pull") -> str:
    """A timed op's algorithm name: ``single`` or ``staged`` by rank 0's last path, both before one."""
    return {SINGLE_PATH: single, STAGED_PATH: staged}.get(path, f"{single}|{staged}")
