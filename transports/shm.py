"""``shm``: collectives between the processes of one node through POSIX shared memory.

One segment per group, created by group rank 0 and mapped by every rank::

    [control: one block per rank][data: per rank, two slots of ``slot_bytes``]

A control block holds the rank's arrival counter (epoch), an abort/close flag,
and two parity copies of its call signature, its all-to-all send counts and the
receive counts its caller declared (``recv_counts=``, checked against the send counts). Data
moves in *rounds*: a rank writes its slot, publishes its epoch, waits for every
peer's epoch, then reads what it needs straight out of the peers' slots (no
pickling, no extra hop). Rounds alternate between the two slots, so a slot is
rewritten only after every peer has arrived at a later synchronisation, which
it does only after finishing its reads of the earlier round.

Messages that fit a slot go through the compiled helper transports._shmfast when it is built (stage,
publish, spin, check, reduce in one call: transports/_shm_latency.py; the Python path below is its
fallback and reference). Large all_gather and all_to_all messages skip the slots: peers read (all_gather:
write) each other's tensors in one copy with process_vm_readv/writev (transports/_cma.py,
transports/_shm_single_copy.py)
where a start-up probe allows it and it measured faster.

Waits spin briefly, then yield, then sleep with backoff, so runs with more ranks
than cores do not crawl, and every wait ends at the communicator's timeout, when
a peer's process dies, or when a peer aborts, naming the ranks involved
(transports/_shm_sync.py).

The segment is unlinked as soon as every rank has mapped it, so nothing stays in
/dev/shm even when all ranks are SIGKILLed; a crash inside that short window is
cleaned up by the next start (segments of dead creators are removed).
"""

from __future__ import annotations

import ctypes
import logging
import time

import numpy as np
import torch

from ._native import load_shmfast
from ._host import as_numpy, copy_bytes, group_settings, reduce_into
from ._segment import create_and_map
from ._shm_latency import CompiledLatencyPaths
from ._p2p_shm import area_bytes as p2p_area_bytes
from ._p2p_shm import attach as attach_p2p
from ._path_choice import size_class
from ._shm_single_copy import STAGED_PATH, SingleCopyPaths
from ._shm_sync import _META0, _STATE, _STATE_CLOSED, RoundSync, _fence
from ._schedule import all_to_all_pulls, part_bounds, staged_segments, windows
from .base import (
    DTYPE_CODES,
    META_LEN,
    Allocator,
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    ReduceOp,
    Signature,
    Transport,
    check_recv_counts,
)

log = logging.getLogger(__name__)


# A wait that follows a large copy busy-waits this long before it sleeps on the futex: the peer's copy
# ends a few to a few hundred us after ours, and waking from the futex cost ~40-60 us a call on the CI VM.
# benchmarks/results/shm-large-wait-spin.txt (2 ranks, two runs, median us a call, 0 -> 200 us budget):
# all_gather in place 8 MiB 351/343 -> 303/306, 16 MiB 891/864 -> 803/804; all_to_all 8 MiB 508/504 ->
# 440/450; 50 to 1000 us all alike, 2 MiB and below unchanged. Only with a core per rank: with more ranks
# than cores the spinning would hold a core a peer needs.
LARGE_WAIT_SPIN_NS = 200_000

# Per-slot size; each rank has two slots and messages larger than a slot go in rounds.
# 1 MiB: in benchmarks/results/shm-allreduce-tuning.txt (2 vCPUs with 1 MiB of L2 each) it beat
# 4 and 16 MiB slots by 1.0-1.5x at 4-64 MiB, ties them below: a round's data stays in cache between
# the writer's copy and the readers' reduction. A round's two synchronisations cost ~2 us against
# ~100 us of copying, so more rounds cost nothing measurable.
DEFAULT_SLOT_BYTES = 1 << 20

