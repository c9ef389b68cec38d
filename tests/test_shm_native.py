"""transports._shmfast, the shm transport's compiled small-message path, against its Python oracle.

n ranks are simulated in one process: one anonymous mapping laid out as transports/shm.py lays out
its segment, and one ``Group`` per rank over it. Reductions must be bitwise identical to
:func:`transports._host.reduce_into` (what the Python path computes), so ranks on either path agree.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing
import os
import sys
import time

import numpy as np
import pytest
import torch

from transports import _native
from transports._host import as_numpy, reduce_into
from transports.base import DTYPE_CODES, META_LEN, SUPPORTED_DTYPES, ReduceOp

shmfast = _native.load_shmfast()
needs_native = pytest.mark.skipif(shmfast is None, reason=f"transports._shmfast: {_native.describe()}")

ARRIVED, PENDING, MISMATCH, DONE = 0, 1, 2, 3
EPOCH, SIG0, META0 = 0, 2, 4  # control block words (transports/shm.py)
CTRL_WORDS = 64  # >= META0 + 2 * META_LEN + all_to_all's words below, 128-byte blocks as shm.py aligns them
COUNTS0 = 4 + 2 * META_LEN  # two parities of n <= 5 send counts (shm.py: _counts0) ...
ADDR0 = COUNTS0 + 2 * 8  # ... then (two parities of) the single-copy addresses (shm.py: _addr0) ...
WAIT0 = ADDR0 + 4  # ... then the epoch a sleeping rank waits for (shm.py: _wait0)
SLOT_BYTES = 64 << 10  # fits the largest case: 5000 float64 + offset
FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class Segment:
    """One mapping with n control blocks and 2 data slots per rank, and a Group per rank over it."""

    def __init__(self, n: int, *, spin: int = 10, yields: int = 2, slot_bytes: int = SLOT_BYTES):
        ctrl_bytes = -(-n * CTRL_WORDS * 8 // 4096) * 4096
        self.map = mmap.mmap(-1, ctrl_bytes + n * 2 * slot_bytes)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.ctrl = self.bytes[: n * CTRL_WORDS * 8].view(torch.int64).view(n, CTRL_WORDS)
        self.slot_bytes = slot_bytes
        self._data0 = ctrl_bytes
        base = self.bytes.data_ptr()
        self.groups = [shmfast.Group(base, CTRL_WORDS, n, r, base + ctrl_bytes, slot_bytes, spin, yields,
                                     COUNTS0, ADDR0, WAIT0) for r in range(n)]

    def slot(self, rank: int, b: int) -> torch.Tensor:
        at = self._data0 + (rank * 2 + b) * self.slot_bytes
        return self.bytes[at : at + self.slot_bytes]

    def publish(self, rank: int, e: int, sig: int) -> None:
        """What rank ``rank`` would have written on arriving at epoch ``e`` with digest ``sig``."""
        self.ctrl[rank, SIG0 + (e & 1)] = sig
        self.ctrl[rank, EPOCH] = e


def random_input(count: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random values of ``dtype``; floats with NaN (both signs), +-inf, +-0.0, subnormals and, for 16-bit
    floats, values large enough to overflow when summed."""
    if dtype == torch.bool:
        return torch.rand(count, generator=g) < 0.5
    if not dtype.is_floating_point:
        lo, hi = (0, 256) if dtype == torch.uint8 else (-(2**31), 2**31) if dtype == torch.int32 else (-(2**62), 2**62)
        return torch.randint(lo, hi, (count,), generator=g, dtype=torch.int64).to(dtype)
    x = torch.randn(count, generator=g, dtype=torch.float64) * 3
    specials = [float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0,
                torch.finfo(dtype).tiny / 3, torch.finfo(dtype).max * 0.75]
    if count >= 8:
        at = torch.randperm(count, generator=g)[: max(8, count // 64)]
        x[at] = torch.tensor(specials, dtype=torch.float64).repeat(len(at) // 8 + 1)[: len(at)]
    return x.to(dtype)


def share_specials(xs: list[torch.Tensor], g: torch.Generator) -> None:
    """At some indices common to all ranks, put +-0.0 or +-NaN of random signs on every rank: the ties
    and NaN pairs that decide max/min and NaN propagation order, which independent draws seldom hit."""
    count = xs[0].numel()
    if not xs[0].dtype.is_floating_point or count < 4:
        return
    at = torch.randperm(count, generator=g)[: max(2, count // 16)]
    for x in xs:
        sign = torch.randint(0, 2, (len(at),), generator=g) * 2.0 - 1
        x[at] = (sign * torch.where(torch.arange(len(at)) % 2 == 0, 0.0, float("nan"))).to(x.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_bitwise(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, op: ReduceOp, what: str) -> None:
    """Bitwise equality, but for two cases where torch itself is not consistent from one element to
    the next (its vectorized body and scalar tail disagree; probed with torch 2.13 on AVX-512):
    - float16 sum/avg/prod through a float32 accumulator: the sign and payload of a NaN;
    - bfloat16 max/min through float32: which of +0.0 and -0.0 a tie of zeros gives.
    Every rank runs the same C code, so ranks still agree with each other bit for bit."""
    a, b = _bits(ours).clone(), _bits(ref).clone()
    if dtype == torch.float16 and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD):
        nan = ours.isnan() & ref.isnan()
        a[nan] = b[nan]
    if dtype == torch.bfloat16 and op in (ReduceOp.MAX, ReduceOp.MIN):
        zeros = (ours == 0) & (ref == 0)
        a[zeros] = b[zeros]
    bad = (a != b).nonzero().flatten()
    assert len(bad) == 0, (f"{what}: {len(bad)} of {a.numel()} elements differ, first at {bad[:4].tolist()}: "
                           f"ours {ours[bad[:4]].tolist()} bits {a[bad[:4]].tolist()}, "
                           f"reduce_into {ref[bad[:4]].tolist()} bits {b[bad[:4]].tolist()}")


def valid_ops(dtype: torch.dtype) -> list[ReduceOp]:
    # the communicator rejects avg on integers and bool before any transport sees it
    return list(ReduceOp) if dtype.is_floating_point else [op for op in ReduceOp if op != ReduceOp.AVG]


def oracle(xs: list[torch.Tensor], op: ReduceOp, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty_like(xs[0])
    with np.errstate(all="ignore"):  # inf and NaN are among the inputs on purpose
            reduce_into(as_numpy(out), [as_numpy(x) for x in xs], op, dtype, len(xs))
    return out


# ---- the module is there where it must be ---------------------------------------------------------
def test_ci_builds_the_native_helper():
    """CI installs with a compiler: losing the build there must fail, not silently skip every test below."""
    if os.environ.get("CI") and shmfast is None:
        pytest.fail(f"transports._shmfast is missing under CI: {_native.describe()}")
    if shmfast is None:
        pytest.skip(f"not under CI, and transports._shmfast is {_native.describe()}")
    assert shmfast.API_VERSION == _native.API_VERSION


def test_loader_warns_once_when_missing_and_not_when_disabled(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "transports._shmfast", None)  # makes the import raise ImportError
    monkeypatch.setattr(_native, "_loaded", None)
    monkeypatch.setattr(_native, "_why_not", None)
    monkeypatch.setattr(_native, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="transports._native"):
        assert _native.load_shmfast(enabled=False) is None
        assert not caplog.records
        assert _native.load_shmfast() is None
        assert _native.load_shmfast() is None
    assert len(caplog.records) == 1 and "pip install -e ." in caplog.records[0].getMessage()
    assert _native.describe().startswith("not built (")
    assert _native.describe(enabled=False) == "disabled (MOECOMM_SHM_NATIVE=off)"


@needs_native
def test_loader_refuses_a_stale_build(monkeypatch):
    class Stale:
        API_VERSION = _native.API_VERSION + 1
        __file__ = "stale.so"

    monkeypatch.setitem(sys.modules, "transports._shmfast", Stale)
    monkeypatch.setattr(_native, "_loaded", None)
    monkeypatch.setattr(_native, "_why_not", None)
    monkeypatch.setattr(_native, "_warned", True)
    assert _native.load_shmfast() is None
    assert _native.describe().startswith("stale build")


# ---- conversions against torch ------------------------------------------------------------------
@needs_native
def test_half_to_float_matches_torch_on_every_pattern():
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    ours = torch.empty(65536, dtype=torch.float32)
    shmfast.convert(h.data_ptr(), DTYPE_CODES[torch.float16], ours.data_ptr(), DTYPE_CODES[torch.float32], 65536)
    assert torch.equal(ours.view(torch.int32), h.view(torch.float16).float().view(torch.int32))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float_to_16bit_matches_torch(dtype):
    g = torch.Generator().manual_seed(16)
    random_bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    fi = torch.finfo(dtype)
    lsb16 = 1 << 13 if dtype == torch.float16 else 1 << 16  # float32 ulps per 16-bit ulp at the same exponent
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), fi.max, -fi.max,
                          fi.tiny, fi.tiny / 2, fi.smallest_normal, 3.4028234663852886e38, 1e-45, -1e-45,
                          65504.0, 65519.99, 65520.0, 65536.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.5, 2.0**-14],
                         dtype=torch.float32).view(torch.int32)
    # every float32 pattern around a 16-bit value: exact, just below/above and on the halfway point (ties)
    near = torch.randint(0, 1 << 15, (4096,), generator=g, dtype=torch.int64).to(torch.int16).view(dtype)
    near = near.float().view(torch.int32)
    around = torch.cat([near + d for d in (-1, 0, 1, lsb16 // 2 - 1, lsb16 // 2, lsb16 // 2 + 1, lsb16 - 1)])
    nans = torch.tensor([0x7F800001, 0x7FC12345, 0x7FFFFFFF, -1, 0x7FA00000, -0x7FE00000], dtype=torch.int64)
    f = torch.cat([random_bits, edges, around, nans.to(torch.int32)]).view(torch.float32)
    ours = torch.empty(f.numel(), dtype=torch.int16)
    shmfast.convert(f.data_ptr(), DTYPE_CODES[torch.float32], ours.data_ptr(), DTYPE_CODES[dtype], f.numel())
    ref = f.to(dtype).view(torch.int16)
    bad = (ours != ref).nonzero().flatten()[:4]
    assert len(bad) == 0, [(hex(int(f.view(torch.int32)[i]) & 0xFFFFFFFF), int(ref[i]), int(ours[i])) for i in bad]


# ---- reduce / gather ------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_reduce_is_bitwise_reduce_into(dtype):
    code = DTYPE_CODES[dtype]
    g = torch.Generator().manual_seed(code)
    item = torch.empty(0, dtype=dtype).element_size()
    for n in range(1, 6):
        seg = Segment(n)
        for count in (0, 1, 7, 1023, 1025, 5000):
            for op in valid_ops(dtype):
                b = int(torch.randint(0, 2, (1,), generator=g))
                off = (int(torch.randint(0, 64, (1,), generator=g)) * item) if count < 5000 else 8 * item
                xs = [random_input(count, dtype, g) for _ in range(n)]
                share_specials(xs, g)
                for r, x in enumerate(xs):
                    seg.groups[r].stage(b, x.data_ptr(), x.numel() * item, off)
                    seg.slot(r, 1 - b)[:256] = torch.randint(0, 256, (256,), generator=g, dtype=torch.uint8)
                ref = oracle(xs, op, dtype)
                me = int(torch.randint(0, n, (1,), generator=g))
                grp, what = seg.groups[me], f"{dtype} {op.name} n={n} count={count} rank={me} off={off}"
                out = random_input(count, dtype, g)
                grp.reduce(b, out.data_ptr(), count, code, op, off, 0)
                assert_bitwise(out, ref, dtype, op, what)
                # this rank's source from its own tensor, in place (out aliases it)
                own = xs[me].clone()
                grp.reduce(b, own.data_ptr(), count, code, op, off, own.data_ptr())
                assert_bitwise(own, ref, dtype, op, what + " in place")
                # out aliases this rank's own slot region
                if count:
                    mine = seg.slot(me, b)[off : off + count * item]
                    grp.reduce(b, mine.data_ptr(), count, code, op, off, 0)
                    assert_bitwise(mine.view(dtype), ref, dtype, op, what + " into own slot")


@needs_native
def test_gather_in_rank_order():
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 5):
        seg = Segment(n)
        for nbytes, off in ((0, 0), (1, 3), (4097, 17), (SLOT_BYTES - 40, 40)):
            b = nbytes & 1
            xs = [torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8) for _ in range(n)]
            for r, x in enumerate(xs):
                seg.groups[r].stage(b, x.data_ptr(), nbytes, off)
            me = n - 1
            out = torch.randint(0, 256, (n * nbytes + 5,), generator=g, dtype=torch.uint8)
            tail = out[n * nbytes :].clone()
            seg.groups[me].gather(b, out.data_ptr(), nbytes, off, nbytes, 0)
            assert torch.equal(out[: n * nbytes], torch.cat(xs)) and torch.equal(out[n * nbytes :], tail)
            # own block from its own tensor, rows strided
            own = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
            stride = nbytes + 3
            out = torch.zeros(n * stride, dtype=torch.uint8)
            seg.groups[me].gather(b, out.data_ptr(), nbytes, off, stride, own.data_ptr() if nbytes else 0)
            rows = out.view(n, stride)[:, :nbytes] if n * stride else out
            expect = xs[:me] + [own]
            assert torch.equal(rows.reshape(-1), torch.cat(expect)), f"n={n} nbytes={nbytes}"


# ---- arrive ------------------------------------------------------------------------------------------
def _sig_words(g: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**40), 2**40, (META_LEN,), generator=g, dtype=torch.int64)


@needs_native
@pytest.mark.parametrize("e", [5, 6])  # both parities
def test_arrive_publishes_and_compares(e):
    g = torch.Generator().manual_seed(e)
    seg = Segment(3)
    words, sig = _sig_words(g), 0x1234_5678_9ABC_DEF0
    par = e & 1
    seg.publish(0, e, sig)
    seg.publish(1, e + 1, sig)  # a peer already past e (and its e parity word still holds sig)
    seg.ctrl[1, SIG0 + par] = sig
    grp = seg.groups[2]
    assert grp.arrive(e, sig, words.data_ptr()) == ARRIVED
    assert int(seg.ctrl[2, EPOCH]) == e and int(seg.ctrl[2, SIG0 + par]) == sig
    assert torch.equal(seg.ctrl[2, META0 + par * META_LEN : META0 + (par + 1) * META_LEN], words)
    assert int(seg.ctrl[2, SIG0 + 1 - par]) == 0  # the other parity untouched
    # a differing digest
    seg.ctrl[0, SIG0 + par] = sig ^ 1
    assert grp.arrive(e, sig, words.data_ptr()) == MISMATCH
    assert not grp.sigs_match(e, sig)
    # without a signature: no digest compare, and the signature words are left alone
    seg.ctrl[2, SIG0 + par] = 77
    assert grp.arrive(e, -1, 0) == ARRIVED
    assert int(seg.ctrl[2, SIG0 + par]) == 77
    # a missing peer: PENDING after the spin and yield budget; then the caller's own wait and check
    seg.ctrl[0, EPOCH] = e - 1
    t0 = time.perf_counter()
    assert grp.arrive(e, sig, words.data_ptr()) == PENDING
    assert time.perf_counter() - t0 < 1.0
    seg.publish(0, e, sig)
    assert grp.sigs_match(e, sig)


@needs_native
def test_single_rank_arrives_at_once():
    seg = Segment(1)
    words = _sig_words(torch.Generator().manual_seed(1))
    assert seg.groups[0].arrive(1, 42, words.data_ptr()) == ARRIVED and int(seg.ctrl[0, EPOCH]) == 1
    # empty tensors may have a NULL data pointer: nothing is copied
    assert seg.groups[0].all_reduce(0, 2, 0, 0, 0, DTYPE_CODES[torch.float32], ReduceOp.SUM, -1, 0) == ARRIVED
    assert seg.groups[0].all_gather(1, 3, 0, 0, 0, -1, 0) == ARRIVED and int(seg.ctrl[0, EPOCH]) == 3
    seg.groups[0].reduce(0, 0, 0, DTYPE_CODES[torch.float64], ReduceOp.MAX, 0, 0)
    seg.groups[0].gather(0, 0, 0, 0, 0, 0)


# ---- fused calls ---------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_fused_all_reduce_on_the_last_arriving_rank(dtype):
    g = torch.Generator().manual_seed(DTYPE_CODES[dtype])
    n, e, b, count, code = 4, 9, 1, 301, DTYPE_CODES[dtype]
    seg = Segment(n)
    words, sig = _sig_words(g), 987654321
    xs = [random_input(count, dtype, g) for _ in range(n)]
    item = xs[0].element_size()
    outs = [torch.empty_like(x) for x in xs]
    for r in range(n - 1):  # the early ranks publish and give up waiting
        assert seg.groups[r].all_reduce(b, e, xs[r].data_ptr(), outs[r].data_ptr(), count, code, ReduceOp.SUM,
                                        sig, words.data_ptr()) == PENDING
    last = seg.groups[n - 1]
    assert last.all_reduce(b, e, xs[-1].data_ptr(), outs[-1].data_ptr(), count, code, ReduceOp.SUM,
                           sig, words.data_ptr()) == ARRIVED
    ref = oracle(xs, ReduceOp.SUM, dtype)
    assert_bitwise(outs[-1], ref, dtype, ReduceOp.SUM, "fused")
    for r in range(n - 1):  # what the early ranks then do: sigs_match + reduce
        assert seg.groups[r].sigs_match(e, sig)
        seg.groups[r].reduce(b, outs[r].data_ptr(), count, code, ReduceOp.SUM, 0, 0)
        assert torch.equal(_bits(outs[r]), _bits(outs[-1]))
    # a mismatch reduces nothing
    seg.ctrl[0, SIG0 + (e & 1)] = sig + 1
    before = outs[-1].clone()
    x = random_input(count, dtype, g)
    assert last.all_reduce(b, e, x.data_ptr(), outs[-1].data_ptr(), count, code, ReduceOp.SUM,
                           sig, words.data_ptr()) == MISMATCH
    assert torch.equal(_bits(outs[-1]), _bits(before))
    assert torch.equal(seg.slot(n - 1, b)[: count * item], x.view(torch.uint8))  # but it was staged


@needs_native
def test_fused_all_gather_on_the_last_arriving_rank():
    g = torch.Generator().manual_seed(7)
    n, e, b, nbytes = 3, 4, 0, 1001
    seg = Segment(n)
    words, sig = _sig_words(g), 5555
    xs = [torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8) for _ in range(n)]
    outs = [torch.zeros(n * nbytes, dtype=torch.uint8) for _ in range(n)]
    for r in range(n - 1):
        assert seg.groups[r].all_gather(b, e, xs[r].data_ptr(), outs[r].data_ptr(), nbytes, sig,
                                        words.data_ptr()) == PENDING
        assert not outs[r].any()
    assert seg.groups[-1].all_gather(b, e, xs[-1].data_ptr(), outs[-1].data_ptr(), nbytes, sig,
                                     words.data_ptr()) == ARRIVED
    assert torch.equal(outs[-1], torch.cat(xs))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_fused_reduce_scatter_on_the_last_arriving_rank(dtype):
    g = torch.Generator().manual_seed(11 + DTYPE_CODES[dtype])
    n, e, b, m, code, op = 3, 6, 0, 257, DTYPE_CODES[dtype], ReduceOp.MAX if dtype == torch.int32 else ReduceOp.SUM
    seg = Segment(n)
    words, sig = _sig_words(g), 24680
    xs = [random_input(n * m, dtype, g) for _ in range(n)]
    outs = [x.clone() for x in xs]  # out is each rank's own block of its input (in place)
    blocks = [o[r * m : (r + 1) * m] for r, o in enumerate(outs)]
    for r in range(n - 1):
        assert seg.groups[r].reduce_scatter(b, e, outs[r].data_ptr(), blocks[r].data_ptr(), m, code, op, sig,
                                            words.data_ptr()) == PENDING
    assert seg.groups[-1].reduce_scatter(b, e, outs[-1].data_ptr(), blocks[-1].data_ptr(), m, code, op, sig,
                                         words.data_ptr()) == ARRIVED
    item = xs[0].element_size()
    for r in range(n):
        if r < n - 1:  # the early ranks finish as the transport does: sigs_match + reduce of their block
            assert seg.groups[r].sigs_match(e, sig)
            seg.groups[r].reduce(b, blocks[r].data_ptr(), m, code, op, r * m * item, 0)
        ref = oracle([x[r * m : (r + 1) * m] for x in xs], op, dtype)
        assert_bitwise(blocks[r], ref, dtype, op, f"reduce_scatter block {r}")
    with pytest.raises(ValueError, match="does not fit"):
        seg.groups[0].reduce_scatter(b, e + 2, outs[0].data_ptr(), blocks[0].data_ptr(), SLOT_BYTES // item, code, op, sig,
                                     words.data_ptr())


@needs_native
@pytest.mark.parametrize("n", [1, 2, 4])
def test_all_to_all_round_matches_the_python_schedule(n):
    """a2a_post + a2a_pull against the rows each sender meant for each receiver (uneven, with empty
    blocks), and 'not handled' (1, nothing copied) for a sender beyond one slot or reading in single copy."""
    g = torch.Generator().manual_seed(n)
    row_bytes, e, b = 12, 3, 1
    seg = Segment(n, slot_bytes=4096)
    counts = [[int(c) for c in torch.randint(0, 6, (n,), generator=g)] for _ in range(n)]
    counts[0][n - 1] = 0
    xs = [torch.randint(0, 256, (sum(row) * row_bytes,), generator=g, dtype=torch.uint8) for row in counts]
    words, sig = _sig_words(g), 777

    def own(s):
        return sum(counts[s][:s]) * row_bytes, counts[s][s] * row_bytes

    codes = [seg.groups[s].a2a_post(b, e, xs[s].data_ptr(), xs[s].numel(), *own(s), counts[s], sig, words.data_ptr())
             for s in range(n)]
    assert codes[-1] == ARRIVED and all(c in (ARRIVED, PENDING) for c in codes)
    assert seg.ctrl[:, COUNTS0 + (e & 1) * n : COUNTS0 + (e & 1) * n + n].tolist() == counts
    for d in range(n):
        want = torch.cat([xs[s][(sum(counts[s][:d])) * row_bytes : (sum(counts[s][: d + 1])) * row_bytes]
                          for s in range(n)])
        y = torch.zeros(len(want) + 5, dtype=torch.uint8)
        assert seg.groups[d].a2a_pull(b, e, y.data_ptr(), y.numel(), row_bytes, xs[d].data_ptr(), *own(d)) == 0
        assert torch.equal(y[: len(want)], want) and not y[len(want):].any(), f"receiver {d}"
        if len(want):
            with pytest.raises(ValueError, match="receives"):
                seg.groups[d].a2a_pull(b, e, y.data_ptr(), len(want) - 1, row_bytes, xs[d].data_ptr(), *own(d))
    if n > 1:  # a sender reading in single copy, then one too large for a slot: Python's turn
        seg.ctrl[1, ADDR0 + 2 * (e & 1)] = 12345
        y = torch.zeros(4096, dtype=torch.uint8)
        assert seg.groups[0].a2a_pull(b, e, y.data_ptr(), y.numel(), row_bytes, xs[0].data_ptr(), *own(0)) == 1
        seg.ctrl[1, ADDR0 + 2 * (e & 1)] = 0
        seg.ctrl[1, COUNTS0 + (e & 1) * n] = 4096  # rows that cannot fit one slot
        assert seg.groups[0].a2a_pull(b, e, y.data_ptr(), y.numel(), row_bytes, xs[0].data_ptr(), *own(0)) == 1
        assert not y.any()


@needs_native
def test_all_to_all_post_into_an_exact_output_finishes_the_round():
    """a2a_post with an output: the last rank to arrive copies its rows at once (DONE) when they fill
    the output exactly; an output of another size is left untouched (ARRIVED: Python allocates)."""
    g = torch.Generator().manual_seed(42)
    n, row_bytes, b = 3, 8, 0
    seg = Segment(n, slot_bytes=4096)
    words, sig = _sig_words(g), 4242
    for e, extra in ((5, 0), (6, 8), (7, -8)):
        counts = [[int(c) for c in torch.randint(1, 5, (n,), generator=g)] for _ in range(n)]
        xs = [torch.randint(0, 256, (sum(row) * row_bytes,), generator=g, dtype=torch.uint8) for row in counts]

        def own(s):
            return sum(counts[s][:s]) * row_bytes, counts[s][s] * row_bytes

        want = torch.cat([xs[s][sum(counts[s][: n - 1]) * row_bytes :] for s in range(n)])
        ys = [torch.zeros(sum(c[d] for c in counts) * row_bytes + (extra if d == n - 1 else 0), dtype=torch.uint8)
              for d in range(n)]
        for s in range(n - 1):
            assert seg.groups[s].a2a_post(b, e, xs[s].data_ptr(), xs[s].numel(), *own(s), counts[s], sig,
                                          words.data_ptr(), ys[s].data_ptr(), ys[s].numel(), row_bytes) == PENDING
            assert not ys[s].any()
        y = ys[-1]
        code = seg.groups[-1].a2a_post(b, e, xs[-1].data_ptr(), xs[-1].numel(), *own(n - 1), counts[-1], sig,
                                       words.data_ptr(), y.data_ptr(), y.numel(), row_bytes)
        if extra:
            assert code == ARRIVED and not y.any(), f"epoch {e}: output of {extra:+d} bytes"
        else:
            assert code == DONE and torch.equal(y, want)


# ---- bad arguments ---------------------------------------------------------------------------------------
@needs_native
def test_bad_arguments_raise_before_touching_memory():
    seg = Segment(2, slot_bytes=4096)
    grp = seg.groups[0]
    buf = torch.zeros(2048, dtype=torch.float32)
    p, f32, s = buf.data_ptr(), DTYPE_CODES[torch.float32], ReduceOp.SUM
    words = torch.zeros(META_LEN, dtype=torch.int64)
    cases = [
        (ValueError, "unknown dtype", lambda: grp.reduce(0, p, 4, 9, s, 0, 0)),
        (ValueError, "unknown reduce op", lambda: grp.reduce(0, p, 4, f32, 6, 0, 0)),
        (ValueError, "avg needs a floating", lambda: grp.reduce(0, p, 4, DTYPE_CODES[torch.int32], 2, 0, 0)),
        (ValueError, "not 0 or 1", lambda: grp.reduce(2, p, 4, f32, s, 0, 0)),
        (ValueError, "do not fit", lambda: grp.reduce(0, p, 1025, f32, s, 0, 0)),
        (ValueError, "do not fit", lambda: grp.reduce(0, p, -1, f32, s, 0, 0)),
        (ValueError, "does not fit", lambda: grp.reduce(0, p, 1024, f32, s, 4, 0)),
        (ValueError, "does not fit", lambda: grp.stage(0, p, 4097, 0)),
        (ValueError, "does not fit", lambda: grp.stage(0, p, 8, -8)),
        (ValueError, "does not fit", lambda: grp.gather(1, p, 16, 4090, 16, 0)),
        (ValueError, "stride", lambda: grp.gather(1, p, 16, 0, 8, 0)),
        (ValueError, "not a valid pointer", lambda: grp.stage(0, 0, 8, 0)),
        (ValueError, "do not fit", lambda: grp.all_reduce(0, 1, p, p, 2000, f32, s, 1, words.data_ptr())),
        (ValueError, "not 0 or 1", lambda: grp.all_gather(-1, 1, p, p, 8, 1, words.data_ptr())),
        (ValueError, "signature words", lambda: grp.arrive(1, 5, 0)),
        (OverflowError, None, lambda: grp.stage(0, p, 2**70, 0)),
        (TypeError, "takes 4 arguments", lambda: grp.stage(0, p, 8)),
        (TypeError, None, lambda: grp.stage(0, p, 8.0, 0)),
        (ValueError, "bad layout", lambda: shmfast.Group(p, 8, 2, 0, p, 64, 1, 1)),
        (ValueError, "bad layout", lambda: shmfast.Group(p, CTRL_WORDS, 2, 2, p, 64, 1, 1)),
    ]
    for exc, text, call in cases:
        with pytest.raises(exc, match=text):
            call()
    assert int(seg.ctrl[0, EPOCH]) == 0, "a refused fused call must not publish its arrival"
    assert not seg.slot(0, 0).any() and not seg.slot(0, 1).any()


# ---- two real processes --------------------------------------------------------------------------------
def _two_process_rank(rank: int, mapping: mmap.mmap, seed: int, iters: int, conn) -> None:
    try:
        n, e = 2, 0
        data = torch.frombuffer(mapping, dtype=torch.uint8)
        base = data.data_ptr()
        grp = shmfast.Group(base, CTRL_WORDS, n, rank, base + 4096, SLOT_BYTES, 200, 50)
        ctrl = data[: n * CTRL_WORDS * 8].view(torch.int64).view(n, CTRL_WORDS)
        words = torch.arange(META_LEN, dtype=torch.int64)
        g = torch.Generator().manual_seed(seed)
        code = DTYPE_CODES[torch.float32]
        digest = torch.zeros(iters, dtype=torch.int64)
        for i in range(iters):
            xs = [torch.randn(1 + i % 37, generator=g) for _ in range(n)]  # both ranks draw both inputs
            out = torch.empty_like(xs[0])
            e += 1
            rc = grp.all_reduce(e & 1, e, xs[rank].data_ptr(), out.data_ptr(), xs[0].numel(), code,
                                ReduceOp.SUM, 1000 + i, words.data_ptr())
            deadline = time.monotonic() + 30
            while rc == PENDING:  # the transport's own wait, bounded
                assert time.monotonic() < deadline, f"rank {rank} timed out at epoch {e}"
                os.sched_yield()
                if int(ctrl[1 - rank, EPOCH]) >= e:
                    rc = ARRIVED if grp.sigs_match(e, 1000 + i) else MISMATCH
                    grp.reduce(e & 1, out.data_ptr(), xs[0].numel(), code, ReduceOp.SUM, 0, 0)
            assert rc == ARRIVED, f"rank {rank} epoch {e}: {rc}"
            assert torch.equal(out, xs[0] + xs[1]), f"rank {rank} epoch {e}"
            digest[i] = int(out.view(torch.int32).sum())
        conn.send(("ok", digest.tolist()))  # a list: torch would pickle a tensor through an fd server
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", repr(exc)))


@needs_native
def test_two_processes_all_reduce_in_lockstep():
    """Two forked processes over one shared mapping: rounds alternate slots and epochs as the
    transport's do, every result equals the sum on both ranks (ordering of data before epoch)."""
    mapping = mmap.mmap(-1, 4096 + 2 * 2 * SLOT_BYTES)
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_two_process_rank, args=(r, mapping, 11, 300, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    for (recv, _), p in zip(pipes, procs):
        assert recv.poll(60), "a rank hung"
        results.append(recv.recv())
        p.join(10)
    assert all(status == "ok" for status, _ in results), results
    assert results[0][1] == results[1][1]


def _arrive_later(mapping: mmap.mmap, delay: float, publish_only: bool = False) -> None:
    """Rank 1 of a 2-rank Segment layout over ``mapping``: publish epoch 1 after ``delay`` seconds, by
    ``arrive`` (publish, then wait in vain) or by ``publish`` alone, which must return at once (exit 1 if not)."""
    base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    group = shmfast.Group(base, CTRL_WORDS, 2, 1, base + 4096, SLOT_BYTES, 0, 0, COUNTS0, ADDR0, WAIT0)
    time.sleep(delay)
    t0 = time.monotonic()
    if publish_only:
        group.publish(1)
    else:
        group.arrive(1, -1, 0)  # rank 0 never arrives: PENDING, but the epoch is out and the sleeper woken
    os._exit(0 if time.monotonic() - t0 < 1 else 1)


def _rank0_of_two() -> tuple[mmap.mmap, object, torch.Tensor]:
    """A 2-rank layout that a forked child can map too: (mapping, rank 0's Group with a wait word, the
    two control blocks as [2, CTRL_WORDS] int64)."""
    mapping = mmap.mmap(-1, 4096 + 2 * 2 * SLOT_BYTES)
    base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    me = shmfast.Group(base, CTRL_WORDS, 2, 0, base + 4096, SLOT_BYTES, 0, 0, COUNTS0, ADDR0, WAIT0)
    return mapping, me, torch.frombuffer(mapping, dtype=torch.int64, count=2 * CTRL_WORDS).view(2, CTRL_WORDS)


def _sleep_until_woken(me, mapping: mmap.mmap, publish_only: bool) -> float:
    """Rank 0 sleeps (10 s bounds) while a child process publishes epoch 1 after 0.3 s; seconds slept."""
    child = multiprocessing.get_context("fork").Process(target=_arrive_later, args=(mapping, 0.3, publish_only))
    child.start()
    t0 = time.monotonic()
    woke = False
    while not woke and time.monotonic() - t0 < 30:
        woke = me.sleep(1, 10_000_000)  # a 10 s bound: the peer's arrival must end it long before
    waited = time.monotonic() - t0
    child.join(10)
    assert woke and child.exitcode == 0, (woke, child.exitcode)
    return waited


@needs_native
def test_sleep_wakes_when_the_peer_arrives_and_is_bounded_otherwise():
    mapping, me, ctrl = _rank0_of_two()
    t0 = time.monotonic()
    assert me.sleep(1, 20_000) is False  # nobody arrives: back after its bound
    assert 0.015 < time.monotonic() - t0 < 5
    assert ctrl[0, WAIT0] == 0  # awake again
    waited = _sleep_until_woken(me, mapping, publish_only=False)
    assert ctrl[1, EPOCH] == 1
    assert waited < 5, f"slept {waited:.1f}s: the peer's arrival did not wake the sleeper"
    assert me.sleep(1, 10_000_000) is True  # already there: no sleep
    base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    with pytest.raises(ValueError, match="wait_word"):
        shmfast.Group(base, CTRL_WORDS, 2, 0, base + 4096, SLOT_BYTES, 0, 0).sleep(1, 10)


@needs_native
def test_publish_returns_at_once_and_wakes_a_sleeper():
    mapping, me, ctrl = _rank0_of_two()
    waited = _sleep_until_woken(me, mapping, publish_only=True)  # the child's exit code: publish did not wait
    assert ctrl[1, EPOCH] == 1 and ctrl[0, EPOCH] == 0
    assert waited < 5, f"slept {waited:.1f}s: publish() did not wake the sleeper"


@needs_native
def test_spin_is_bounded_and_sees_an_arrival():
    seg = Segment(2)
    me = seg.groups[0]
    t0 = time.monotonic()
    assert me.spin(1, 20_000_000) is False  # nobody arrives: back after its 20 ms budget
    assert 0.015 < time.monotonic() - t0 < 5
    assert me.spin(1, 0) is False
    seg.groups[1].publish(1)
    assert seg.ctrl[1, EPOCH] == 1
    t0 = time.monotonic()
    assert me.spin(1, 10_000_000_000) is True  # already there: no wait
    assert time.monotonic() - t0 < 1
    assert me.spin(2, 0) is False
