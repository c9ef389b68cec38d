"""Low-latency MoE dispatch and combine over peer-mapped regions (DeepEP's low-latency mode).

Notation: P ranks (``world``), E experts, L = E / P local experts per rank (expert ``e`` lives on
rank ``e // L`` as local expert ``e % L``), M the most tokens a rank sends per call, T <= M the
tokens of this call, K <= KM the top-k slots per token (-1: unused), H the hidden size.

Every rank owns an *exchange region*, mapped by every rank (``reg``: int64 [P] base addresses)::

    [words: WORDS int64][counts: int32 [MAX_RANKS, L]][info: int32 [L, P*M]]
    [rows: [L, P*M] rows of RB bytes][combine: [M*KM, H] of the dtype]

Dispatch is two launches, with no host synchronization and shapes fixed by (E, M, H, P):

1. :func:`ll_dispatch_send`: every program checks the whole ``topk_idx`` (ids in [-1, E), no id
   twice in a token) and computes, for its tokens, each slot's position among this rank's tokens
   routed to that expert. It writes token ``t``'s row into segment ``[rank*M, rank*M + n)`` of the
   expert's rows on the owner, with its info word ``rank*M*KM + t*KM + k``, and its share of this
   rank's per-expert counts (program 0 the error and call words) into every rank; then every
   program adds 1 to ``D_ARRIVE[rank]`` of every rank (release).
2. :func:`ll_dispatch_recv`: wait until ``D_ARRIVE[src] >= seq * programs`` for every source
   (acquire), compare every source's call word with ours, then compact each local expert's
   segments, in source order, into the packed output (``recv_x [L, P*M, ...]``, ``info [L, P*M]``,
   ``recv_count [L]``) and add 1 to ``D_ACK[rank]`` of every source: the sender waits for that
   before it rewrites our rows in its next call.

Combine mirrors it: :func:`ll_combine_send` writes each received row back to its source's combine
rows ``[t*KM + k]`` (after ``C_ACK``), then arrives in ``C_ARRIVE``; :func:`ll_combine_recv`
waits, sums ``weight * row`` over each token's kept slots in slot order in float32, rounds once,
and acks. Counters only grow (``seq`` per program lives in the region and advances in the
kernels), so CUDA-graph replays stay in step and nothing is reset between calls.

Counters pair the ranks' calls by launch, so each call also carries a *call word* from the host
(its call number * 2 + FP8; a combine, the word of its handle's dispatch), stored before the
arrival (``D_CALL``/``C_CALL[src]``). A receiver reads no rows of a source whose word differs
from its own (a combine then writes no output), and program 0 records the first such source in
the status block (S_PAIRING, S_PAIR_WORD, S_PAIR_MAX), which the host raises.

FP8 (``FP8``): the sender quantizes each row to float8 e4m3 with one float32 scale per 128
channels, torch's ``s = |x|.amax(-1).clamp(min=1e-4) / 448; (x / s).to(float8_e4m3fn)`` bit for
bit: both divisions correctly rounded (``tl.div_rn``: a GPU's ``/`` is ``div.full.f32``, within 2
ulp), the cast with integer operations (:func:`_e4m3`). A NaN in a group makes its scale and all its
bytes NaN (torch's amax and clamp propagate it); an Inf makes the scale Inf, its byte NaN (Inf / Inf)
and the others +-0. A NaN byte's sign bit is the float32 quotient's, as torch's on the same device:
x86 (the interpreter, torch on a CPU) sets it for Inf / Inf and keeps a NaN input's, where a GPU's
canonical NaN has none. A staged row is the H bytes of ``q`` then the H/128 scales.

Input errors never stop the protocol: the sender's error word (``code + 256 * detail``, codes in
:data:`transports.kernels.layout`) travels with its counts, it sends no rows, and every receiver's
program 0 records ``err * MAX_RANKS + src`` in its status block's INPUT word, which the host reads
after the call's kernels (``IPCTransport.launch_exchange``) and raises as a ValueError naming the
source rank. A rank records host-detected errors (too many tokens, a wrong shape) of its own
source only for its peers: it raises them itself.

Waits are bounded and give up on ABORT (``sync.wait_flag``): ERROR names the missing rank and
every later step of the call is skipped. A program waits only for peers' (or earlier launches')
arrivals, never for another program of its own launch. Every launch of one exchange must use the
same number of programs on every rank.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import layout as L
from .sync import _add, _max, _min, done, may_start, store_rounded, wait_flag

# words of an exchange region (int64); D_CALL/C_CALL[src]: the call word src's last dispatch/combine sent,
# D_ERR/C_ERR[src] its error word
D_ARRIVE, D_ACK, C_ARRIVE, C_ACK, D_ERR, D_CALL, C_CALL, C_ERR = 0, 16, 32, 48, 64, 80, 96, 112
D_SEND, D_RECV, C_SEND, C_RECV = 128, 192, 256, 320  # per program: calls this program has finished
WORDS = L.LL_WORDS
assert L.MAX_RANKS <= 16 and C_RECV + L.MAX_PROGRAMS <= WORDS

_D_ARRIVE = tl.constexpr(D_ARRIVE)
_D_ACK = tl.constexpr(D_ACK)
_C_ARRIVE = tl.constexpr(C_ARRIVE)
_C_ACK = tl.constexpr(C_ACK)
_D_ERR = tl.constexpr(D_ERR)
_D_CALL = tl.constexpr(D_CALL)
_C_CALL = tl.constexpr(C_CALL)
_C_ERR = tl.constexpr(C_ERR)
_STALE = tl.constexpr(L.INPUT_STALE_HANDLE)
_D_SEND = tl.constexpr(D_SEND)
_D_RECV = tl.constexpr(D_RECV)
_C_SEND = tl.constexpr(C_SEND)
_C_RECV = tl.constexpr(C_RECV)
_LL_CALLS = tl.constexpr(L.LL_CALLS)
_S_INPUT = tl.constexpr(L.S_INPUT)
_S_PAIRING = tl.constexpr(L.S_PAIRING)
_S_PAIR_WORD = tl.constexpr(L.S_PAIR_WORD)
_S_PAIR_MAX = tl.constexpr(L.S_PAIR_MAX)
_MAX_RANKS = tl.constexpr(L.MAX_RANKS)
_BAD_ID = tl.constexpr(L.INPUT_BAD_ID)
_DUP_ID = tl.constexpr(L.INPUT_DUPLICATE_ID)
_EXPERT_CHUNK = tl.constexpr(16)  # experts counted per step (a [16, NB] compare)

_PER_CALL = ["T", "K", "rank", "world", "call", "max_spins"]


# ---- helpers -----------------------------------------------------------------------------------
@triton.jit
def _words(reg, r):
    """Rank r's exchange words (int64 pointer)."""
    return tl.load(reg + r).to(tl.pointer_type(tl.int64))


