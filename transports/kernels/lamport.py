"""Lamport one-shot all-reduce (TensorRT-LLM style) and a fused all-reduce + residual add + RMSNorm.

No barrier: every rank writes its input, as float32 words, straight into a slot of every rank's
*Lamport area*, and the data carry their own arrival. An empty word holds the float32 -0.0 bit
pattern (LAMPORT_SENTINEL_BITS), which pushed data never hold (-0.0 is pushed as +0.0), so a
reader spins with volatile loads until no word it needs is the sentinel. One kernel per call,
no flag round trip: the latency of small tensor-parallel all-reduces.

Slots rotate: call ``i`` (LAMPORT_CALLS of the program) writes slot ``i % 3`` and clears the
previous call's slot ``(i + 2) % 3`` of its own area back to the sentinel over the length it read
there (LAMPORT_LEN). That is safe without a barrier: we read all of that slot in our previous
call, so every peer finished writing it, and no peer reaches it again (its call ``i + 2``) before
it has read our pushes of call ``i + 1``, which we make after this kernel.

A slot is ``[MAX_RANKS] int64`` headers (a source's ``digest | 1``, 0 when empty), then
``[MAX_RANKS][elems]`` float32 rows (source ``q`` writes row ``q``). Program 0 publishes the
call's header (after META, with a release) and checks the peers' against ours; a difference is
fatal (ERROR = world + 2): the slots then hold a peer's partial data, which the rotation would
read later. One difference is not: a rank that rejected its own input for the same call runs it
with the header ``(digest | 1) ^ 2`` and META of OpCode.LOCAL_ERROR, pushing a whole row, so the
slots stay in step; every rank then records S_MISMATCH (PEER_META names the rank), not ERROR. The other programs do not wait for headers (they were written by program 0 of the
peers): they learn of a failure from the ERROR word, where their waits give up, so on a GPU a
mismatching call may still have reduced some tiles; its OUT is undefined.

Every program ``p`` pushes and reduces the same elements on every rank (tile ``t`` of BLOCK, or row
``r``, belongs to program ``t % num_programs``), so it only waits for program ``p`` of its peers,
never for another program of its own launch (Triton's interpreter runs those one after another).
Programs keep their own LAMPORT_CALLS/LAMPORT_LEN words: every launch on an area must use the same
number of programs. Waits are bounded (``max_spins``) and give up when this rank's ABORT or ERROR
word becomes nonzero; the first error is recorded in ERROR (compare-and-swap, system scope) and
mirrored into the status block, as :mod:`transports.kernels.sync` does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import layout as L
from .sync import OP_AVG, _add, combine, done, rank_ptr, record_error, store_rounded

_ABORT = tl.constexpr(L.ABORT)
_ERROR = tl.constexpr(L.ERROR)
_META = tl.constexpr(L.META)
_PEER_META = tl.constexpr(L.PEER_META)
_LAMPORT_CALLS = tl.constexpr(L.LAMPORT_CALLS)
_LAMPORT_LEN = tl.constexpr(L.LAMPORT_LEN)
_SLOTS = tl.constexpr(L.LAMPORT_SLOTS)
_SENTINEL = tl.constexpr(L.LAMPORT_SENTINEL_BITS)
_S_MISMATCH = tl.constexpr(L.S_MISMATCH)
_MAX_RANKS = tl.constexpr(L.MAX_RANKS)
_META_WORDS = tl.constexpr(L.META_WORDS)
_META_OPCODE = tl.constexpr(L.META_OPCODE)
_LOCAL_ERROR = tl.constexpr(L.LOCAL_ERROR)

# ---- bookkeeping -------------------------------------------------------------------------------
@triton.jit
def _stopped(my_sig):
    """Nonzero once this rank's ABORT or ERROR word is set (a wait then gives up)."""
    return tl.load(my_sig + _ABORT, volatile=True) | tl.load(my_sig + _ERROR, volatile=True)


@triton.jit
def _slot(lam_ptrs, q, s, elems):
    """Rank q's slot s: (headers int64 [MAX_RANKS], rows int32 [MAX_RANKS][elems]) pointers."""
    base = tl.load(lam_ptrs + q) + s * (_MAX_RANKS * 8 + _MAX_RANKS * 4 * elems)
    return base.to(tl.pointer_type(tl.int64)), (base + _MAX_RANKS * 8).to(tl.pointer_type(tl.int32))


