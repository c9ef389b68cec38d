"""MoELayer over 2 and 4 ranks equals the same-seed layer over 1 rank, forward and backward.

Inside each launched rank the 1-rank reference runs on a size-1 sub-communicator over the whole
batch; the expert-parallel layer runs on the rank's contiguous slice of tokens.
"""

from __future__ import annotations

import pytest
import torch

import collectives
from moe import MoELayer, gather_state_dict, shard_state_dict
from spmd import outcome

H = 16

CONFIGS = [
    # dropless, softmax, both losses, 2-D input, one rank without tokens
    dict(E=8, k=2, ffn=24, kw=dict(activation="swiglu", aux_loss_coef=0.01, z_loss_coef=1e-3), shape="2d"),
    # sigmoid scores, capacity dropping, a shared expert, 3-D input
    dict(E=8, k=1, ffn=12, kw=dict(activation="gelu", score="sigmoid", capacity_factor=1.0,
                                   shared_ffn_hidden_size=10, aux_loss_coef=0.02), shape="3d"),
    # k = 4 of 4 experts, tight capacity, no renormalisation, weights loaded from a perturbed full state dict
    dict(E=4, k=4, ffn=8, kw=dict(activation="relu", normalize=False, capacity_factor=0.5, z_loss_coef=0.01),
         shape="2d", reload=True),
]


