"""The MoE dispatch/combine model (collectives/model/moe.py): the routing expectation against a
Monte-Carlo simulation with torch.topk, the byte accounting against an exhaustive enumeration of
every routing choice, and the predictions against DeepEP's published tables."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from collectives.model.moe import (
    EP_KERNEL_OVERHEAD_US,
    KERNEL_FIXED_US,
    NORMAL_KERNEL_INTRA_EFFICIENCY,
    UCCL_EP_PROXY_PER_PEER_US,
    expected_distinct,
    predict_moe,
    routing_expectation,
    token_bytes,
)
from collectives.model.systems import NET_HOP_US, NVLINK_HOP_US, Link, System, get_system
from tools import validate_model as vm

# The machine of DeepEP V1's tables (deepseek-ai/DeepEP docs/legacy.md): 8x H800 (~160 GB/s
# NVLink), one CX7 400 Gb/s card per GPU.
H800 = get_system("h800-8")


def test_expected_distinct_hand_computed() -> None:
    # 4 experts on 2 ranks, 2 picks: both on one rank for 2 of the C(4,2)=6 subsets -> 1*2/6 + 2*4/6.
    assert expected_distinct(2, 2, 4) == pytest.approx(5 / 3)
    assert expected_distinct(1, 16, 256) == pytest.approx(1.0)  # one pick: one bin
    assert expected_distinct(8, 8, 8) == pytest.approx(8.0)  # every item picked: every bin
    # 256 experts on 8 ranks, top-8: 8 * (1 - C(224, 8) / C(256, 8)).
    assert expected_distinct(8, 8, 256) == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))
    for bad in ((0, 2, 4), (5, 2, 4), (2, 3, 4), (2, 2, 4.0)):
        with pytest.raises(ValueError):
            expected_distinct(*bad)


def _grouped_topk(scores: torch.Tensor, *, nodes: int, groups: int, topk: int) -> torch.Tensor:
    """DeepEP test_internode.py's group-limited routing: the ``groups`` nodes with the highest
    maximum score, then top-k among their experts."""
    group_scores = scores.view(scores.size(0), nodes, -1).amax(dim=-1)
    group_idx = torch.topk(group_scores, k=groups, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    masked = scores.masked_fill(~mask.repeat_interleave(scores.size(1) // nodes, dim=1), float("-inf"))
    return torch.topk(masked, topk, dim=-1).indices


@pytest.mark.parametrize("experts,topk,ep,gpus_per_node,groups", [
    (64, 6, 16, 4, None),   # 4 nodes, unlimited
    (256, 8, 32, 8, None),  # DeepEP's EP32 shape
    (64, 6, 16, 4, 2),      # group-limited: 2 of 4 nodes
])
def test_routing_expectation_matches_monte_carlo(experts: int, topk: int, ep: int, gpus_per_node: int,
                                                 groups: int | None) -> None:
    tokens = 20000
    gen = torch.Generator().manual_seed(1234 + experts + ep)
    scores = torch.rand(tokens, experts, generator=gen)
    nodes = ep // gpus_per_node
    if groups is None:
        picks = torch.topk(scores, topk, dim=-1).indices
    else:
        picks = _grouped_topk(scores, nodes=nodes, groups=groups, topk=topk)
    ranks = picks // (experts // ep)
    node_of = picks // (experts // nodes)
    distinct_ranks = torch.zeros(tokens, ep).scatter_(1, ranks, 1.0).sum(1)
    distinct_nodes = torch.zeros(tokens, nodes).scatter_(1, node_of, 1.0).sum(1)
    want = routing_expectation(topk=topk, experts=experts, ep=ep, gpus_per_node=gpus_per_node, topk_groups=groups)
    for sample, expected in ((distinct_ranks, want.ranks_per_token), (distinct_nodes, want.nodes_per_token)):
        standard_error = sample.std().item() / math.sqrt(tokens)
        # 5 standard errors: a false alarm once in ~2 million runs; drawing WITH replacement
        # (P*(1-(1-1/P)^k)) is off by ~25 standard errors on the first case, so this tells them apart.
        assert abs(sample.mean().item() - expected) < 5 * standard_error + 1e-9, (sample.mean().item(), expected)
    # Own-rank / own-node hit probabilities, the inputs of the byte accounting.
    assert ranks.eq(0).any(1).float().mean().item() == pytest.approx(want.rank_hit, abs=0.02)
    assert node_of.eq(0).any(1).float().mean().item() == pytest.approx(want.node_hit, abs=0.02)


def _copies_per_token(picks: torch.Tensor, *, experts: int, ep: int, gpus_per_node: int) -> dict[str, torch.Tensor]:
    """Rank 0's token copies per link, token by token, from routed expert ids ``picks: [T, k] int64``."""
    nodes = ep // gpus_per_node
    ranks = picks // (experts // ep)
    dest_ranks = torch.zeros(picks.size(0), ep).scatter_(1, ranks, 1.0)
    dest_nodes = dest_ranks.view(-1, nodes, gpus_per_node).amax(-1)
    return {
        # Sender rank 0 on node 0: one network copy per destination node but its own.
        "normal_network": dest_nodes[:, 1:].sum(1),
        # Rank 0 as forwarder: each of the `nodes` same-rail sources (all routing alike) hands
        # it a token bound for node 0; it sends to node 0's destination ranks but itself.
        # With one node this is plain direct sending.
        "normal_nvlink": nodes * dest_ranks[:, 1:gpus_per_node].sum(1),
        # Low latency: a message per selection, none to itself.
        "ll_nvlink": ((ranks > 0) & (ranks < gpus_per_node)).sum(1).double(),
        "ll_network": (ranks >= gpus_per_node).sum(1).double(),
    }


