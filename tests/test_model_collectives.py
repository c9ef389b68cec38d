"""The collective cost model (collectives/model/collective.py): every algorithm's formula against a
case written out by hand with NCCL's constants spelled out, the choice by minimum time,
monotonicity over a grid of systems/ops/nodes/sizes, and bad input. Pure Python, well under 5 s."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from collectives.model import (
    ALGORITHMS,
    NCCL_ALGORITHMS,
    OPS,
    Link,
    System,
    bus_factor,
    get_system,
    list_systems,
    predict_collective,
)
from collectives.model.collective import P2P_EFFICIENCY, _tree_correction
from collectives.model.systems import efa_latency_us

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10
A100, H100, P5EN = get_system("dgx-a100"), get_system("dgx-h100"), get_system("p5en")


def candidate_time(system: System, op: str, size: int, algorithm: str, protocol: str, **kw) -> float:
    """The model's time for one algorithm x protocol (also checks that it was a candidate)."""
    pred = predict_collective(system, op, size, **kw)
    found = [c.time_us for c in pred.candidates if (c.algorithm, c.protocol) == (algorithm, protocol)]
    assert len(found) == 1, f"{algorithm}/{protocol} not among {[(c.algorithm, c.protocol) for c in pred.candidates]}"
    return found[0]


# ---- each formula against hand arithmetic (GB/s = 1e3 B/us) -------------------------------------
def test_ring_all_reduce_8_gpus_by_hand() -> None:
    # 8x A100, 1 GiB, Simple: base 8.4 + 2(n-1) = 14 NVLink hops x 3.4 us; each GPU sends
    # 2(n-1)/n S over 12 x 20.0 GB/s (tuning.cc / topo.h, NCCL v2.30.7).
    expected = 8.4 + 14 * 3.4 + 2 * 7 / 8 * GIB / (12 * 20.0 * 1e3)
    assert candidate_time(A100, "all_reduce", GIB, "ring", "Simple") == pytest.approx(expected, rel=1e-12)
    # LL at 8 B on 8x H100: base 6.6 + 14 hops x 0.6; bandwidth half the link under the Hopper LL ceiling 141
    expected_ll = 6.6 + 14 * 0.6 + 2 * 7 / 8 * 8 / (min(141.0, 0.5 * 18 * 20.6) * 1e3)
    assert candidate_time(H100, "all_reduce", 8, "ring", "LL") == pytest.approx(expected_ll, rel=1e-12)
    # LL128: 0.92 of the link, base 14.0 + 14 x 1.9
    expected_ll128 = 14.0 + 14 * 1.9 + 2 * 7 / 8 * MIB / (0.92 * 370.8 * 1e3)
    assert candidate_time(H100, "all_reduce", MIB, "ring", "LL128") == pytest.approx(expected_ll128, rel=1e-12)


def test_ring_multi_node_latency_and_bandwidth_by_hand() -> None:
    # 2x DGX A100 (AMD hosts): intra hops cost max(3.4, net post overhead 2.0 x 3 for Simple) = 6.0;
    # 2(N-1) = 2 network hops of 14.0; x1.4 "plateau effect of ring"; the network (8 x 24 GB/s per node)
    # is slower than NVLink (240).
    n = 16
    latency = (8.4 + (2 * (n - 1) - 2) * 6.0 + 2 * 14.0) * 1.4
    expected = latency + 2 * (n - 1) / n * GIB / (8 * 24.0 * 1e3)
    assert candidate_time(A100, "all_reduce", GIB, "ring", "Simple", nodes=2) == pytest.approx(expected, rel=1e-12)
    # all_gather on 2x DGX H100 (Intel: overhead 1.0 x 3 < 3.4): no plateau factor, n-1 steps, one network hop
    latency_ag = 8.4 + (15 - 1) * 3.4 + 1 * 14.0
    expected_ag = latency_ag + 15 / 16 * GIB / (min(370.8, 8 * 47.0) * 1e3)
    assert candidate_time(H100, "all_gather", GIB, "ring", "Simple", nodes=2) == pytest.approx(expected_ag, rel=1e-12)