@triton.jit
def _begin(reg, sig_ptrs, status, rank, world, SEQ: tl.constexpr):
    """(my_sig, mine, seq, ok): this rank's signal area and exchange words, this program's call
    number of this kernel (1 for the first), and whether to start (no earlier failure, no ABORT)."""
    my_sig = tl.load(sig_ptrs + rank).to(tl.pointer_type(tl.int64))
    mine = _words(reg, rank)
    seq = tl.load(mine + SEQ + tl.program_id(0)) + 1
    ok = may_start(my_sig, status, world)
    return my_sig, mine, seq, ok


@triton.jit
def _wait_all(counter, target, my_sig, status, world, max_spins, ok):
    """Wait (acquire, bounded) until counter[r] >= target for every rank r; ERROR names the first
    that never gets there."""
    for r in range(0, world):
        if ok:
            ok = wait_flag(counter + r, target, my_sig, status, r, max_spins)
    return ok


@triton.jit
def _paired(mine, status, world, call, WORD: tl.constexpr):
    """[MAX_RANKS] mask of the sources whose call word (``mine[WORD + src]``, stored before their
    arrival) equals ours; program 0 records the first that differs (S_PAIRING = source + 1, its
    word in S_PAIR_WORD, every source's largest in S_PAIR_MAX) unless an earlier one is recorded."""
    s = tl.arange(0, _MAX_RANKS)
    sm = s < world
    words = tl.load(mine + WORD + s, mask=sm, other=0, volatile=True)
    same = sm & (words == call.to(tl.int64))
    if tl.program_id(0) == 0:
        first = tl.reduce(tl.where(sm & (same == 0), s, _MAX_RANKS), 0, _min)
        if first < world:
            if tl.load(status + _S_PAIRING, volatile=True) == 0:
                tl.store(status + _S_PAIR_WORD, tl.reduce(tl.where(s == first, words, 0), 0, _add))
                tl.store(status + _S_PAIR_MAX, tl.reduce(tl.where(sm, words, 0), 0, _max))
                tl.store(status + _S_PAIRING, (first + 1).to(tl.int64))
    return same


