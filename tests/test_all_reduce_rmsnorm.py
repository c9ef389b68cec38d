"""Communicator.all_reduce_rmsnorm: all-reduce, add the residual, RMSNorm (a tensor-parallel block's
epilogue) against its definition as a composition, on every host transport.

The composed path (the default of every transport) must equal ``all_reduce`` + the torch ops bit for bit;
a transport that fuses the call is stood in for by a fake hook on the shm transport, which checks what
the communicator hands a fused transport (contiguous [rows, H] tensors, in place where allowed). The mpi
transport's run is this module under mpiexec (tests/test_launch_modes.py::test_collective_suite_under_mpiexec).
"""

from __future__ import annotations

import signal
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

import collectives
from spmd import UNDER_MPI, outcome, rank_input, run
from transports.base import CommunicatorBrokenError, PeerFailedError, ReduceOp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 7), (5, 64), (0, 16), (2, 3, 10)]
EPS = 1e-5
# machine epsilon of each dtype, and of the arithmetic the normalization runs in
DTYPE_EPS = {torch.float64: 2.2e-16, torch.float32: 1.2e-7, torch.float16: 9.8e-4, torch.bfloat16: 7.9e-3}


def _launch(body, nprocs: int, transport: str, *args, timeout: float = 30.0):
    if UNDER_MPI:
        return run(body, nprocs, *args, transport="mpi", timeout=timeout)
    return collectives.launch(body, nprocs, *args, transport=transport, timeout=timeout)


def composed(a: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) from the all-reduced ``a``, as all_reduce_rmsnorm's docstring defines them."""
    n = a + residual
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    f = n.to(acc)
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)).to(a.dtype), n


def _weight_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    return list(dict.fromkeys((dtype, torch.float32)))


def _digest(*ts: torch.Tensor) -> int:
    d = 0
    for t in ts:
        if t.numel():
            d = zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes(), d)
    return d


def _check_against_float64(normed, new, xs, residual, weight, what: str) -> None:
    """The new residual within the dtype's rounding of the float64 sum; normed within the rounding of the
    dtype (and of float32 arithmetic) of the float64 RMSNorm of the new residual this rank got."""
    dtype = xs[0].dtype
    e = DTYPE_EPS[dtype]
    s = sum(x.double() for x in xs) + residual.double()
    mag = sum(x.double().abs() for x in xs) + residual.double().abs()
    err = (new.double() - s).abs()
    assert (err <= 2 * e * mag + 1e-300).all(), f"{what}: new residual off by {err.max().item():.3g}"
    nd = new.double()
    inv = torch.rsqrt(nd.pow(2).mean(-1, keepdim=True) + EPS)
    ref = nd * inv * weight.double()
    acc_e = DTYPE_EPS[torch.float64 if dtype == torch.float64 else torch.float32]
    tol = e * ref.abs() + 16 * acc_e * (nd.abs() * inv * weight.double().abs()) + 1e-300
    err = (normed.double() - ref).abs()
    assert (err <= tol).all(), f"{what}: normed off by {err.max().item():.3g}"