def test_tree_all_reduce_by_hand() -> None:
    # 4x DGX A100, 1 MiB, Simple: efficiency 0.92 x treeCorrectionFactor[Simple][log2(1 MiB / 64) = 14] = 0.5;
    # the network carries 2S per node (each node inner in one tree, leaf in the other) at 8 x 24 GB/s.
    bw = 8 * 24.0 * 0.92 * 0.5
    latency = 8.4 + 2 * (7 * 4.0 + 2 * 14.0)  # base + 2 x (7 NVLink chain hops + log2(4) network hops)
    expected = latency + 2 * MIB / (bw * 1e3)
    assert candidate_time(A100, "all_reduce", MIB, "tree", "Simple", nodes=4) == pytest.approx(expected, rel=1e-12)
    # two nodes: S per node; LL: x 1/3.8 and Ampere's multi-node AMD LL ceiling 22.5 does not bind here
    corr = _tree_correction("LL", 4 * KIB)
    assert corr == pytest.approx(0.7)  # table[LL][6]
    bw_ll = min(22.5, 240.0 * 0.92 / 3.8 * corr)
    latency_ll = 6.8 + 2 * (7 * 0.6 + 1 * 5.0)
    expected_ll = latency_ll + 2 * 4 * KIB / (bw_ll * 1e3)  # the NVLink chain (2S) binds before the network (S)
    assert candidate_time(A100, "all_reduce", 4 * KIB, "tree", "LL", nodes=2) == pytest.approx(expected_ll, rel=1e-12)


def test_tree_correction_is_interpolated_between_powers_of_two() -> None:
    assert _tree_correction("LL", 64 << 11) == pytest.approx(0.5)  # table[LL][11]
    assert _tree_correction("LL", 64 << 12) == pytest.approx(0.4)
    assert _tree_correction("LL", int(64 * 2 ** 12.5)) == pytest.approx(0.4, abs=1e-4)  # .4 -> .4
    assert _tree_correction("Simple", int(64 * 2 ** 8.5)) == pytest.approx((0.7 + 0.6) / 2, abs=1e-4)
    assert _tree_correction("Simple", 64 << 23) == 1.0 and _tree_correction("Simple", 1 << 40) == 1.0


def test_nvls_by_hand_and_in_sample_anchors() -> None:
    # One node: S (G+1)/G each way over NVLink at nvlsEfficiency (Hopper 0.85), latency 25 us (NVLS table).
    size = 8 * GIB
    expected = 25.0 + size * 9 / 8 / (370.8 * 0.85 * 1e3)
    pred = predict_collective(H100, "all_reduce", size)
    assert (pred.algorithm, pred.protocol) == ("nvls", "Simple")
    assert pred.time_us == pytest.approx(expected, rel=1e-12)
    assert pred.busbw == pytest.approx(size / (expected * 1e3) * 2 * 7 / 8, rel=1e-12)
    # the calibration targets (shared ANCHORS.md; in-sample): H100 NVLS ~480, ring ~370; B200 838 / 682
    assert pred.busbw == pytest.approx(480, rel=0.03)
    ring = predict_collective(H100, "all_reduce", size, algorithms=("ring",))
    assert ring.busbw == pytest.approx(370, rel=0.03)
    b200 = get_system("b200-8")
    assert predict_collective(b200, "all_reduce", size).busbw == pytest.approx(838, rel=0.03)
    assert predict_collective(b200, "all_reduce", size, algorithms=("ring",)).busbw == pytest.approx(682, rel=0.06)
    # all_gather via NVLS: ingress S per GPU, slower than the ring at large sizes -> ring is picked
    assert candidate_time(H100, "all_gather", size, "nvls", "Simple") == pytest.approx(
        25.0 + size / (370.8 * 0.85 * 1e3), rel=1e-12)
    assert predict_collective(H100, "all_gather", size).algorithm == "ring"


def test_nvls_tree_by_hand() -> None:
    # 2x DGX H100: NVLS inside (S 9/8 at 370.8 x 0.85), each GPU's shard over its rail: S per node on
    # 2 nodes at 8 x 47 x 0.92; latency 25 + 2 log2(2) x 20.9.
    size = GIB
    expected = 25.0 + 2 * 1 * 20.9 + max(size * 9 / 8 / (370.8 * 0.85 * 1e3), size / (8 * 47.0 * 0.92 * 1e3))
    assert candidate_time(H100, "all_reduce", size, "nvls_tree", "Simple", nodes=2) == pytest.approx(expected, rel=1e-12)
    # 4 nodes: 2S per node over the network, which now binds; 2 log2(4) network hops
    expected4 = 25.0 + 4 * 20.9 + 2 * size / (8 * 47.0 * 0.92 * 1e3)
    pred = predict_collective(H100, "all_reduce", size, nodes=4, algorithms=("nvls_tree",))
    assert pred.time_us == pytest.approx(expected4, rel=1e-12) and pred.bottleneck == "network"