@triton.jit
def _record_refusal(status, errs, refused, world):
    """S_INPUT = ``err * MAX_RANKS + src`` of the first source in ``refused`` ([MAX_RANKS] mask;
    ``errs``: the sources' error words), unless an earlier refusal is recorded there."""
    s = tl.arange(0, _MAX_RANKS)
    first = tl.reduce(tl.where(refused, s, _MAX_RANKS), 0, _min)
    if first < world:
        if tl.load(status + _S_INPUT, volatile=True) == 0:
            err = tl.reduce(tl.where(s == first, errs, 0), 0, _add)
            tl.store(status + _S_INPUT, err * _MAX_RANKS + first)


@triton.jit
def _arrive_all(reg, rank, world, WORD: tl.constexpr):
    """Add 1 to word WORD + rank of every rank's exchange words (release: this program's stores
    before it are visible to whoever acquires the count)."""
    tl.debug_barrier()
    for r in range(0, world):
        tl.atomic_add(_words(reg, r) + WORD + rank, 1, sem="release", scope="sys")


@triton.jit
def _end(my_sig, status, mine, seq, SEQ: tl.constexpr):
    """This program's call number of the kernel, LL_CALLS += 1 (the watchdog compares peers'), DONE."""
    pid = tl.program_id(0)
    tl.store(mine + SEQ + pid, seq)
    tl.store(my_sig + _LL_CALLS + pid, tl.load(my_sig + _LL_CALLS + pid) + 1)
    done(my_sig, status)


