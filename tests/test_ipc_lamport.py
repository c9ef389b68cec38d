"""The ipc transport's Lamport one-shot all_reduce and its fused all_reduce + residual + RMSNorm, in
emulation (host provider + Triton's interpreter), ranks in forked processes.

Inputs are seeded per rank, so every rank computes the reference: float32 accumulation in rank
order, rounded once (the kernels' order), compared bitwise; -0.0 and NaN included. Results must be
bitwise the same on every rank.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ipc_harness import run_ranks  # noqa: E402
from transports.base import OpCode, ReduceOp, Signature  # noqa: E402

ELEMS = 512  # per-source slot capacity: sizes past it take the barrier one-shot
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN, "prod": ReduceOp.PROD}


def _input(seed: int, rank: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g) * (1.5 if op == "prod" else 4)
    if numel > 3:
        x[1] = -0.0  # never mistaken for an empty slot
    if numel > 5 and rank == 1:
        x[4] = float("nan")
    return x.to(dtype)


def _ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = xs[0].float()
    for x in xs[1:]:
        x = x.float()
        if op in ("sum", "avg"):
            acc = acc + x
        elif op == "prod":
            acc = acc * x
        else:
            nan = acc.isnan() | x.isnan()
            acc = torch.where(nan, float("nan"), torch.maximum(acc, x) if op == "max" else torch.minimum(acc, x))
    if op == "avg":
        acc = acc / len(xs)
    return acc.to(xs[0].dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (-0.0 == 0.0), NaN where the other has NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _cell(i: int, cells: int) -> int:
    """The cell of call ``i``: pass ``i // cells`` goes over every cell, forward on even passes and
    backward on odd ones, each starting one cell further on. Passes therefore differ in which size
    follows which in a slot, which cells run in place (every 7th call) and which of the three
    slots a cell lands in: a pass that repeated the last one would check nothing new."""
    p, k = divmod(i, cells)
    c = (k + p) % cells
    return cells - 1 - c if p % 2 else c


def _cells(sizes, every_op_at=None) -> list:
    """(dtype, op, size) of the grid: every op at the sizes in ``every_op_at`` (all sizes if None), sum
    alone at the others (an op's combiner is the same at every size; a size's tiles and slot use are
    the same for every op)."""
    return [(dt, op, size) for size in sizes for dt in FLOATS
            for op in (OPS if every_op_at is None or size in every_op_at else list(OPS)[:1])]


def _grid(group, sizes, calls, every_op_at=None):
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=4096, lamport_elems=ELEMS)
    n, me = group.size, group.rank
    fails, outs, algos, expected = [], [], set(), 0
    cells = _cells(sizes, every_op_at)
    inputs = {}  # a cell's inputs and reference, made once: repeated calls reuse the slots, not the data
    for i in range(calls):
        c = _cell(i, len(cells))
        dtype, op, size = cells[c]
        if c not in inputs:
            xs = [_input(c, r, size, dtype, op) for r in range(n)]
            inputs[c] = (xs, _ref(xs, op))
        xs, want = inputs[c]
        sig = Signature.of(OpCode.ALL_REDUCE, dtype=dtype, shape=(size,), op=OPS[op])
        algo = t.algorithm(OpCode.ALL_REDUCE, size * xs[0].element_size(), dtype)
        algos.add(algo)
        expected += algo == "lamport"
        x = xs[me].clone()
        out = torch.empty_like(x)
        if i % 7 == 3:  # in place
            t.all_reduce(x, x, OPS[op], sig)
            out = x
        else:
            t.all_reduce(x, out, OPS[op], sig)
            if not torch.equal(x, xs[me]) and not (x.isnan() | xs[me].isnan()).any():
                fails.append(f"call {i}: input changed")
        if not _same(out, want):
            fails.append(f"call {i} {dtype} {op} n={size}: got {out[:6].tolist()}, want {want[:6].tolist()}")
        if i < 200:
            outs.append(out.view(torch.uint8).clone() if size else out)
    from transports.kernels import layout as L

    lamport_calls = int(t._regions.read(me, L.LAMPORT_CALLS, 1)[0])  # program 0's count of slot rounds
    t.close()
    return fails[:10], outs, sorted(algos), (lamport_calls, expected)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_lamport_every_dtype_op_and_size_bitwise_on_every_rank(ranks):
    """2 ranks: three passes in a row over every cell (45 cells, 135 calls: every op at 300 and ELEMS
    elements, sum at the other sizes; sizes past the slots and 0 take the barrier kernels between them),
    forward, backward and forward again (see :func:`_cell`), which cycles the three slots through every
    size in both orders and reuses them (45 is a multiple of 3: each pass starts one slot further on).
    (It made 1,000 calls until #42: nine and a half passes in the same order, whose state repeated from
    the second on; then 315, every op at every size.)"""
    sizes = [1, 7, 300, ELEMS // 2 + 1, ELEMS, ELEMS + 1, 0] if ranks == 2 else [1, 33, ELEMS]
    every_op_at = (300, ELEMS) if ranks == 2 else None
    cells = len(_cells(sizes, every_op_at))
    assert cells % 3 == 0 or ranks != 2  # the three slots: see above
    results = run_ranks(_grid, ranks, sizes, 3 * cells if ranks == 2 else cells, every_op_at, timeout=300.0)
    for res in results:
        assert res[0] == "ok", res
        fails, _, algos, (lamport_calls, expected) = res[1]
        assert not fails, fails
        assert "lamport" in algos, algos
        assert lamport_calls == expected > 0  # every Lamport call went through the slots
    for i, out in enumerate(results[0][1][1]):
        assert all(torch.equal(r[1][1][i], out) for r in results), f"call {i} differs across ranks"


def _mismatch(group):
    from transports.base import CommunicatorBrokenError
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=4096, lamport_elems=ELEMS)

    def call(size):
        x = torch.randn(size)
        t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype,
                                                                           shape=(size,), op=ReduceOp.SUM))

    for size in (5, 6):  # both signatures agreed once (the host compares a signature's first call)
        call(size)
    try:
        call(5 + group.rank)  # then rank 1 passes another shape: only the kernel can tell
        outcome = "no error"
    except ValueError as e:
        outcome = str(e)
    try:
        call(5)
        later = "no error"
    except CommunicatorBrokenError:
        later = "broken"
    t.close()
    return outcome, later


def _host_mismatch(group):
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=4096, lamport_elems=ELEMS)
    size = 8 if group.rank == 0 else 3000  # Lamport on rank 0, a barrier kernel on rank 1
    x = torch.randn(size)
    try:
        t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype,
                                                                           shape=(size,), op=ReduceOp.SUM))
        outcome = "no error"
    except ValueError as e:
        outcome = str(e)
    y = torch.full((4,), float(group.rank + 1))
    t.all_reduce(y, y, ReduceOp.SUM, Signature.of(OpCode.ALL_REDUCE, dtype=y.dtype, shape=(4,), op=ReduceOp.SUM))
    t.close()
    return outcome, y.tolist()


def test_sizes_that_pick_lamport_on_one_rank_only_raise_on_the_first_call():
    results = run_ranks(_host_mismatch, 2, timeout=20.0)
    for res in results:
        assert res[0] == "ok", res
        outcome, after = res[1]
        assert "shape differs" in outcome and "rank 0: (8)" in outcome and "rank 1: (3000)" in outcome, outcome
        assert after == [3.0] * 4  # still in step


def test_lamport_signature_mismatch_raises_value_error_on_every_rank():
    results = run_ranks(_mismatch, 2, timeout=20.0)
    for res in results:
        assert res[0] == "ok", res
        outcome, later = res[1]
        assert "rank 0" in outcome and "rank 1" in outcome and "shape" in outcome.lower(), outcome
        assert later == "broken"  # a peer's stray data may sit in the slots


def _fused(comm):
    """comm.all_reduce_rmsnorm over ipc (fused in one Lamport kernel) against the composition."""
    n, me = comm.size, comm.rank
    fails, outs, plans = [], [], set()
    cases = [((1, 7), None), ((5, 64), torch.float32), ((3, 100), None), ((2, 3, 10), None), ((4, 33), torch.float32)]
    for k, (dtype, (shape, wdt)) in enumerate([(d, c) for d in FLOATS for c in cases]):
        wdt = wdt or dtype
        g = [torch.Generator().manual_seed(100 * k + r) for r in range(n + 2)]
        xs = [(torch.randn(shape, generator=g[r]) * 2).to(dtype) for r in range(n)]
        residual = torch.randn(shape, generator=g[n]).to(dtype)  # replicated, as in tensor parallelism
        weight = (torch.rand(shape[-1], generator=g[n + 1]) + 0.5).to(wdt)
        plans.add(comm.plan("all_reduce_rmsnorm", xs[me], weight_dtype=wdt).algorithm)
        a = _ref([x.reshape(-1) for x in xs], "sum").reshape(shape)
        new_res = a + residual
        r32 = new_res.float()
        want = (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()).to(dtype)
        x = xs[me].clone()
        if k % 2:  # in place, as vLLM's fused_add_rms_norm
            res = residual.clone()
            normed, got_res = comm.all_reduce_rmsnorm(x, res, weight, 1e-5, out=x, residual_out=res)
            if normed is not x and normed.data_ptr() != x.data_ptr():
                fails.append(f"case {k}: out=x not written in place")
        else:
            normed, got_res = comm.all_reduce_rmsnorm(x, residual, weight, 1e-5)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
        if not torch.equal(got_res, new_res):
            fails.append(f"case {k} {dtype} {shape}: residual {got_res.flatten()[:4]} vs {new_res.flatten()[:4]}")
        if not torch.allclose(normed.float(), want.float(), rtol=tol, atol=tol):
            fails.append(f"case {k} {dtype} {shape}: normed off by {(normed.float() - want.float()).abs().max()}")
        outs.append(normed.clone().view(torch.uint8))
    comm.synchronize()
    return fails, outs, sorted(plans)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_fused_all_reduce_rmsnorm_matches_the_composition(ranks):
    import collectives

    results = collectives.launch(_fused, ranks, transport="ipc", options={"ipc_emulate": 1}, timeout=120.0)
    for fails, _, plans in results:
        assert not fails, fails
        assert plans == ["lamport_rmsnorm"], plans
    for i, out in enumerate(results[0][1]):
        assert all(torch.equal(r[1][i], out) for r in results), f"case {i} differs across ranks"


def _fused_too_big(comm):
    """Past the Lamport slots the communicator composes all_reduce (over ipc) and the torch ops."""
    n, me = comm.size, comm.rank
    shape = (80, 64)  # 5120 elements: more than the emulated slots' 4096
    xs = [torch.randn(shape, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    residual = torch.randn(shape, generator=torch.Generator().manual_seed(99))
    weight = torch.rand(64, generator=torch.Generator().manual_seed(98)) + 0.5
    plan = comm.plan("all_reduce_rmsnorm", xs[me], weight_dtype=torch.float32)
    normed, new_res = comm.all_reduce_rmsnorm(xs[me], residual, weight, 1e-6)
    want_res = _ref([x.reshape(-1) for x in xs], "sum").reshape(shape) + residual
    want = want_res * torch.rsqrt(want_res.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    empty = torch.empty(0, 64, dtype=torch.bfloat16)  # no rows: composed, empty results
    e_normed, e_res = comm.all_reduce_rmsnorm(empty, empty.clone(), weight.to(torch.bfloat16), 1e-6)
    empty_ok = e_normed.shape == e_res.shape == (0, 64) and \
        comm.plan("all_reduce_rmsnorm", empty, weight_dtype=torch.bfloat16).algorithm == "all_reduce+rmsnorm"
    return (plan.algorithm, plan.transport, torch.equal(new_res, want_res) and empty_ok,
            torch.allclose(normed, want, atol=1e-5))


def test_fused_past_the_slots_composes():
    import collectives

    for algo, transport, res_ok, normed_ok in collectives.launch(_fused_too_big, 2, transport="ipc",
                                                                  options={"ipc_emulate": 1}, timeout=60.0):
        assert algo == "all_reduce+rmsnorm" and transport == "ipc", (algo, transport)
        assert res_ok and normed_ok