@triton.jit
def _prologue(sig_ptrs, status, rank, world):
    """Steps 1-2 of a call: (my_sig, i, s, p, ok) with i = LAMPORT_CALLS of this program, s its
    slot, p the previous call's slot; ok 0 (and ERROR = world + 1) after an earlier failure or ABORT."""
    pid = tl.program_id(0)
    my_sig = rank_ptr(sig_ptrs, rank, tl.int64)
    i = tl.load(my_sig + _LAMPORT_CALLS + pid)
    s = i % _SLOTS
    p = (i + _SLOTS - 1) % _SLOTS
    ok = _stopped(my_sig) == 0
    if ok == 0:
        record_error(my_sig, status, world + 1)
    return my_sig, i, s, p, ok


@triton.jit
def _clear_previous(lam_ptrs, my_sig, rank, world, elems, p, BLOCK: tl.constexpr):
    """Step 3: our slot p back to empty over the length this program recorded there (every program
    recorded the same one), this program's BLOCK tiles of every source row; program 0 zeroes the
    headers."""
    pid = tl.program_id(0)
    hdr, rows = _slot(lam_ptrs, rank, p, elems)
    plen = tl.load(my_sig + _LAMPORT_LEN + pid * _SLOTS + p)
    offs = tl.arange(0, BLOCK)
    empty = tl.full([BLOCK], _SENTINEL, tl.int32)
    for src in range(0, world):
        for t in range(pid * BLOCK, plen, tl.num_programs(0) * BLOCK):
            tl.store(rows + src * elems + t + offs, empty, mask=t + offs < plen)
    if pid == 0:
        k = tl.arange(0, _MAX_RANKS)
        tl.store(hdr + k, tl.full([_MAX_RANKS], 0, tl.int64))


@triton.jit
def _row_offset(s, src, elems):
    """Byte offset, in a Lamport area, of source ``src``'s row of slot s."""
    return s * (_MAX_RANKS * 8 + _MAX_RANKS * 4 * elems) + _MAX_RANKS * 8 + src * 4 * elems


@triton.jit
def _push(lam_ptrs, world, off, at, x, m):
    """Step 4: x (float32) at element ``at`` of the row at byte ``off`` (our row of the call's
    slot) of every rank's area; -0.0 goes as +0.0 (never the sentinel; NaNs keep their bits)."""
    bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    for q in range(0, world):
        tl.store((tl.load(lam_ptrs + q) + off).to(tl.pointer_type(tl.int32)) + at, bits, mask=m)


@triton.jit
def _publish_and_check(lam_ptrs, sig_ptrs, my_sig, status, rank, world, digest, meta, elems, max_spins, s, ok):
    """Steps 4-5 of program 0: our META, then ``digest | 1`` into header[rank] of slot s of every
    rank (release: META is visible first); then wait for every source's header in our slot s and
    compare. A header that never comes: ERROR = source + 1. A different one: S_MISMATCH = 1,
    every rank's META into our PEER_META, ERROR = world + 2, unless it is the same call rejected
    by its rank or by us (the module docstring): then S_MISMATCH and PEER_META only. Returns ok."""
    k = tl.arange(0, _META_WORDS)
    tl.store(my_sig + _META + k, tl.load(meta + k))
    tl.debug_barrier()  # every thread's META store precedes the release below
    want = (digest | 1).to(tl.int64)
    for q in range(0, world):
        hdr, _rows = _slot(lam_ptrs, q, s, elems)
        tl.atomic_xchg(hdr + rank, want, sem="release", scope="sys")
    mine, _rows = _slot(lam_ptrs, rank, s, elems)
    differs = ok & (rank < 0)  # False, typed like ok
    rejected = differs
    we_rejected = tl.load(my_sig + _META + _META_OPCODE) == _LOCAL_ERROR
    for q in range(0, world):
        if ok:
            h = tl.atomic_add(mine + q, 0, sem="acquire", scope="sys")
            left = max_spins
            stop = _stopped(my_sig)
            while (h == 0) & (stop == 0) & (left > 0):
                h = tl.atomic_add(mine + q, 0, sem="acquire", scope="sys")
                stop = _stopped(my_sig)
                left -= 1
            h = tl.atomic_add(mine + q, 0, sem="acquire", scope="sys")  # it may have come with ABORT
            if h == 0:
                record_error(my_sig, status, q + 1)
                ok = ok & (h != 0)
            theirs = tl.load(rank_ptr(sig_ptrs, q, tl.int64) + _META + _META_OPCODE, volatile=True)
            rejection = ((h ^ want) == 2) & (we_rejected | (theirs == _LOCAL_ERROR))
            differs = differs | ((h != 0) & (h != want) & (rejection == 0))
            rejected = rejected | ((h != 0) & rejection)
    if differs | rejected:
        for r in range(0, world):
            peer = rank_ptr(sig_ptrs, r, tl.int64)
            tl.store(my_sig + _PEER_META + r * _META_WORDS + k, tl.load(peer + _META + k, volatile=True))
        tl.store(status + _S_MISMATCH, 1)
    if differs:
        record_error(my_sig, status, world + 2)
    return ok & (differs == 0)


