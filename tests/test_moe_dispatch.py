"""ExpertDispatcher: dispatch/combine against a single-process float64 reference, on 1, 2 and 4 ranks.

Every rank builds the same global batch from a seed, takes its contiguous slice of tokens, and
checks its part of the result; one launch per world size runs all cases.
"""

from __future__ import annotations

import math

import pytest
import torch

import collectives
from moe import ExpertDispatcher

H, H2 = 12, 7


def _token_split(P: int, case: int) -> list[int]:
    """Per-rank token counts: differ between ranks, one rank empty when P > 1."""
    ts = [5 + 3 * r + (case % 3) for r in range(P)]
    if P > 1:
        ts[(case + 1) % P] = 0
    return ts


def _routing(mode: str, T: int, E: int, k: int, g: torch.Generator) -> torch.Tensor:
    if mode == "random":                     # k distinct experts per token
        return torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    if mode == "skip_first":                 # expert 0 (and 1 when possible) gets no token
        lo = 1 if E - 1 >= k else 0
        return lo + torch.rand(T, E - lo, generator=g).argsort(-1)[:, :k]
    if mode == "one_expert":                 # every token's first slot picks the last expert
        e = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
        e[:, 0] = E - 1
        e[:, 1:] = torch.where(e[:, 1:] == E - 1, torch.zeros_like(e[:, 1:]), e[:, 1:])
        return e
    if mode == "masked":                     # some unused slots (-1)
        e = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
        return torch.where(torch.rand(T, k, generator=g) < 0.3, torch.full_like(e, -1), e)
    raise AssertionError(mode)


def _reference_keep(e: torch.Tensor, w: torch.Tensor, E: int, capacity: int | None) -> torch.Tensor:
    """Keep mask [T, k]: per expert the `capacity` highest-weight pairs, ties to the earlier (token, slot)."""
    keep = e >= 0
    if capacity is None:
        return keep
    T, k = e.shape
    for ex in range(E):
        pairs = [(t, j) for t in range(T) for j in range(k) if int(e[t, j]) == ex]
        pairs.sort(key=lambda p: (-float(w[p]), p[0], p[1]))
        for p in pairs[capacity:]:
            keep[p] = False
    return keep


