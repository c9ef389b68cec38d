"""Mixture-of-experts: router, expert-parallel token dispatch/combine, the MoE layer.

    from moe import TopKRouter, ExpertDispatcher, MoELayer
    r = TopKRouter(H, E, k)(x)                                  # weights, experts, aux_loss
    disp = ExpertDispatcher(comm, E)
    recv_x, tokens_per_expert, handle = disp.dispatch(x, r.experts)
    y = disp.combine(expert_fn(recv_x), handle, r.weights)

Hugging Face transformers MoE models: :mod:`moe.hf` (``expert_parallel(model, comm)``; importing it
registers ``DistributedConfig(ep_implementation="moecomm")``). It needs the ``hf`` extra.
"""

from .dispatcher import ExpertDispatcher
from .internode import NodeAwareHandle, NodeAwareLayout
from .records import DispatchHandle, DispatchLayout, DispatchTraffic
from .layer import GroupedExperts, MoELayer, SharedExpert, gather_state_dict, shard_state_dict
from .router import RouterOutput, RouterScores, TopKRouter

__all__ = ["TopKRouter", "RouterOutput", "RouterScores", "ExpertDispatcher", "DispatchLayout", "DispatchHandle",
           "DispatchTraffic", "NodeAwareLayout", "NodeAwareHandle",
           "MoELayer", "GroupedExperts", "SharedExpert", "gather_state_dict", "shard_state_dict"]
