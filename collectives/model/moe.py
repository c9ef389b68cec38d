"""Expert-parallel MoE dispatch/combine time per rank, modelled on DeepEP's kernels.

The model counts the bytes one rank sends over each link under uniform-random routing and
divides by that link's bandwidth; the slowest link sets the time, plus a fixed latency term::

    time = overhead + hop latencies (+ the engine's per-peer cost) + max(nvlink_bytes / intra bandwidth,
                                                                         network_bytes / NIC bandwidth)

(normal mode: the intra bandwidth times :data:`NORMAL_KERNEL_INTRA_EFFICIENCY`, what those kernels reach).

Routing expectation (derived, see :func:`expected_distinct`): a token picks ``topk`` distinct
experts out of ``experts``, uniformly and without replacement (``torch.topk`` over i.i.d.
scores, as DeepEP's and pplx-kernels' benchmarks route). Experts lie evenly on the ``ep``
ranks (``experts / ep`` each), ranks evenly on nodes (``gpus_per_node`` each).

Two kernels:

* ``normal`` (DeepEP's high-throughput kernels, ``DeepEP:csrc/kernels/legacy/intranode.cu`` and
  ``internode.cu``): one node: each token goes once to every distinct destination rank over
  NVLink. Several nodes: node-aware de-duplication -- a token crosses the network once per
  destination node, landing on the GPU with the same local index (rail-optimised, one NIC per
  GPU), which forwards it over NVLink to the destination ranks of its node. Tokens for the own
  node skip the network (DeepEP copies them locally: ``dst_rdma_rank == rdma_rank``; so does
  UCCL-EP, ``uccl:ep/src/internode.cu``), tokens for the own rank move no bytes. Network and
  NVLink stages are pipelined, so the slower one bounds the time.
* ``low_latency`` (DeepEP's LL kernels, ``internode_ll.cu``; pplx-kernels works the same way):
  no de-duplication at all -- each of a token's ``topk`` selections is its own message to the
  expert's rank (two experts on one rank: two messages), over NVLink to same-node ranks
  (NVSHMEM's P2P path; DeepEP's ``allow_nvlink_for_low_latency_mode``) and over the network
  (IBGDA) to the others. With ``nvlink_in_low_latency=False`` same-node messages loop through
  the NIC too (older DeepEP, ``NVSHMEM_DISABLE_P2P=1``).

Combine moves the same token copies back in bf16 (DeepEP's combine is always bf16). Dispatch
sends fp8 (1 byte per element plus one float32 scale per 128 elements, DeepEP's
``per_token_cast_to_fp8``) or bf16.

``algbw`` follows DeepEP's bandwidth convention so that it compares with DeepEP's tables
directly: the bytes of the token copies the rank handles on its bottleneck path, own-rank or
own-node copies included, over the time (``DeepEP:tests/legacy/test_intranode.py``: received
tokens x hidden; ``test_internode.py``: tokens x destination nodes; ``test_low_latency.py``:
tokens x selections x message bytes). ``nvlink_bytes`` and ``network_bytes`` are the bytes that really
cross each link.

AWS EFA offers no GPU-initiated RDMA (IBGDA): engines post the writes from CPU proxies there, and
drive every card of the node (UCCL-EP's README tests p5en "with each GPU connected to two 200 Gb/s
EFA RDMA network cards" and reports 50-54 GB/s of RDMA per GPU in normal mode, more than one card's
25; pplx-garden's TransferEngine "transparently manag[es] multiple NICs per GPU"). So on a system
whose network is EFA (``System.network_is_efa``) the network part moves over all of the node's cards.

Engines (:data:`ENGINES`, ``engine=``) differ in a cost per remote rank written to over the network
(LL mode: every rank on another node; normal mode: the same-index GPU of every other node):
``"deepep"`` (the default: DeepEP's GPU-initiated kernels on InfiniBand) and ``"pplx-garden"``
(Perplexity's TransferEngine kernels, on ConnectX-7 and on EFA) have none: pplx-garden's published
p5en decode times come out within 29% of this model from EP16 to EP64. ``"uccl-ep"`` (DeepEP's API
on CPU proxies, the drop-in on EFA) pays :data:`UCCL_EP_PROXY_PER_PEER_US` per remote rank.

Where it misses (checked against DeepEP's, pplx-kernels', pplx-garden's and UCCL-EP's published
tables): normal-mode kernels move the bytes that really cross the intra-node link at
:data:`NORMAL_KERNEL_INTRA_EFFICIENCY` of its rate, fitted on DeepEP's one-node table (H800); with
it DeepEP's two-node times on H800 come out 8-10% short and UCCL-EP's one-node times on H200 3-7%
short (network-bound ones 3-8%). The fixed kernel overhead is pplx-kernels', so DeepEP's LL dispatch
comes out up to 13% long on H800 and 40% long at EP8 on an H100 node (42.6 us: DeepEP's kernel
starts faster). UCCL-EP's normal-mode times on EFA do not follow the bytes (p5en's combine at EP16
takes 6.4 ms, 18 GB/s, against 4.9 ms at EP32), and on one node its kernels stay far below NVLink5
on B200: those points miss by up to ~80% (benchmarks/results/model-validation.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import ceil, comb
from typing import TYPE_CHECKING, Any

from .systems import NVLINK_HOP_US

if TYPE_CHECKING:  # the System dataclass; only annotations here
    from .systems import System

MOE_OPS = ("moe_dispatch", "moe_combine")
MODES = ("normal", "low_latency")
DISPATCH_DTYPES = ("fp8", "bf16")

# DeepEP per_token_cast_to_fp8 (DeepEP:deep_ep/utils/math.py): one float32 scale per 128 elements.
FP8_SCALE_BLOCK = 128
FP8_SCALE_BYTES = 4
BF16_BYTES = 2
# DeepEP:tests/legacy/test_low_latency.py: an LL dispatch message is
# hidden + hidden / 128 * 4 + 16 bytes (an int4 of source-token info per message).
LL_DISPATCH_HEADER_BYTES = 16
# Fixed cost of one GPU-initiated expert-parallel all-to-all kernel (launch, flag hand-shakes,
# waiting for the last arrival), with next to no payload: pplx-kernels README, 1 token per GPU,
# EP8 over NVLink: dispatch 41.6 us, combine 41.7 us. Taken from pplx so that DeepEP's tables
# stay out of sample. That figure holds one NVLink hop, so the kernel's own part is
# 41.6 - NVLINK_HOP_US, and each prediction adds the hop latencies of the links it uses
# (System links carry NCCL's per-hop latencies, systems.py).
EP_KERNEL_OVERHEAD_US = 41.6
KERNEL_FIXED_US = EP_KERNEL_OVERHEAD_US - NVLINK_HOP_US
# UCCL-EP's CPU-proxy cost per remote rank, us. UCCL-EP's low-latency times grow with the
# ranks on other nodes, not with the bytes (p5en dispatch: 226 / 386 / 465 us at EP16 / 24 / 32, 8 /
# 16 / 24 remote ranks, while its network bytes grow 1.5x). Fitted, least squares on the relative
# error, on the six points of UCCL-EP's p5en low-latency table (README, "Low-latency kernels with pure
# RDMA": dispatch and combine at EP16, 24, 32) with every other term of this model in place; those
# points are in sample, the p6-b200 table is the check (benchmarks/results/model-validation.md). The
# form of the term (a cost per remote rank) was read off both tables before the fit, so p6-b200
# checks the constant and the every-card bandwidth (1x 400G per GPU there, 2x 200G on p5en), not
# the choice of the term.
# tests/test_model_moe.py re-derives it from benchmarks/results/published-points.json.
UCCL_EP_PROXY_PER_PEER_US = 12.4
# Normal-mode kernels (DeepEP's intranode.cu, internode.cu's NVLink forwarders, UCCL-EP's port of
# them) copy with a fixed set of SMs (24 by default) and reach this fraction of the intra-node link's
# rate on the bytes that really cross it. Fitted, least squares on the relative error, on DeepEP's
# two single-node points (docs/legacy.md, H800 EP8: dispatch 1047.8 us for 140.3 MB over NVLink,
# combine 1967.7 us for 272.0 MB; the fit is 0.852, kept to two digits) with every other term in
# place; those points are in sample. Out of sample it moves DeepEP's NVLink-bound EP16 rows from
# -21/-23% to -8/-10% and UCCL-EP's p5en EP8 rows, on H200's 18 NVLinks, from -16/-20% to -3/-7%;
# on B200's NVLink5 UCCL-EP stays 33-53% short. Low-latency kernels keep the link's rate: their EP8
# points split both ways (pplx-kernels' come out short, DeepEP's and pplx-garden's long).
# tests/test_model_moe.py re-derives it from benchmarks/results/published-points.json.
NORMAL_KERNEL_INTRA_EFFICIENCY = 0.85
# The cost per remote rank written to over the network, us, of each engine the model knows.
# pplx-garden's proxy posts its writes in ~0.5 us per inter-node peer on EFA (28 us at EP64, third-party
# notes on arXiv 2510.27656's Table 9): small beside its times, so none is charged.
ENGINES: dict[str, float] = {"deepep": 0.0, "pplx-garden": 0.0, "uccl-ep": UCCL_EP_PROXY_PER_PEER_US}


@dataclass(frozen=True)
class MoEPrediction:
    """Predicted time and traffic of one dispatch or combine, for one rank.

    Bytes are per rank, sent (by symmetry of uniform routing also received). ``algbw`` is GB/s
    in DeepEP's convention (module docstring): ``logical_bytes / time``. ``proxy_us``: the part of
    ``latency_us`` that the engine's per-remote-rank cost adds (0 for ``"deepep"``).
    """

    op: str
    mode: str
    tokens: int
    hidden: int
    topk: int
    experts: int
    ep: int
    gpus_per_node: int
    nodes: int
    dispatch_dtype: str
    time_us: float
    nvlink_bytes: float
    network_bytes: float
    expected_ranks_per_token: float
    expected_nodes_per_token: float
    bottleneck: str
    algbw: float
    logical_bytes: float
    messages: float
    latency_us: float
    topk_groups: int | None
    system: str
    proxy_us: float = 0.0
    engine: str = "deepep"

    def as_dict(self) -> dict[str, Any]:
        """The prediction as a JSON-ready row (every field)."""
        return asdict(self)


def expected_distinct(k: int, bins: int, items: int) -> float:
    """Expected number of distinct bins hit by ``k`` distinct uniform picks among ``items``.

    The ``items`` (experts) lie evenly in ``bins`` (ranks or nodes), ``items / bins`` each. A
    token's ``k`` experts are a uniformly random ``k``-subset (``torch.topk`` over i.i.d. scores
    is one: every ordering of the scores is equally likely). A given bin is missed exactly when
    all ``k`` picks fall among the other ``items - items / bins`` items, which happens for
    ``C(items - items/bins, k)`` of the ``C(items, k)`` equally likely subsets (hypergeometric
    with zero successes). By linearity of expectation over the bins::

        E[distinct bins] = bins * (1 - C(items - items/bins, k) / C(items, k))

    Example: 4 experts on 2 ranks, 2 picks: both picks on one rank for 2 of the 6 subsets, so
    E = 1 * 2/6 + 2 * 4/6 = 5/3 = 2 * (1 - C(2, 2) / C(4, 2)).

    Args:
        k: picks per token (``topk``), ``1 <= k <= items``.
        bins: number of bins (ranks or nodes); must divide ``items``.
        items: number of items (experts).

    Returns:
        The expectation, a float in ``[1, min(k, bins)]``.
    """
    for name, value in (("k", k), ("bins", bins), ("items", items)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"expected_distinct: {name} must be a positive int, got {value!r}")
    if k > items:
        raise ValueError(f"expected_distinct: k={k} picks exceed items={items}")
    if items % bins:
        raise ValueError(f"expected_distinct: items={items} must split evenly over bins={bins}")
    return bins * (1.0 - comb(items - items // bins, k) / comb(items, k))  # exact ints, one rounding


@dataclass(frozen=True)
class RoutingExpectation:
    """Per-token routing expectations under uniform (optionally group-limited) routing.

    ``rank_hit`` is the probability that one given rank receives a given token (``nodes x
    gpus_per_node x rank_hit = ranks_per_token``); ``node_hit`` likewise for one node.
    """

    ranks_per_token: float
    nodes_per_token: float
    rank_hit: float
    node_hit: float


def _distinct_groups_distribution(k: int, groups: int, items: int) -> list[float]:
    """P(exactly d distinct groups) for d = 0..groups, k distinct uniform picks among ``items``
    split evenly into ``groups``: inclusion-exclusion over which of d chosen groups stay empty,
    ``C(groups, d) * sum_i (-1)^i C(d, i) C((d - i) m, k) / C(items, k)`` with m = items / groups."""
    per_group, total = items // groups, comb(items, k)
    return [comb(groups, d) * sum((-1) ** i * comb(d, i) * comb((d - i) * per_group, k) for i in range(d + 1)) / total
            for d in range(groups + 1)]


def _group_limited_rank_hit(*, topk: int, experts: int, ep: int, nodes: int, groups: int) -> float:
    """P(a given rank receives a token) under group-limited routing (see routing_expectation).

    Walks the token's picks in score order. While fewer than ``groups`` node groups are open every
    pick is uniform over all unseen experts (and opens its group if new); once ``groups`` are open
    the rest are uniform over the unseen experts of the open groups. State: open groups ``j``,
    whether the given rank's group is open, picks already made in that group ``n0``; the mass
    that lands on the rank's ``experts / ep`` experts is absorbed as a hit.
    """
    per_node, per_rank = experts // nodes, experts // ep
    # (open groups, own group open, picks in own group) -> probability, the rank not hit yet
    states: dict[tuple[int, bool, int], float] = {(0, False, 0): 1.0}
    hit = 0.0
    for made in range(topk):
        following: dict[tuple[int, bool, int], float] = {}

        def add(key: tuple[int, bool, int], mass: float) -> None:
            if mass > 0.0:
                following[key] = following.get(key, 0.0) + mass

        for (open_groups, own_open, own_picks), mass in states.items():
            limited = open_groups == groups
            unseen = (open_groups * per_node - made) if limited else (experts - made)
            if own_open:
                own_unseen = per_node - own_picks  # of which per_rank on the rank (not hit yet)
                hit += mass * per_rank / unseen
                add((open_groups, True, own_picks + 1), mass * (own_unseen - per_rank) / unseen)
                add((open_groups, True, own_picks), mass * (open_groups * per_node - made - own_unseen) / unseen)
                if not limited:
                    add((open_groups + 1, True, own_picks), mass * (nodes - open_groups) * per_node / unseen)
            elif not limited:  # once the groups are chosen without this one, the rank is out
                add((open_groups, False, 0), mass * (open_groups * per_node - made) / unseen)
                hit += mass * per_rank / unseen
                add((open_groups + 1, True, 1), mass * (per_node - per_rank) / unseen)
                add((open_groups + 1, False, 0), mass * (nodes - 1 - open_groups) * per_node / unseen)
        states = following
    return hit


def routing_expectation(*, topk: int, experts: int, ep: int, gpus_per_node: int,
                        topk_groups: int | None = None) -> RoutingExpectation:
    """Expected distinct destination ranks and nodes per token.

    Without ``topk_groups``: :func:`expected_distinct` over ranks and over nodes.

    Group-limited routing (DeepSeek-V3; DeepEP's ``test_internode.py``: one group per node, a
    token takes the ``g = min(nodes, 4)`` groups with the highest maximum score, then its top-k
    among their experts). Under i.i.d. scores, read the experts in descending score order: the
    chosen groups are the first ``g`` distinct groups that appear, and the token's experts are
    the first ``topk`` experts of chosen groups. So the picks are uniform without replacement over
    all experts until the g-th group appears, then uniform over the chosen groups' remaining
    experts. (Not a uniform choice of g groups followed by uniform picks: selecting groups by
    their maxima spreads the picks over them more evenly.)

    * Nodes: if the first ``topk`` uniform picks touch ``D >= g`` groups, the g-th group opened
      by pick ``topk`` and every chosen group holds a pick; otherwise all picks were uniform and
      touch ``D``. So ``E[nodes] = E[min(D, g)]`` with ``D``'s distribution by inclusion-exclusion.
    * Ranks: a small dynamic programme over that pick sequence (``_group_limited_rank_hit``).

    Both reduce to the closed forms when ``g = nodes``.

    Args:
        topk: experts per token.
        experts: total experts, a multiple of ``ep``.
        ep: expert-parallel ranks, a multiple of ``gpus_per_node``.
        gpus_per_node: ranks per node.
        topk_groups: node groups a token may use (``None``: all nodes, no limit).

    Returns:
        A :class:`RoutingExpectation` (by symmetry ``rank_hit = ranks_per_token / ep`` and
        ``node_hit = nodes_per_token / nodes``).
    """
    nodes = ep // gpus_per_node
    if topk_groups is None or topk_groups >= nodes:
        ranks = expected_distinct(topk, ep, experts)
        node_count = expected_distinct(topk, nodes, experts)
    else:
        distribution = _distinct_groups_distribution(topk, nodes, experts)
        node_count = sum(min(d, topk_groups) * p for d, p in enumerate(distribution))
        ranks = ep * _group_limited_rank_hit(topk=topk, experts=experts, ep=ep, nodes=nodes, groups=topk_groups)
    return RoutingExpectation(ranks_per_token=ranks, nodes_per_token=node_count,
                              rank_hit=ranks / ep, node_hit=node_count / nodes)


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"predict_moe: {name} must be a positive int, got {value!r}")
    return value


def _check_shape(*, tokens: int, hidden: int, topk: int, experts: int, ep: int, gpus_per_node: int,
                 topk_groups: int | None) -> None:
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError(f"predict_moe: tokens must be an int >= 0, got {tokens!r}")
    for name, value in (("hidden", hidden), ("topk", topk), ("experts", experts), ("ep", ep),
                        ("gpus_per_node", gpus_per_node)):
        _positive_int(name, value)
    if experts % ep:
        raise ValueError(f"predict_moe: experts={experts} must be a multiple of ep={ep}")
    if ep % gpus_per_node:
        raise ValueError(f"predict_moe: ep={ep} must be a multiple of gpus_per_node={gpus_per_node}")
    nodes = ep // gpus_per_node
    if topk_groups is not None:
        _positive_int("topk_groups", topk_groups)
        if topk_groups > nodes:
            raise ValueError(f"predict_moe: topk_groups={topk_groups} exceeds the {nodes} node(s)")
    allowed = (topk_groups or nodes) * experts // nodes
    if topk > allowed:
        raise ValueError(f"predict_moe: topk={topk} exceeds the {allowed} experts a token may choose from")


def token_bytes(op: str, dispatch_dtype: str, hidden: int, *, mode: str = "normal") -> int:
    """Bytes of one token copy on the wire.

    Args:
        op: "moe_dispatch" or "moe_combine".
        dispatch_dtype: "fp8" (hidden bytes + one float32 scale per 128 elements) or "bf16".
        hidden: hidden size.
        mode: "low_latency" adds DeepEP's 16-byte per-message header to dispatch messages.

    Returns:
        Bytes per token copy (combine: always bf16).
    """
    if op == "moe_combine":
        return BF16_BYTES * hidden
    if dispatch_dtype == "fp8":
        payload = hidden + ceil(hidden / FP8_SCALE_BLOCK) * FP8_SCALE_BYTES
    else:
        payload = BF16_BYTES * hidden
    return payload + (LL_DISPATCH_HEADER_BYTES if mode == "low_latency" else 0)


def predict_moe(system: System, op: str, *, tokens: int, hidden: int, topk: int, experts: int, ep: int,
                dispatch_dtype: str = "fp8", mode: str = "normal", gpus_per_node: int | None = None,
                topk_groups: int | None = None, nvlink_in_low_latency: bool = True,
                engine: str = "deepep") -> MoEPrediction:
    """Predict one rank's expert-parallel dispatch or combine (module docstring has the model).

    Args:
        system: the machine (``collectives.model.systems.System``).
        op: "moe_dispatch" or "moe_combine".
        tokens: tokens per rank (``x: [tokens, hidden]`` on every rank).
        hidden: hidden size.
        topk: experts per token.
        experts: total experts, a multiple of ``ep``.
        ep: expert-parallel ranks.
        dispatch_dtype: "fp8" or "bf16" (dispatch payload; combine is bf16 regardless).
        mode: "normal" (node-aware forwarding) or "low_latency" (per-expert messages).
        gpus_per_node: ranks per node (default: ``min(system.gpus_per_node, ep)``).
        topk_groups: group-limited routing, node groups per token (``None``: unlimited).
        nvlink_in_low_latency: low_latency mode sends same-node messages over NVLink (True) or
            through the NIC (False).
        engine: a key of :data:`ENGINES`: ``"deepep"`` or ``"pplx-garden"`` (no cost per remote rank)
            or ``"uccl-ep"`` (UCCL-EP's CPU proxies, :data:`UCCL_EP_PROXY_PER_PEER_US` per remote rank).

    Returns:
        A :class:`MoEPrediction`: per-rank ``time_us``, ``nvlink_bytes``, ``network_bytes``,
        the routing expectations, the bottleneck ("nvlink", "pcie", "network", "latency", or
        "proxy" where the engine's per-remote-rank cost is most of the latency).

    Raises:
        ValueError: an unknown op/mode/dtype, inconsistent shapes, or several nodes on a
            system without a NIC.
    """
    if op not in MOE_OPS:
        raise ValueError(f"predict_moe: op must be one of {MOE_OPS}, got {op!r}")
    if mode not in MODES:
        raise ValueError(f"predict_moe: mode must be one of {MODES}, got {mode!r}")
    if dispatch_dtype not in DISPATCH_DTYPES:
        raise ValueError(f"predict_moe: dispatch_dtype must be one of {DISPATCH_DTYPES}, got {dispatch_dtype!r}")
    _positive_int("ep", ep)
    local = min(system.gpus_per_node, ep) if gpus_per_node is None else gpus_per_node
    _check_shape(tokens=tokens, hidden=hidden, topk=topk, experts=experts, ep=ep, gpus_per_node=local,
                 topk_groups=topk_groups)
    nodes = ep // local
    loopback = mode == "low_latency" and not nvlink_in_low_latency
    if engine not in ENGINES:
        raise ValueError(f"predict_moe: engine must be one of {tuple(ENGINES)}, got {engine!r}")
    proxy_per_peer_us = ENGINES[engine]
    if (nodes > 1 or loopback) and system.nic is None:
        raise ValueError(f"predict_moe: system {system.name!r} has no NIC, so ep={ep} over {nodes} node(s) "
                         f"of {local} GPUs{' (or NIC loopback)' if loopback else ''} cannot be modelled")
    routing = routing_expectation(topk=topk, experts=experts, ep=ep, gpus_per_node=local, topk_groups=topk_groups)
    copy_bytes = token_bytes(op, dispatch_dtype, hidden, mode=mode)

    if mode == "normal":
        if nodes == 1:
            # Each distinct destination rank once; the own rank's copy stays in HBM.
            nvlink_copies = routing.ranks_per_token - routing.rank_hit
            network_copies = 0.0
            logical_copies = routing.ranks_per_token  # DeepEP: received tokens, own ones included
        else:
            # Once per destination node over the network (not the own node), then the forwarder
            # (same local index there) sends to the node's destination ranks but itself. Summed
            # over the N ranks that share this forwarder's rail: N * (G - 1) * rank_hit per token.
            network_copies = routing.nodes_per_token - routing.node_hit
            nvlink_copies = (ep - nodes) * routing.rank_hit
            logical_copies = routing.nodes_per_token  # DeepEP: RDMA tokens, own node included
        messages = network_copies + nvlink_copies
        network_peers = nodes - 1  # the same-index GPU of every other node (rail-aligned)
    else:
        # Every selection is a message to its expert's rank; own-rank ones stay in HBM.
        same_node_peers = topk * (local - 1) / ep
        other_nodes = topk * (ep - local) / ep
        if loopback:  # same-node messages through the NIC as well
            nvlink_copies, network_copies = 0.0, same_node_peers + other_nodes
        else:
            nvlink_copies, network_copies = same_node_peers, other_nodes
        logical_copies = float(topk)  # DeepEP: every selection's message bytes
        messages = nvlink_copies + network_copies
        network_peers = ep - 1 if loopback else ep - local  # every rank the NIC carries messages to

    nvlink_bytes = tokens * nvlink_copies * copy_bytes
    network_bytes = tokens * network_copies * copy_bytes
    intra_gbps = system.intra.bandwidth_gbps * (NORMAL_KERNEL_INTRA_EFFICIENCY if mode == "normal" else 1.0)
    nvlink_us = nvlink_bytes / (intra_gbps * 1e3)  # GB/s = 1e3 bytes/us
    # GPU-initiated point-to-point traffic drives one NIC per GPU (NVSHMEM binds one NIC per PE;
    # NCCL's p2p likewise, NVIDIA/nccl-tests#267); the proxy engines on EFA drive every card
    # (module docstring), so there a p5en GPU's second EFA card counts.
    every_card = system.network_is_efa
    network_gbps = system.nic_bandwidth_per_gpu() if every_card else system.all_to_all_nic_bandwidth_per_gpu()
    network_us = network_bytes / (network_gbps * 1e3) if network_bytes else 0.0
    proxy_us = proxy_per_peer_us * network_peers if network_bytes else 0.0
    nvlink_latency = system.intra.latency_us if nvlink_bytes else 0.0
    network_latency = system.nic.latency_us if network_bytes and system.nic is not None else 0.0
    intra_kind = system.intra.kind  # "nvlink" or "pcie" (or "host")
    if mode == "normal":
        # Pipelined stages in series: the slower link's transfer plus both hops' latency.
        latency = KERNEL_FIXED_US + nvlink_latency + network_latency + proxy_us
        transfer, slower = (network_us, "network") if network_us >= nvlink_us else (nvlink_us, intra_kind)
    else:
        # Independent paths in parallel: the later of the two arrivals.
        if network_us + network_latency + proxy_us >= nvlink_us + nvlink_latency:
            transfer, hop, slower = network_us, network_latency + proxy_us, "network"
        else:
            transfer, hop, slower = nvlink_us, nvlink_latency, intra_kind
            proxy_us = 0.0  # the NVLink arrivals come later: the proxies' time is hidden
        latency = KERNEL_FIXED_US + hop
    time_us = latency + transfer
    bottleneck = "latency" if latency >= transfer else slower
    if bottleneck == "latency" and 2 * proxy_us > latency:
        bottleneck = "proxy"  # most of the fixed part is the engine's per-remote-rank work
    logical_bytes = tokens * logical_copies * copy_bytes
    return MoEPrediction(
        op=op, mode=mode, tokens=tokens, hidden=hidden, topk=topk, experts=experts, ep=ep, gpus_per_node=local,
        nodes=nodes, dispatch_dtype=dispatch_dtype, time_us=time_us, nvlink_bytes=nvlink_bytes,
        network_bytes=network_bytes, expected_ranks_per_token=routing.ranks_per_token,
        expected_nodes_per_token=routing.nodes_per_token, bottleneck=bottleneck,
        algbw=logical_bytes / (time_us * 1e3), logical_bytes=logical_bytes, messages=tokens * messages,
        latency_us=latency, topk_groups=topk_groups, system=system.name, proxy_us=proxy_us,
        engine=engine)
