"""Hugging Face transformers MoE models, expert-parallel over moecomm.

transformers 5 gives every MoE family one experts interface (``use_experts_implementation``): the
block's own router picks ``top_k_index [T, k]`` and ``top_k_weights [T, k]``, then
``experts(hidden_states [T, H], top_k_index, top_k_weights) -> [T, H]``. An experts module keeps its
``num_experts`` experts as parameters with the expert on dim 0 (``gate_up_proj`` or ``up_proj``,
``down_proj``, their biases), and its forward runs the expert ids below ``num_experts``.

Two entry points, one exchange:

- ``DistributedConfig(fsdp_size=P, ep_size=P, ep_implementation="moecomm")`` in ``from_pretrained``:
  :class:`MoecommEP`, registered in transformers' ``EPImplementationInterface`` when this module is
  imported. transformers shards the experts (whole experts per rank) and calls it per layer.
- :func:`expert_parallel` ``(model, comm)``: a model already in memory, no DeviceMesh. Every experts
  module keeps this rank's ``num_experts / P`` experts and routes through moecomm;
  :func:`gather_experts_state_dict` gives the full checkpoint back.

Call path of one experts module (both entry points)::

    hidden_states [T, H], top_k_index [T, k] (global ids), top_k_weights [T, k]
      -> ExpertDispatcher.dispatch      each token once to every rank holding one of its experts
      -> experts' own forward           [N, H] rows, local expert ids [N, 1], unit weights
      -> ExpertDispatcher.combine       weighted sum per token, back on the token's rank
      -> [T, H]

Rank ``i`` owns global experts ``[i*L, (i+1)*L)``, ``L = E / P``. The experts run with the module's
own math (gate/up layout, ``_apply_gate``, activation, biases, GPT-OSS's clamped SwiGLU), on
``experts_implementation`` "eager", "batched_mm" or "grouped_mm" alike. Autograd runs through the
exchange (dispatch and combine are autograd functions), so gradients reach every token's rank,
routing weights included. Every call is collective over the group: a rank with no tokens still
calls, and ``generate()`` must take the same number of steps on every rank.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from torch import nn

from collectives.agreement import agree, rank_label
from collectives.protocols import CommunicatorLike, check_communicator

from .dispatcher import ExpertDispatcher

log = logging.getLogger("moe")

__all__ = ["EP_IMPLEMENTATION", "MoecommEP", "expert_parallel", "experts_modules", "gather_experts_state_dict"]

EP_IMPLEMENTATION = "moecomm"  # the name in transformers' EPImplementationInterface


# ---- private helpers --------------------------------------------------------------------------
def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module of transformers' experts interface in ``model``
    (classes decorated with ``use_experts_implementation``), in ``named_modules`` order."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate") and isinstance(
                getattr(m, "num_experts", None), int)]


def _expert_tensors(module: nn.Module, num_experts: int) -> list[str]:
    """Names of the module's own parameters and buffers with the expert on dim 0."""
    own = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
    return [n for n, t in own if t is not None and t.dim() >= 1 and t.shape[0] == num_experts]