@triton.jit
def _e4m3(x):
    """float32 -> float8 e4m3fn bits (int32 0..255) as torch's cast (c10's fp8e4m3fn_from_fp32_value,
    torch 2.13): round to nearest even, finite overflow and Inf saturated to 448, NaN 0x7F, the sign
    bit kept (a NaN's too). Integer operations only: no float min or compare has to see a NaN."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF  # |x|'s bits, ordered as |x| is, NaN above Inf
    ab = tl.minimum(mag, 0x43E00000).to(tl.int64)  # |x| saturated at 448 (a NaN too, replaced below)
    # normal (a >= 2**-6): keep 3 mantissa bits of the float32 exponent|mantissa, rebias 127 -> 7
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: a * 2**9 rounded to an integer, from the float32 mantissa with its implicit 1
    shift = tl.minimum(141 - (ab >> 23), 40)
    m = (ab & 0x7FFFFF) | 0x800000
    sub = (m + (((1 << shift) >> 1) - 1) + ((m >> shift) & 1)) >> shift
    q = tl.where(ab >= 0x3C800000, normal, sub)  # 2**-6
    q = tl.where(mag > 0x7F800000, 0x7F, q)
    return q.to(tl.int32) | sign


@triton.jit
def _check_ids(IDX, T, K, E, TB: tl.constexpr, KB: tl.constexpr):
    """The error word of these top-k ids: 0, or BAD_ID + 256 * (the largest id >= E, else the
    smallest < -1), or DUPLICATE_ID + 256 * (the id) for an expert twice in one token."""
    t = tl.arange(0, TB)
    k = tl.arange(0, KB)
    m = (t[:, None] < T) & (k[None, :] < K)
    ids = tl.load(IDX + t[:, None] * K + k[None, :], mask=m, other=-1)
    hi = tl.reduce(tl.where(ids >= E, ids, -1), None, _max)
    lo = tl.reduce(tl.where(ids < -1, ids, 0), None, _min)
    dup = tl.full([TB, KB], -1, tl.int64)
    for kk in range(1, K):
        col = tl.load(IDX + t * K + kk, mask=t < T, other=-1)
        same = (ids == col[:, None]) & (k[None, :] < kk) & (col[:, None] >= 0)
        dup = tl.maximum(dup, tl.where(same, col[:, None], -1))
    dup_id = tl.reduce(dup, None, _max)
    err = tl.where(hi >= 0, _BAD_ID + 256 * hi, tl.where(lo < -1, _BAD_ID + 256 * lo,
                                                          tl.where(dup_id >= 0, _DUP_ID + 256 * dup_id, 0)))
    return err


# ---- dispatch ----------------------------------------------------------------------------------
@triton.jit(do_not_specialize=[*_PER_CALL, "host_err"])
def ll_dispatch_send(X, IDX, SAVED, T, K, host_err, reg, rank, world, call, sig_ptrs, status, max_spins,
                     E: tl.constexpr, M: tl.constexpr, KM: tl.constexpr, H: tl.constexpr, RB: tl.constexpr,
                     OFF_CNT: tl.constexpr, OFF_INFO: tl.constexpr, OFF_ROWS: tl.constexpr,
                     TB: tl.constexpr, KB: tl.constexpr, NB: tl.constexpr, CB: tl.constexpr,
                     ITEM: tl.constexpr, FP8: tl.constexpr):
    """Send this rank's tokens to their experts' owners (step 1 of the module docstring).

    X: [T, H] (bfloat16/float16/float32), IDX: int64 [T, K] top-k expert ids (-1 unused), T <= M,
    K <= KM; SAVED: int64 [T, K], where the ids are copied for the combine's check; host_err: nonzero when the host refused the inputs (then nothing but the error goes
    out); call: this call's word (the host's call number * 2 + FP8), which every receiver compares
    with its own before it reads our rows. RB: bytes of a staged row; ITEM: bytes of an element of X; CB: channels per step (divides
    H; a multiple of 128 with FP8);
    TB, KB, NB: powers of two >= M, KM, M*KM.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my_sig, mine, seq, ok = _begin(reg, sig_ptrs, status, rank, world, _D_SEND)
    # the receivers have read our previous call's rows, counts and error word
    ok = _wait_all(mine + _D_ACK, (seq - 1) * nprog, my_sig, status, world, max_spins, ok)
    err = host_err.to(tl.int64)
    if err == 0:
        err = _check_ids(IDX, T, K, E, TB, KB)
    local = E // world
    if ok & (err == 0):
        j = tl.arange(0, NB)
        flat = tl.load(IDX + j, mask=j < T * K, other=-1)
        k = tl.arange(0, KB)
        c = tl.arange(0, CB)
        for t in range(pid, T, nprog):
            ids = tl.load(IDX + t * K + k, mask=k < K, other=-1)
            tl.store(SAVED + t * K + k, ids, mask=k < K)
            # slot k's position among this rank's tokens routed to its expert: earlier tokens' slots
            earlier = (flat[None, :] == ids[:, None]) & (j[None, :] < t * K)
            pos = tl.reduce(earlier.to(tl.int32), 1, _add)
            valid = ids >= 0
            e = tl.where(valid, ids, 0)
            owner = e // local
            row = (e % local) * (world * M) + rank * M + pos  # row in the owner's [L, P*M] layout
            base = tl.load(reg + owner, mask=valid, other=0)
            info = (base + OFF_INFO + row.to(tl.int64) * 4).to(tl.pointer_type(tl.int32))
            tl.store(info, rank * (M * KM) + t * KM + k, mask=valid)
            dst = base + OFF_ROWS + row.to(tl.int64) * RB  # [KB] byte addresses of the rows
            for h0 in range(0, H, CB):
                x = tl.load(X + t * H + h0 + c)
                if FP8:
                    # torch's bits (module docstring): a NaN makes its group's amax NaN, as torch's amax
                    # and clamp do (tl.maximum and the max reduce drop it); divisions correctly rounded
                    xf = tl.reshape(x.to(tl.float32), (CB // 128, 128))
                    nan = ((xf.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000).to(tl.int32)
                    amax = tl.maximum(tl.reduce(tl.abs(xf), 1, _max), 1e-4)
                    amax = tl.where(tl.reduce(nan, 1, _max) != 0, float("nan"), amax)
                    scale = tl.div_rn(amax, 448.0)
                    q = tl.reshape(_e4m3(tl.div_rn(xf, scale[:, None])), (CB,)).to(tl.uint8)
                    qp = (dst[:, None] + h0 + c[None, :]).to(tl.pointer_type(tl.uint8))
                    tl.store(qp, tl.broadcast_to(q[None, :], (KB, CB)), mask=valid[:, None])
                    g = tl.arange(0, CB // 128)
                    sp = (dst[:, None] + H + (h0 // 128 + g[None, :]) * 4).to(tl.pointer_type(tl.float32))
                    tl.store(sp, tl.broadcast_to(scale[None, :], (KB, CB // 128)), mask=valid[:, None])
                else:
                    xp = dst[:, None] + (h0 + c[None, :]) * ITEM
                    tl.store(xp.to(tl.pointer_type(X.dtype.element_ty)), tl.broadcast_to(x[None, :], (KB, CB)),
                             mask=valid[:, None])
    if ok:
        # our counts per expert (0 after an error), chunks of experts spread over the programs (each
        # program's arrival covers its own), and program 0's error and call words, into every rank
        j = tl.arange(0, NB)
        flat = tl.load(IDX + j, mask=j < tl.where(err == 0, T * K, 0), other=-1)
        x_ = tl.arange(0, _EXPERT_CHUNK)
        for r in range(0, world):
            peer = tl.load(reg + r)
            cnt = (peer + OFF_CNT + rank * local * 4).to(tl.pointer_type(tl.int32))
            for l0 in range(pid * _EXPERT_CHUNK, local, nprog * _EXPERT_CHUNK):
                ex = r * local + l0 + x_
                n = tl.reduce((flat[None, :] == ex[:, None]).to(tl.int32), 1, _add)
                tl.store(cnt + l0 + x_, n, mask=l0 + x_ < local)
            if pid == 0:
                tl.store(_words(reg, r) + _D_ERR + rank, err)
                tl.store(_words(reg, r) + _D_CALL + rank, call.to(tl.int64))
    if ok:
        _arrive_all(reg, rank, world, _D_ARRIVE)
    _end(my_sig, status, mine, seq, _D_SEND)


@triton.jit(do_not_specialize=_PER_CALL[2:])
def ll_dispatch_recv(OUT, OUT2, INFO, RECV_COUNT, reg, rank, world, call, sig_ptrs, status, max_spins,
                     E: tl.constexpr, M: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, RB: tl.constexpr,
                     OFF_CNT: tl.constexpr, OFF_INFO: tl.constexpr, OFF_ROWS: tl.constexpr, WB: tl.constexpr,
                     LC: tl.constexpr):
    """Wait for every source's arrival, then pack (step 2 of the module docstring).

    OUT: int32 words [L, P*M, W1] (the rows' first W1 words), OUT2: int32 [L, P*M, W2] (the rest:
    FP8 scales; W2 = 0 otherwise), INFO: int32 [L, P*M], RECV_COUNT: int32 [L]; row ``j`` of
    local expert ``l`` is the ``j``-th of the sources' rows for it, in source order, then token
    order. call: this call's word (rows of a source that sent another are not read). WB: words
    copied per step; LC: local experts whose counts one load brings (a power of two).

    The counts come in one [MAX_RANKS, LC] load per LC experts, the sources' error and call words
    in one load each: 2 + ceil(L / LC) loads a program before it copies, where a load per (expert,
    source) pair made 2 * L * P dependent ones (512 at DeepEP's decoding shape).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my_sig, mine, seq, ok = _begin(reg, sig_ptrs, status, rank, world, _D_RECV)
    ok = _wait_all(mine + _D_ARRIVE, seq * nprog, my_sig, status, world, max_spins, ok)
    local = E // world
    if ok:
        s = tl.arange(0, _MAX_RANKS)
        sm = s < world
        take = _paired(mine, status, world, call, _D_CALL)
        errs = tl.load(mine + _D_ERR + s, mask=sm, other=0, volatile=True)
        if pid == 0:  # the first source's input error (not our own host-detected ones: we raised)
            code = errs & 255
            own_host = (s == rank) & (code != _BAD_ID) & (code != _DUP_ID)
            _record_refusal(status, errs, take & (errs != 0) & (own_host == 0), world)
        take = take & (errs == 0)  # a refused or unpaired source sent no rows for this call
        cnt = (tl.load(reg + rank) + OFF_CNT).to(tl.pointer_type(tl.int32))
        info = (tl.load(reg + rank) + OFF_INFO).to(tl.pointer_type(tl.int32))
        rows = tl.load(reg + rank) + OFF_ROWS
        w = tl.arange(0, WB)
        lc = tl.arange(0, LC)
        for l0 in range(0, local, LC):
            tile = tl.load(cnt + s[:, None] * local + l0 + lc[None, :],
                           mask=take[:, None] & (l0 + lc[None, :] < local), other=0, volatile=True)
            for le in range(l0, tl.minimum(l0 + LC, local)):
                col = tl.reduce(tl.where(lc[None, :] == le - l0, tile, 0), 1, _add)  # [MAX_RANKS]: rows per source
                at = 0
                for src in range(0, world):
                    n = tl.reduce(tl.where(s == src, col, 0), 0, _add)
                    for j in range(pid, n, nprog):
                        r = le * (world * M) + src * M + j
                        d = le * (world * M) + at + j
                        srow = (rows + r.to(tl.int64) * RB).to(tl.pointer_type(tl.int32))
                        for w0 in range(0, W1, WB):
                            m = w0 + w < W1
                            tl.store(OUT + d.to(tl.int64) * W1 + w0 + w, tl.load(srow + w0 + w, mask=m), mask=m)
                        for w0 in range(0, W2, WB):
                            m = w0 + w < W2
                            tl.store(OUT2 + d.to(tl.int64) * W2 + w0 + w, tl.load(srow + W1 + w0 + w, mask=m),
                                     mask=m)
                        tl.store(INFO + d, tl.load(info + r))
                    at += n
                if pid == 0:
                    tl.store(RECV_COUNT + le, at)
        _arrive_all(reg, rank, world, _D_ACK)
    _end(my_sig, status, mine, seq, _D_RECV)


# ---- combine -----------------------------------------------------------------------------------
@triton.jit(do_not_specialize=_PER_CALL[2:])
def ll_combine_send(Y, INFO, RECV_COUNT, IDX, SAVED, T, K, host_err, reg, rank, world, call, sig_ptrs, status,
                    max_spins, E: tl.constexpr, M: tl.constexpr, KM: tl.constexpr, W: tl.constexpr,
                    OFF_COMB: tl.constexpr, WB: tl.constexpr, LC: tl.constexpr, NB: tl.constexpr):
    """Send each received row's expert output back to its source's combine rows.

    Y: int32 words [L, P*M, W] (the experts' outputs, W words a row), INFO, RECV_COUNT: what
    :func:`ll_dispatch_recv` wrote (the handle); IDX: int64 [T, K] the combine's top-k ids,
    SAVED: those the handle's dispatch sent (a difference: a stale handle, refused as
    STALE_HANDLE); host_err: nonzero when the host refused the inputs. A refused combine sends
    no rows, only its error word (C_ERR), which every receiver records. call: the word of the
    handle's dispatch, which the sources compare with theirs. LC: counts read per load; NB: a
    power of two >= M * KM.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my_sig, mine, seq, ok = _begin(reg, sig_ptrs, status, rank, world, _C_SEND)
    ok = _wait_all(mine + _C_ACK, (seq - 1) * nprog, my_sig, status, world, max_spins, ok)
    local = E // world
    err = host_err.to(tl.int64)
    if err == 0:
        at = tl.arange(0, NB)
        used = at < T * K
        differ = tl.load(IDX + at, mask=used, other=0) != tl.load(SAVED + at, mask=used, other=0)
        if tl.reduce(differ.to(tl.int32), 0, _max) != 0:
            err = err * 0 + _STALE
    if ok & (err == 0):
        w = tl.arange(0, WB)
        lc = tl.arange(0, LC)
        for l0 in range(0, local, LC):
            ns = tl.load(RECV_COUNT + l0 + lc, mask=l0 + lc < local, other=0)
            for le in range(l0, tl.minimum(l0 + LC, local)):
                n = tl.reduce(tl.where(lc == le - l0, ns, 0), 0, _add)
                for j in range(pid, n, nprog):
                    r = le * (world * M) + j
                    code = tl.load(INFO + r)
                    src = code // (M * KM)
                    slot = code % (M * KM)
                    dst = (tl.load(reg + src) + OFF_COMB + slot.to(tl.int64) * (W * 4)).to(tl.pointer_type(tl.int32))
                    for w0 in range(0, W, WB):
                        m = w0 + w < W
                        tl.store(dst + w0 + w, tl.load(Y + r.to(tl.int64) * W + w0 + w, mask=m), mask=m)
    if ok:
        if pid == 0:
            for r in range(0, world):
                tl.store(_words(reg, r) + _C_CALL + rank, call.to(tl.int64))
                tl.store(_words(reg, r) + _C_ERR + rank, err)
        _arrive_all(reg, rank, world, _C_ARRIVE)
    _end(my_sig, status, mine, seq, _C_SEND)


@triton.jit(do_not_specialize=_PER_CALL)
def ll_combine_recv(OUT, IDX, WEIGHTS, T, K, reg, rank, world, call, sig_ptrs, status, max_spins,
                    KM: tl.constexpr, H: tl.constexpr, OFF_COMB: tl.constexpr, CB: tl.constexpr,
                    OUT_BF16: tl.constexpr):
    """OUT[t] = sum over k of WEIGHTS[t, k] * (expert output of slot k) for IDX[t, k] >= 0, in
    float32, slots in order, rounded once (bfloat16: to nearest even). OUT: [T, H];
    WEIGHTS: float32 [T, K]; call: the word of our handle's dispatch. When a source sent rows of
    another call or refused its combine, OUT is left unwritten and S_PAIRING or S_INPUT says so."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my_sig, mine, seq, ok = _begin(reg, sig_ptrs, status, rank, world, _C_RECV)
    ok = _wait_all(mine + _C_ARRIVE, seq * nprog, my_sig, status, world, max_spins, ok)
    if ok:
        s = tl.arange(0, _MAX_RANKS)
        take = _paired(mine, status, world, call, _C_CALL)
        errs = tl.load(mine + _C_ERR + s, mask=s < world, other=0, volatile=True)
        if pid == 0:  # the first source's refusal (not our own host-detected ones: we raise them)
            own_host = (s == rank) & ((errs & 255) != _STALE)
            _record_refusal(status, errs, take & (errs != 0) & (own_host == 0), world)
        whole = tl.reduce((take & (errs == 0)).to(tl.int32), 0, _add) == world  # every source's rows came
        comb = (tl.load(reg + rank) + OFF_COMB).to(tl.pointer_type(OUT.dtype.element_ty))
        c = tl.arange(0, CB)
        for t in range(pid, tl.where(whole, T, 0), nprog):
            for h0 in range(0, H, CB):
                m = h0 + c < H
                acc = tl.full([CB], 0.0, tl.float32)
                for k in range(0, K):
                    if tl.load(IDX + t * K + k) >= 0:
                        wt = tl.load(WEIGHTS + t * K + k)
                        acc += wt * tl.load(comb + (t * KM + k) * H + h0 + c, mask=m).to(tl.float32)
                store_rounded(OUT + t * H + h0 + c, acc, m, OUT_BF16)
        _arrive_all(reg, rank, world, _C_ACK)
    _end(my_sig, status, mine, seq, _C_RECV)
