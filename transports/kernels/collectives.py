"""The ipc collective kernels. One launch moves one chunk (at most a buffer's worth) of a call.

Common arguments: ``data_ptrs``/``sig_ptrs`` int64 [world] tensors of every rank's data-buffer and
signal-area addresses; ``rank``/``world``; ``digest`` the call signature's 63-bit digest and
``meta`` its [META_LEN] int64 words; ``max_spins`` the bound of every wait. Every kernel starts
with :func:`sync.begin` (publishes its staged input and its signature) and ends with
:func:`sync.finish` (no rank rewrites its buffer while a peer still reads it); on a signature
difference it moves no data but still passes both barriers, so every rank stays in step.
Element kernels take the element type from their input pointer (DT), accumulate in ACC and
reduce ranks in the order 0..world-1, so every rank computes bitwise the same result.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .sync import (
    _COUNTS,
    _EPOCH,
    _MAX_RANKS,
    _RECV_COUNTS,
    begin,
    copy_tiles,
    done,
    finish,
    may_start,
    rank_ptr,
    reduce_ranks,
    store_rounded,
)

# Per-call integers are not specialized (Triton would otherwise compile a variant for the value 1
# and for multiples of 16): one compiled kernel per argument types and constants, which the
# transport's pre-bound launch keeps.
_PER_CALL = ["rank", "world", "digest", "max_spins"]


@triton.jit(do_not_specialize=["rank", "world", "digest", "max_spins"])
def barrier_kernel(sig_ptrs, status, rank, world, digest, meta, max_spins, COPY_META: tl.constexpr):
    """A barrier that agrees on the signature (COPY_META: gathers every rank's full signature)."""
    my_sig, e0, ok, go = begin(sig_ptrs, status, rank, world, digest, meta, max_spins, COPY_META)
    finish(sig_ptrs, my_sig, status, rank, world, e0 + 2, max_spins, ok)
    done(my_sig, status)


@triton.jit(do_not_specialize=["n", *_PER_CALL])
def all_reduce_one_shot(X, OUT, n, data_ptrs, sig_ptrs, status, rank, world, digest, meta, max_spins,
                        ACC: tl.constexpr, OP: tl.constexpr, IS_FLOAT: tl.constexpr, OUT_BF16: tl.constexpr,
                        BLOCK: tl.constexpr, STAGE: tl.constexpr):
    """OUT[:n] = op over ranks of X[:n]: stage X in our buffer, then every rank reduces all of it.
    STAGE False: X already is our buffer's data (a symmetric tensor; data_ptrs point at it)."""
    DT = X.dtype.element_ty
    if STAGE:
        copy_tiles(rank_ptr(data_ptrs, rank, DT), X, n, BLOCK)
    my_sig, e0, ok, go = begin(sig_ptrs, status, rank, world, digest, meta, max_spins, False)
    if go:
        offs = tl.arange(0, BLOCK)
        for t in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            m = t + offs < n
            acc = reduce_ranks(data_ptrs, world, t + offs, m, DT, ACC, OP, IS_FLOAT)
            store_rounded(OUT + t + offs, acc, m, OUT_BF16)
    finish(sig_ptrs, my_sig, status, rank, world, e0 + 2, max_spins, ok)
    done(my_sig, status)


@triton.jit
def _part(n, world, q, ALIGN: tl.constexpr):
    """[lo, hi) of rank q's part of n elements (transports._schedule.part_bounds)."""
    per = ((n + world - 1) // world + ALIGN - 1) // ALIGN * ALIGN
    return tl.minimum(q * per, n), tl.minimum((q + 1) * per, n)


@triton.jit(do_not_specialize=["n", *_PER_CALL])
def all_reduce_two_shot(X, OUT, n, data_ptrs, sig_ptrs, status, rank, world, digest, meta, max_spins,
                        ACC: tl.constexpr, OP: tl.constexpr, IS_FLOAT: tl.constexpr, OUT_BF16: tl.constexpr,
                        BLOCK: tl.constexpr, ALIGN: tl.constexpr, STAGE: tl.constexpr):
    """Reduce-scatter then all-gather through the buffers: rank q reduces part q of every buffer
    into part q of its own buffer (and OUT); after a barrier every rank copies the other parts.

    Tiles are numbered from each part's start in both phases, so the program that reads a tile
    is the one that synchronised with the program that wrote it. STAGE False: X is our buffer's
    data already (a symmetric tensor, all-reduced in place: OUT is X, and no rank reads a part
    of a peer's buffer that the peer writes in the same phase).
    """
    DT = X.dtype.element_ty
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    mine = rank_ptr(data_ptrs, rank, DT)
    if STAGE:
        for q in range(0, world):
            lo, hi = _part(n, world, q, ALIGN)
            copy_tiles(mine + lo, X + lo, hi - lo, BLOCK)
    my_sig, e0, ok, go = begin(sig_ptrs, status, rank, world, digest, meta, max_spins, False)
    last = e0 + 2
    if go:
        lo, hi = _part(n, world, rank, ALIGN)
        for t in range(lo + pid * BLOCK, hi, step):
            m = t + offs < hi
            acc = reduce_ranks(data_ptrs, world, t + offs, m, DT, ACC, OP, IS_FLOAT)
            store_rounded(OUT + t + offs, acc, m, OUT_BF16)
            tl.store(mine + t + offs, tl.load(OUT + t + offs, mask=m), mask=m)
        ok = finish(sig_ptrs, my_sig, status, rank, world, e0 + 2, max_spins, ok)
        last = e0 + 3
        if ok:
            for q in range(0, world):
                if q != rank:
                    qlo, qhi = _part(n, world, q, ALIGN)
                    copy_tiles(OUT + qlo, rank_ptr(data_ptrs, q, DT) + qlo, qhi - qlo, BLOCK)
    finish(sig_ptrs, my_sig, status, rank, world, last, max_spins, ok)
    done(my_sig, status)


@triton.jit(do_not_specialize=["m_block", "lo", "w", *_PER_CALL])
def reduce_scatter(X, OUT, m_block, lo, w, data_ptrs, sig_ptrs, status, rank, world, digest, meta, max_spins,
                   ACC: tl.constexpr, OP: tl.constexpr, IS_FLOAT: tl.constexpr, OUT_BF16: tl.constexpr,
                   BLOCK: tl.constexpr):
    """OUT[lo:lo+w] = op over ranks of their X[rank*m_block + lo :][:w]: each rank stages window
    [lo, lo+w) of every destination's block d at d*w of its buffer; rank q reduces slot q."""
    DT = X.dtype.element_ty
    mine = rank_ptr(data_ptrs, rank, DT)
    for d in range(0, world):
        copy_tiles(mine + d * w, X + d * m_block + lo, w, BLOCK)
    my_sig, e0, ok, go = begin(sig_ptrs, status, rank, world, digest, meta, max_spins, False)
    if go:
        offs = tl.arange(0, BLOCK)
        for t in range(tl.program_id(0) * BLOCK, w, tl.num_programs(0) * BLOCK):
            m = t + offs < w
            acc = reduce_ranks(data_ptrs, world, rank * w + t + offs, m, DT, ACC, OP, IS_FLOAT)
            store_rounded(OUT + lo + t + offs, acc, m, OUT_BF16)
    finish(sig_ptrs, my_sig, status, rank, world, e0 + 2, max_spins, ok)
    done(my_sig, status)


@triton.jit(do_not_specialize=["m_block", "lo", "w", *_PER_CALL])
def all_gather(X, OUT, m_block, lo, w, data_ptrs, sig_ptrs, status, rank, world, digest, meta, max_spins,
               BLOCK: tl.constexpr):
    """OUT[r*m_block + lo :][:w] = rank r's X[lo:][:w] for every r (bytes or any element type)."""
    DT = X.dtype.element_ty
    copy_tiles(rank_ptr(data_ptrs, rank, DT), X + lo, w, BLOCK)
    my_sig, e0, ok, go = begin(sig_ptrs, status, rank, world, digest, meta, max_spins, False)
    if go:
        for r in range(0, world):
            copy_tiles(OUT + r * m_block + lo, rank_ptr(data_ptrs, r, DT), w, BLOCK)
    finish(sig_ptrs, my_sig, status, rank, world, e0 + 2, max_spins, ok)
    done(my_sig, status)


@triton.jit(do_not_specialize=["w", "root", *_PER_CALL])
def broadcast(X, OUT, w, root, data_ptrs, sig_ptrs, status, rank, world, digest, meta, max_spins,
              BLOCK: tl.constexpr):
    """OUT[:w] = root's X[:w]: the root stages it, the others copy it out of the root's buffer."""
    DT = X.dtype.element_ty
    if rank == root:
        copy_tiles(rank_ptr(data_ptrs, rank, DT), X, w, BLOCK)
    my_sig, e0, ok, go = begin(sig_ptrs, status, rank, world, digest, meta, max_spins, False)
    if go:
        copy_tiles(OUT, rank_ptr(data_ptrs, root, DT), w, BLOCK)
    finish(sig_ptrs, my_sig, status, rank, world, e0 + 2, max_spins, ok)
    done(my_sig, status)


@triton.jit(do_not_specialize=["n_pieces", *_PER_CALL])
def all_to_all_stage(X, pieces, n_pieces, counts, data_ptrs, sig_ptrs, status, rank, world, digest, meta, max_spins,
                     BLOCK: tl.constexpr):
    """First half of an all_to_all round: stage pieces of our send stream (bytes) in our buffer,
    publish our send and declared receive counts (round 0) and the signature.

    pieces: int64 [n_pieces, 3] (offset in the buffer, offset in X, nbytes); counts: int64
    [2 * world], the rows this rank sends to each rank (into COUNTS), then the rows it says it
    receives from each rank (recv_counts=, -1 when not given; into RECV_COUNTS). Written every
    round; the host reads every rank's after round 0's first barrier.
    The pull kernel ends the round; on a signature difference this kernel ends it itself.
    """
    mine = rank_ptr(data_ptrs, rank, tl.uint8)
    for i in range(0, n_pieces):
        off = tl.load(pieces + i * 3)
        src = tl.load(pieces + i * 3 + 1)
        nb = tl.load(pieces + i * 3 + 2)
        copy_tiles(mine + off, X + src, nb, BLOCK)
    if tl.program_id(0) == 0:
        sig = rank_ptr(sig_ptrs, rank, tl.int64)
        k = tl.arange(0, _MAX_RANKS)
        m = k < world
        tl.store(sig + _COUNTS + k, tl.load(counts + k, mask=m), mask=m)
        tl.store(sig + _RECV_COUNTS + k, tl.load(counts + world + k, mask=m), mask=m)
    my_sig, e0, ok, go = begin(sig_ptrs, status, rank, world, digest, meta, max_spins, False)
    if go:
        tl.store(my_sig + _EPOCH + tl.program_id(0), e0 + 1)  # the pull kernel goes on from here
    else:
        finish(sig_ptrs, my_sig, status, rank, world, e0 + 2, max_spins, ok)
    done(my_sig, status)


@triton.jit(do_not_specialize=["n_copies", "rank", "world", "max_spins"])
def all_to_all_pull(OUT, copies, n_copies, data_ptrs, sig_ptrs, status, rank, world, max_spins, BLOCK: tl.constexpr):
    """Second half of an all_to_all round: copy our blocks out of the peers' staged windows.

    copies: int64 [n_copies, 4] (source rank, offset in its buffer, offset in OUT, nbytes).
    """
    pid = tl.program_id(0)
    my_sig = rank_ptr(sig_ptrs, rank, tl.int64)
    e = tl.load(my_sig + _EPOCH + pid)
    ok = may_start(my_sig, status, world)
    if ok:
        for i in range(0, n_copies):
            src = tl.load(copies + i * 4)
            off = tl.load(copies + i * 4 + 1)
            dst = tl.load(copies + i * 4 + 2)
            nb = tl.load(copies + i * 4 + 3)
            copy_tiles(OUT + dst, rank_ptr(data_ptrs, src, tl.uint8) + off, nb, BLOCK)
    finish(sig_ptrs, my_sig, status, rank, world, e + 1, max_spins, ok)
    done(my_sig, status)