def test_ipc_one_shot_and_two_shot_by_hand() -> None:
    # launch 3.4 + 0.3 per peer (x2 for two-shot's second meeting); staging 2S through HBM (3350 GB/s),
    # then one-shot reads (n-1) S, two-shot 2(n-1)/n S over NVLink.
    size = 64 * KIB
    stage = 2 * size / (3350.0 * 1e3)
    one = 3.4 + 0.3 * 7 + stage + 7 * size / (370.8 * 1e3)
    two = 3.4 + 0.6 * 7 + stage + 2 * 7 / 8 * size / (370.8 * 1e3)
    assert candidate_time(H100, "all_reduce", size, "one_shot", "Simple") == pytest.approx(one, rel=1e-12)
    assert candidate_time(H100, "all_reduce", size, "two_shot", "Simple") == pytest.approx(two, rel=1e-12)
    # all_gather one-shot: each rank stages its own block and pulls the n-1 others
    ag = 3.4 + 0.3 * 7 + 2 * size / 8 / (3350.0 * 1e3) + 7 / 8 * size / (370.8 * 1e3)
    assert candidate_time(H100, "all_gather", size, "one_shot", "Simple") == pytest.approx(ag, rel=1e-12)


def test_hierarchical_by_hand() -> None:
    # 4x DGX H100, Simple, phases one after another: intra reduce-scatter (7/8 S over NVLink), the shard
    # S/8 all-reduced over each GPU's own NIC (2 x 3/4 of it at 47 GB/s), intra all-gather.
    size = GIB
    latency = 3 * 8.4 + 2 * 7 * 3.4 + 2 * 3 * 14.0
    expected = latency + 2 * (7 / 8 * size / (370.8 * 1e3)) + 2 * 3 / 4 * (size / 8) / (47.0 * 1e3)
    assert candidate_time(H100, "all_reduce", size, "hierarchical", "Simple", nodes=4) == pytest.approx(expected, rel=1e-12)


def test_pairwise_all_to_all_by_hand_and_nvidias_rule() -> None:
    # 4x DGX H100, 1 GiB per rank: 7/32 of it over NVLink, 24/32 over the GPU's one NIC, both at the
    # send/recv efficiency; latency: base + one NVLink hop + one network hop + 24 remote peers x 3.0
    # (NCCL's 1 us post overhead on Intel, x3 for Simple).
    size = GIB
    latency = 8.4 + 3.4 + 14.0 + 24 * 3.0
    transfer = max(size * 7 / 32 / (370.8 * P2P_EFFICIENCY * 1e3), size * 24 / 32 / (47.0 * P2P_EFFICIENCY * 1e3))
    assert candidate_time(H100, "all_to_all", size, "pairwise", "Simple", nodes=4) == pytest.approx(
        latency + transfer, rel=1e-12)
    # NVIDIA/nccl-tests#130: multi-node busbw ~ N/(N-1) x the per-GPU network bandwidth
    for nodes in (2, 4, 16):
        pred = predict_collective(H100, "all_to_all", 64 * GIB, nodes=nodes)
        n = 8 * nodes
        assert pred.busbw == pytest.approx(nodes / (nodes - 1) * 47.0 * P2P_EFFICIENCY * (n - 1) / n, rel=2e-3)
    # nccl-tests#267: all_to_all cannot use p5en's second NIC per GPU; the ring does
    assert P5EN.nic_bandwidth_per_gpu() == pytest.approx(2 * 23.5)
    assert P5EN.all_to_all_nic_bandwidth_per_gpu() == pytest.approx(23.5)
    pcie = get_system("pcie-l40s-8")  # 4 NICs for 8 GPUs: half a NIC each, either way
    assert pcie.nic_bandwidth_per_gpu() == pytest.approx(12.0) == pcie.all_to_all_nic_bandwidth_per_gpu()


