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
"""

from .dispatcher import ExpertDispatcher
from .internode import NodeAwareHandle, NodeAwareLayout
from .layer import (
           GroupedExperts,
           MoELayer,
           SharedExpert,
           gather_state_dict,
           shard_state_dict,
)
from .low_latency import LowLatencyDispatcher, LowLatencyHandle
from .records import DispatchHandle, DispatchLayout, DispatchTraffic
from .router import RouterOutput, RouterScores, TopKRouter

__all__ = [
           "DispatchHandle",
           "DispatchLayout",
           "DispatchTraffic",
           "ExpertDispatcher",
           "GroupedExperts",
           "LowLatencyDispatcher",
           "LowLatencyHandle",
           "MoELayer",
           "NodeAwareHandle",
           "NodeAwareLayout",
           "RouterOutput",
           "RouterScores",
           "SharedExpert",
           "TopKRouter",
           "gather_state_dict",
           "shard_state_dict",
]
