"""TopKRouter: routing, weights and the auxiliary losses against hand-computed values (single process)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe import TopKRouter


def _router_with_logits(logits: list[list[float]], k: int, **kw) -> tuple[TopKRouter, torch.Tensor]:
    """A router whose logits for the returned x are exactly ``logits`` (W = I, x = logits)."""
    E = len(logits[0])
    r = TopKRouter(E, E, k, **kw)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))
    return r, torch.tensor(logits, dtype=torch.float32)


def test_aux_and_z_loss_hand_computed():
    l3 = math.log(3.0)
    # softmax rows: [.75, .25], [.75, .25], [.25, .75]; top-1 picks 0, 0, 1.
    r, x = _router_with_logits([[l3, 0.0], [l3, 0.0], [0.0, l3]], 1, aux_loss_coef=0.1)
    out = r(x)
    assert out.experts.tolist() == [[0], [0], [1]]
    assert out.weights.dtype == torch.float32 and torch.allclose(out.weights, torch.ones(3, 1))
    # f = [2/3, 1/3], P = [7/12, 5/12]: aux = 0.1 * 2 * (2/3 * 7/12 + 1/3 * 5/12) = 0.1 * 19/18
    assert out.aux_loss.shape == () and out.aux_loss.item() == pytest.approx(0.1 * 19 / 18, rel=1e-6)
    # z-loss: every row's logsumexp is log(4)
    r, x = _router_with_logits([[l3, 0.0], [l3, 0.0], [0.0, l3]], 1, z_loss_coef=0.01)
    assert r(x).aux_loss.item() == pytest.approx(0.01 * math.log(4.0) ** 2, rel=1e-6)
    # both, balanced: f = P = [1/2, 1/2] -> aux = coef exactly
    r, x = _router_with_logits([[l3, 0.0], [0.0, l3]], 1, aux_loss_coef=0.3, z_loss_coef=0.01)
    assert r(x).aux_loss.item() == pytest.approx(0.3 + 0.01 * math.log(4.0) ** 2, rel=1e-6)
    # no coefficients: a plain zero
    r, x = _router_with_logits([[l3, 0.0]], 1)
    assert r(x).aux_loss.item() == 0.0


def _numpy_reference(x, w, k, score, normalize, aux_coef, z_coef):
    logits = x.astype(np.float64) @ w.T.astype(np.float64)
    T, E = logits.shape
    if score == "softmax":
        s = np.exp(logits - logits.max(1, keepdims=True))
        s /= s.sum(1, keepdims=True)
        p = s
    else:
        s = 1 / (1 + np.exp(-logits))
        p = s / s.sum(1, keepdims=True)
    experts = np.argsort(-s, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(s, experts, 1)
    if normalize:
        weights = weights / weights.sum(1, keepdims=True)
    f = np.bincount(experts.ravel(), minlength=E) / (T * k)
    aux = aux_coef * E * np.sum(f * p.mean(0))
    lse = np.log(np.exp(logits).sum(1))
    return weights, experts, aux + z_coef * np.mean(lse ** 2)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_router_matches_numpy(score, normalize, k):
    g = torch.Generator().manual_seed(7 + k)
    x = torch.randn(37, 16, generator=g)
    r = TopKRouter(16, 6, k, score=score, normalize=normalize, aux_loss_coef=0.02, z_loss_coef=1e-3, seed=3)
    out = r(x)
    w_ref, e_ref, loss_ref = _numpy_reference(x.numpy(), r.weight.detach().numpy(), k, score, normalize, 0.02, 1e-3)
    assert out.experts.dtype == torch.int64 and np.array_equal(out.experts.numpy(), e_ref)
    np.testing.assert_allclose(out.weights.detach().numpy(), w_ref, rtol=1e-5, atol=1e-6)
    assert out.aux_loss.item() == pytest.approx(loss_ref, rel=1e-5)
    # the losses and weights are differentiable w.r.t. the gate
    (out.weights.sum() + out.aux_loss).backward()
    assert r.weight.grad is not None and torch.isfinite(r.weight.grad).all() and r.weight.grad.abs().sum() > 0


def test_aux_loss_shares_sum_to_whole_batch():
    """Per-rank shares with global counts (what MoELayer does) add up to the single-batch loss."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g)
    r = TopKRouter(8, 4, 2, aux_loss_coef=0.05, z_loss_coef=2e-3)
    whole = r(x).aux_loss
    counts = torch.bincount(r(x).experts.reshape(-1), minlength=4)
    shares = [r.aux_loss(r.route(part)[2], counts, 40) for part in (x[:13], x[13:13], x[13:])]
    assert sum(s.item() for s in shares) == pytest.approx(whole.item(), rel=1e-6)


def test_router_seeding_and_edge_cases():
    a, b, c = TopKRouter(8, 4, 2, seed=5), TopKRouter(8, 4, 2, seed=5), TopKRouter(8, 4, 2, seed=6)
    assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)
    torch.manual_seed(0)  # the global RNG plays no part
    assert torch.equal(TopKRouter(8, 4, 2, seed=5).weight, a.weight)
    out = TopKRouter(8, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.1)(torch.empty(0, 8))
    assert out.weights.shape == (0, 2) and out.experts.shape == (0, 2) and out.aux_loss.item() == 0.0
    for kwargs, needle in (({"score": "relu"}, "score"), ({"aux_loss_coef": -1.0}, "aux_loss_coef")):
        with pytest.raises(ValueError, match=needle):
            TopKRouter(8, 4, 2, **kwargs)
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(8, 4, 5)
    with pytest.raises(ValueError, match="seed"):
        TopKRouter(8, 4, 2, seed=-1)
    with pytest.raises(ValueError, match=r"\[num_tokens, 8\]"):
        a(torch.randn(3, 7))