def _exchange(dispatcher: ExpertDispatcher, experts_forward: Any, hidden_states: torch.Tensor,
              top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Dispatch -> the local experts -> combine (the module docstring's call path). Returns [T, H]."""
    num_local = dispatcher.num_local_experts
    recv_x, tokens_per_expert, handle = dispatcher.dispatch(hidden_states, top_k_index, weights=top_k_weights)
    device = recv_x.device
    local_ids = torch.repeat_interleave(torch.arange(num_local, device=device), tokens_per_expert.to(device))
    local_ids = local_ids.unsqueeze(-1)
    # the routing weights are applied in combine, on the token's rank: the experts run top-1, unit weight
    ones = torch.ones(local_ids.shape, dtype=recv_x.dtype, device=device)
    if recv_x.shape[0] == 0:
        # no rows here: one dummy row keeps the experts' parameters in the graph (their gradients
        # are then zeros, and a data-parallel reduction over them still runs on every rank)
        expert_out = experts_forward(recv_x.sum(0, keepdim=True), local_ids.new_zeros((1, 1)),
                                     ones.new_ones((1, 1)))[:0]
    else:
        expert_out = experts_forward(recv_x, local_ids, ones)
    return dispatcher.combine(expert_out, handle, top_k_weights)


class _ExpertParallelForward:
    """The forward :func:`expert_parallel` installs on one experts module."""

    def __init__(self, dispatcher: ExpertDispatcher, experts_forward: Any, num_experts: int, sharded: list[str]):
        self.dispatcher = dispatcher
        self.experts_forward = experts_forward  # the module's own forward, on local expert ids
        self.num_experts = num_experts  # E, over all ranks
        self.sharded = sharded  # names of the tensors cut to this rank's experts

    @property
    def comm(self) -> CommunicatorLike:
        return self.dispatcher.comm

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 **kwargs: Any) -> torch.Tensor:
        out = _exchange(self.dispatcher, self.experts_forward, hidden_states, top_k_index, top_k_weights)
        return out.to(hidden_states.dtype)


# ---- the EPImplementation ---------------------------------------------------------------------
def _ep_base() -> type:
    try:
        from transformers.distributed.expert_parallel import EPImplementation
    except ImportError:  # transformers without native EP: MoecommEP is still a plain class
        return object
    return EPImplementation


class MoecommEP(_ep_base()):  # type: ignore[misc]
    """transformers' ``EPImplementation`` over moecomm (``ep_implementation="moecomm"``).

    Built by transformers once per experts module when it applies the expert-parallel plan, with
    the module already cut to its local experts. The EP mesh's group gives the Communicator: the
    group's own when its backend is "moecomm", else one made over the group's ranks
    (:func:`collectives.torch_backend.group_communicator`, once per group). When ``tp_size > 1``
    the ranks of a TP group (which share one batch) each send a disjoint slice of its tokens, and
    the outputs are gathered back over TP, as transformers' ``AllToAllEP`` does.

    ``__call__(hidden_states [T, H], top_k_index [T, k] int64 global ids, top_k_weights [T, k])``
    returns ``[T, H]``: each token's weighted sum of its experts' outputs.
    """

    def __init__(self, experts: nn.Module, ep_mesh: Any, tp_mesh: Any):
        from collectives.torch_backend import group_communicator

        super().__init__(experts, ep_mesh, tp_mesh)
        comm = group_communicator(ep_mesh.get_group())
        self.dispatcher = ExpertDispatcher(comm, self.num_local_experts * comm.size)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        sliced = self.tp_mesh.size() > 1
        if sliced:
            from torch.distributed.tensor import DTensor, Replicate, Shard

            # Replicate -> Shard(0): a local slice of the shared batch; its backward all-gathers the gradients
            hidden_states, top_k_index, top_k_weights = (
                DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                for t in (hidden_states, top_k_index, top_k_weights))
        out = _exchange(self.dispatcher, self.experts_forward, hidden_states, top_k_index, top_k_weights)
        if not sliced:
            return out
        return DTensor.from_local(out.contiguous(), self.tp_mesh, [Shard(0)], shape=(num_tokens, out.shape[-1]),
                                  stride=(out.shape[-1], 1)).full_tensor()


def register() -> bool:
    """Register :class:`MoecommEP` as ``ep_implementation="moecomm"`` (done on import; idempotent).
    Returns False where transformers has no ``EPImplementationInterface``."""
    try:
        from transformers.distributed.expert_parallel import EPImplementationInterface
    except ImportError:
        return False
    EPImplementationInterface.register(EP_IMPLEMENTATION, MoecommEP)
    return True


# ---- public wrappers --------------------------------------------------------------------------
def expert_parallel(model: nn.Module, comm: CommunicatorLike) -> nn.Module:
    """Make a transformers MoE model in memory expert-parallel over ``comm`` (collective; in place).

    Every experts module keeps only this rank's ``L = num_experts / comm.size`` experts
    (``[rank*L, (rank+1)*L)``: every parameter and buffer with the expert on dim 0, biases
    included) and its forward routes the tokens through moecomm to the experts' ranks and back.
    Everything else (attention, routers, shared experts) stays replicated: every rank runs the
    whole model on its own batch, whose size may differ between ranks.

    Args:
        model: any transformers model whose experts use transformers' experts interface
            (``use_experts_implementation``: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GPT-OSS, ...).
        comm: the expert-parallel group (a moecomm Communicator; see
            :func:`collectives.torch_backend.group_communicator` for a torch.distributed group).

    Returns:
        ``model``. A model without such experts raises ``TypeError``, and expert counts that do
        not divide over the ranks ``ValueError``, on every rank (naming the class or the counts).
        Its ``save_pretrained`` then raises ``ValueError`` without ``state_dict=`` (it would write
        this rank's experts only): pass :func:`gather_experts_state_dict`'s.
    """
    check_communicator(comm, "expert_parallel")
    found = experts_modules(model)
    err: Exception | None = None
    counts = sorted({m.num_experts for _, m in found})
    # agree() prefixes each message with "expert_parallel on rank N: "
    if not found:
        err = TypeError(f"{type(model).__name__} has no experts module of transformers' experts interface (a class "
                        "decorated with use_experts_implementation)")
    elif any(isinstance(getattr(m, "_moecomm_ep", None), _ExpertParallelForward) for _, m in found):
        err = ValueError(f"{type(model).__name__} is already expert-parallel")
    elif any(c % comm.size for c in counts):
        err = ValueError(f"{type(model).__name__} has experts modules of {counts} experts, not divisible by the "
                         f"{comm.size} ranks")
    agree(comm, "expert_parallel", {"experts modules": len(found), "num_experts (max)": max(counts, default=0),
                                    "num_experts (min)": min(counts, default=0)},
          error=err, hint="Pass the same model (same config) on every rank.")
    dispatchers: dict[int, ExpertDispatcher] = {}
    for name, module in found:
        total = module.num_experts
        local = total // comm.size
        if total not in dispatchers:
            dispatchers[total] = ExpertDispatcher(comm, total)
        sharded = _expert_tensors(module, total)
        lo = comm.rank * local
        with torch.no_grad():
            for n in sharded:
                t = getattr(module, n)
                part = t[lo:lo + local].clone()
                if isinstance(t, nn.Parameter):
                    setattr(module, n, nn.Parameter(part, requires_grad=t.requires_grad))
                else:
                    module._buffers[n] = part
        ep = _ExpertParallelForward(dispatchers[total], module.forward, total, sharded)
        module.num_experts = local
        module._is_expert_parallel = True  # the experts' forward then masks ids >= num_experts
        module._moecomm_ep = ep
        module.forward = ep
        log.debug("%s: %s keeps experts [%d, %d) of %d (%s)", rank_label(comm), name, lo, lo + local, total,
                  ", ".join(sharded))
    if hasattr(model, "save_pretrained"):
        # on this model only (an instance attribute): its class's save_pretrained stays as it is
        model.save_pretrained = types.MethodType(_save_pretrained, model)
    return model


def _save_pretrained(model: nn.Module, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained`` of a model made expert-parallel: without ``state_dict=`` it would write this
    rank's experts only (a checkpoint missing the others, with nothing said), so it refuses."""
    # transformers' signature: save_pretrained(save_directory, is_main_process, state_dict, ...)
    state_dict = kwargs.get("state_dict", args[1] if len(args) > 1 else None)
    if state_dict is None:
        ep = next((m._moecomm_ep for _, m in experts_modules(model)
                   if isinstance(getattr(m, "_moecomm_ep", None), _ExpertParallelForward)), None)
        where = f" on {rank_label(ep.comm)}" if ep is not None else ""
        raise ValueError(f"save_pretrained{where}: this {type(model).__name__} is expert-parallel "
                         "(moe.hf.expert_parallel): its experts modules hold this rank's experts only, so the "
                         "checkpoint would lack the others. "
                         "Pass state_dict=moe.hf.gather_experts_state_dict(model), gathered on every rank (it is "
                         "collective), and save from one rank")
    return type(model).save_pretrained(model, save_directory, *args, **kwargs)


def gather_experts_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a model made expert-parallel by :func:`expert_parallel`, in transformers'
    full layout (collective over the experts' group): every expert tensor gathered over the ranks
    (``[E, ...]``), the rest as this rank holds it. Every rank gets it; save it from one
    (``model.save_pretrained(dir, state_dict=...)``).

    Raises ValueError when the model has no expert-parallel experts modules.
    """
    state = model.state_dict()
    sharded = [(name, m) for name, m in experts_modules(model)
               if isinstance(getattr(m, "_moecomm_ep", None), _ExpertParallelForward)]
    if not sharded:
        raise ValueError(f"gather_experts_state_dict: {type(model).__name__} has no experts made expert-parallel "
                         "by moe.hf.expert_parallel")
    for name, module in sharded:
        ep = module._moecomm_ep
        for n in ep.sharded:
            key = f"{name}.{n}" if name else n
            state[key] = ep.comm.all_gather(getattr(module, n).detach().contiguous())
    return state


register()