def test_broadcast_by_hand() -> None:
    # ring (pipelined chain): base + n hops of the NVLink *tree* Simple latency (tuning.cc, not sameChannels)
    expected = 8.4 + 8 * 4.0 + GIB / (240.0 * 1e3)
    assert candidate_time(A100, "broadcast", GIB, "ring", "Simple") == pytest.approx(expected, rel=1e-12)
    # binary tree: inner ranks send twice; log2(8) = 3 hops
    expected_tree = 6.8 + 3 * 0.6 + 2 * 8 / (min(87.7, 0.5 * 240.0) * 1e3)
    assert candidate_time(A100, "broadcast", 8, "tree", "LL") == pytest.approx(expected_tree, rel=1e-12)


def test_efa_latency_reproduces_its_fitted_point_only() -> None:
    # systems.EFA_LATENCY_SCALE was fitted on 2x p5 all_reduce 8 B = 69.12 us (NCCL runs tree/LL there);
    # p5's EFA reports 75 us to NCCL through aws-ofi-nccl, p5en's 35 us
    p5 = replace(P5EN, name="p5", nic=replace(P5EN.nic, latency_us=efa_latency_us(75.0)))
    pred = predict_collective(p5, "all_reduce", 8, nodes=2, algorithms=NCCL_ALGORITHMS)
    assert (pred.algorithm, pred.protocol) == ("tree", "LL")
    assert pred.time_us == pytest.approx(69.12, rel=1e-3)
    # p5en: the same shape with 35/75 of p5's extra per hop (21.96 us for LL)
    extra = (69.12 - 6.8 - 2 * (7 * 0.6 + 5.0)) / 2 * 35.0 / 75.0
    p5en = predict_collective(P5EN, "all_reduce", 8, nodes=2, algorithms=NCCL_ALGORITHMS)
    assert p5en.time_us == pytest.approx(6.8 + 2 * (7 * 0.6 + 5.0 + extra), rel=1e-3)
    # the same shape over InfiniBand: NCCL's own table, 6.8 + 2 (7 x 0.6 + 5.0)
    ib = predict_collective(H100, "all_reduce", 8, nodes=2, algorithms=NCCL_ALGORITHMS)
    assert ib.time_us == pytest.approx(6.8 + 2 * (7 * 0.6 + 5.0), rel=1e-3)


def test_efa_latency_us_by_hand() -> None:
    # NCCL's NET Simple reference + twice (scale x plugin figure); the plugin's 0 leaves NCCL's reference
    assert efa_latency_us(0.0) == pytest.approx(14.0)
    assert efa_latency_us(75.0) == pytest.approx(14.0 + 2 * 21.96, rel=1e-9)
    assert efa_latency_us(35.0) - 14.0 == pytest.approx((efa_latency_us(75.0) - 14.0) * 35 / 75, rel=1e-12)
    for bad in (-1.0, "75", True):
        with pytest.raises(ValueError, match="plugin_latency_us"):
            efa_latency_us(bad)


def test_network_protocols_restrict_multi_node_candidates_only() -> None:
    simple_only = replace(A100, name="a100-simple", network_protocols=("Simple",))
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        multi = predict_collective(simple_only, op, 4096, nodes=2)
        assert {c.protocol for c in multi.candidates} == {"Simple"}, op
        # one node: the plugin never sets NCCL_PROTO there, every protocol stays
        assert "LL" in {c.protocol for c in predict_collective(simple_only, op, 4096).candidates}, op
    # tree/Simple by hand: base 8.4 + 2 x (7 NVLink tree Simple hops of 4.0 + one IB hop of 14.0)
    pred = predict_collective(simple_only, "all_reduce", 8, nodes=2, algorithms=NCCL_ALGORITHMS)
    assert (pred.algorithm, pred.protocol) == ("tree", "Simple")
    assert pred.time_us == pytest.approx(8.4 + 2 * (7 * 4.0 + 14.0), rel=1e-3)
    # and the restriction can only make a prediction slower
    for size in (8, 1 << 16, 1 << 30):
        assert _two_node_all_reduce_us(simple_only, size) >= _two_node_all_reduce_us(A100, size)
    # a restriction that leaves an op nothing says so instead of failing inside the choice
    ll_only = replace(A100, name="a100-ll", network_protocols=("LL",))
    with pytest.raises(ValueError, match="allows only LL across nodes.*all_to_all.*add Simple"):
        predict_collective(ll_only, "all_to_all", 1 << 30, nodes=2)


