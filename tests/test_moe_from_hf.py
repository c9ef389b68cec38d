"""MoELayer.from_hf against the transformers MoE blocks it copies (Mixtral, Qwen3-MoE, DeepSeek-V3),
and TopKRouter's DeepSeek-V3 mode against transformers' DeepseekV3TopkRouter, in float64.

The blocks get random weights (and a random nonzero e_score_correction_bias) scaled so that their
outputs are of order 1, so the 1e-10 tolerance is a real check. The expert-parallel cases run in one
2-rank launch: per family, a 1-rank layer (a size-1 sub-communicator) and the 2-rank layer run on
each rank's own tokens (a different count per rank) and are compared with the full block there.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from spmd import outcome
from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3MoE,
    DeepseekV3TopkRouter,
)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

import collectives
from moe import MoELayer, TopKRouter

H, E, FFN, TOL = 32, 8, 24, 1e-10

# (family, config overrides): the cases of the layer test
FAMILIES = [("mixtral", {}), ("qwen3", {"norm_topk_prob": True}), ("qwen3", {"norm_topk_prob": False}),
            ("deepseek", {})]


def _config(family: str, **overrides):
    if family == "mixtral":
        cfg = MixtralConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E, num_experts_per_tok=2)
    elif family == "qwen3":
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=FFN, num_experts=E, num_experts_per_tok=2)
    elif family == "qwen2":
        cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=FFN, shared_expert_intermediate_size=FFN,
                             num_experts=E, num_experts_per_tok=2)
    else:
        cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=FFN, n_routed_experts=E, num_experts_per_tok=2,
                               n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                               norm_topk_prob=True)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._experts_implementation = "eager"  # the blocks run outside a PreTrainedModel here
    return cfg


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    """Float64, eval mode; every parameter N(0, 1/fan_in), every buffer (the correction bias) N(0, 0.3^2)."""
    g = torch.Generator().manual_seed(seed)
    module.double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / p.shape[-1] ** 0.5)
        for b in module.buffers():
            b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.3)
    return module


def _block(family: str, seed: int, **overrides) -> nn.Module:
    cls = {"mixtral": MixtralSparseMoeBlock, "qwen3": Qwen3MoeSparseMoeBlock, "qwen2": Qwen2MoeSparseMoeBlock,
           "deepseek": DeepseekV3MoE}[family]
    return _randomize(cls(_config(family, **overrides)), seed)


@pytest.mark.parametrize("groups, keep, k, normalize, scale", [(4, 2, 2, True, 2.5), (4, 2, 4, False, 1.0),
                                                               (8, 3, 3, True, 1.5), (1, 1, 4, True, 2.5)])
def test_deepseek_router_matches_transformers(groups, keep, k, normalize, scale):
    experts = 16
    cfg = _config("deepseek", n_routed_experts=experts, num_local_experts=experts, n_group=groups,
                  topk_group=keep, num_experts_per_tok=k, norm_topk_prob=normalize, routed_scaling_factor=scale)
    hf = _randomize(DeepseekV3TopkRouter(cfg), seed=groups * 10 + k)
    ours = TopKRouter(H, experts, k, score="sigmoid", num_groups=groups, topk_groups=keep, bias=True,
                      routed_scaling_factor=scale, norm_topk_prob=normalize)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)                   # float32: transformers runs this gate in float32
    ours.e_score_correction_bias = hf.e_score_correction_bias.clone()   # float64, as the block's
    assert bool((ours.e_score_correction_bias != 0).all())
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    with torch.no_grad():
        _, hf_weights, hf_experts = hf(x)
        weights, chosen, _ = ours.route(x)
    assert [set(row) for row in chosen.tolist()] == [set(row) for row in hf_experts.tolist()]
    # weights per expert id (transformers' top-k is unsorted)
    order, hf_order = chosen.argsort(-1), hf_experts.argsort(-1)
    torch.testing.assert_close(weights.gather(1, order).double(), hf_weights.gather(1, hf_order).double(),
                               rtol=1e-6, atol=0)
    # the bias matters: without it transformers picks differently for some token
    with torch.no_grad():
        hf.e_score_correction_bias.zero_()
        unbiased = hf(x)[2]
    assert [set(r) for r in unbiased.tolist()] != [set(r) for r in hf_experts.tolist()]


def _layers_body(comm) -> dict:
    r = comm.rank
    single = comm.split(r)                      # a 1-rank communicator: all experts on this rank
    shape = [(2, 3), (1, 11)][r % 2]            # 6 tokens on rank 0, 11 on rank 1
    errors = {}
    for i, (family, overrides) in enumerate(FAMILIES):
        block = _block(family, seed=i, **overrides)   # the same block on every rank
        x = torch.randn(*shape, H, generator=torch.Generator().manual_seed(100 * i + r), dtype=torch.float64)
        with torch.no_grad():
            want = block(x)
            for name, c in (("1 rank", single), (f"{comm.size} ranks", comm)):
                layer = MoELayer.from_hf(block, c)
                assert layer.num_local_experts == E // c.size
                y, _ = layer(x)
                assert y.shape == x.shape and y.dtype == torch.float64
                errors[f"{family} {overrides} {name}"] = (float((y - want).abs().max()), float(want.abs().max()))
    mixtral = _block("mixtral", seed=0)
    errors["unsupported"] = outcome(lambda: MoELayer.from_hf(_block("qwen2", seed=0), comm))
    errors["one rank unsupported"] = outcome(lambda: MoELayer.from_hf(nn.Linear(H, H) if r == 0 else mixtral, comm))
    errors["not divisible"] = outcome(lambda: MoELayer.from_hf(_block("mixtral", 0, num_local_experts=5), comm))
    errors["block's keyword"] = outcome(lambda: MoELayer.from_hf(mixtral, comm, top_k=3))
    # still in step after the errors: a correct call completes on every rank
    errors["after"] = outcome(lambda: MoELayer.from_hf(mixtral, comm, capacity_factor=2.0)(torch.randn(3, 2, H)))
    return errors


def test_from_hf_equals_the_block_on_1_and_2_ranks():
    per_rank = collectives.launch(_layers_body, 2, timeout=120)
    for r, errors in enumerate(per_rank):
        for case, (err, scale) in [(c, v) for c, v in errors.items() if isinstance(v[0], float)]:
            assert err <= TOL, f"rank {r}, {case}: max |layer - block| = {err:.3g}"
            assert scale > 0.1, f"rank {r}, {case}: outputs too small ({scale:.3g}) for the tolerance to mean much"
        kind, msg = errors["unsupported"]
        assert kind == "TypeError" and "Qwen2MoeSparseMoeBlock" in msg, msg
        kind, msg = errors["one rank unsupported"]    # rank 0 passed an nn.Linear: rank 1 raises too
        assert kind == "TypeError" and "MoELayer.from_hf on rank 0: unsupported block class Linear" in msg, msg
        kind, msg = errors["not divisible"]
        assert kind == "ValueError" and "has 5 experts, not divisible by the 2 ranks" in msg, msg
        kind, msg = errors["block's keyword"]
        assert kind == "TypeError" and "['top_k']" in msg, msg
        assert errors["after"] == ("ok", ""), errors["after"]