# all_reduce: one-shot (every rank reduces each window from all slots: 1 sync a round) up to
# settings["shm_one_shot_max"] bytes, two-shot (reduce-scatter + all-gather through the slots: 2 syncs
# a round, 1/n of the additions per rank) above. The communicator fills that setting in from the
# performance model (collectives/prediction.py: where the fitted one-shot and two-shot lines cross for
# the group's size). This fallback serves a transport made without it (a GroupInfo built by hand, a
# model without shm fits): 64 KiB, the largest size at which one-shot won for 2, 3 and 4 ranks in
# benchmarks/results/shm-allreduce-tuning.txt.
ONE_SHOT_MAX_BYTES_DEFAULT = 64 << 10
ONE_SHOT_UNBOUNDED = 1 << 62  # a one-shot limit no message reaches: always one-shot

def _tight_timer_slack() -> None:
    """Let short sleeps in waits end on time: Linux adds 50 us of timer slack to every sleep by default."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(29, 1000)  # PR_SET_TIMERSLACK, 1 us
    except (OSError, AttributeError):
        pass


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class SharedMemoryTransport(RoundSync, CompiledLatencyPaths, SingleCopyPaths, Transport):
    name = "shm"
    devices = ("cpu",)
    takes_rank_block_alias = True
    takes_shaped_rows = True

    def __init__(self, group: GroupInfo, *, slot_bytes: int | None = None):
        super().__init__(group)
        if not group.single_node:
            raise RuntimeError("shm transport needs every rank of the group on one node")
        n = self.size
        settings = group_settings(group)
        self.slot_bytes = _align(int(slot_bytes or settings["shm_slot_bytes"] or DEFAULT_SLOT_BYTES), 4096)
        self.timeout = group.timeout
        self._pids = list(group.pids)
        self._ranks = list(group.global_ranks)
        self._counts0 = _META0 + 2 * META_LEN
        self._recv0 = self._counts0 + 2 * n
        self._addr0 = self._recv0 + 2 * n  # two parities of (send address, output address): single copy
        self._wait0 = self._addr0 + 4  # the epoch this rank sleeps for on a futex (0: awake)
        self._choice0 = self._wait0 + 1  # two parities of the path rank 0 chose for a timed call
        self._ctrl_words = _align(self._choice0 + 2, 16)  # 128-byte aligned blocks
        ctrl_bytes = _align(n * self._ctrl_words * 8, 4096)
        total = ctrl_bytes + n * 2 * self.slot_bytes + p2p_area_bytes(n)  # + point-to-point (_p2p_shm.py)
        self._map, self.segment_name = create_and_map(group, total)
        self._ctrl = np.frombuffer(self._map, dtype=np.int64, count=n * self._ctrl_words).reshape(n, self._ctrl_words)
        self._q = memoryview(self._map)[: n * self._ctrl_words * 8].cast("q")  # fast scalar access
        self._slots = [
            [np.frombuffer(self._map, dtype=np.uint8, count=self.slot_bytes,
                           offset=ctrl_bytes + (r * 2 + b) * self.slot_bytes) for r in range(n)]
            for b in range(2)
        ]
        # Fault the slots in now (our own by writing them, the peers' by reading a byte a page): the
        # first staged calls would otherwise pay for it, ~0.4 ms a MiB on the CI VM, and a timed path
        # choice (transports/_path_choice.py) made on those calls would be made on page faults.
        for b in range(2):
            self._slots[b][self.rank][:] = 0
        for r in range(n):
            if r != self.rank:
                for b in range(2):
                    int(self._slots[b][r][::4096].sum())
        self._bases = [r * self._ctrl_words for r in range(n)]
        self._my_base = self._bases[self.rank]
        self._peers = [r for r in range(n) if r != self.rank]
        self._peer_bases = [self._bases[r] for r in self._peers]
        self._view_cache: dict = {}
        self._pull_cache: dict = {}
        base = self._ctrl.ctypes.data
        self._slot_addr = [[base + ctrl_bytes + (r * 2 + b) * self.slot_bytes for r in range(n)] for b in range(2)]
        self._epoch = 0
        self._use = 0
        self._broken: str | None = None  # why this transport is unusable (a failure, or "closed")
        oversubscribed = group.oversubscribed
        # Spin (~100 ns a turn) only briefly: a peer that is not running now will not arrive soon, and
        # with more ranks than cores the spinning would steal its core. Then yield, then sleep.
        spin = settings["shm_spin"]
        self._spin_iters = int(spin if spin is not None else (16 if oversubscribed else 400))
        self._yield_iters = int(settings["shm_yield"])
        self._large_spin_ns = 0 if oversubscribed else LARGE_WAIT_SPIN_NS
        _tight_timer_slack()
        one_shot = settings["shm_one_shot_max"]
        self._one_shot_limit = int(one_shot) if one_shot is not None else (
            ONE_SHOT_UNBOUNDED if n == 1 else ONE_SHOT_MAX_BYTES_DEFAULT)
        self._setup_single_copy(group, settings["shm_single_copy"])
        self._setup_native(group, ctrl_bytes, settings["shm_native"] != "off", settings["shm_sleep"] == "futex")
        attach_p2p(self, ctrl_bytes + n * 2 * self.slot_bytes)
        log.debug("shm transport up: segment %s, %d ranks, slot %d B, oversubscribed=%s, single copy: %s",
                  self.segment_name, n, self.slot_bytes, oversubscribed, self.single_copy_status)

    def _views(self, b: int, nbytes: int, st: np.dtype) -> list[np.ndarray]:
        """Typed views of the first ``nbytes`` of every rank's slot ``b`` (cached: the hot path)."""
        key = (b, nbytes, st)
        v = self._view_cache.get(key)
        if v is None:
            if len(self._view_cache) > 256:
                self._view_cache.clear()
            v = self._view_cache[key] = [s[:nbytes].view(st) for s in self._slots[b]]
        return v

    # ---- compiled small-message helper ------------------------------------------------------
    def _setup_native(self, group: GroupInfo, ctrl_bytes: int, enabled: bool, futex_sleep: bool) -> None:
        """Use transports._shmfast when every rank has it (collective: one exchange of a flag).

        Its results are bitwise those of the Python path except NaN payloads and the sign of a
        tied zero in bfloat16 max/min (torch itself differs there between its vector body and
        tail), so the ranks of a group take the same path.
        """
        fast = load_shmfast(enabled=enabled)
        if self.size > 1:
            flags = group.rendezvous.allgather_bytes(b"1" if fast is not None else b"0")
            if fast is not None and b"0" in flags:
                lacking = [self._ranks[r] for r, f in enumerate(flags) if f == b"0"]
                log.warning("shm: rank(s) %s run without the compiled helper, so this group runs in Python", lacking)
                fast = None
        self._g = self._sleeper = None
        self.native_status = "compiled helper" if fast is not None else "Python"
        if fast is not None:
            base = self._ctrl.ctypes.data
            # With a futex to sleep on and a core per rank, a wait goes from spinning straight to sleeping:
            # a sched_yield hands the core to whatever else runs, which can cost a whole time slice (ms),
            # a futex wake only the peer's arrival (bench-ddp under two busy loops: 1.05-1.07x gloo against
            # 0.23-0.33x with timed sleeps, benchmarks/results/bench-ddp-contended.txt). With more ranks
            # than cores the yields hand the core to a sibling rank, which is what the wait needs: 4x
            # faster there than sleeping at once (4 ranks on 2 cores, small all_reduce: ~14 against ~55 us,
            # benchmarks/results/shm-sleep-oversubscribed.txt).
            futex_sleep = futex_sleep and bool(fast.HAS_FUTEX)  # Linux only; elsewhere timed sleeps
            yields = 0 if futex_sleep and not group.oversubscribed else self._yield_iters
            self._g = fast.Group(base, self._ctrl_words, self.size, self.rank, base + ctrl_bytes, self.slot_bytes,
                                 self._spin_iters, yields, self._counts0, self._addr0, self._wait0)
            if futex_sleep:
                self._sleeper = self._g.sleep
        # the latency paths' limits, as plain ints: one comparison per call
        self._all_reduce_copy_min = self._copy_min.get(OpCode.ALL_REDUCE, ONE_SHOT_UNBOUNDED)
        self._native_all_reduce_max = min(self.slot_bytes, self._one_shot_limit, self._all_reduce_copy_min - 1)
        self._native_gather_max = min(self.slot_bytes, self._copy_min.get(OpCode.ALL_GATHER, ONE_SHOT_UNBOUNDED) - 1)
        self._native_scatter_max = min(self.slot_bytes,
                                       self._copy_min.get(OpCode.REDUCE_SCATTER, ONE_SHOT_UNBOUNDED) - 1)
        self._a2a_direct_min = max(1, self._copy_min.get(OpCode.ALL_TO_ALL, ONE_SHOT_UNBOUNDED))  # sender bytes

    # ---- capabilities ---------------------------------------------------------------------
    def algorithm(self, opcode: OpCode, nbytes: int, dtype: torch.dtype) -> str:
        if self._use_single_copy(opcode, nbytes) and opcode != OpCode.ALL_TO_ALL:
            if opcode == OpCode.ALL_GATHER:
                return self._gather_label(nbytes)
            return {OpCode.ALL_REDUCE: "cma_two_shot", OpCode.REDUCE_SCATTER: "cma_pull_reduce"}.get(opcode, "cma_pull")
        if opcode == OpCode.ALL_REDUCE:
            return "one_shot" if nbytes <= self._one_shot_limit else "two_shot"
        if opcode == OpCode.ALL_TO_ALL:
            # Each sender picks single copy from its own input size: this names how this rank's rows
            # travel (an uneven exchange may mix both), so that an even sweep's rows, and the model
            # fitted on them, tell the staged reads from the single-copy ones.
            return self._a2a_label(nbytes)
        return {OpCode.ALL_GATHER: "pull", OpCode.REDUCE_SCATTER: "pull_reduce", OpCode.ALL_TO_ALL: "pull",
                OpCode.BROADCAST: "pull", OpCode.BARRIER: "flags"}.get(opcode, "flags")

    # ---- collectives ----------------------------------------------------------------------
    def exchange_meta(self, sig: Signature) -> np.ndarray:
        self._begin_round()
        self._sync(sig, check=False)
        return self._metas()

    def barrier(self, sig: Signature) -> None:
        self._begin_round()
        self._sync(sig)

    def all_reduce(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        if self._g is not None and send.nbytes <= self._native_all_reduce_max:  # the latency path, compiled
            self._compiled_all_reduce(send.numel(), DTYPE_CODES[send.dtype], int(op), sig)(send.data_ptr(),
                                                                                           out.data_ptr())
            return
        dtype = send.dtype
        x, y = as_numpy(send), as_numpy(out)
        nbytes = x.nbytes
        if nbytes >= self._all_reduce_copy_min and nbytes:
            self._single_copy_all_reduce(x, y, op, dtype, sig)
            return
        if nbytes <= self.slot_bytes and nbytes <= self._one_shot_limit:  # the latency path: one round
            views = self._views(self._begin_round(), nbytes, x.dtype)
            np.copyto(views[self.rank], x)
            self._sync(sig)
            reduce_into(y, views, op, dtype, self.size)
            return
        n, me = self.size, self.rank
        item = x.itemsize
        window = self.slot_bytes // item // (n * 16) * (n * 16)  # elements; parts stay 64B-aligned
        first = sig
        if nbytes <= self._one_shot_limit:
            # one-shot in rounds: every rank reduces each whole window from all slots
            for lo, hi in windows(x.size, window):
                views = self._views(self._begin_round(), (hi - lo) * item, x.dtype)
                np.copyto(views[me], x[lo:hi])
                self._sync(first)
                first = None
                reduce_into(y[lo:hi], views, op, dtype, n)
            return
        # two-shot: per round, reduce-scatter of the window through the slots, then all-gather.
        # Our own part is reduced straight from x, so it is not staged (unless out is x).
        in_place = np.may_share_memory(x, y)
        for lo, hi in windows(x.size, window):
            cnt = hi - lo
            slots = self._views(self._begin_round(), cnt * item, x.dtype)
            bounds = part_bounds(cnt, n)
            p0, p1 = bounds[me], bounds[me + 1]
            if in_place:
                np.copyto(slots[me], x[lo:hi])
            else:
                np.copyto(slots[me][:p0], x[lo : lo + p0])
                np.copyto(slots[me][p1:], x[lo + p1 : hi])
            self._sync(first)
            first = None
            mine = y[lo + p0 : lo + p1]
            srcs = [s[p0:p1] for s in slots]
            if not in_place:
                srcs[me] = x[lo + p0 : lo + p1]
            reduce_into(mine, srcs, op, dtype, n)
            np.copyto(slots[me][p0:p1], mine)
            self._sync()
            for r in range(n):
                if r != me:
                    np.copyto(y[lo + bounds[r] : lo + bounds[r + 1]], slots[r][bounds[r] : bounds[r + 1]])

    def all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        if self._g is not None and send.nbytes <= self._native_gather_max:  # the latency path, compiled
            self._compiled_all_gather(send.nbytes, sig)(send.data_ptr(), out.data_ptr())
            return
        if self._use_single_copy(OpCode.ALL_GATHER, send.nbytes):  # plain addresses: no NumPy views
            try:
                if self._timed_gather:
                    self._timed_all_gather(send, out, sig)
                else:
                    self._single_copy_all_gather(send.data_ptr(), out.data_ptr(), send.nbytes, sig)
            except BaseException:  # an interrupt too: a slower peer may still write into out
                self._keep_written_alive(out)
                raise
            return
        self._staged_all_gather(send, out, sig)

    def _staged_all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature | None) -> None:
        """all_gather through the slots, a chunk of every rank's input per round (``sig``: checked in the
        first round's synchronisation; None when an earlier one checked it). The chunk is
        :data:`~transports._shm_single_copy.STAGED_COPY_CHUNK_BYTES`, at most a slot: 1.4-1.8x faster
        than a whole 1 MiB slot at 8-32 MiB on 2 ranks of the CI VM. Copies by address (the compiled
        helper's when built) and waits with the large-copy spin: 5-25% faster than NumPy views and a
        plain wait (same VM, benchmarks/results/shm-in-place-all-to-all.txt)."""
        x_addr, y_addr, nbytes, me = send.data_ptr(), out.data_ptr(), send.nbytes, self.rank
        own = y_addr + me * nbytes  # x itself in place: nothing to copy there
        first = sig
        for lo, hi in windows(nbytes, self._staged_chunk):
            b = self._begin_round()
            self._stage(b, 0, x_addr + lo, hi - lo)
            self._sync(first, spin_ns=self._large_spin_ns)
            first = None
            for r in range(self.size):
                if r != me:
                    self._pull(b, r, 0, y_addr + r * nbytes + lo, hi - lo)
                elif own != x_addr:
                    copy_bytes(own + lo, x_addr + lo, hi - lo)

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        if self._g is not None and send.nbytes <= self._native_scatter_max:  # the latency path, compiled: one round
            self._compiled_reduce_scatter(out.numel(), DTYPE_CODES[send.dtype], int(op), send.element_size(),
                                          sig)(send.data_ptr(), out.data_ptr())
            return
        x, y = as_numpy(send), as_numpy(out)
        n, me, dtype = self.size, self.rank, send.dtype
        m = y.size
        if self._use_single_copy(OpCode.REDUCE_SCATTER, x.nbytes):
            self._single_copy_reduce_scatter(x, y, op, dtype, sig)
            return
        window = max(1, self.slot_bytes // x.itemsize // n)
        # our own block is reduced straight from x, unless out is that block (reduce_into's
        # destination may alias only its first source): then it is staged like the peers' blocks
        aliased = np.may_share_memory(x, y)
        first = sig
        for lo, hi in windows(m, window):
            w = hi - lo
            slots = self._views(self._begin_round(), n * w * x.itemsize, x.dtype)
            for d in range(n):
                if d != me or aliased:
                    np.copyto(slots[me][d * w : (d + 1) * w], x[d * m + lo : d * m + hi])
            self._sync(first)
            first = None
            srcs = [s[me * w : (me + 1) * w] for s in slots]
            if not aliased:
                srcs[me] = x[me * m + lo : me * m + hi]
            reduce_into(y[lo:hi], srcs, op, dtype, n)

    def broadcast(self, send: torch.Tensor, out: torch.Tensor, src: int, sig: Signature) -> None:
        x = as_numpy(send).view(np.uint8)
        y = as_numpy(out).view(np.uint8)
        nbytes, S = x.nbytes, self.slot_bytes
        root = self.rank == src
        if self._use_single_copy(OpCode.BROADCAST, nbytes):
            self._single_copy_broadcast(x, y, src, sig)
            return
        first = sig
        for lo, hi in windows(nbytes, S):
            slots = self._views(self._begin_round(), hi - lo, np.dtype(np.uint8))
            if root:
                np.copyto(slots[src], x[lo:hi])
            self._sync(first)
            first = None
            if root:
                if y.ctypes.data != x.ctypes.data:
                    np.copyto(y[lo:hi], x[lo:hi])
            else:
                np.copyto(y[lo:hi], slots[src])

    takes_recv_counts = True
    takes_into = True

    def all_to_all(self, send: torch.Tensor, send_counts: list[int], row_numel: int, alloc: Allocator,
                   sig: Signature, recv_counts: list[int] | None = None,
                   into: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`Transport.all_to_all`. With ``recv_counts`` every rank publishes them beside its
        send counts in the first synchronisation, and every rank compares the whole [size, size]
        matrices after it, so a wrong value raises on every rank before any peer's row is read.

        ``into`` (see ``takes_into``): with the compiled helper, a one-round exchange whose rows
        for this rank fill it exactly is one compiled call (stage, publish counts, arrive, copy).

        Out of place with every sender read in one copy, rank 0 may choose the staged path instead
        (``_timed_a2a_path``): pairwise exchanges through the slots (``_staged_pairwise_all_to_all``).
        In place, the blocks are swapped by single copy or by those pairwise exchanges, as rank 0 chose
        (``_swap_path``)."""
        me = self.rank
        x_addr, total = send.data_ptr(), send.nbytes  # plain addresses: small calls are all overhead
        row_bytes = row_numel * send.element_size()
        # single copy per sender, from its own size: the peers learn it from its published address
        direct = total >= self._a2a_direct_min
        # out=x: a sender read in one copy swaps in place (_swap_all_to_all) or receives aside; one that
        # stages stages all it sends in the first round (total <= slot_bytes), so only its own block
        # is read from x after that, and moved before any row lands (_all_to_all_rest, a2a_pull)
        in_place = into is not None and into.data_ptr() == x_addr and total > 0
        if in_place and not direct and total > self.slot_bytes:  # callers ask takes_in_place_all_to_all first
            send = send.clone()
            x_addr, in_place = send.data_ptr(), False
        if self._g is not None and not direct:  # the compiled helper's round
            if recv_counts is not None:
                return self._compiled_all_to_all_declared(send_counts, recv_counts, row_bytes, total, sig, x_addr,
                                                          alloc)
            return self._compiled_all_to_all(send_counts, row_bytes, total, sig)(
                x_addr, into if row_bytes else None, alloc)
        own_start, own_len = sum(send_counts[:me]) * row_bytes, send_counts[me] * row_bytes
        b = self._begin_round()
        if not direct:
            for off, src, nb in staged_segments(own_start, own_len, total, 0, self.slot_bytes):
                self._stage(b, off, x_addr + src, nb)
        # rank 0's, for a call that may be timed: out of place, or the in-place swap's path
        chooser = (self._swap_chooser if in_place else self._a2a_chooser) if direct else None
        t0 = time.perf_counter() if chooser is not None else 0.0
        # the output address published is only a flag: nonzero = this rank exchanges in place
        self._sync(sig, send_counts, recv=recv_counts,
                   addrs=(x_addr if direct else 0, x_addr if in_place else 0) if self.single_copy else None,
                   spin_ns=self._large_spin_ns if direct else 0,
                   choice=chooser.choose(size_class(total)) if chooser is not None else None)
        counts = self._published_counts(self._epoch)
        if recv_counts is not None:  # every rank passed them: the signatures agreed on that
            self._check_declared(counts, self._epoch)
        out = alloc([row[me] for row in counts])
        path = self._timed_a2a_path() if direct and not in_place else None
        if path is not None:
            self._a2a_paths[size_class(sum(counts[0]) * row_bytes)] = path  # by rank 0's send (_a2a_label)
            if path == STAGED_PATH:
                out = self._staged_pairwise_all_to_all(x_addr, out, counts, row_bytes)
                self._timing_barrier()
            else:
                out = self._all_to_all_rest(x_addr, total, row_bytes, own_start, own_len, b, direct, out, counts)
            if chooser is not None:
                chooser.record(size_class(total), path, (time.perf_counter() - t0) / total)
            return out
        if self.single_copy and (direct or not total):  # a rank that stages rows rules the swap out
            if self._can_swap(counts):  # some rank exchanges in place, and every rank can swap with its peers
                swap = self._swap_path()
                self._swap_paths[size_class(sum(counts[0]) * row_bytes)] = swap  # by rank 0's send (_swap_label)
                if swap == STAGED_PATH:
                    out = self._staged_pairwise_all_to_all(x_addr, out, counts, row_bytes)
                else:
                    out = self._swap_all_to_all(x_addr, out, counts, row_bytes)
                if chooser is not None and in_place:  # rank 0 in place: it chose this swap
                    chooser.record(size_class(total), swap, (time.perf_counter() - t0) / total)
                return out
            if out.data_ptr() == x_addr and total:  # in place, but not as a swap: receive aside, then copy
                aside = torch.empty_like(out)
                self._all_to_all_rest(x_addr, total, row_bytes, own_start, own_len, b, direct, aside, counts)
                out.copy_(aside)  # the peers finished reading x: _all_to_all_rest ended on that barrier
                return out
        return self._all_to_all_rest(x_addr, total, row_bytes, own_start, own_len, b, direct, out, counts)

    def _all_to_all_rest(self, x_addr: int, total: int, row_bytes: int, own_start: int, own_len: int, b: int,
                         direct: bool, out: torch.Tensor, counts: list[list[int]] | None = None) -> torch.Tensor:
        """all_to_all after its first synchronisation: our own block, the direct senders' rows, then
        the staged rounds (``counts``: the [n][n] send counts, read from the control blocks if None)."""
        n, me, S = self.size, self.rank, self.slot_bytes
        if counts is None:
            counts = self._published_counts(self._epoch)
        recv = [row[me] for row in counts]
        y_addr = out.data_ptr()
        own_at = y_addr + sum(recv[:me]) * row_bytes
        if y_addr == x_addr:  # in place, staged in one round: move our block before the peers' rows land
            copy_bytes(own_at, x_addr + own_start, own_len)  # memmove: the two may overlap
            own_len = 0
        # direct senders: read their rows for us from their inputs; pull the rest from the slots
        inputs = [self._peer_addrs(r)[0] for r in range(n)] if self.single_copy else [0] * n
        direct_senders = [r for r in range(n) if inputs[r]]
        for r in direct_senders:
            if r != me:
                self._read_peer(r, inputs[r] + sum(counts[r][:me]) * row_bytes,
                                y_addr + sum(recv[:r]) * row_bytes, counts[r][me] * row_bytes)
        for j, copies in enumerate(self._pulls(counts, row_bytes, direct_senders)):
            if j > 0:  # the staged senders' later rounds (every rank synchronises; direct senders stage nothing)
                b = self._begin_round()
                if not direct:
                    for off, src, nb in staged_segments(own_start, own_len, total, j * S, (j + 1) * S):
                        self._stage(b, off, x_addr + src, nb)
                self._sync()
            for src, off, dst, nb in copies:
                self._pull(b, src, off, y_addr + dst, nb)
        if not direct_senders:
            copy_bytes(own_at, x_addr + own_start, own_len)  # our block to ourselves
            return out
        self._begin_round()
        done_reading = self._publish()
        # our own block while the peers finish reading the direct senders' inputs: it hides the
        # difference in their read times
        copy_bytes(own_at, x_addr + own_start, own_len)
        self._await(done_reading, self._large_spin_ns)
        return out

    def _published_counts(self, e: int) -> list[list[int]]:
        """The [size][size] all_to_all send counts every rank published at epoch ``e`` (counts[src][dst] rows)."""
        q, n, c0 = self._q, self.size, self._counts0 + (e & 1) * self.size
        return [q[base + c0 : base + c0 + n].tolist() for base in self._bases]

    def _check_declared(self, counts: list[list[int]], e: int) -> None:
        """Raise check_recv_counts' ValueError (on every rank alike) unless the receive counts every rank
        declared at epoch ``e`` are what the others send it (``counts``: :meth:`_published_counts`)."""
        q, n, r0 = self._q, self.size, self._recv0 + (e & 1) * self.size
        declared = [q[base + r0 : base + r0 + n].tolist() for base in self._bases]  # declared[dst][src]
        if any(declared[d][s] != counts[s][d] for s in range(n) for d in range(n)):
            check_recv_counts(counts, declared, self._ranks)

    def takes_in_place_all_to_all(self, nbytes: int) -> bool:
        """See :meth:`Transport.takes_in_place_all_to_all`: a sender read in one copy (its peers read
        its rows from x itself, so it may overwrite them once they have), or one that stages all it
        sends in the first round (nothing but its own block is read from x after that)."""
        return nbytes >= self._a2a_direct_min or nbytes <= self.slot_bytes

    def _pulls(self, counts: list[list[int]], row_bytes: int, skip: list[int]) -> list:
        """:func:`all_to_all_pulls` for this rank, cached by counts (MoE steps and benchmarks repeat them)."""
        key = (row_bytes, tuple(skip), *map(tuple, counts))
        plan = self._pull_cache.get(key)
        if plan is None:
            if len(self._pull_cache) >= 64:
                self._pull_cache.clear()
            plan = self._pull_cache[key] = all_to_all_pulls(counts, self.rank, row_bytes, self.slot_bytes, skip=skip)
        return plan

    def _stage(self, b: int, off: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` at address ``src`` into our slot ``b`` at ``off``."""
        if self._g is not None:
            self._g.stage(b, src, nbytes, off)
        else:
            copy_bytes(self._slot_addr[b][self.rank] + off, src, nbytes)

    def _pull(self, b: int, r: int, off: int, dst: int, nbytes: int) -> None:
        """Copy ``nbytes`` from rank ``r``'s slot ``b`` at ``off`` to address ``dst``."""
        if self._g is not None:
            self._g.pull(b, r, off, dst, nbytes)
        else:
            copy_bytes(dst, self._slot_addr[b][r] + off, nbytes)

    # ---- teardown -------------------------------------------------------------------------
    def abort(self, why: str) -> None:
        if self._map is not None and not self._broken:
            self._abort(why)  # ABORTED, not CLOSED: a peer raises even if this rank had arrived
        self.close()

    def close(self) -> None:
        """Unmap the segment; peers waiting for this rank see the closed state and raise at once.

        Peers that are still reading this rank's slots keep their own mapping, so closing right after
        the last collective is safe. Any later call on this transport raises CommunicatorBrokenError.
        """
        if self._map is None:
            return
        try:
            if not self._broken:
                self._q[self._my_base + _STATE] = _STATE_CLOSED
        except (ValueError, TypeError):
            pass
        _fence()  # the state before anything the caller writes next: a peer checks it around its reads of our memory
        self._broken = self._broken or "closed"
        if getattr(self, "p2p", None) is not None:
            self.p2p.close()  # drops its views of the mapping
        self._g = self._sleeper = None  # they hold addresses into the mapping
        self._q.release()
        self._ctrl = self._slots = None  # drop views so the mapping can close
        self._view_cache.clear()
        try:
            self._map.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with it
        self._map = None