def _two_node_all_reduce_us(system: System, size: int) -> float:
    return predict_collective(system, "all_reduce", size, nodes=2, algorithms=NCCL_ALGORITHMS).time_us


def test_network_protocols_validated_and_round_trip() -> None:
    simple_only = replace(A100, network_protocols=("Simple",))
    assert System.from_dict(json.loads(json.dumps(simple_only.to_dict()))) == simple_only
    assert System.from_dict(json.loads(json.dumps(A100.to_dict()))).network_protocols == ("LL", "LL128", "Simple")
    for bad in ((), ("simple",), ["Simple"], ("LL", "fast")):
        with pytest.raises(ValueError, match="network_protocols"):
            replace(A100, network_protocols=bad)
    with pytest.raises(ValueError, match="network_protocols"):
        System.from_dict(dict(A100.to_dict(), network_protocols="Simple"))


def test_size_zero_is_latency_only() -> None:
    for system in (A100, H100):
        pred = predict_collective(system, "all_reduce", 0)
        assert pred.algbw == 0.0 and pred.busbw == 0.0 and pred.count == 0
        assert pred.bottleneck == "latency"
        assert pred.time_us == min(c.time_us for c in pred.candidates) > 0
    assert predict_collective(H100, "all_reduce", 0).time_us == pytest.approx(3.4 + 0.3 * 7)  # ipc one-shot launch


def test_count_follows_nccl_tests() -> None:
    assert predict_collective(H100, "all_reduce", 1024, dtype="bfloat16").count == 512
    assert predict_collective(H100, "all_gather", 1024).count == 1024 // 4 // 8
    assert predict_collective(H100, "all_to_all", 1024, nodes=2, dtype="float").count == 1024 // 4 // 16


def test_bus_factor() -> None:
    assert bus_factor("all_reduce", 8) == 2 * 7 / 8
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, 16) == 15 / 16
    assert bus_factor("broadcast", 8) == bus_factor("reduce", 8) == 1.0
    with pytest.raises(ValueError, match="no bus factor"):
        bus_factor("gather", 8)


# ---- the choice -------------------------------------------------------------------------------
GRID_SIZES = [0, 1, 8, 100, 4 * KIB, 64 * KIB, 300 * KIB, MIB, 16 * MIB, 256 * MIB, GIB, 16 * GIB]


def test_choice_is_the_argmin_of_the_candidates() -> None:
    for system in list_systems():
        for op in OPS:
            for nodes in (1, 2, 8):
                if nodes > 1 and system.nic is None:
                    continue
                for size in GRID_SIZES:
                    pred = predict_collective(system, op, size, nodes=nodes)
                    times = [c.time_us for c in pred.candidates]
                    assert times == sorted(times)
                    assert pred.time_us == min(times)
                    best = pred.candidates[0]
                    assert (pred.algorithm, pred.protocol, pred.bottleneck) == (best.algorithm, best.protocol, best.bottleneck)
                    assert all(c.algorithm in ALGORITHMS for c in pred.candidates)


def test_which_algorithms_apply_where() -> None:
    def considered(system: System, op: str, **kw) -> set[str]:
        return {c.algorithm for c in predict_collective(system, op, MIB, **kw).candidates}

    assert considered(H100, "all_reduce") == {"ring", "tree", "nvls", "one_shot", "two_shot"}
    assert considered(H100, "all_reduce", nodes=2) == {"ring", "tree", "nvls_tree", "hierarchical"}
    assert considered(A100, "all_reduce") == {"ring", "tree", "one_shot", "two_shot"}  # no NVLS on A100
    assert considered(H100, "all_to_all", nodes=4) == {"pairwise"}
    assert considered(H100, "broadcast") == {"ring", "tree"}
    pcie = get_system("pcie-l40s-8")  # vLLM's rule: custom all-reduce beyond 2 GPUs needs full NVLink
    assert considered(pcie, "all_reduce") == {"ring", "tree"}
    assert considered(pcie, "all_reduce", gpus_per_node=2) == {"ring", "tree", "one_shot", "two_shot"}
    assert considered(H100, "all_reduce", algorithms=NCCL_ALGORITHMS) == {"ring", "tree", "nvls"}
    # LL for send/recv only up to 16 KiB per peer (NCCL_P2P_LL_THRESHOLD)
    protocols = {c.protocol for c in predict_collective(H100, "all_to_all", 8 * 16 * KIB).candidates}
    assert protocols == {"LL", "Simple"}
    assert {c.protocol for c in predict_collective(H100, "all_to_all", 8 * 16 * KIB + 8).candidates} == {"Simple"}