def _close(a, b, what, tol=2e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _layer_body(comm) -> list[float]:
    P, r = comm.size, comm.rank
    single = comm.split(r)                    # a 1-rank communicator for the reference layer
    auxes = []
    for i, cfg in enumerate(CONFIGS):
        g = torch.Generator().manual_seed(100 + i)
        kw = dict(cfg["kw"], seed=11 + i)
        ref = MoELayer(single, H, cfg["ffn"], cfg["E"], cfg["k"], **kw)
        layer = MoELayer(comm, H, cfg["ffn"], cfg["E"], cfg["k"], **kw)
        # identical initialisation, whatever the number of ranks
        full = gather_state_dict(layer)
        assert full.keys() == ref.state_dict().keys()
        for name, t in ref.state_dict().items():
            assert torch.equal(full[name], t), name
        if cfg.get("reload"):
            perturbed = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in ref.state_dict().items()}
            ref.load_state_dict(perturbed)
            layer.load_state_dict(shard_state_dict(layer, perturbed))
        rows = [3 + 2 * q + i for q in range(P)]
        if P > 1 and i == 0:
            rows[1] = 0
        n = sum(rows)
        X = torch.randn((n, 3, H) if cfg["shape"] == "3d" else (n, H), generator=g)
        G = torch.randn(X.shape, generator=g)
        Xr = X.clone().requires_grad_()
        y_ref, aux_ref = ref(Xr)
        ((y_ref * G).sum() + aux_ref).backward()

        sl = slice(sum(rows[:r]), sum(rows[:r + 1]))
        x = X[sl].clone().requires_grad_()
        y, aux = layer(x)
        ((y * G[sl]).sum() + aux).backward()
        assert y.shape == x.shape
        _close(y, y_ref[sl].detach(), "forward")
        aux_sum = comm.all_reduce(aux.detach().reshape(1))[0]
        _close(aux_sum, aux_ref.detach(), "aux loss summed over ranks")
        assert torch.equal(layer.last_handle.dropped, ref.last_handle.dropped[sl.start * X[0].numel() // H:
                                                                              sl.stop * X[0].numel() // H])
        _close(x.grad, Xr.grad[sl], "grad x")
        first, L = layer.dispatcher.first_local_expert, layer.num_local_experts
        ref_grads = dict(ref.named_parameters())
        for name, p in layer.named_parameters():
            want = ref_grads[name].grad
            if name in ("experts.fc1", "experts.fc2"):
                _close(p.grad, want[first:first + L], f"grad {name}")
            else:                                   # replicated: the ranks' shares sum to the whole
                _close(comm.all_reduce(p.grad), want, f"grad {name} summed over ranks")
        auxes.append(float(aux_ref))
        if cfg["kw"].get("capacity_factor"):
            assert int(ref.last_handle.dropped.sum()) > 0, "capacity case should drop something"
    return auxes


@pytest.mark.parametrize("nprocs", [2, 4])
def test_layer_matches_single_rank(nprocs):
    auxes = collectives.launch(_layer_body, nprocs, timeout=120)
    assert all(a > 0 for a in auxes[0])


def _mismatch_body(comm) -> str:
    try:
        MoELayer(comm, H, 8 + comm.rank, 4, 2)
    except ValueError as e:
        return str(e)
    return "no error"


def test_layer_arguments_must_agree():
    msgs = collectives.launch(_mismatch_body, 2, timeout=60)
    assert all("ffn_hidden_size" in m and "rank 0: 8, rank 1: 9" in m for m in msgs), msgs


def _one_rank_wrong_body(comm) -> dict[str, tuple[str, str]]:
    """One rank passes a bad argument; every case must raise on every rank (a hang raises a timeout instead)."""
    r = comm.rank
    big = 2**60  # seeds this large differ from their neighbours only past float64 precision
    out = {
        "top_k": outcome(lambda: MoELayer(comm, H, 8, 4, 8 if r == 0 else 2)),
        "activation": outcome(lambda: MoELayer(comm, H, 8, 4, 2, activation="tanh" if r == 1 else "gelu")),
        "unknown kwarg": outcome(lambda: MoELayer(comm, H, 8, 4, 2, **({"scor": "sigmoid"} if r == 1 else {}))),
        "score": outcome(lambda: MoELayer(comm, H, 8, 4, 2, score="sigmoid" if r == 1 else "softmax")),
        "seed": outcome(lambda: MoELayer(comm, H, 8, 4, 2, seed=big + r)),
    }
    layer = MoELayer(comm, H, 8, 4, 2, seed=3)
    x = torch.randn(5, H + (r == 1))
    out["forward width"] = outcome(lambda: layer(x))
    # still in step: a correct call completes on every rank
    y, _ = layer(torch.randn(5, H))
    assert y.shape == (5, H)
    return out


def test_one_rank_with_a_bad_argument_fails_every_rank_at_once():
    per_rank = collectives.launch(_one_rank_wrong_body, 2, timeout=30)
    expected = {  # case -> (exception type on every rank, text in every rank's message, or one per rank)
        "top_k": ("ValueError", "MoELayer on rank 0: top_k=8 exceeds num_experts=4"),
        "activation": ("ValueError", "MoELayer on rank 1: activation must be one of"),
        "unknown kwarg": ("TypeError", "MoELayer on rank 1: unknown keyword argument(s) ['scor']"),
        "score": ("ValueError", "score (rank 0: 'softmax', rank 1: 'sigmoid')"),
        "seed": ("ValueError", f"seed (rank 0: {2**60}, rank 1: {2**60 + 1})"),
        # forward: rank 0 is already in dispatch's exchange and learns that rank 1 rejected its input
        "forward width": ("ValueError", ["rank(s) [1]", f"MoELayer on rank 1: x must be [T, {H}]"]),
    }
    wrong = []
    for r, outcomes in enumerate(per_rank):
        for case, (kind, text) in outcomes.items():
            want_kind, want_text = expected[case]
            want_text = want_text if isinstance(want_text, str) else want_text[r]
            if kind != want_kind or want_text not in text:
                wrong.append(f"rank {r} {case}: got {kind}: {text!r}; expected {want_kind} containing {want_text!r}")
    assert not wrong, "\n".join(wrong)


# ---- GroupedExperts: grouped_mm where torch runs it, the per-expert loop elsewhere ------------------
def _run_experts(dtype, activation, hidden, tpe, X, G, *, grouped: bool, monkeypatch) -> tuple[bool, list]:
    """Forward + backward of GroupedExperts in ``dtype`` (grouped=False: the loop forced); returns whether
    grouped_mm ran and [y, x.grad, fc1.grad, fc2.grad]."""
    import torch.nn.functional as F

    from moe import GroupedExperts
    from moe import layer as layer_mod

    calls = []
    real = F.grouped_mm
    with monkeypatch.context() as m:
        m.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
        if not grouped:
            m.setattr(layer_mod, "_grouped_mm_supported", lambda *a: False)
        experts = GroupedExperts(3, 5, hidden, 24, activation, seed=9).to(dtype)
        x = X.to(dtype, copy=True).requires_grad_()
        y = experts(x, tpe)
        # y.sum() hands the backward a stride-0 gradient, which grouped_mm's own backward rejects
        ((y.double() * G).sum() + y.sum()).backward()
    return bool(calls), [y.detach(), x.grad, experts.fc1.grad, experts.fc2.grad]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("hidden", [16, 6])
def test_grouped_experts_paths_match_a_float64_reference(dtype, activation, hidden, monkeypatch):
    """Forward and backward of both paths against the float64 loop, with an empty expert and no rows at all;
    float64 and rows of 24 bytes (hidden 6 in float32) must take the loop, the rest grouped_mm."""
    g = torch.Generator().manual_seed(3)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 3e-2)
    aligned = dtype != torch.float64 and hidden * torch.tensor([], dtype=dtype).element_size() % 16 == 0
    for counts in ([4, 0, 7], [0, 0, 0]):
        tpe = torch.tensor(counts)
        X = torch.randn(sum(counts), hidden, generator=g, dtype=torch.float64)
        G = torch.randn(sum(counts), hidden, generator=g, dtype=torch.float64)
        _, want = _run_experts(torch.float64, activation, hidden, tpe, X, G, grouped=False, monkeypatch=monkeypatch)
        results = {}
        for grouped in (True, False):
            took_grouped, got = _run_experts(dtype, activation, hidden, tpe, X, G, grouped=grouped,
                                             monkeypatch=monkeypatch)
            assert took_grouped == (grouped and aligned), (grouped, aligned)
            for a, b, what in zip(got, want, ("y", "grad x", "grad fc1", "grad fc2")):
                assert a.dtype == dtype, what
                atol = tol * max(1.0, float(b.abs().max())) if b.numel() else tol
                torch.testing.assert_close(a.double(), b, rtol=tol, atol=atol, msg=lambda m, w=what: f"{w}: {m}")
            results[grouped] = got
        if aligned and dtype == torch.float32:  # the same GEMMs on the same rows: float32 agrees bit for bit
            assert torch.equal(results[True][0], results[False][0])
