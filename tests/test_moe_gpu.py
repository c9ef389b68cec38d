"""MoE on CUDA: ExpertDispatcher dispatch/combine and MoELayer forward + backward, at 1 rank and at
2 ranks sharing cuda:0, in float32 and bfloat16.

Every rank rebuilds the same global batch from a seed (inputs and weights rounded to the dtype
under test, so the reference sees exactly the values the GPU sees), computes the whole batch's
result and gradients in float64 on the CPU with plain torch ops (no moe code), and checks its
contiguous slice of tokens: outputs, received rows, input / router-weight / expert-weight
gradients. Cases include a rank with no tokens, unused (-1) slots and capacity dropping.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from gpu_harness import each_dtype, launch_on_gpu

from moe import ExpertDispatcher, MoELayer, shard_state_dict

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

F64 = torch.float64
E, K = 8, 2                    # experts, slots per token
H, H2 = 32, 24                 # token width, expert output width (dispatch test)
# Relative tolerance per dtype; the absolute one scales with the reference's magnitude (see _close).
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
DTYPES = list(TOL)


def _close(got: torch.Tensor | None, want: torch.Tensor, tol: float, what: str, comm: Any) -> None:
    """``got`` (any device and dtype) against the float64 CPU reference ``want``."""
    where = f"P={comm.size} rank {comm.rank}: {what}"
    assert got is not None, f"{where}: missing (no gradient reached it)"
    # atol relative to the largest reference value: low-precision GEMMs err relative to their operands, not per element
    atol = tol * max(1.0, float(want.abs().max())) if want.numel() else tol
    torch.testing.assert_close(got.detach().cpu().double(), want, rtol=tol, atol=atol,
                               msg=lambda m: f"{where}: {m}")


def _split(ts: list[int], r: int) -> slice:
    return slice(sum(ts[:r]), sum(ts[:r + 1]))


# ---- ExpertDispatcher ---------------------------------------------------------------------------
class _DispatchCase(NamedTuple):
    splits: dict[int, list[int]]      # tokens per rank, by the number of ranks
    capacity_factor: float | None
    weights_to_dispatch: bool         # True: weights travel with the tokens; False: combine sends them
    masked: bool                      # some slots unused (-1)


_DISPATCH_CASES = (
    _DispatchCase({1: [48], 2: [0, 48]}, None, True, False),      # rank 0 empty
    _DispatchCase({1: [48], 2: [20, 28]}, None, False, True),
    _DispatchCase({1: [40], 2: [40, 0]}, 1.0, True, False),       # capacity dropping, rank 1 empty
    _DispatchCase({1: [0], 2: [0, 0]}, None, True, False),        # no tokens anywhere
)


def _reference_keep(e: torch.Tensor, w: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """[T, k] bool: per expert the ``capacity`` highest-weight pairs, ties to the earlier (token, slot)."""
    keep = e >= 0
    if capacity is None:
        return keep
    for ex in range(E):
        pairs = sorted(((t, j) for t, j in (e == ex).nonzero().tolist()), key=lambda p: (-float(w[p]), p))
        for p in pairs[capacity:]:
            keep[p] = False
    return keep


def _dispatch_body(comm: Any, device: str, dtype_name: str) -> int:
    """Linear experts ``out = x @ We[e]`` behind dispatch/combine, against the float64 einsum of the batch."""
    dtype, tol = getattr(torch, dtype_name), TOL[dtype_name]
    P, r = comm.size, comm.rank
    L = E // P
    for i, case in enumerate(_DISPATCH_CASES):
        g = torch.Generator().manual_seed(100 + i)
        ts = case.splits[P]
        Tg = sum(ts)
        X = torch.randn(Tg, H, generator=g, dtype=F64).to(dtype).double()   # exactly representable in dtype
        e = torch.rand(Tg, E, generator=g).argsort(-1)[:, :K]                # K distinct experts per token
        if case.masked:
            e = torch.where(torch.rand(Tg, K, generator=g) < 0.25, torch.full_like(e, -1), e)
        Wt = torch.rand(Tg, K, generator=g) + 0.05                           # float32 router weights
        We = (torch.randn(E, H, H2, generator=g, dtype=F64) / math.sqrt(H)).to(dtype).double()
        G = torch.randn(Tg, H2, generator=g, dtype=F64)
        cap = None if case.capacity_factor is None else math.ceil(case.capacity_factor * Tg * K / E)
        keep = _reference_keep(e, Wt, cap)
        assert cap is None or not keep[e >= 0].all(), "the capacity case must drop pairs (test data)"

        # float64 reference over the whole batch
        Xr, Wr, Wer = (t.clone().requires_grad_() for t in (X, Wt.double(), We))
        pair_out = torch.einsum("th,tjhg->tjg", Xr, Wer[e.clamp(min=0)])
        y_ref = torch.einsum("tj,tjg->tg", Wr * keep, pair_out)
        (y_ref * G).sum().backward()

        sl = _split(ts, r)
        x = X[sl].to(device=device, dtype=dtype).requires_grad_()
        w = Wt[sl].to(device).requires_grad_()
        we = We[r * L:(r + 1) * L].to(device=device, dtype=dtype).requires_grad_()
        disp = ExpertDispatcher(comm, E, capacity_factor=case.capacity_factor)
        recv_x, tpe, handle = disp.dispatch(x, e[sl].to(device),
                                            weights=w.detach() if case.weights_to_dispatch else None)
        what = f"{dtype_name} case {i}"
        assert recv_x.device == x.device and recv_x.dtype == dtype, f"{what}: recv_x {recv_x.device} {recv_x.dtype}"
        # recv_x: this rank's kept pairs in (local expert, global token, slot) order, exact copies of the rows
        flat_e = torch.where(keep, e, -1).reshape(-1)
        mine = ((flat_e >= r * L) & (flat_e < (r + 1) * L)).nonzero(as_tuple=True)[0]
        mine = mine[torch.argsort(flat_e[mine], stable=True)]
        assert torch.equal(recv_x.detach().cpu().double(), X[mine // K]), f"{what}: recv_x rows"
        assert tpe.device.type == "cpu" and tpe.tolist() == torch.bincount(flat_e[mine] - r * L, minlength=L).tolist()
        assert torch.equal(handle.dropped.cpu(), (e[sl] >= 0) & ~keep[sl]), f"{what}: dropped mask"

        expert_out = torch.cat([c @ we[j] for j, c in enumerate(torch.split(recv_x, tpe.tolist()))])
        y = disp.combine(expert_out, handle, w)
        assert y.device == x.device and y.dtype == dtype and y.shape == (ts[r], H2), f"{what}: y {y.device} {y.shape}"
        # every rank runs backward, the empty one too: the reverse all-to-alls are collective
        (y.double() * G[sl].to(device)).sum().backward()
        _close(y, y_ref[sl].detach(), tol, f"{what}: combine output", comm)
        _close(x.grad, Xr.grad[sl], tol, f"{what}: grad x", comm)
        _close(w.grad, Wr.grad[sl], tol, f"{what}: grad router weights", comm)
        _close(we.grad, Wer.grad[r * L:(r + 1) * L], tol, f"{what}: grad expert weights", comm)
    return len(_DISPATCH_CASES)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_dispatch_combine_on_cuda_matches_cpu_reference(nprocs: int) -> None:
    got = launch_on_gpu(each_dtype, nprocs, _dispatch_body, DTYPES)
    assert got == [[len(_DISPATCH_CASES)] * len(DTYPES)] * nprocs


# ---- MoELayer -----------------------------------------------------------------------------------
class _LayerCase(NamedTuple):
    splits: dict[int, list[int]]      # rows of x per rank (tokens for 2-D x, batch entries for 3-D)
    seq: int                          # 0: x is [T, H]; else x is [B, seq, H]
    ffn: int
    kw: dict[str, Any]


_LAYER_CASES = (
    # swiglu, both router losses, 2-D input; rank 1 without tokens
    _LayerCase({1: [40], 2: [40, 0]}, 0, 48, {"activation": "swiglu", "aux_loss_coef": 0.01, "z_loss_coef": 1e-3}),
    # gelu, a shared expert, 3-D input; rank 0 without tokens
    _LayerCase({1: [6], 2: [0, 6]}, 4, 32,
               {"activation": "gelu", "shared_ffn_hidden_size": 40, "aux_loss_coef": 0.02}),
)


def _ffn(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, activation: str) -> torch.Tensor:
    """Per-token FFN: x [T, H], fc1 [T, H, W] or [H, W], fc2 [T, F, H] or [F, H]."""
    h = torch.einsum("th,thw->tw", x, fc1) if fc1.dim() == 3 else x @ fc1
    if activation == "swiglu":
        h = F.silu(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2:]
    else:
        h = F.gelu(h)
    return torch.einsum("tf,tfh->th", h, fc2) if fc2.dim() == 3 else h @ fc2


def _reference_layer(X: torch.Tensor, params: dict[str, torch.Tensor], case: _LayerCase
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer over the whole batch X [N, H] in float64: softmax top-k router (weights renormalised),
    experts, shared expert, load-balancing and z losses (formulas of moe.router.TopKRouter)."""
    act, N = case.kw["activation"], X.shape[0]
    logits = X @ params["router.weight"].t()
    probs = torch.softmax(logits, -1)
    top, e = probs.topk(K, dim=-1)
    # float32 routing on the GPU must pick the same experts: keep the k-th and (k+1)-th scores well apart
    s = probs.detach().sort(-1, descending=True).values
    assert N == 0 or float((s[:, K - 1] - s[:, K]).min()) > 1e-4, "near-tie in the routing (test data)"
    w = top / top.sum(-1, keepdim=True)
    y = sum(w[:, j:j + 1] * _ffn(X, params["experts.fc1"][e[:, j]], params["experts.fc2"][e[:, j]], act)
            for j in range(K))
    if "shared.fc1" in params:
        y = y + _ffn(X, params["shared.fc1"], params["shared.fc2"], act)
    n = max(N, 1)
    f = torch.bincount(e.reshape(-1), minlength=E).double() / (n * K)
    aux = case.kw.get("aux_loss_coef", 0.0) * E * (f * probs.sum(0)).sum() / n
    aux = aux + case.kw.get("z_loss_coef", 0.0) * torch.logsumexp(logits, -1).square().sum() / n
    return y, aux