def _toy_system(gpus_per_node: int) -> System:
    return System(name="toy", description="toy", gpus_per_node=gpus_per_node, arch="sm90",
                  intra=Link("nvlink4", 100.0, NVLINK_HOP_US), nic=Link("ndr-400g", 40.0, NET_HOP_US),
                  nics_per_node=gpus_per_node, nvls=False)


def _predicted_copies(system: System, **shape: int | None) -> dict[str, float]:
    tokens, hidden = 977, 256
    normal = predict_moe(system, "moe_dispatch", tokens=tokens, hidden=hidden, **shape)
    ll = predict_moe(system, "moe_dispatch", tokens=tokens, hidden=hidden, mode="low_latency", **shape)
    copy, message = tokens * token_bytes("moe_dispatch", "fp8", hidden), tokens * token_bytes(
        "moe_dispatch", "fp8", hidden, mode="low_latency")
    return {"normal_network": normal.network_bytes / copy, "normal_nvlink": normal.nvlink_bytes / copy,
            "ll_nvlink": ll.nvlink_bytes / message, "ll_network": ll.network_bytes / message}


@pytest.mark.parametrize("experts,topk,ep,gpus_per_node", [(8, 3, 4, 2), (12, 4, 6, 2), (8, 3, 4, 4)])
def test_byte_accounting_matches_enumeration(experts: int, topk: int, ep: int, gpus_per_node: int) -> None:
    # Every k-subset of experts is equally likely: their average is the exact expectation.
    picks = torch.tensor(list(itertools.combinations(range(experts), topk)))
    exact = {k: v.mean().item() for k, v in _copies_per_token(picks, experts=experts, ep=ep,
                                                                gpus_per_node=gpus_per_node).items()}
    predicted = _predicted_copies(_toy_system(gpus_per_node), topk=topk, experts=experts, ep=ep)
    assert predicted == pytest.approx(exact)


