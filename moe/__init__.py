"""Mixture-of-experts: router, expert-parallel token dispatch/combine, the MoE layer.

    from moe import TopKRouter, ExpertDispatcher, MoELayer
    r = TopKRouter(H, E, k)(x)                                  # weights, experts, aux_loss
    disp = ExpertDispatcher(comm, E)
    recv_x, tokens_per_expert, handle = disp.dispatch(x, r.experts)
    y = disp.combine(expert_fn(recv_x), handle, r.weights)

Decoding (DeepEP low-latency style: fixed buffers, no host synchronization, CUDA-graph capturable,
FP8 dispatch) over the ipc transport: :class:`LowLatencyDispatcher` (:mod:`moe.low_latency`).

Hugging Face transformers MoE models: :mod:`moe.hf` (``expert_parallel(model, comm)``; importing it
registers ``DistributedConfig(ep_implementation="moecomm")``). It needs the ``hf`` extra.

Load balancing (EPLB): ``MoELayer(..., num_redundant_experts=R)`` holds replicas of hot experts
(:mod:`moe.eplb`: :class:`Placement`, :func:`balance`, :func:`route`); :mod:`moe.rebalance` moves
experts between ranks while training or serving (``layer.rebalance``, :class:`Balancer`).

Expert tensor parallelism (ETP): ``MoELayer(comm, ..., expert_tp_size=T)`` runs EP x ETP over ``comm``
(rank = ep_rank * T + etp_rank): experts spread over P / T ranks, each one's FFN sharded over T
(:mod:`moe.expert_tp`), with or without EPLB; the same seed gives the same function at any layout.

Masks (elastic EP): ``disp.dispatch(x, experts, masked_ranks=[r])`` runs without rank r (dead or
stopped: no call waits for it) over a :class:`MaskedGroup` of the others; ``disp.mask([r])`` masks
it for good, and ``ExpertDispatcher(..., on_peer_failure="mask")`` does so itself when r dies.
:class:`LowLatencyDispatcher` takes the same masks (``dispatch(..., masked_ranks=)``, ``mask``,
``on_peer_failure``); both hold a :class:`moe.elastic.MaskSet`.
"""

from .dispatcher import ExpertDispatcher
from .elastic import MaskedGroup
from .eplb import Placement, balance, fold_replicas, logical_loads, route
from .internode import NodeAwareHandle, NodeAwareLayout
from .layer import (
           GroupedExperts,
           MoELayer,
           SharedExpert,
           gather_state_dict,
           shard_state_dict,
)
from .low_latency import LowLatencyDispatcher, LowLatencyHandle
from .rebalance import Balancer, Moved
from .records import DispatchHandle, DispatchLayout, DispatchTraffic
from .router import RouterOutput, RouterScores, TopKRouter

__all__ = [
           "Balancer",
           "DispatchHandle",
           "DispatchLayout",
           "DispatchTraffic",
           "ExpertDispatcher",
           "GroupedExperts",
           "LowLatencyDispatcher",
           "LowLatencyHandle",
           "MaskedGroup",
           "MoELayer",
           "Moved",
           "NodeAwareHandle",
           "NodeAwareLayout",
           "Placement",
           "RouterOutput",
           "RouterScores",
           "SharedExpert",
           "TopKRouter",
           "balance",
           "fold_replicas",
           "gather_state_dict",
           "logical_loads",
           "route",
           "shard_state_dict",
]