def test_small_messages_pick_latency_protocols_large_ones_bandwidth() -> None:
    small = predict_collective(A100, "all_reduce", 8, nodes=4, algorithms=NCCL_ALGORITHMS)
    large = predict_collective(A100, "all_reduce", 16 * GIB, nodes=4, algorithms=NCCL_ALGORITHMS)
    assert small.protocol == "LL" and small.bottleneck == "latency"
    assert large.protocol == "Simple" and large.bottleneck == "network"
    assert predict_collective(H100, "all_reduce", 16 * GIB, nodes=4).bottleneck in ("network", "nvlink")


# ---- monotonicity -------------------------------------------------------------------------------
MONO_SIZES = [4 ** k for k in range(18)] + [3 * 4 ** k for k in range(17)]
NODES = (1, 2, 4, 8, 16, 32)


def _fabric_cases():
    for system in list_systems():
        for op in OPS:
            for gpus in sorted({1, 2, system.gpus_per_node}):
                yield system, op, gpus


def test_a_larger_size_never_predicts_a_shorter_time() -> None:
    for system, op, gpus in _fabric_cases():
        for nodes in NODES:
            if nodes > 1 and system.nic is None:
                continue
            times = [predict_collective(system, op, s, nodes=nodes, gpus_per_node=gpus).time_us
                     for s in sorted(MONO_SIZES)]
            assert all(b >= a for a, b in zip(times, times[1:])), (system.name, op, nodes, gpus)


def test_more_nodes_never_predict_a_shorter_time_for_the_same_data_per_rank() -> None:
    for system, op, gpus in _fabric_cases():
        if system.nic is None:
            continue
        for per_rank in (8, 4 * KIB, MIB, 64 * MIB, GIB):
            times = []
            for nodes in NODES:
                n = nodes * gpus
                size = per_rank if op in ("all_reduce", "broadcast") else per_rank * n
                times.append(predict_collective(system, op, size, nodes=nodes, gpus_per_node=gpus).time_us)
            assert all(b >= a for a, b in zip(times, times[1:])), (system.name, op, gpus, per_rank, times)


def test_more_nodes_never_predict_a_higher_busbw_for_bandwidth_optimal_algorithms() -> None:
    """ring / hierarchical at every size; pairwise from 256 MiB, where its latency is a small part of
    the time (below, its factor (n-1)/n can grow faster than its latency: 0.5 -> 0.75 from 2 to 4
    single-GPU nodes), and with two or more GPUs per node (with one, every node count has the same
    asymptote: the NIC is the bus, and the order is left to latency terms). The docstring of collectives.model.collective says why trees and NVLS trees
    are exempt."""
    for system, op, gpus in _fabric_cases():
        if system.nic is None:
            continue
        for algorithm in ("ring", "hierarchical", "pairwise"):
            for size in MONO_SIZES:
                busbw = []
                for nodes in NODES[1:]:
                    try:
                        pred = predict_collective(system, op, size, nodes=nodes, gpus_per_node=gpus, algorithms=(algorithm,))
                    except ValueError:  # not applicable (hierarchical with one GPU per node, ring for all_to_all ...)
                        continue
                    if algorithm == "pairwise" and (size < 256 * MIB or gpus == 1):
                        continue
                    busbw.append(pred.busbw)
                assert all(b <= a * (1 + 1e-12) for a, b in zip(busbw, busbw[1:])), (system.name, op, gpus, algorithm, size)


# ---- systems: presets, JSON, files --------------------------------------------------------------
def test_presets_round_trip_through_json() -> None:
    names = [s.name for s in list_systems()]
    assert {"dgx-a100", "dgx-h100", "dgx-h200", "b200-8", "p5en", "pcie-l40s-8"} <= set(names)
    for system in list_systems():
        again = System.from_dict(json.loads(json.dumps(system.to_dict())))
        assert again == system and again.sources == system.sources
        assert get_system(system.name) is system
        assert system.sources, f"{system.name} names no sources"


