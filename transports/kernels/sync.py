"""Jit helpers shared by every ipc kernel: pointer tables, the bounded epoch barrier, the call
prologue that agrees on signatures, and element loads, reductions and stores.

Barrier of program ``b`` at epoch ``e``: write ``e`` into ``FLAGS[b][me]`` of every peer's signal
area (release, system scope), then wait until ``FLAGS[b][src] >= e`` in our own area for every
peer (acquire). A program only ever waits for the same program index of its peers, never for
another program of its own launch: Triton's interpreter runs a launch's programs one after
another, and a GPU need not run them all at once either.

Waits are bounded: they stop when this rank's ABORT word is set (the host's watchdog does that
when a peer dies, closes or aborts, or at the timeout) or after ``max_spins`` turns; a wait that
stops records which peer it waited for in ERROR, and the kernel skips the rest of its work.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import layout as L

# Reductions go through tl.reduce with Triton's own combiners, not tl.sum/tl.max: the standard
# library's jit functions were defined for the GPU when triton was imported before TRITON_INTERPRET
# was set, and the interpreter cannot call them; it reduces with NumPy when it sees these combiners.
try:
    from triton.language.standard import _elementwise_max as _max
    from triton.language.standard import _elementwise_min as _min
    from triton.language.standard import _sum_combine as _add
except ImportError:  # pragma: no cover - another Triton: the interpreter then reduces element by element

    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _max(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _min(a, b):
        return tl.minimum(a, b)


_ABORT = tl.constexpr(L.ABORT)
_ERROR = tl.constexpr(L.ERROR)
_COUNTS = tl.constexpr(L.COUNTS)
_META = tl.constexpr(L.META)
_RECV_COUNTS = tl.constexpr(L.RECV_COUNTS)
_DIGEST = tl.constexpr(L.DIGEST)
_EPOCH = tl.constexpr(L.EPOCH)
_FLAGS = tl.constexpr(L.FLAGS)
_PEER_META = tl.constexpr(L.PEER_META)
_CALLS = tl.constexpr(L.CALLS)
_S_ERROR = tl.constexpr(L.S_ERROR)
_S_MISMATCH = tl.constexpr(L.S_MISMATCH)
_S_DONE = tl.constexpr(L.S_DONE)
_MAX_RANKS = tl.constexpr(L.MAX_RANKS)
_META_WORDS = tl.constexpr(L.META_WORDS)

# ReduceOp values (transports.base.ReduceOp)
OP_SUM = tl.constexpr(1)
OP_AVG = tl.constexpr(2)
OP_MAX = tl.constexpr(3)
OP_MIN = tl.constexpr(4)
OP_PROD = tl.constexpr(5)


@triton.jit
def rank_ptr(table, r, DT: tl.constexpr):
    """Rank ``r``'s address from an int64 address table, as a pointer to DT."""
    return tl.load(table + r).to(tl.pointer_type(DT))


@triton.jit
def record_error(my_sig, status, code):
    """ERROR = code unless an earlier failure is recorded there (int64 compare-and-swap); the
    program whose swap won mirrors it into the status block, where the host reads it lazily."""
    zero = tl.load(my_sig + _ERROR, volatile=True) * 0  # an int64 0: the CAS operands match the word
    old = tl.atomic_cas(my_sig + _ERROR, zero, zero + code, sem="relaxed", scope="sys")
    if old == 0:
        tl.store(status + _S_ERROR, zero + code)


@triton.jit
def done(my_sig, status):
    """The kernel's last step: CALLS += 1 for this program, mirrored into the status block's DONE
    (a posted store to host-mapped memory: the host sees that this program finished)."""
    pid = tl.program_id(0)
    c = tl.load(my_sig + _CALLS + pid) + 1
    tl.store(my_sig + _CALLS + pid, c)
    tl.debug_barrier()  # every thread's work precedes the store the host reads
    tl.store(status + _S_DONE + pid, c)


@triton.jit
def wait_flag(flag, e, my_sig, status, peer, max_spins):
    """Spin until ``*flag >= e``; 1 if it got there, else 0 with ERROR = peer + 1."""
    v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    abort = tl.load(my_sig + _ABORT, volatile=True)
    left = max_spins
    while (v < e) & (abort == 0) & (left > 0):
        v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        abort = tl.load(my_sig + _ABORT, volatile=True)
        left -= 1
    # ABORT may be set because the peer closed or exited after it signalled (the watchdog saw that
    # between our last flag read and our ABORT read): read the flag once more, so a peer that
    # arrived is never reported as failed.
    v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    arrived = v >= e
    if v < e:
        record_error(my_sig, status, peer + 1)
    return arrived


@triton.jit
def barrier(sig_ptrs, my_sig, status, rank, world, pid, e, max_spins, ok):
    """Epoch barrier of program ``pid`` with the same program of every peer (skipped when not ok)."""
    tl.debug_barrier()  # every thread's stores of this program precede the release below
    if ok:
        for r in range(0, world):
            if r != rank:
                peer = rank_ptr(sig_ptrs, r, tl.int64)
                tl.atomic_xchg(peer + _FLAGS + pid * _MAX_RANKS + rank, e, sem="release", scope="sys")
        for r in range(0, world):
            if r != rank:
                if ok:
                    ok = wait_flag(my_sig + _FLAGS + pid * _MAX_RANKS + r, e, my_sig, status, r, max_spins)
    tl.debug_barrier()  # no thread reads peers' data before the acquire above
    return ok