def _check_case(comm, disp: ExpertDispatcher, E: int, k: int, mode: str, case: int, dtype=torch.float32,
                tie_weights: bool = False) -> dict:
    P, r = comm.size, comm.rank
    L = E // P
    g = torch.Generator().manual_seed(1000 + case)
    ts = _token_split(P, case)
    Tg = sum(ts)
    X = torch.randn(Tg, H, generator=g, dtype=torch.float64)
    e = _routing(mode, Tg, E, k, g)
    if tie_weights:                          # few distinct values, so ties decide drops
        Wt = torch.randint(1, 4, (Tg, k), generator=g).double() / 4
    else:
        Wt = torch.rand(Tg, k, generator=g, dtype=torch.float64)
    We = torch.randn(E, H, H2, generator=g, dtype=torch.float64) / math.sqrt(H)
    G = torch.randn(Tg, H2, generator=g, dtype=torch.float64)
    cap = None if disp.capacity_factor is None else math.ceil(disp.capacity_factor * Tg * k / E)
    keep = _reference_keep(e, Wt, E, cap)

    # single-process reference in float64
    Xr, Wr, Wer = (t.clone().requires_grad_() for t in (X, Wt, We))
    out_pairs = torch.einsum("th,tjhg->tjg", Xr, Wer[e.clamp(min=0)])
    y_ref = torch.einsum("tj,tjg->tg", Wr * keep, out_pairs)
    (y_ref * G).sum().backward()

    off = sum(ts[:r])
    sl = slice(off, off + ts[r])
    x = X[sl].to(dtype).requires_grad_()
    w = Wt[sl].to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    we = We[r * L:(r + 1) * L].to(dtype).requires_grad_()
    # with weights, they travel with the tokens and combine is one all-to-all; without, combine sends them
    pass_weights = disp.capacity_factor is not None or case % 2 == 0
    recv_x, tpe, handle = disp.dispatch(x, e[sl], weights=w.detach() if pass_weights else None)
    assert (handle.pair_weight is not None) == pass_weights

    # recv_x: pairs of local experts in (expert, global token, slot) order -- exact copies
    flat_e = torch.where(keep, e, -1).reshape(-1)
    local = (flat_e >= r * L) & (flat_e < (r + 1) * L)
    p = local.nonzero(as_tuple=True)[0]
    p = p[torch.argsort(flat_e[p], stable=True)]
    assert torch.equal(recv_x.detach(), X[p // k].to(dtype)), "recv_x rows"
    assert tpe.dtype == torch.int64 and tpe.tolist() == torch.bincount(flat_e[p] - r * L, minlength=L).tolist()
    assert torch.equal(handle.dropped, (e[sl] >= 0) & ~keep[sl]), "dropped mask"
    assert handle.layout.capacity == cap and handle.layout.num_global_tokens == Tg

    # identity experts: y = x * sum of kept weights
    y_id = disp.combine(recv_x.detach(), handle, w.detach())
    tol = 1e-12 if dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2e-2
    atol = 1e-1 if dtype == torch.bfloat16 else tol  # bf16 experts: ~3 significant digits per GEMM
    want = X[sl] * (Wt[sl] * keep[sl]).sum(-1, keepdim=True)
    torch.testing.assert_close(y_id.double(), want, rtol=tol, atol=tol)

    # linear experts, with gradients of x, weights and expert parameters
    chunks = torch.split(recv_x, tpe.tolist())
    expert_out = torch.cat([c @ we[i] for i, c in enumerate(chunks)])
    y = disp.combine(expert_out, handle, w)
    assert y.shape == (ts[r], H2) and y.dtype == dtype
    (y.double() * G[sl]).sum().backward()
    torch.testing.assert_close(y.double(), y_ref[sl].detach(), rtol=tol, atol=atol)
    torch.testing.assert_close(x.grad.double(), Xr.grad[sl], rtol=tol, atol=atol)
    torch.testing.assert_close(w.grad.double(), Wr.grad[sl], rtol=tol, atol=atol)
    torch.testing.assert_close(we.grad.double(), Wer.grad[r * L:(r + 1) * L], rtol=tol, atol=atol)
    return {"pairs": int(tpe.sum()), "dropped": int(handle.dropped.sum())}


def _dropless_body(comm) -> int:
    n = 0
    special = ("skip_first", "one_expert", "masked")
    for E in (4, 8, 12):
        disp = ExpertDispatcher(comm, E)
        for k in (1, 2, 4):
            for mode in ("random", special[n % 3]):      # every special mode meets every E and k
                _check_case(comm, disp, E, k, mode, case=n)
                n += 1
    disp = ExpertDispatcher(comm, 8)
    _check_case(comm, disp, 8, 2, "random", case=n, dtype=torch.float64)
    _check_case(comm, disp, 8, 2, "random", case=n + 1, dtype=torch.bfloat16)
    # all tokens to a single expert (k = 1)
    E = 4 * comm.size
    disp = ExpertDispatcher(comm, E)
    x = torch.randn(3 + comm.rank, H)
    e = torch.full((x.shape[0], 1), E - 1)
    w = torch.rand(x.shape[0], 1)
    recv_x, tpe, h = disp.dispatch(x, e)
    last = comm.rank == comm.size - 1
    assert tpe.tolist() == ([0, 0, 0, sum(3 + r for r in range(comm.size))] if last else [0, 0, 0, 0])
    torch.testing.assert_close(disp.combine(recv_x, h, w), x * w)
    return n + 2


def _capacity_body(comm) -> list[int]:
    drops = []
    n = 500
    for cf in (0.5, 1.0, 1.5):
        for E, k in ((4, 1), (8, 2)):
            disp = ExpertDispatcher(comm, E, capacity_factor=cf)
            for mode, ties in (("random", False), ("one_expert", True)):
                drops.append(_check_case(comm, disp, E, k, mode, case=n, tie_weights=ties)["dropped"])
                n += 1
    return drops


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_dispatch_combine_matches_reference(nprocs):
    counts = collectives.launch(_dropless_body, nprocs, timeout=120)
    assert counts == [counts[0]] * nprocs and counts[0] == 20


@pytest.mark.parametrize("nprocs", [1, 2, 4])
def test_capacity_dropping_matches_reference(nprocs):
    drops = collectives.launch(_capacity_body, nprocs, timeout=120)
    # the drop pattern must actually exercise dropping (and not drop everything)
    total = [sum(d[i] for d in drops) for i in range(len(drops[0]))]
    assert any(t > 0 for t in total) and any(t == 0 for t in total)


def _error_body(comm) -> list[str]:
    r, msgs = comm.rank, []

    def expect(fn, *needles):
        try:
            fn()
        except ValueError as e:
            msgs.append(str(e))
            assert any(s in str(e) for s in needles), (needles, str(e))
            return
        raise AssertionError(f"no ValueError on rank {r} (expected {needles})")

    expect(lambda: ExpertDispatcher(comm, 4 if r == 0 else 8), "num_experts")
    expect(lambda: ExpertDispatcher(comm, 3), "not divisible")
    expect(lambda: ExpertDispatcher(comm, 4, capacity_factor=-1 if r == 1 else 1.0), "capacity_factor", "rejected")
    disp = ExpertDispatcher(comm, 4)
    x = torch.randn(5, H)
    e = torch.randint(0, 4, (5, 2))
    bad_e = torch.full((5, 2), 4 if r == 1 else 0)
    expect(lambda: disp.dispatch(x, bad_e), "expert indices", "rejected")
    expect(lambda: disp.dispatch(torch.randn(5, H + r), e), "hidden size")
    expect(lambda: disp.dispatch(x.to(torch.float64) if r else x, e), "dtype")
    expect(lambda: disp.dispatch(x.clone().requires_grad_(r == 0), e), "requires_grad")
    expect(lambda: disp.dispatch(x, e[:, :1] if r else e), "top_k")
    recv_x, _, h = disp.dispatch(x, e)
    w = torch.rand(5, 2)
    expect(lambda: disp.combine(recv_x[1:] if r == 0 else recv_x, h, w), "expert_out", "rejected")
    expect(lambda: disp.combine(recv_x, h, w[:, :1] if r == 1 else w), "weights", "rejected")
    recv_w, _, hw = disp.dispatch(x, e, weights=w)
    expect(lambda: disp.combine(recv_w, hw, w * 2 if r == 0 else w), "differ from the weights", "rejected")
    torch.testing.assert_close(disp.combine(recv_w, hw, w.clone()), x * w.sum(-1, keepdim=True))
    expect(lambda: disp.dispatch(x, e, weights=w if r == 0 else None), "weights")
    cap = ExpertDispatcher(comm, 4, capacity_factor=1.0)
    expect(lambda: cap.dispatch(x, e), "weights")
    # a precomputed layout serves any x of the same shape; a mismatched x is rejected on every rank
    lay = disp.get_dispatch_layout(x, e, weights=w)
    x2 = torch.randn(5, H)
    rx2, _, h2 = disp.dispatch(x2, e, layout=lay)
    torch.testing.assert_close(disp.combine(rx2, h2, w), x2 * w.sum(-1, keepdim=True))
    expect(lambda: disp.dispatch(x[:3] if r else x, e[:3] if r else e, layout=lay), "layout", "rejected")
    # the communicator still works after the aborted calls
    y = disp.combine(*disp.dispatch(x, e)[::2], w)
    torch.testing.assert_close(y, x * w.sum(-1, keepdim=True))
    return msgs


def test_errors_raise_on_every_rank():
    msgs = collectives.launch(_error_body, 2, timeout=60)
    # rank 0's view of rank 1's bad expert ids names rank 1 and the problem (the agreement carries it)
    assert any("dispatch on rank 1: expert indices must lie in [0, 4)" in m for m in msgs[0]), msgs[0]
    assert any("rank 0: 4, rank 1: 8" in m for m in msgs[1])


def test_one_dtype_code_table():
    """moe compares dtypes across ranks with the codes of transports.base, the library's one table (bug 4)."""
    import moe.dispatcher
    import moe.flat
    import moe.internode
    import moe.records
    import transports.base

    # the dispatch agreement (dtypes included) runs in the flat path's count exchange
    assert moe.flat.dtype_code is transports.base.dtype_code
    assert moe.flat.dtype_name is transports.base.dtype_name
    assert not any(isinstance(v, dict) and torch.float32 in v
                   for m in (moe.dispatcher, moe.flat, moe.internode, moe.records, moe.layer, moe.router)
                   for v in vars(m).values()), "a second dtype table in moe"


def _unequal_nodes_body(comm) -> list[list[int]]:
    """3 ranks as 2 "nodes" of unequal size ((0, 1), (2,)): the flat path's traffic counters (issue #37 item 9)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "jobs"))
    from moe_internode_job import FakeNodes

    nodes = ((0, 1), (2,))
    c = FakeNodes(comm, nodes)
    disp = ExpertDispatcher(c, 6)
    assert not disp.node_aware
    x = torch.randn(4, H)
    e = torch.tensor([[0, 5], [2, 4], [1, 3], [4, 5]])       # experts 0-1 on rank 0, 2-3 on rank 1, 4-5 on rank 2
    t = disp.get_dispatch_layout(x, e).traffic
    return [t.internode_bytes, t.intranode_bytes, t.flat_internode_bytes]


def test_traffic_counts_cross_node_bytes_with_unequal_nodes():
    """Nodes of 2 and 1 ranks take the flat path; its counters must still see the node boundary (issue #37)."""
    got = collectives.launch(_unequal_nodes_body, 3, timeout=60)
    row = H * 4
    # rows per destination rank (one per (token, rank)): every rank sends the same tokens to ranks 0: 2, 1: 2, 2: 3
    assert got[0] == [3 * row, 2 * row, 3 * row], got        # rank 1 is on node 0 with rank 0; rank 2 is not
    assert got[1] == [3 * row, 2 * row, 3 * row], got
    assert got[2] == [4 * row, 0, 4 * row], got               # rank 2 is alone on node 1


def _nan_weights_body(comm) -> bool:
    disp = ExpertDispatcher(comm, 4)
    x = torch.randn(5, H)
    e = torch.randint(0, 4, (5, 2), generator=torch.Generator().manual_seed(comm.rank))
    w = torch.rand(5, 2)
    w[1, 0] = float("nan")
    recv, _, h = disp.dispatch(x, e, weights=w)
    y = disp.combine(recv, h, w.clone())        # the same values, NaN included, in another tensor
    torch.testing.assert_close(y, x * w.sum(-1, keepdim=True), equal_nan=True)
    return bool(y[1].isnan().all())


def test_combine_accepts_the_same_nan_weights():
    """NaN weights given to dispatch and again (copied) to combine are the same weights (issue #37 item 9)."""
    assert collectives.launch(_nan_weights_body, 2, timeout=60) == [True, True]