def test_system_file_and_calibration_round_trip(tmp_path) -> None:
    custom = System(name="my-box", description="4 GPUs over PCIe", gpus_per_node=4, arch="sm89",
                    intra=Link("pcie-gen5", 48.0, 5.7), nic=Link("roce-100g", 11.5, 20.0), nics_per_node=2,
                    nvls=False, cpu_vendor="amd", sources={"intra": "measured"},
                    calibration={"all_reduce": [{"algorithm": "shm/one_shot", "ranks": 4, "alpha_us": 9.5,
                                                 "beta_us_per_byte": 1e-3}]})
    path = tmp_path / "my-box.json"
    path.write_text(json.dumps(custom.to_dict()))
    from collectives.model import load_system_file
    assert load_system_file(path) == custom


def test_bad_system_descriptions_raise_naming_the_problem(tmp_path) -> None:
    from collectives.model import load_system_file
    good = H100.to_dict()
    for mutate, match in (
            (lambda d: d.pop("intra"), "lacks intra"),
            (lambda d: d.update(colour="green"), "unknown key.*colour"),
            (lambda d: d.update(nic=None), "nic=None and nics_per_node=0"),
            (lambda d: d.update(nvls_efficiency=0.0), "nvls_efficiency"),
            (lambda d: d.update(arch="sm75"), "arch must be one of"),
            (lambda d: d.update(gpus_per_node=0), "gpus_per_node"),
            (lambda d: d["intra"].update(bandwidth_gbps=-1.0), "bandwidth_gbps must be > 0"),
            (lambda d: d.update(cpu_vendor="arm"), "cpu_vendor")):
        d = json.loads(json.dumps(good))
        mutate(d)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(d))
        with pytest.raises(ValueError, match=match):
            load_system_file(path)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_system_file(tmp_path / "broken.json")
    with pytest.raises(ValueError, match="cannot read"):
        load_system_file(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown system 'dgx-z9'.*dgx-h100"):
        get_system("dgx-z9")


def test_calibrated_terms_replace_the_analytical_model() -> None:
    terms = [{"algorithm": "shm/one_shot", "ranks": 4, "alpha_us": 10.0, "beta_us_per_byte": 1e-3},
             {"algorithm": "shm/two_shot", "ranks": 4, "alpha_us": 20.0, "beta_us_per_byte": 5e-4},
             {"algorithm": "shm/one_shot", "ranks": 2, "alpha_us": 5.0, "beta_us_per_byte": 1e-3}]
    local = System(name="local", description="fitted", gpus_per_node=4, arch="host",
                   intra=Link("shm", 10.0, 1.0), nic=None, nics_per_node=0, nvls=False,
                   calibration={"all_reduce": terms})
    small = predict_collective(local, "all_reduce", 1000, gpus_per_node=4)
    assert (small.algorithm, small.protocol, small.time_us) == ("shm/one_shot", "fitted", pytest.approx(11.0))
    large = predict_collective(local, "all_reduce", 10 ** 6, gpus_per_node=4)
    assert large.algorithm == "shm/two_shot" and large.time_us == pytest.approx(520.0)
    assert large.candidates[1].algorithm == "shm/one_shot"  # the runner-up
    assert predict_collective(local, "all_reduce", 1000, gpus_per_node=2).time_us == pytest.approx(6.0)
    with pytest.raises(ValueError, match="not for all_reduce on 3 ranks.*\\('all_reduce', 2\\)"):
        predict_collective(local, "all_reduce", 1000, gpus_per_node=3)
    with pytest.raises(ValueError, match="not for all_gather on 4 ranks"):
        predict_collective(local, "all_gather", 1000)
    with pytest.raises(ValueError, match="calibrated.*drop the protocols filter"):
        predict_collective(local, "all_reduce", 1000, protocols=["Simple"])


def test_protocols_filter_like_nccl_proto() -> None:
    for protocol in ("LL", "LL128", "Simple"):
        pred = predict_collective(H100, "all_reduce", 1 << 20, nodes=2, protocols=[protocol])
        assert {c.protocol for c in pred.candidates} == {protocol}
        full = predict_collective(H100, "all_reduce", 1 << 20, nodes=2)
        assert pred.time_us >= full.time_us
    with pytest.raises(ValueError, match="unknown protocol.*'Fast'.*LL, LL128, Simple"):
        predict_collective(H100, "all_reduce", 8, protocols=["Fast"])
    with pytest.raises(ValueError, match="unknown protocol"):
        predict_collective(H100, "all_reduce", 8, protocols=[])
    # nvls runs Simple only: nothing left
    with pytest.raises(ValueError, match="no candidate.*among the algorithms asked for"):
        predict_collective(H100, "all_reduce", 8, algorithms=["nvls"], protocols=["LL"])


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(op="allreduce"), "unknown op 'allreduce'; pass one of all_reduce"),
    (dict(size=-1), "size must be an integer number of bytes >= 0"),
    (dict(size=1.5), "size must be an integer"),
    (dict(size=True), "size must be an integer"),
    (dict(nodes=0), "nodes must be an integer >= 1"),
    (dict(nodes=2.0), "nodes must be an integer >= 1"),
    (dict(gpus_per_node=9), "gpus_per_node must be an integer in 1..8"),
    (dict(gpus_per_node=0), "gpus_per_node must be an integer in 1..8"),
    (dict(dtype="complex64"), "unknown dtype 'complex64'"),
    (dict(algorithms=("butterfly",)), "unknown algorithm"),
    (dict(algorithms=("nvls",), nodes=2), "none of the algorithms"),
    (dict(system="dgx-h100"), "system must be a System"),
])
def test_bad_input_raises_value_error(kwargs, match) -> None:
    args = dict(system=H100, op="all_reduce", size=1024)
    args.update(kwargs)
    system, op, size = args.pop("system"), args.pop("op"), args.pop("size")
    with pytest.raises(ValueError, match=match):
        predict_collective(system, op, size, **args)


