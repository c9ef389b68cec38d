"""TopKRouter's DeepSeek-V3 routing: group-limited top-k over bias-corrected sigmoid scores, weights
from the unbiased scores, the routed scaling factor, and the auxiliary-loss-free bias update
(arXiv 2412.19437), against a per-token reference written from the paper's description."""

from __future__ import annotations

import pytest
import torch

import collectives
from moe import MoELayer, TopKRouter

E, G, TOPK_GROUPS, K = 64, 8, 4, 8


def _reference(s: torch.Tensor, bias: torch.Tensor, k: int, groups: int, keep: int, scale: float,
               normalize: bool) -> tuple[list[set[int]], torch.Tensor]:
    """Per token: rank groups by the sum of their two best biased scores, keep ``keep`` groups, take
    the k best biased scores among their experts; weights: unbiased scores (normalized), x scale."""
    chosen, weights = [], []
    per = s.shape[1] // groups
    for t in range(s.shape[0]):
        b = (s[t] + bias).tolist()
        group_score = [sum(sorted(b[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:keep]
        candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
        pick = sorted(candidates, key=lambda e: -b[e])[:k]
        w = torch.tensor([float(s[t, e]) for e in pick], dtype=torch.float64)
        if normalize:
            w = w / w.sum()
        chosen.append(set(pick))
        weights.append(sorted((w * scale).tolist(), reverse=True))
    return chosen, torch.tensor(weights)


@pytest.mark.parametrize("normalize", [True, False])
def test_group_limited_choice_and_unbiased_weights(normalize):
    torch.manual_seed(0)
    r = TopKRouter(32, E, K, score="sigmoid", num_groups=G, topk_groups=TOPK_GROUPS, bias=True,
                   routed_scaling_factor=2.5, norm_topk_prob=normalize)
    with torch.no_grad():
        r.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
    x = torch.randn(50, 32)
    weights, experts, _ = r.route(x)
    s = torch.sigmoid(x @ r.weight.t()).detach()
    want_sets, want_weights = _reference(s, r.e_score_correction_bias, K, G, TOPK_GROUPS, 2.5, normalize)
    assert [set(row) for row in experts.tolist()] == want_sets
    got = torch.sort(weights.double(), dim=-1, descending=True).values
    assert torch.allclose(got, want_weights.double(), rtol=1e-5, atol=1e-6)
    # the weights are the unbiased scores of the chosen experts, never the biased ones
    raw = s.gather(1, experts)
    if normalize:
        raw = raw / raw.sum(-1, keepdim=True)
    assert torch.allclose(weights, raw * 2.5, rtol=1e-6)
    # every chosen expert lies in one of the topk_groups groups
    assert all(len({e // (E // G) for e in row}) <= TOPK_GROUPS for row in experts.tolist())


def test_the_bias_changes_the_choice_and_the_update_follows_the_load():
    torch.manual_seed(1)
    r = TopKRouter(16, 8, 2, score="sigmoid", bias=True)
    x = torch.randn(200, 16)
    before = r.route(x)[1]
    load = torch.bincount(before.reshape(-1), minlength=8)
    bias = r.update_bias(load, 0.02).clone()
    mean = load.double().mean()
    assert torch.equal(bias, (0.02 * torch.sign(mean - load.double())).float())
    after = r.route(x)[1]
    new_load = torch.bincount(after.reshape(-1), minlength=8)
    assert not torch.equal(before, after)
    over = load.double() > mean  # the overloaded experts lose tokens, the others gain them
    assert new_load[over].sum() < load[over].sum() and new_load[~over].sum() > load[~over].sum()


def test_bad_arguments():
    for kw, text in (({"num_groups": 3}, "not divisible by num_groups"),
                     ({"num_groups": 4, "topk_groups": 5}, "topk_groups must be"),
                     ({"num_groups": 8, "topk_groups": 1}, "exceeds the 8 experts"),
                     ({"routed_scaling_factor": 0.0}, "routed_scaling_factor")):
        with pytest.raises(ValueError, match=text):
            TopKRouter(16, E, 9, score="sigmoid", **kw)
    r = TopKRouter(16, 8, 2)
    with pytest.raises(ValueError, match="no bias"):
        r.update_bias(torch.zeros(8), 0.1)
    r = TopKRouter(16, 8, 2, bias=True)
    with pytest.raises(ValueError, match=r"tokens_per_expert must be \[8\]"):
        r.update_bias(torch.zeros(7), 0.1)
    with pytest.raises(ValueError, match="rate"):
        r.update_bias(torch.zeros(8), -1.0)


def _agreed_update(comm):
    """Each rank counts its own tokens; update_bias(comm=) sums them, so the bias is the same everywhere."""
    r = TopKRouter(8, 8, 2, score="sigmoid", bias=True, num_groups=4, topk_groups=2, seed=3)
    local = torch.arange(8) * (comm.rank + 1) % 5
    bias = r.update_bias(local, 0.01, comm=comm).clone()
    total = sum(torch.arange(8) * (q + 1) % 5 for q in range(comm.size)).double()
    want = (0.01 * torch.sign(total.mean() - total)).float()
    # the layer takes the same routing options and checks that every rank passed them
    layer = MoELayer(comm, 8, 16, 8, 2, score="sigmoid", num_groups=4, topk_groups=2, bias=True,
                     routed_scaling_factor=2.0, seed=3)
    y = layer(torch.randn(5, 8, generator=torch.Generator().manual_seed(comm.rank)))
    y = y[0] if isinstance(y, tuple) else y
    try:
        MoELayer(comm, 8, 16, 8, 2, score="sigmoid", num_groups=4, topk_groups=1 + comm.rank, seed=3)
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    return torch.equal(bias, want), tuple(y.shape), mismatch


def test_update_bias_agrees_across_ranks_and_the_layer_checks_the_options():
    for same, shape, mismatch in collectives.launch(_agreed_update, 2, timeout=60):
        assert same
        assert shape == (5, 8)
        assert "topk_groups" in mismatch, mismatch