def _strided_like(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor of t's shape and values (its last two dims transposed in memory)."""
    if t.dim() < 2:
        return t.clone()
    s = torch.empty((*t.shape[:-2], t.shape[-1], t.shape[-2]), dtype=t.dtype).transpose(-1, -2)
    s.copy_(t)
    return s


# ---- values ---------------------------------------------------------------------------------------
def _values_body(comm, seed: int) -> list[int]:
    """Every dtype x shape x weight dtype against the composition (bitwise) and a float64 reference; the
    out=/residual_out= layouts; a rank's own residual and weight. Returns digests of the replicated cases."""
    n, r = comm.size, comm.rank
    digests = []
    for dtype in DTYPES:
        for shape in SHAPES:
            for wdtype in _weight_dtypes(dtype):
                what = f"{dtype} {shape} weight {wdtype}"
                xs = [rank_input("x", k, shape, dtype, seed) for k in range(n)]
                res = rank_input("res", 0, shape, dtype, seed)  # replicated, as in tensor parallelism
                w = rank_input("w", 0, shape[-1:], wdtype, seed)
                normed, new = comm.all_reduce_rmsnorm(xs[r], res, w, EPS)
                assert normed.dtype == new.dtype == dtype and normed.shape == new.shape == shape, what
                want_normed, want_new = composed(comm.all_reduce(xs[r]), res, w, EPS)
                assert torch.equal(new, want_new), f"{what}: new residual differs from all_reduce + residual"
                assert torch.equal(normed, want_normed), f"{what}: normed differs from the composition"
                _check_against_float64(normed, new, xs, res, w, what)
                digests.append(_digest(normed, new))
                if shape[0] == 0 or wdtype != dtype:
                    continue
                # out= and residual_out=: new tensors, in place (out is x, residual_out is residual), strided
                o, ro = torch.empty_like(normed), torch.empty_like(new)
                got = comm.all_reduce_rmsnorm(xs[r], res, w, EPS, out=o, residual_out=ro)
                assert got[0] is o and got[1] is ro and torch.equal(o, normed) and torch.equal(ro, new), what
                xc, rc = xs[r].clone(), res.clone()
                got = comm.all_reduce_rmsnorm(xc, rc, w, EPS, out=xc, residual_out=rc)
                assert got[0] is xc and got[1] is rc, what
                assert torch.equal(xc, normed) and torch.equal(rc, new), f"{what}: in place"
                rc = res.clone()
                got = comm.all_reduce_rmsnorm(xs[r], rc, w, EPS, residual_out=rc)
                assert got[1] is rc and torch.equal(rc, new) and torch.equal(got[0], normed), f"{what}: residual_out"
                xs_, rs_, o, ro = _strided_like(xs[r]), _strided_like(res), _strided_like(normed), _strided_like(new)
                got = comm.all_reduce_rmsnorm(xs_, rs_, w, EPS, out=o, residual_out=ro)
                assert got[0] is o and torch.equal(o, normed) and torch.equal(ro, new), f"{what}: strided"
                assert torch.equal(rs_, res) and torch.equal(xs_, xs[r]), f"{what}: an input was written"
    # each rank's own residual and weight (and the default eps)
    xs = [rank_input("x-own", k, (5, 64), torch.float32, seed) for k in range(n)]
    res, w = rank_input("res-own", r, (5, 64), torch.float32, seed), rank_input("w-own", r, (64,), torch.float32, seed)
    normed, new = comm.all_reduce_rmsnorm(xs[r], res, w)
    want_normed, want_new = composed(comm.all_reduce(xs[r]), res, w, 1e-6)
    assert torch.equal(normed, want_normed) and torch.equal(new, want_new), "own residual and weight"
    plan = comm.plan("all_reduce_rmsnorm", xs[r])
    assert plan.op == "all_reduce_rmsnorm" and plan.algorithm == "all_reduce+rmsnorm", plan
    assert plan.transport == comm.plan("all_reduce", xs[r]).transport and "composed" in plan.reason, plan
    return digests


def _cases() -> list[tuple[str, int]]:
    return [("mpi", 2), ("mpi", 3)] if UNDER_MPI else [("shm", 2), ("shm", 3), ("gloo", 2)]


@pytest.mark.parametrize("transport,nprocs", _cases(), ids=lambda v: str(v))
def test_values_equal_the_composition_and_agree_across_ranks(transport, nprocs):
    if transport == "gloo" and not torch.distributed.is_gloo_available():
        pytest.skip("this torch build has no gloo")
    digests = _launch(_values_body, nprocs, transport, 5)
    assert len(digests[0]) == sum(len(SHAPES) * len(_weight_dtypes(d)) for d in DTYPES)
    assert all(d == digests[0] for d in digests), "ranks got different bits"


# ---- errors ---------------------------------------------------------------------------------------
X_SHAPE = (5, 64)


def _bad_calls(r: int):
    """(name, call on the bad rank, expected exception type and words of its message)."""
    x, res, w = (rank_input("bad", r, X_SHAPE, torch.float32, 3), rank_input("bad-res", r, X_SHAPE, torch.float32, 3),
                 rank_input("bad-w", r, (64,), torch.float32, 3))
    same = torch.empty(X_SHAPE)
    return [
        ("residual shape", lambda c: c.all_reduce_rmsnorm(x, res[:, :32], w), "ValueError", "residual of shape (5, 32)"),
        ("residual dtype", lambda c: c.all_reduce_rmsnorm(x, res.double(), w), "ValueError", "residual of shape"),
        ("weight shape", lambda c: c.all_reduce_rmsnorm(x, res, w[:63]), "ValueError", "weight of shape (63,)"),
        ("weight dtype", lambda c: c.all_reduce_rmsnorm(x, res, w.double()), "ValueError", "dtype torch.float64"),
        ("weight device", lambda c: c.all_reduce_rmsnorm(x, res, w.to("meta")), "ValueError", "weight on meta"),
        ("weight type", lambda c: c.all_reduce_rmsnorm(x, res, w.numpy()), "TypeError", "weight of type ndarray"),
        ("out shape", lambda c: c.all_reduce_rmsnorm(x, res, w, out=torch.empty(5, 63)), "ValueError", "out of shape"),
        ("out dtype", lambda c: c.all_reduce_rmsnorm(x, res, w, out=x.half()), "ValueError", "out of shape"),
        ("residual_out grad", lambda c: c.all_reduce_rmsnorm(x, res, w, residual_out=torch.zeros(X_SHAPE,
                                                                                                requires_grad=True)),
         "TypeError", "requires grad"),
        ("outputs overlap", lambda c: c.all_reduce_rmsnorm(x, res, w, out=same, residual_out=same), "ValueError",
         "overlap"),
        ("x dtype", lambda c: c.all_reduce_rmsnorm(x.to(torch.int64), res, w), "TypeError", "dtype torch.int64"),
        ("x 0-d", lambda c: c.all_reduce_rmsnorm(x[0, 0], res[0, 0], w[:0]), "ValueError", "0-d"),
        ("x numpy", lambda c: c.all_reduce_rmsnorm(x.numpy(), res, w), "TypeError", "x of type ndarray"),
        ("eps negative", lambda c: c.all_reduce_rmsnorm(x, res, w, -1e-6), "ValueError", "eps=-1e-06"),
        ("eps nan", lambda c: c.all_reduce_rmsnorm(x, res, w, float("nan")), "ValueError", "eps=nan"),
        ("eps str", lambda c: c.all_reduce_rmsnorm(x, res, w, "1e-6"), "TypeError", "eps='1e-6'"),
        ("eps bool", lambda c: c.all_reduce_rmsnorm(x, res, w, True), "TypeError", "eps=True"),
    ]


def _errors_body(comm, bad: int):
    """Rank ``bad`` makes each bad call while the others make a good one; then calls that differ across
    ranks: all_reduce_rmsnorm against a plain all_reduce, different weight dtypes, different shapes.
    Returns every case's outcome on this rank, and whether a good call works afterwards."""
    r = comm.rank
    x, res, w = (rank_input("bad", r, X_SHAPE, torch.float32, 3), rank_input("bad-res", r, X_SHAPE, torch.float32, 3),
                 rank_input("bad-w", r, (64,), torch.float32, 3))
    got = []
    for _, call, _, _ in _bad_calls(r):
        got.append(outcome(lambda call=call: call(comm) if r == bad else comm.all_reduce_rmsnorm(x, res, w)))
    got.append(outcome(lambda: comm.all_reduce_rmsnorm(x, res, w) if r == 0 else comm.all_reduce(x)))
    xb, rb = x.bfloat16(), res.bfloat16()
    got.append(outcome(lambda: comm.all_reduce_rmsnorm(xb, rb, w if r == 0 else w.bfloat16())))
    got.append(outcome(lambda: comm.all_reduce_rmsnorm(x if r else x[:, :32], res if r else res[:, :32],
                                                       w if r else w[:32])))
    normed, new = comm.all_reduce_rmsnorm(x, res, w)
    want = composed(comm.all_reduce(x), res, w, 1e-6)
    return r, got, torch.equal(normed, want[0]) and torch.equal(new, want[1])


def test_bad_arguments_and_mismatches_raise_on_every_rank():
    nprocs = 2 if UNDER_MPI else 3
    bad = nprocs - 1
    results = _launch(_errors_body, nprocs, "shm", bad)
    cases = _bad_calls(0)
    for rank, got, ok_after in results:  # under mpiexec: this rank's only
        assert ok_after, f"rank {rank}: a good call after the errors went wrong"
        for (name, _, kind, words), (k, msg) in zip(cases, got):
            if rank == bad:
                assert k == kind and f"all_reduce_rmsnorm: rank {bad}" in msg and words in msg, (name, k, msg)
            else:
                assert k == "ValueError" and f"rank(s) [{bad}] rejected their input" in msg, (name, rank, k, msg)
        mismatch, weights, shapes = got[len(cases):]
        others = ", ".join(f"rank {i}: all_reduce" for i in range(1, nprocs))
        assert mismatch[0] == "ValueError" and f"collective differs (rank 0: all_reduce_rmsnorm, {others})" \
            in mismatch[1] and "src" not in mismatch[1], mismatch
        assert weights[0] == "ValueError" and "all_reduce_rmsnorm called with arguments that differ" in weights[1] \
            and "weight dtype differs (rank 0: float32, rank 1: bfloat16" in weights[1], weights
        assert shapes[0] == "ValueError" and "shape differs (rank 0: (5, 32), rank 1: (5, 64)" in shapes[1], shapes


# ---- a transport that fuses the call ----------------------------------------------------------------
def _fused_body(comm) -> list:
    """The shm transport made to 'fuse' float32/16-bit calls by a fake hook (all_reduce with the call's
    signature + the torch ops): what the hook receives, results, plans, and a peer's plain all_reduce."""
    r = comm.rank
    tr = comm.transports["shm"]
    seen = []

    def fuses(numel, hidden, dtype, weight_dtype):
        assert isinstance(numel, int) and isinstance(hidden, int)
        return "fake_fused" if dtype != torch.float64 else None

    def fused(x, residual, weight, eps, out, residual_out, sig):
        rows, hidden = x.shape
        for t in (x, residual, out, residual_out):
            assert t.is_contiguous() and t.shape == (rows, hidden) and t.dtype == x.dtype
        assert weight.is_contiguous() and weight.shape == (hidden,) and isinstance(eps, float)
        seen.append((out.data_ptr() == x.data_ptr(), residual_out.data_ptr() == residual.data_ptr()))
        a = torch.empty_like(x)
        tr.all_reduce(x, a, ReduceOp.SUM, sig)  # the signature marks the fused op: a peer's all_reduce raises
        normed, new = composed(a, residual, weight, eps)
        residual_out.copy_(new)
        out.copy_(normed)

    tr.fuses_all_reduce_rmsnorm, tr.all_reduce_rmsnorm = fuses, fused
    try:
        report = []
        for dtype in DTYPES:
            x = rank_input("fx", r, (2, 3, 10), dtype, 9)
            res, w = rank_input("fres", r, (2, 3, 10), dtype, 9), rank_input("fw", r, (10,), torch.float32, 9)
            plan = comm.plan("all_reduce_rmsnorm", x, weight_dtype=torch.float32)
            want = composed(comm.all_reduce(x), res, w, EPS)
            del seen[:]
            got = comm.all_reduce_rmsnorm(x, res, w, EPS)
            xc, rc = x.clone(), res.clone()
            comm.all_reduce_rmsnorm(xc, rc, w, EPS, out=xc, residual_out=rc)  # in place: handed over as is
            xs, o = _strided_like(x), _strided_like(x)
            comm.all_reduce_rmsnorm(xs, res, w, EPS, out=o)  # strided: contiguous copies in, copied back
            same = all(torch.equal(a, b) for a, b in ((got[0], want[0]), (got[1], want[1]), (xc, want[0]),
                                                       (rc, want[1]), (o, want[0])))
            report.append((str(dtype), plan.algorithm, list(seen), same))
        x = rank_input("fx", r, (4, 8), torch.float32, 9)
        report.append(outcome(lambda: comm.all_reduce_rmsnorm(x, x, x[0]) if r == 0 else comm.all_reduce(x)))
        return report
    finally:
        del tr.fuses_all_reduce_rmsnorm, tr.all_reduce_rmsnorm


@pytest.mark.skipif(UNDER_MPI, reason="drives the shm transport")
def test_a_fusing_transport_gets_contiguous_rows_and_in_place_outputs():
    for report in collectives.launch(_fused_body, 2, transport="shm", timeout=30.0):
        *per_dtype, mismatch = report
        for dtype, algorithm, seen, same in per_dtype:
            assert same, f"{dtype}: results differ from the composition"
            if dtype == "torch.float64":
                assert algorithm == "all_reduce+rmsnorm" and seen == [], (dtype, algorithm, seen)
            else:  # new outputs, out is x and residual_out is residual (in place), temporaries for strided ones
                assert algorithm == "fake_fused" and seen == [(False, False), (True, True), (False, False)], seen
        assert mismatch[0] == "ValueError" and "collective differs (rank 0: all_reduce_rmsnorm, rank 1: all_reduce)" \
            in mismatch[1], mismatch


# ---- an interrupted call ------------------------------------------------------------------------------
PAUSE = 1.5


def _interrupted_body(comm):
    """Rank 0 is interrupted (SIGINT) while it waits in all_reduce_rmsnorm for rank 1, which is late."""
    x, res, w = torch.full((3, 8), 1.5), torch.full((3, 8), 0.25), torch.full((8,), 2.0)
    if comm.rank == 0:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        timer = threading.Timer(PAUSE / 3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
        timer.start()
        try:
            comm.all_reduce_rmsnorm(x, res, w)
            return "not interrupted"
        except KeyboardInterrupt:
            pass
        finally:
            timer.cancel()
        return outcome(lambda: comm.all_reduce_rmsnorm(x, res, w)), comm.closed
    time.sleep(PAUSE)
    t0 = time.monotonic()
    kind, msg = outcome(lambda: [comm.all_reduce_rmsnorm(x, res, w) for _ in range(3)])
    return kind, msg, time.monotonic() - t0


@pytest.mark.skipif(UNDER_MPI, reason="starts its own ranks")
def test_an_interrupted_call_breaks_the_communicator_and_the_peer_raises():
    first, second = collectives.launch(_interrupted_body, 2, transport="shm", timeout=20.0)
    (kind, msg), closed = first
    assert closed and kind == CommunicatorBrokenError.__name__ and "KeyboardInterrupt" in msg, first
    assert second[0] == PeerFailedError.__name__ and "rank 0" in second[1] and second[2] < 10.0, second