def test_group_limited_bytes_match_monte_carlo() -> None:
    experts, topk, ep, gpus_per_node, groups, tokens = 64, 6, 16, 4, 2, 20000
    scores = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(99))
    picks = _grouped_topk(scores, nodes=ep // gpus_per_node, groups=groups, topk=topk)
    sampled = _copies_per_token(picks, experts=experts, ep=ep, gpus_per_node=gpus_per_node)
    predicted = _predicted_copies(_toy_system(gpus_per_node), topk=topk, experts=experts, ep=ep, topk_groups=groups)
    ungrouped = _predicted_copies(_toy_system(gpus_per_node), topk=topk, experts=experts, ep=ep)
    for key in ("normal_network", "normal_nvlink"):
        standard_error = sampled[key].std().item() / math.sqrt(tokens)
        assert abs(sampled[key].mean().item() - predicted[key]) < 5 * standard_error, key
        # Group limiting matters here (fewer nodes per token), so the check above has teeth.
        assert abs(ungrouped[key] - predicted[key]) > 10 * standard_error, key


def test_group_limited_reduces_to_closed_form() -> None:
    plain = routing_expectation(topk=8, experts=256, ep=32, gpus_per_node=8)
    assert routing_expectation(topk=8, experts=256, ep=32, gpus_per_node=8, topk_groups=4) == plain
    # The dynamic programme itself, forced with groups == nodes, gives the closed form too.
    from collectives.model.moe import _group_limited_rank_hit
    assert 32 * _group_limited_rank_hit(topk=8, experts=256, ep=32, nodes=4, groups=4) == pytest.approx(
        plain.ranks_per_token, rel=1e-12)


def test_token_bytes_follow_deepep() -> None:
    # DeepEP test_low_latency.py: fp8 message hidden + hidden/128*4 + 16; combine hidden*2.
    assert token_bytes("moe_dispatch", "fp8", 7168, mode="low_latency") == 7168 + 56 * 4 + 16
    assert token_bytes("moe_dispatch", "fp8", 7168) == 7168 + 224
    assert token_bytes("moe_dispatch", "bf16", 7168) == 2 * 7168
    assert token_bytes("moe_combine", "fp8", 7168) == 2 * 7168  # combine is bf16 whatever dispatch sent


# Published tables (4096 tokens normal / 128 tokens LL, hidden 7168, top-8, 256 experts, fp8
# dispatch, bf16 combine, H800 + CX7): deepseek-ai/DeepEP docs/legacy.md. Normal mode: GB/s in
# DeepEP's convention (so time = our logical bytes / GB/s); LL: microseconds.
DEEPEP_NORMAL_GBPS = {8: (153, 158), 16: (43, 43), 32: (58, 57), 64: (51, 50)}
DEEPEP_LL_US = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314), 128: (192, 369), 256: (194, 360)}