@triton.jit
def may_start(my_sig, status, world):
    """1 unless an earlier wait gave up or ABORT is set; a kernel that does not start records
    ERROR = world + 1 (no peer to name), so the host never takes a skipped call for a done one."""
    ok = (tl.load(my_sig + _ERROR, volatile=True) == 0) & (tl.load(my_sig + _ABORT, volatile=True) == 0)
    if ok == 0:
        record_error(my_sig, status, world + 1)
    return ok


@triton.jit
def begin(sig_ptrs, status, rank, world, digest, meta, max_spins, COPY_META: tl.constexpr):
    """First barrier of a call, carrying its signature.

    Returns (my_sig, e0, ok, go): this rank's signal area, the program's epoch before the call,
    whether every wait so far succeeded, and whether to move data (ok and every peer's signature
    digest equals ours). On a difference program 0 copies the peers' full signatures into
    PEER_META and sets the status block's MISMATCH; with COPY_META it copies them in any case (exchange_meta).
    """
    pid = tl.program_id(0)
    my_sig = rank_ptr(sig_ptrs, rank, tl.int64)
    e0 = tl.load(my_sig + _EPOCH + pid)
    ok = may_start(my_sig, status, world)
    tl.store(my_sig + _DIGEST + pid, digest)
    if pid == 0:
        k = tl.arange(0, _META_WORDS)
        tl.store(my_sig + _META + k, tl.load(meta + k))
    ok = barrier(sig_ptrs, my_sig, status, rank, world, pid, e0 + 1, max_spins, ok)
    differs = ok & (rank < 0)  # False, typed like ok
    if ok:
        for r in range(0, world):
            if r != rank:
                peer = rank_ptr(sig_ptrs, r, tl.int64)
                differs = differs | (tl.load(peer + _DIGEST + pid, volatile=True) != digest)
        if pid == 0:
            if differs | COPY_META:
                k = tl.arange(0, _META_WORDS)
                for r in range(0, world):
                    peer = rank_ptr(sig_ptrs, r, tl.int64)
                    tl.store(my_sig + _PEER_META + r * _META_WORDS + k, tl.load(peer + _META + k, volatile=True))
        if differs:
            tl.store(status + _S_MISMATCH, 1)
    go = ok & (differs == 0)
    return my_sig, e0, ok, go


@triton.jit
def finish(sig_ptrs, my_sig, status, rank, world, e, max_spins, ok):
    """Last barrier of a call (no rank rewrites its buffer while a peer still reads it); the
    program's epoch becomes ``e``."""
    pid = tl.program_id(0)
    ok = barrier(sig_ptrs, my_sig, status, rank, world, pid, e, max_spins, ok)
    tl.store(my_sig + _EPOCH + pid, e)
    return ok


@triton.jit
def copy_tiles(dst, src, n, BLOCK: tl.constexpr):
    """dst[i] = src[i] for i < n, this program's tiles (tile t of BLOCK goes to program t % nprog)."""
    offs = tl.arange(0, BLOCK)
    for t in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        m = t + offs < n
        tl.store(dst + t + offs, tl.load(src + t + offs, mask=m), mask=m)


@triton.jit
def combine(acc, x, OP: tl.constexpr, IS_FLOAT: tl.constexpr):
    """acc op x; max/min propagate NaN so every rank gets the same result."""
    if OP == OP_MAX:
        if IS_FLOAT:
            r = tl.maximum(acc, x, propagate_nan=tl.PropagateNan.ALL)
        else:
            r = tl.maximum(acc, x)
    elif OP == OP_MIN:
        if IS_FLOAT:
            r = tl.minimum(acc, x, propagate_nan=tl.PropagateNan.ALL)
        else:
            r = tl.minimum(acc, x)
    elif OP == OP_PROD:
        r = acc * x
    else:
        r = acc + x
    return r


@triton.jit
def reduce_ranks(data_ptrs, world, at, m, DT: tl.constexpr, ACC: tl.constexpr, OP: tl.constexpr,
                 IS_FLOAT: tl.constexpr):
    """op over ranks 0..world-1, in that order, of their buffers' elements ``at`` (mask m), in ACC."""
    acc = tl.load(rank_ptr(data_ptrs, 0, DT) + at, mask=m, other=0).to(ACC)
    for r in range(1, world):
        acc = combine(acc, tl.load(rank_ptr(data_ptrs, r, DT) + at, mask=m, other=0).to(ACC), OP, IS_FLOAT)
    if OP == OP_AVG:
        acc = acc / world
    return acc


@triton.jit
def store_rounded(ptr, acc, m, OUT_BF16: tl.constexpr):
    """Store ``acc`` into ptr's element type; bfloat16 rounds to nearest even with integer ops
    (Triton's interpreter truncates in its float cast, GPUs round: this gives both the same bits)."""
    if OUT_BF16:
        bits = acc.to(tl.float32).to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        rounded = tl.where(acc != acc, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
        tl.store(ptr, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)
    else:
        tl.store(ptr, acc.to(ptr.dtype.element_ty), mask=m)
