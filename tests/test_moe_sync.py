"""Host syncs of the normal-mode MoE path (issue #41): one device-to-host copy per dispatch layout.

Every count a layout needs, and the least and greatest expert id (the range check), travel in one
call of ``moe.records._to_host``. On the CPU, where a copy costs nothing, each rank wraps that
function in every moe module and counts its calls around each step, with random routing checked
against a float64 reference (odd sizes, a rank without tokens, unused slots, capacity dropping):
a second gathering call anywhere in the path fails these tests. On a GPU (skipped here) torch's
sync debug mode counts the real syncs: one per layout, none in dispatch, the experts and combine.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import collectives
from moe import ExpertDispatcher, GroupedExperts

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
from moe_internode_job import FakeNodes

H = 6


class Case(NamedTuple):
    E: int
    k: int
    capacity_factor: float | None
    pass_weights: bool         # weights to dispatch (they travel with the tokens) or only to combine
    masked: bool               # some slots unused (-1)
    dtype: torch.dtype


CASES = (
    Case(8, 2, None, True, False, torch.float64),
    Case(4, 3, None, False, True, torch.float64),
    Case(12, 4, None, True, True, torch.bfloat16),
    Case(8, 2, 0.5, True, False, torch.float64),        # over-full experts: pairs dropped
    Case(4, 1, 100.0, True, True, torch.float64),       # capacity set, no expert over it
)


def _count_host_copies() -> list[tuple[int, ...]]:
    """Wrap the layout's gathering step in every moe module that holds it; returns the list of calls."""
    import moe.flat
    import moe.internode
    import moe.records

    calls: list[tuple[int, ...]] = []
    real = moe.records._to_host

    def counted(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return real(t)

    for module in (moe.records, moe.flat, moe.internode):
        module._to_host = counted
    return calls


def _batch(case: Case, n: int, P: int) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-rank token counts (odd, one rank empty when P > 1) and the global x, experts, weights, output grad."""
    g = torch.Generator().manual_seed(4100 + n)
    ts = [3 + 2 * r + n for r in range(P)]
    if P > 1:
        ts[n % P] = 0
    T = sum(ts)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    e = torch.rand(T, case.E, generator=g).argsort(-1)[:, :case.k]
    if case.masked:
        e = torch.where(torch.rand(T, case.k, generator=g) < 0.3, torch.full_like(e, -1), e)
    w = torch.rand(T, case.k, generator=g, dtype=torch.float64)
    return ts, x, e, w, torch.randn(T, H, generator=g, dtype=torch.float64)


def _keep(e: torch.Tensor, w: torch.Tensor, E: int, capacity: int | None) -> torch.Tensor:
    """[T, k] bool: per expert the ``capacity`` highest-weight pairs, ties to the earlier (token, slot)."""
    keep = e >= 0
    if capacity is not None:
        for ex in range(E):
            pairs = sorted((tuple(p) for p in (e == ex).nonzero().tolist()), key=lambda p: (-float(w[p]), p))
            for p in pairs[capacity:]:
                keep[p] = False
    return keep


def _sync_body(comm: Any, nodes: tuple[tuple[int, ...], ...] | None) -> list[dict[str, Any]]:
    """Each case: host copies in the layout, in dispatch + combine + backward with that layout, and in a
    dispatch that makes its own layout; the results against the float64 reference."""
    calls = _count_host_copies()
    c = FakeNodes(comm, nodes) if nodes else comm
    P, r = comm.size, comm.rank
    out = []
    for n, case in enumerate(CASES):
        disp = ExpertDispatcher(c, case.E, capacity_factor=case.capacity_factor)
        assert disp.node_aware == (nodes is not None)
        ts, X, e_all, W, G = _batch(case, n, P)
        sl = slice(sum(ts[:r]), sum(ts[:r + 1]))
        cap = None if case.capacity_factor is None else math.ceil(case.capacity_factor * sum(ts) * case.k / case.E)
        keep = _keep(e_all, W, case.E, cap)
        x = X[sl].to(case.dtype).requires_grad_()
        w = W[sl].to(torch.float32 if case.dtype != torch.float64 else torch.float64).requires_grad_()
        e = e_all[sl]
        wd = w.detach() if case.pass_weights else None

        before = len(calls)
        lay = disp.get_dispatch_layout(x, e, weights=wd)
        layout_copies = len(calls) - before
        before = len(calls)
        recv_x, _, h = disp.dispatch(x, e, layout=lay)
        y = disp.combine(recv_x, h, w)              # identity experts: y = x * (sum of kept weights)
        (y.double() * G[sl]).sum().backward()
        step_copies = len(calls) - before
        before = len(calls)
        disp.dispatch(x.detach(), e, weights=wd)
        own_layout_copies = len(calls) - before

        tol = 1e-12 if case.dtype == torch.float64 else 2e-2
        xr = X[sl].to(case.dtype).double()
        kw = (W[sl].to(w.dtype).double() * keep[sl])
        torch.testing.assert_close(y.double(), xr * kw.sum(-1, keepdim=True), rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad.double(), G[sl] * kw.sum(-1, keepdim=True), rtol=tol, atol=tol)
        torch.testing.assert_close(w.grad.double(), (G[sl] * xr).sum(-1, keepdim=True) * keep[sl], rtol=tol,
                                   atol=tol)
        assert torch.equal(h.dropped, (e >= 0) & ~keep[sl])
        over_full = cap is not None and bool((torch.bincount(e_all[e_all >= 0], minlength=case.E) > cap).any())
        out.append({"layout": layout_copies, "step": step_copies, "own_layout": own_layout_copies,
                    "over_full": over_full, "dropped": int(h.dropped.sum())})
        disp.close()
    return out


def _expected(per_case: list[dict[str, Any]], per_layout: int) -> list[tuple[int, int, int]]:
    return [(per_layout * (1 + c["over_full"]), 0, per_layout * (1 + c["over_full"])) for c in per_case]


@pytest.mark.parametrize("nprocs", [1, 2])
def test_flat_path_one_host_copy_per_layout(nprocs):
    per_rank = collectives.launch(_sync_body, nprocs, None, timeout=120)
    for r, cases in enumerate(per_rank):
        got = [(c["layout"], c["step"], c["own_layout"]) for c in cases]
        assert got == _expected(cases, 1), f"rank {r}: {got}"
    # the cases cover capacity dropping over an over-full expert, and capacity without one
    assert [c["over_full"] for c in per_rank[0]] == [False, False, False, True, False]
    assert sum(c["dropped"] for cases in per_rank for c in cases) > 0


def test_node_aware_path_one_host_copy_per_flat_layout():
    """4 ranks as 2 fake nodes: the group's layout and the node group's, one copy each (two more with dropping)."""
    per_rank = collectives.launch(_sync_body, 4, ((0, 1), (2, 3)), timeout=180)
    for r, cases in enumerate(per_rank):
        got = [(c["layout"], c["step"], c["own_layout"]) for c in cases]
        assert got == _expected(cases, 2), f"rank {r}: {got}"


def _bad_id_body(comm: Any) -> tuple[str, int]:
    """Rank 1 passes an expert id past E, rank 0 one below -1 (when alone): the range check, read from the one copy."""
    calls = _count_host_copies()
    disp = ExpertDispatcher(comm, 4)
    x = torch.randn(5, H)
    e = torch.randint(0, 4, (5, 2), generator=torch.Generator().manual_seed(comm.rank))
    if comm.rank == 1:
        e[3, 1] = 4
    if comm.size == 1:
        e[2, 0] = -2
    try:
        disp.dispatch(x, e)
    except ValueError as err:
        return str(err), len(calls)
    return "no error", len(calls)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_bad_expert_id_raises_on_every_rank_from_the_one_copy(nprocs):
    got = collectives.launch(_bad_id_body, nprocs, timeout=60)
    if nprocs == 1:
        want = "dispatch on rank 0: expert indices must lie in [0, 4) (or -1 for an unused slot), got values in [-2, 3]"
    else:
        want = "dispatch on rank 1: expert indices must lie in [0, 4) (or -1 for an unused slot), got values in [0, 4]"
    for message, copies in got:
        assert want in message, message
        assert copies == 1


# ---- on a GPU: torch's sync debug mode counts every host sync -----------------------------------
def _syncs(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the synchronising CUDA calls it made (torch.cuda.set_sync_debug_mode warns on each)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in seen)


def _cuda_body(comm: Any) -> list[tuple[str, int]]:
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(7)
    E, k, T = 8, 2, 37
    x = torch.randn(T, 64, generator=g).to(dev, torch.bfloat16)
    e = torch.rand(T, E, generator=g).argsort(-1)[:, :k].to(dev)
    w = torch.rand(T, k, generator=g).to(dev)
    experts = GroupedExperts(E, 0, 64, 32, "swiglu", 0).to(dev, torch.bfloat16)
    disp = ExpertDispatcher(comm, E)
    disp.get_dispatch_layout(x, e, weights=w)                     # warm up (allocator, pinned host memory)
    lay, n_layout = _syncs(lambda: disp.get_dispatch_layout(x, e, weights=w))
    (recv_x, tpe, h), n_dispatch = _syncs(lambda: disp.dispatch(x, e, layout=lay))
    out, n_experts = _syncs(lambda: experts(recv_x, tpe))
    y, n_combine = _syncs(lambda: disp.combine(out, h, w))
    torch.cuda.synchronize()
    ref = torch.stack([sum(float(w[t, j]) * experts(x[t:t + 1].float().to(torch.bfloat16),
                                                     torch.bincount(e[t, j:j + 1].cpu(), minlength=E))[0].float()
                           for j in range(k)) for t in range(T)])
    torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-2)
    return [("layout", n_layout), ("dispatch", n_dispatch), ("experts", n_experts), ("combine", n_combine)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_host_sync_per_layout_on_cuda():
    got = collectives.launch(_cuda_body, 1, timeout=120)[0]
    assert got == [("layout", 1), ("dispatch", 0), ("experts", 0), ("combine", 0)], got