def test_predictions_within_25_percent_of_deepep_tables() -> None:
    errors = []
    for ep, rates in DEEPEP_NORMAL_GBPS.items():
        for op, rate in zip(("moe_dispatch", "moe_combine"), rates):
            # test_internode.py routes group-limited: num_topk_groups = min(nodes, 4).
            pred = predict_moe(H800, op, tokens=4096, hidden=7168, topk=8, experts=256, ep=ep,
                               topk_groups=None if ep == 8 else min(ep // 8, 4))
            errors.append((f"normal {op} EP{ep}", pred.time_us / (pred.logical_bytes / (rate * 1e3)) - 1))
            assert pred.bottleneck == ("nvlink" if ep <= 16 else "network")
    for ep, times in DEEPEP_LL_US.items():
        for op, published in zip(("moe_dispatch", "moe_combine"), times):
            pred = predict_moe(H800, op, tokens=128, hidden=7168, topk=8, experts=256, ep=ep, mode="low_latency")
            errors.append((f"LL {op} EP{ep}", pred.time_us / published - 1))
    worst = max(errors, key=lambda e: abs(e[1]))
    assert abs(worst[1]) <= 0.25, errors


def _uccl_ll_points(platform: str) -> list[tuple[dict, object]]:
    """UCCL-EP's low-latency points of one platform with their systems (published-points.json)."""
    doc = vm.load_points()
    points = [p for p in doc["points"] if p["id"].startswith(f"ucclep-ll-{platform}-")]
    assert len(points) == 6, platform  # dispatch and combine at EP16, 24, 32
    return [(p, vm.build_system(p["system"], doc["systems"])) for p in points]


def test_uccl_ep_proxy_cost_is_the_fit_on_p5en_and_holds_on_p6_b200() -> None:
    # The constant is the least-squares fit (relative error) of c in time = model(deepep) + c * remote
    # ranks on UCCL-EP's six p5en low-latency points, with every other term of the model in place.
    xs, ys = [], []
    for p, system in _uccl_ll_points("p5en"):
        assert p["engine"] == "uccl-ep" and p["in_sample"] and "UCCL_EP_PROXY_PER_PEER_US" in p["calibrates"], p["id"]
        base = vm.moe_prediction(p, system, engine="deepep")
        remote_ranks = p["ep"] - p["gpus_per_node"]
        xs.append(remote_ranks / p["measured"])
        ys.append((p["measured"] - base.time_us) / p["measured"])
    fitted = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    assert UCCL_EP_PROXY_PER_PEER_US == pytest.approx(round(fitted, 1)), fitted
    # Out of sample: p6-b200's table (1x 400G EFA per GPU, against p5en's 2x 200G) within 25%.
    for p, system in _uccl_ll_points("p6-b200"):
        assert not p["in_sample"]
        assert vm.moe_prediction(p, system, engine="uccl-ep").time_us == pytest.approx(p["measured"], rel=0.25), p["id"]


def _normal_nvlink_bound(doc: dict, point_id: str) -> tuple[dict, float, float, float]:
    """(the point, its measured us, the model's fixed part us, its NVLink transfer us at the full link
    rate) of a normal-mode published point that the model finds NVLink-bound."""
    p = next(q for q in doc["points"] if q["id"] == point_id)
    system = vm.build_system(p["system"], doc["systems"])
    pred = vm.moe_prediction(p, system)
    assert p["mode"] == "normal" and pred.bottleneck == "nvlink", (point_id, pred.bottleneck)
    full_rate_us = pred.nvlink_bytes / (system.intra.bandwidth_gbps * 1e3)
    return p, vm.evaluate(p, doc["systems"]).measured, pred.latency_us, full_rate_us


def test_normal_kernel_intra_efficiency_is_the_fit_on_deepep_one_node() -> None:
    # time = fixed + transfer / eff: least squares on the relative error in x = 1 / eff over DeepEP's
    # two single-node (EP8, H800) points, every other term in place.
    doc = vm.load_points()
    a, b = [], []
    for point_id in ("deepep-v1-normal-ep8-dispatch", "deepep-v1-normal-ep8-combine"):
        p, measured, fixed, transfer = _normal_nvlink_bound(doc, point_id)
        assert p["in_sample"] and "NORMAL_KERNEL_INTRA_EFFICIENCY" in p["calibrates"], point_id
        a.append(transfer / measured)
        b.append((fixed - measured) / measured)
    fitted = 1.0 / (-sum(x * y for x, y in zip(a, b)) / sum(x * x for x in a))
    assert NORMAL_KERNEL_INTRA_EFFICIENCY == pytest.approx(round(fitted, 2)), fitted
    # Out of sample: DeepEP's NVLink-bound EP16 rows (H800, 2 nodes) and UCCL-EP's one-node p5en rows
    # (H200, 18 NVLinks) come closer than at the full link rate, and within 25%.
    for point_id in ("deepep-v1-normal-ep16-dispatch", "deepep-v1-normal-ep16-combine",
                     "ucclep-p5en-ep8-dispatch", "ucclep-p5en-ep8-combine"):
        p, measured, fixed, transfer = _normal_nvlink_bound(doc, point_id)
        assert not p["in_sample"], point_id
        with_eff = fixed + transfer / NORMAL_KERNEL_INTRA_EFFICIENCY
        assert abs(with_eff / measured - 1) < abs((fixed + transfer) / measured - 1), point_id
        assert with_eff == pytest.approx(measured, rel=0.25), point_id
        # and the model's own prediction is that time
        assert vm.evaluate(p, doc["systems"]).predicted == pytest.approx(with_eff), point_id


def test_efa_drives_every_card_and_engines_differ_per_remote_rank() -> None:
    p5en = get_system("p5en")
    assert p5en.network_is_efa and not H800.network_is_efa
    shape = dict(tokens=128, hidden=7168, topk=8, experts=256, ep=16, mode="low_latency")
    deepep = predict_moe(p5en, "moe_dispatch", **shape)
    # the network part over both 200G cards of the GPU (2 x 23.5 GB/s), later than the NVLink part
    by_hand = KERNEL_FIXED_US + p5en.nic.latency_us + deepep.network_bytes / (2 * 23.5e3)
    assert deepep.time_us == pytest.approx(by_hand) and deepep.proxy_us == 0 and deepep.engine == "deepep"
    # UCCL-EP: 8 ranks on the other node, each written to through its proxies
    uccl = predict_moe(p5en, "moe_dispatch", engine="uccl-ep", **shape)
    assert uccl.proxy_us == pytest.approx(8 * UCCL_EP_PROXY_PER_PEER_US) and uccl.bottleneck == "proxy"
    assert uccl.time_us - deepep.time_us == pytest.approx(8 * UCCL_EP_PROXY_PER_PEER_US)
    # normal mode writes to the same-index GPU of each other node: 3 of them at EP32
    normal = predict_moe(p5en, "moe_combine", engine="uccl-ep", **{**shape, "mode": "normal", "ep": 32, "tokens": 4096})
    assert normal.proxy_us == pytest.approx(3 * UCCL_EP_PROXY_PER_PEER_US)
    # one node: nothing crosses the network, so no proxy cost
    assert predict_moe(p5en, "moe_dispatch", engine="uccl-ep", **{**shape, "ep": 8}).proxy_us == 0
    # NIC loopback (no NVLink in LL): every other rank goes through the proxies
    loop = predict_moe(p5en, "moe_dispatch", engine="uccl-ep", nvlink_in_low_latency=False, **shape)
    assert loop.proxy_us == pytest.approx(15 * UCCL_EP_PROXY_PER_PEER_US)
    # on InfiniBand a GPU drives one NIC, however many the node has: h800-8 has one per GPU anyway,
    # so give it two per GPU and the time must not change
    doubled = System(**{**H800.__dict__, "name": "h800-16nic", "nics_per_node": 16})
    assert predict_moe(doubled, "moe_dispatch", **shape).time_us == pytest.approx(
        predict_moe(H800, "moe_dispatch", **shape).time_us)


def test_node_aware_dedup_and_modes() -> None:
    shape = dict(tokens=4096, hidden=7168, topk=8, experts=256, ep=32)
    normal = predict_moe(H800, "moe_dispatch", **shape)
    ll = predict_moe(H800, "moe_dispatch", mode="low_latency", **shape)
    # De-duplication: a token crosses the network at most once per remote node (3 of them) ...
    assert normal.network_bytes < 4096 * 3 * token_bytes("moe_dispatch", "fp8", 7168)
    # ... while LL sends every remote selection (8 * 24/32 per token) on its own.
    message = token_bytes("moe_dispatch", "fp8", 7168, mode="low_latency")
    assert ll.network_bytes == pytest.approx(4096 * 8 * 24 / 32 * message)
    assert ll.network_bytes > 1.5 * normal.network_bytes
    loop = predict_moe(H800, "moe_dispatch", mode="low_latency", nvlink_in_low_latency=False, **shape)
    assert loop.nvlink_bytes == 0 and loop.network_bytes > ll.network_bytes
    bf16 = predict_moe(H800, "moe_dispatch", dispatch_dtype="bf16", **shape)
    assert bf16.time_us > normal.time_us and bf16.network_bytes > 1.9 * normal.network_bytes
    combine = predict_moe(H800, "moe_combine", dispatch_dtype="fp8", **shape)
    assert combine.network_bytes == pytest.approx(bf16.network_bytes)  # combine is bf16 regardless


def test_time_grows_with_tokens_and_single_rank_moves_nothing() -> None:
    times = [predict_moe(H800, op, tokens=t, hidden=4096, topk=8, experts=64, ep=16, mode=mode).time_us
             for op in ("moe_dispatch", "moe_combine") for mode in ("normal", "low_latency")
             for t in (0, 1, 64, 4096)]
    for group in range(0, len(times), 4):
        assert times[group:group + 4] == sorted(times[group:group + 4])
    alone = predict_moe(H800, "moe_dispatch", tokens=512, hidden=4096, topk=2, experts=8, ep=1)
    assert alone.nvlink_bytes == alone.network_bytes == 0 and alone.bottleneck == "latency"
    assert alone.time_us == pytest.approx(EP_KERNEL_OVERHEAD_US - NVLINK_HOP_US)
    row = predict_moe(H800, "moe_combine", tokens=128, hidden=7168, topk=8, experts=256, ep=16).as_dict()
    for key in ("op", "mode", "ep", "nodes", "time_us", "nvlink_bytes", "network_bytes", "bottleneck", "algbw",
                "expected_ranks_per_token", "expected_nodes_per_token"):
        assert key in row
    assert row["nodes"] == 2 and row["gpus_per_node"] == 8


def test_bad_input_raises() -> None:
    shape = dict(tokens=128, hidden=7168, topk=8, experts=256, ep=16)
    for bad in (dict(op="moe_gather"), dict(mode="fast"), dict(dispatch_dtype="fp4")):
        args = {"op": "moe_dispatch", **bad}
        with pytest.raises(ValueError):
            predict_moe(H800, args.pop("op"), **shape, **args)
    for bad in (dict(experts=250), dict(topk=300), dict(tokens=-1), dict(ep=12), dict(topk_groups=3), dict(hidden=0)):
        with pytest.raises(ValueError):
            predict_moe(H800, "moe_dispatch", **{**shape, **bad})
    for bad in ("nccl", "UCCL-EP", None):
        with pytest.raises(ValueError, match="engine must be one of"):
            predict_moe(H800, "moe_dispatch", **shape, engine=bad)
    single = System(name="box", description="one node, no NIC", gpus_per_node=8, arch="sm90",
                    intra=Link("nvlink4", 160.0, NVLINK_HOP_US), nic=None, nics_per_node=0, nvls=False)
    with pytest.raises(ValueError, match="no NIC"):
        predict_moe(single, "moe_dispatch", **shape)
    assert predict_moe(single, "moe_dispatch", **{**shape, "ep": 8}).network_bytes == 0