@triton.jit
def _arrive(ptr, m, my_sig, status, src, max_spins):
    """Spin with volatile loads until no word of ``ptr`` (mask m) is the sentinel: (float32 words,
    1), or (whatever came, 0) with ERROR = src + 1 after max_spins turns or once ABORT/ERROR is set.
    (Hot: no nested helpers, which cost the interpreter much more than an operation.)"""
    v = tl.load(ptr, mask=m, other=0, volatile=True)
    pending = tl.reduce((v == _SENTINEL).to(tl.int32), 0, _add)
    left = max_spins
    stop = tl.load(my_sig + _ABORT, volatile=True) | tl.load(my_sig + _ERROR, volatile=True)
    while (pending != 0) & (stop == 0) & (left > 0):
        v = tl.load(ptr, mask=m, other=0, volatile=True)
        pending = tl.reduce((v == _SENTINEL).to(tl.int32), 0, _add)
        stop = tl.load(my_sig + _ABORT, volatile=True) | tl.load(my_sig + _ERROR, volatile=True)
        left -= 1
    if pending != 0:  # the data may have come with ABORT (the peer finished, then closed): look again
        v = tl.load(ptr, mask=m, other=0, volatile=True)
        pending = tl.reduce((v == _SENTINEL).to(tl.int32), 0, _add)
        if pending != 0:
            record_error(my_sig, status, src + 1)
    return v.to(tl.float32, bitcast=True), pending == 0


@triton.jit
def _finish(my_sig, status, i, s, n):
    """Step 7 (always): LAMPORT_LEN[pid][s] = n, LAMPORT_CALLS = i + 1, CALLS += 1 mirrored into
    the status block's DONE (a plain store to host-mapped memory, after every thread's work)."""
    pid = tl.program_id(0)
    tl.store(my_sig + _LAMPORT_LEN + pid * _SLOTS + s, n + i * 0)
    tl.store(my_sig + _LAMPORT_CALLS + pid, i + 1)
    done(my_sig, status)