def _layer_body(comm: Any, device: str, dtype_name: str) -> int:
    """MoELayer loaded with random weights vs :func:`_reference_layer`: output, aux loss, all gradients."""
    dtype, tol = getattr(torch, dtype_name), TOL[dtype_name]
    P, r = comm.size, comm.rank
    for i, case in enumerate(_LAYER_CASES):
        what = f"{dtype_name} case {i}"
        g = torch.Generator().manual_seed(200 + i)
        layer = MoELayer(comm, H, case.ffn, E, K, seed=i, **case.kw).to(device=device, dtype=dtype)
        # Random full weights (not the seeded init), rounded to dtype: the reference uses exactly these values.
        full = {}
        for name, t in layer.state_dict().items():
            shape = (E, *t.shape[1:]) if name in layer.expert_keys else tuple(t.shape)
            fan_in = shape[-1] if name == "router.weight" else shape[-2]
            full[name] = (torch.randn(shape, generator=g, dtype=F64) / math.sqrt(fan_in)).to(dtype)
        layer.load_state_dict(shard_state_dict(layer, full))
        ref = {n: t.double().requires_grad_() for n, t in full.items()}

        ts = case.splits[P]
        shape = (sum(ts), case.seq, H) if case.seq else (sum(ts), H)
        X = torch.randn(shape, generator=g, dtype=F64).to(dtype).double()
        G = torch.randn(shape, generator=g, dtype=F64)
        Xr = X.clone().requires_grad_()
        y_ref, aux_ref = _reference_layer(Xr.reshape(-1, H), ref, case)
        ((y_ref.reshape(shape) * G).sum() + aux_ref).backward()

        sl = _split(ts, r)
        x = X[sl].to(device=device, dtype=dtype).requires_grad_()
        y, aux = layer(x)
        assert y.device == x.device and y.dtype == dtype and y.shape == x.shape, f"{what}: y {y.device} {y.shape}"
        ((y.double() * G[sl].to(device)).sum() + aux).backward()
        _close(y, y_ref.reshape(shape)[sl].detach(), tol, f"{what}: forward", comm)
        # each rank's aux loss is its share of the whole batch's
        _close(comm.all_reduce(aux.detach().reshape(1)), aux_ref.detach().reshape(1), tol, f"{what}: aux loss", comm)
        _close(x.grad, Xr.grad[sl], tol, f"{what}: grad x", comm)
        first, L = layer.dispatcher.first_local_expert, layer.num_local_experts
        for name, p in layer.named_parameters():
            if name in layer.expert_keys:
                _close(p.grad, ref[name].grad[first:first + L], tol, f"{what}: grad {name}", comm)
            else:  # replicated: each rank holds its tokens' share
                assert p.grad is not None, f"{what}: no grad for {name} on rank {r}"
                _close(comm.all_reduce(p.grad), ref[name].grad, tol, f"{what}: grad {name} summed over ranks", comm)
    return len(_LAYER_CASES)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_moe_layer_on_cuda_matches_cpu_reference(nprocs: int) -> None:
    assert launch_on_gpu(each_dtype, nprocs, _layer_body, DTYPES) == [[len(_LAYER_CASES)] * len(DTYPES)] * nprocs