def test_several_nodes_of_a_machine_without_a_nic_is_refused() -> None:
    single = System(name="workstation", description="2 GPUs", gpus_per_node=2, arch="sm89",
                    intra=Link("pcie-gen4", 24.0, 5.7), nic=None, nics_per_node=0, nvls=False)
    assert predict_collective(single, "all_reduce", MIB).time_us > 0
    with pytest.raises(ValueError, match="no NIC: it is a single-node machine; pass nodes=1"):
        predict_collective(single, "all_reduce", MIB, nodes=2)


def test_prediction_json_row() -> None:
    row = predict_collective(H100, "all_reduce", GIB, nodes=2).as_dict()
    for key in ("op", "nodes", "gpus_per_node", "size", "time_us", "algbw", "busbw", "algorithm", "protocol",
                "bottleneck", "count", "dtype", "candidates"):
        assert key in row
    again = json.loads(json.dumps(row))
    assert again["time_us"] == row["time_us"] and math.isclose(again["busbw"], row["busbw"])
    assert again["candidates"][0]["algorithm"] == row["algorithm"]


def test_calibrated_terms_hold_over_their_fitted_sizes() -> None:
    # a two-shot term fitted on large sizes only (alpha 0) must not win at 24 B
    terms = [{"algorithm": "shm/one_shot", "ranks": 2, "alpha_us": 9.0, "beta_us_per_byte": 9e-5,
              "min_bytes": 8, "max_bytes": 131072},
             {"algorithm": "shm/two_shot", "ranks": 2, "alpha_us": 0.0, "beta_us_per_byte": 1e-4,
              "min_bytes": 524288, "max_bytes": 1 << 25}]
    local = System(name="local", description="fitted", gpus_per_node=2, arch="host",
                   intra=Link("shm", 10.0, 1.0), nic=None, nics_per_node=0, nvls=False,
                   calibration={"all_reduce": terms})
    assert predict_collective(local, "all_reduce", 24).algorithm == "shm/one_shot"
    assert predict_collective(local, "all_reduce", 1 << 20).algorithm == "shm/two_shot"
    # between the ranges: the nearer one (393216 is 0.29 ln from 524288, 1.1 from 131072)
    gap = predict_collective(local, "all_reduce", 393216)
    assert [c.algorithm for c in gap.candidates] == ["shm/two_shot"]
    assert predict_collective(local, "all_reduce", 1 << 30).algorithm == "shm/two_shot"  # extrapolated above