@triton.jit
def _round_to(acc, OUT_BF16: tl.constexpr, DT: tl.constexpr):
    """float32 acc rounded to DT and back (bfloat16: round to nearest even, as store_rounded)."""
    if OUT_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        rounded = tl.where(acc != acc, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
        r = (rounded << 16).to(tl.float32, bitcast=True)
    else:
        r = acc.to(DT).to(tl.float32)
    return r


# ---- kernels -----------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["n", "rank", "world", "digest", "elems", "max_spins"])
def all_reduce_lamport(X, OUT, n, lam_ptrs, sig_ptrs, status, rank, world, digest, meta, elems, max_spins,
                       OP: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[:n] = op over ranks 0..world-1 (in that order, in float32) of X[:n]; one kernel, no barrier.

    X, OUT: float32/float16/bfloat16 [n], one dtype, n <= elems (OUT may be X). lam_ptrs,
    sig_ptrs: int64 [world] every rank's Lamport-area and signal-area addresses; status: this
    rank's int64 [STATUS_WORDS] status block (written only); digest: the call signature's 63-bit
    digest, meta: int64 [META_WORDS] the signature; elems: a slot's elements per source; OP:
    ReduceOp (sum 1, avg 2, max 3, min 4, prod 5); OUT_BF16: OUT is bfloat16 (rounded to nearest
    even). -0.0 inputs count as +0.0.
    """
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    my_sig, i, s, p, ok = _prologue(sig_ptrs, status, rank, world)
    if ok:
        _clear_previous(lam_ptrs, my_sig, rank, world, elems, p, BLOCK)
        off = _row_offset(s, rank, elems)
        for t in range(pid * BLOCK, n, step):
            m = t + offs < n
            _push(lam_ptrs, world, off, t + offs, tl.load(X + t + offs, mask=m).to(tl.float32), m)
        if pid == 0:
            ok = _publish_and_check(lam_ptrs, sig_ptrs, my_sig, status, rank, world, digest, meta, elems, max_spins,
                                    s, ok)
    if ok:
        _hdr, rows = _slot(lam_ptrs, rank, s, elems)
        for t in range(pid * BLOCK, n, step):
            m = t + offs < n
            acc = tl.full([BLOCK], 0.0, tl.float32)
            for src in range(0, world):
                if ok:
                    v, ok = _arrive(rows + src * elems + t + offs, m, my_sig, status, src, max_spins)
                    if src == 0:
                        acc = v
                    else:
                        acc = combine(acc, v, OP, True)
            if ok:
                if OP == OP_AVG:
                    acc = acc / world
                store_rounded(OUT + t + offs, acc, m, OUT_BF16)
    _finish(my_sig, status, i, s, n)


@triton.jit(do_not_specialize=["rows", "H", "rank", "world", "digest", "elems", "max_spins"])
def all_reduce_rmsnorm_lamport(X, RESIDUAL, WEIGHT, OUT, RES_OUT, rows, H, eps, lam_ptrs, sig_ptrs, status, rank,
                               world, digest, meta, elems, max_spins, OUT_BF16: tl.constexpr, BLOCK_H: tl.constexpr):
    """The tensor-parallel block's epilogue, fused on the Lamport all-reduce:
    ``RES_OUT = all_reduce(X) + RESIDUAL``; ``OUT = RES_OUT * rsqrt(mean(RES_OUT**2) + eps) * WEIGHT``.

    X, RESIDUAL, OUT, RES_OUT: [rows, H] contiguous, one dtype (float32/float16/bfloat16; OUT may
    be X and RES_OUT may be RESIDUAL); WEIGHT: [H], that dtype or float32; rows * H <= elems;
    BLOCK_H: a power of two >= H; eps: float. Per row, in float32, sources summed in the order
    0..world-1: a = sum rounded to the dtype; r = round(a + residual) -> RES_OUT;
    round(r * (1 / sqrt(mean(r * r) + eps)) * weight) -> OUT (bfloat16 rounds to nearest even).
    Program p handles rows r with r % num_programs == p. Other arguments as
    :func:`all_reduce_lamport`.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    DT = X.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    cm = cols < H
    n = rows * H
    my_sig, i, s, p, ok = _prologue(sig_ptrs, status, rank, world)
    if ok:
        _clear_previous(lam_ptrs, my_sig, rank, world, elems, p, BLOCK_H)
        off = _row_offset(s, rank, elems)
        for r in range(pid, rows, nprog):
            _push(lam_ptrs, world, off, r * H + cols, tl.load(X + r * H + cols, mask=cm).to(tl.float32), cm)
        if pid == 0:
            ok = _publish_and_check(lam_ptrs, sig_ptrs, my_sig, status, rank, world, digest, meta, elems, max_spins,
                                    s, ok)
    if ok:
        _hdr, src_rows = _slot(lam_ptrs, rank, s, elems)
        w = tl.load(WEIGHT + cols, mask=cm, other=0).to(tl.float32)
        for r in range(pid, rows, nprog):
            acc = tl.full([BLOCK_H], 0.0, tl.float32)
            for src in range(0, world):
                if ok:
                    v, ok = _arrive(src_rows + src * elems + r * H + cols, cm, my_sig, status, src, max_spins)
                    acc = acc + v
            if ok:
                a = _round_to(acc, OUT_BF16, DT)
                res = _round_to(a + tl.load(RESIDUAL + r * H + cols, mask=cm, other=0).to(tl.float32), OUT_BF16, DT)
                res = tl.where(cm, res, 0.0)
                inv = 1.0 / tl.sqrt_rn(tl.reduce(res * res, 0, _add) / H + eps)
                store_rounded(RES_OUT + r * H + cols, res, cm, OUT_BF16)
                store_rounded(OUT + r * H + cols, res * inv * w, cm, OUT_BF16)
    _finish(my_sig, status, i, s, n)
