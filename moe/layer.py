"""The expert-parallel MoE layer and its state-dict helpers."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from collectives.agreement import agree, rank_label, rejecting
from collectives.protocols import CommunicatorLike, check_communicator
from transports.base import PeerFailedError

from . import elastic_layer as _elastic
from .elastic import ON_PEER_FAILURE as _ON_PEER_FAILURE
from . import expert_tp as _etp
from . import rebalance as _rebalance
from .dispatcher import ExpertDispatcher
from .eplb import Placement, fold_replicas, logical_loads, route
from .ffn import _ACTIVATIONS, _expert_weights, _ffn_weights
from .records import _to_device
from .router import (SCORES, SHARED_STREAM, TopKRouter, check_router_arguments, is_positive_int, seeded_generator,
                     shape_or_type)


def _grouped_mm_supported(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes x [N, K] with these stacked weights [L, K, M] here: torch has it, the
    dtype and device are ones it runs (CPU: float32/16, bfloat16; CUDA: bfloat16 from sm80), every row
    and matrix stride and base address is 16-byte aligned (its kernels' requirement), and so are the
    rows of every product's input and output ([N, K] and [N, M] for each weight)."""
    grouped = getattr(F, "grouped_mm", None)
    if grouped is None or any(w.dtype != x.dtype or w.device != x.device for w in weights):
        return False
    if x.device.type == "cpu":
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
    elif x.device.type != "cuda" or x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    esz = x.element_size()
    for t in (x, *weights):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * esz % 16 for s in t.stride()[:-1]):
            return False
    return all(w.shape[-2] * esz % 16 == 0 and w.shape[-1] * esz % 16 == 0 for w in weights)


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(a, b, offs=offs)``: [N, K] x [L, K, M] -> [N, M], rows grouped by ``offs`` (cumulative ends)."""
    out = F.grouped_mm(a, b, offs=offs)
    if out.requires_grad:  # its backward rejects the stride-0 gradient of e.g. out.sum() (torch 2.13)
        out.register_hook(_contiguous)
    return out


class GroupedExperts(nn.Module):
    """This rank's experts, stacked: ``fc1`` [L, H, F or 2F], ``fc2`` [L, F, H] float32 (no biases).

    Expert ``i`` here is logical expert ``expert_ids[i]`` (default: ``first_expert + i``); its weights
    come from ``seeded_generator(seed, EXPERT_STREAM, expert_ids[i])`` alone, so they do not depend
    on how experts are spread over ranks, nor on how many replicas an expert has (a logical id may
    appear several times: identical copies). Local (no communication).

    Args:
        num_local_experts: L. first_expert: the global id of local expert 0 (ignored with ``expert_ids``).
        hidden_size: H. ffn_hidden_size: F. activation: a key of ``_ACTIVATIONS`` (gated ones
            double fc1's width). seed: an int >= 0.
        expert_ids: L logical ids, one per local slot (an EPLB placement's slots of this rank), or None.
    """

    def __init__(self, num_local_experts: int, first_expert: int, hidden_size: int, ffn_hidden_size: int,
                 activation: str, seed: int, *, expert_ids: Sequence[int] | None = None):
        super().__init__()
        self.activation = activation
        ids, drawn = _expert_weights("GroupedExperts", num_local_experts, first_expert, expert_ids, hidden_size,
                                     ffn_hidden_size, activation, seed)
        self.expert_ids = ids
        self.fc1 = nn.Parameter(torch.stack([drawn[e][0] for e in ids]))
        self.fc2 = nn.Parameter(torch.stack([drawn[e][1] for e in ids]))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Run each local expert on its rows.

        Two grouped GEMMs (``F.grouped_mm``) where torch runs them for this dtype, device and these
        sizes (:func:`_grouped_mm_supported`), else one GEMM pair per local expert (float64, CUDA
        before sm80 or in float32/16, sizes whose rows are not 16-byte multiples). Either way no
        host sync: the counts are on the host already, and reach a GPU by a non-blocking copy.

        Args:
            x: [N, H] float, rows grouped by local expert (as ``ExpertDispatcher.dispatch`` returns them).
            tokens_per_expert: [L] int64 (CPU), rows per local expert (sums to N).

        Returns:
            [N, H] fc1.dtype, row i the output of row i's expert.
        """
        act = _ACTIVATIONS[self.activation]
        x = x.to(self.fc1.dtype).contiguous()
        if _grouped_mm_supported(x, self.fc1, self.fc2):
            offs = _to_device(torch.cumsum(tokens_per_expert, 0).to(torch.int32), x.device)
            return _grouped(act(_grouped(x, self.fc1, offs)), self.fc2, offs)
        # One GEMM pair per local expert (like Megatron's SequentialMLP); empty experts still run
        # so that every parameter gets a (zero) gradient on every rank (grouped_mm's backward too).
        chunks = torch.split(x, tokens_per_expert.tolist())
        outs = [act(c @ self.fc1[i]) @ self.fc2[i] for i, c in enumerate(chunks)]
        return torch.cat(outs) if outs else x.new_zeros((0, self.fc2.shape[-1]))


class SharedExpert(nn.Module):
    """A dense FFN every token passes through (DeepSeek-style shared expert), replicated on all ranks.

    Args: hidden_size H, ffn_hidden_size F, activation and seed as :class:`GroupedExperts`; its
    weights come from ``seeded_generator(seed, SHARED_STREAM)``. Local (no communication).
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str, seed: int):
        super().__init__()
        self.activation = activation
        w1, w2 = _ffn_weights(hidden_size, ffn_hidden_size, activation, seeded_generator(seed, SHARED_STREAM))
        self.fc1, self.fc2 = nn.Parameter(w1), nn.Parameter(w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x [T, H] float. Returns: [T, H] fc1.dtype."""
        return _ACTIVATIONS[self.activation](x.to(self.fc1.dtype) @ self.fc1) @ self.fc2


# The transformers MoE blocks MoELayer.from_hf takes (matched by class name along the MRO, so transformers
# need not be importable here), and the MoELayer keywords it passes on (the rest comes from the block).
_HF_BLOCKS = ("MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock", "DeepseekV3MoE")
_HF_OPTIONS = ("capacity_factor", "node_aware", "aux_loss_coef", "z_loss_coef", "expert_tp_size")


def _hf_gated(act: object, where: str) -> str:
    """Our gated activation for a transformers ``act_fn`` module (ValueError for one we lack)."""
    kind = type(act).__name__
    if kind in ("SiLUActivation", "SiLU"):
        return "swiglu"
    if (kind == "GELUActivation" and getattr(act, "act", F.gelu) is F.gelu) or (
            kind == "GELU" and getattr(act, "approximate", "none") == "none"):
        return "geglu"
    raise ValueError(f"{where}: activation {kind} is not supported (silu and exact gelu are)")


def _hf_spec(block: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(MoELayer arguments, full tensors by our state-dict name, experts [E, ...] in our layout)`` of a
    transformers MoE block. Local; TypeError for a block or keyword from_hf does not take, ValueError
    for a block it cannot reproduce."""
    name = type(block).__qualname__
    family = next((c.__name__ for c in type(block).__mro__ if c.__name__ in _HF_BLOCKS), None)
    if family is None:
        raise TypeError(f"unsupported block class {name} (supported: {', '.join(_HF_BLOCKS)})")
    unknown = set(kwargs) - set(_HF_OPTIONS)
    if unknown:
        raise TypeError(f"unknown keyword argument(s) {sorted(unknown)} (from_hf takes {', '.join(_HF_OPTIONS)}; "
                        f"the rest comes from the block)")
    experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    weight = getattr(gate, "weight", None)
    layout = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True}
    if not (all(isinstance(t, torch.Tensor) and t.dim() == d for t, d in ((gate_up, 3), (down, 3), (weight, 2)))
            and all(getattr(experts, k, v) == v for k, v in layout.items())):
        raise TypeError(f"{name}: expected the experts of transformers >= 5 (3-D gate_up_proj [E, 2I, H], "
                        f"[gate; up] concatenated, and down_proj [E, H, I], no biases) and a gate.weight [E, H]")
    E, two_i, H = gate_up.shape
    ffn = two_i // 2
    if two_i % 2 or tuple(down.shape) != (E, H, ffn) or tuple(weight.shape) != (E, H):
        raise ValueError(f"{name}: inconsistent shapes gate_up_proj {tuple(gate_up.shape)}, down_proj "
                         f"{tuple(down.shape)}, gate.weight {tuple(weight.shape)}")
    args: dict[str, Any] = {"hidden_size": H, "ffn_hidden_size": ffn, "num_experts": E, "top_k": gate.top_k,
                            "activation": _hf_gated(experts.act_fn, name)}
    # our layout: fc1 [E, H, 2I] (x @ fc1, gate half first), fc2 [E, I, H]; transformers applies F.linear
    full = {"experts.fc1": gate_up.detach().transpose(1, 2), "experts.fc2": down.detach().transpose(1, 2),
            "router.weight": weight.detach()}
    if family == "MixtralSparseMoeBlock":
        args["normalize"] = True
    elif family == "Qwen3MoeSparseMoeBlock":
        args["normalize"] = bool(gate.norm_topk_prob)
    else:  # DeepseekV3MoE: group-limited sigmoid routing, correction bias, scaling, one shared MLP
        args.update(score="sigmoid", normalize=bool(gate.norm_topk_prob), num_groups=gate.num_group,
                    topk_groups=gate.topk_group, bias=True, routed_scaling_factor=float(gate.routed_scaling_factor))
        full["router.weight"] = weight.detach().float()  # transformers runs this gate in float32 whatever its dtype
        full["router.e_score_correction_bias"] = gate.e_score_correction_bias.detach()
        mlp = block.shared_experts
        if _hf_gated(mlp.act_fn, name) != args["activation"]:
            raise ValueError(f"{name}: the shared experts' activation differs from the routed experts'")
        args["shared_ffn_hidden_size"] = mlp.gate_proj.out_features
        full["shared.fc1"] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().t()
        full["shared.fc2"] = mlp.down_proj.weight.detach().t()
    return args, full


def _check_expert_tp(P: int, ffn: int, T: Any) -> int:
    """T, checked against P ranks and the experts' inner size ``ffn`` (ValueError for a bad one). Local."""
    if not is_positive_int(T):
        raise ValueError(f"expert_tp_size must be a positive int, got {T!r}")
    if P % T:
        raise ValueError(f"expert_tp_size={T} does not divide the {P} ranks of comm")
    if ffn % T:
        raise ValueError(f"ffn_hidden_size={ffn} is not divisible by expert_tp_size={T}")
    return T


def _check_placement(P: int, E: int, R: Any, placement: Any) -> Placement | None:
    """The placement a layer of E experts + R redundant slots on P ranks starts with (None: the identity,
    R = 0); ValueError for an invalid R or placement. Local."""
    if not isinstance(R, int) or isinstance(R, bool) or R < 0:
        raise ValueError(f"num_redundant_experts must be an int >= 0, got {R!r}")
    if placement is None:
        if R and (E + R) % P:
            raise ValueError(f"num_experts + num_redundant_experts = {E} + {R} = {E + R} slots are not divisible "
                             f"by the {P} ranks; each rank must hold the same number of slots")
        return Placement.default(E, P, R) if R else None
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a moe.eplb.Placement, got {type(placement).__name__}")
    if (placement.num_logical, placement.num_physical, placement.num_ranks) != (E, E + R, P):
        raise ValueError(f"placement has {placement.num_logical} experts in {placement.num_physical} slots on "
                         f"{placement.num_ranks} ranks; this layer needs {E} in {E + R} slots on {P} ranks")
    return placement


class MoELayer(nn.Module):
    """Router -> dispatch -> local experts -> combine (+ shared expert), expert-parallel over ``comm``.

    Rank ``i`` of P holds experts ``[i*L, (i+1)*L)``, L = E / P (notation in :mod:`moe.dispatcher`),
    or with EPLB the slots ``placement.slots_of(i)``, or with ETP (``expert_tp_size``) a shard of
    those of its EP rank; the router and the shared expert are replicated. All weights are drawn
    from ``seed`` and each expert's global (logical) index, so layers with the same arguments over
    1 or N ranks, with or without redundant experts, at any EP x ETP size, compute the same function.

    Gradients: expert parameters get their full gradient on their rank (with ETP: the full gradient
    of this rank's shard). The router and shared expert are replicated, so each rank's gradient is
    its tokens' share: sum them over all P ranks of ``comm`` (a data-parallel all-reduce with
    op="sum") to get the gradient of the whole batch.

    Args:
        comm: the expert-parallel group. Construction is collective: every rank must pass the same
            arguments; a bad or differing argument on any rank raises ``ValueError`` (``TypeError``
            for an unknown keyword) on every rank, naming the rank.
        hidden_size: H. ffn_hidden_size: F, each expert's inner size. num_experts: E, divisible by P / T.
        top_k: k <= E, experts per token.
        activation: "swiglu", "geglu" (gated: fc1 is 2F wide), "gelu", "relu" or "silu".
        capacity_factor: None (dropless) or > 0: see :class:`~moe.dispatcher.ExpertDispatcher`.
        shared_ffn_hidden_size: inner size of a shared expert, 0 for none.
        seed: an int >= 0.
        node_aware: None (auto: node-aware dispatch when ``comm`` spans nodes), True or False: see
            :class:`~moe.dispatcher.ExpertDispatcher`; call :meth:`close` when done with the layer.
        num_redundant_experts: R >= 0 redundant expert slots (EPLB, :mod:`moe.eplb`); (E + R) % (P / T) == 0.
            0 (default): the plain layer. With R > 0 (or a ``placement``) the dispatcher runs over
            E + R physical slots, this rank's :class:`GroupedExperts` hold the logical experts
            ``placement.physical_to_logical[placement.slots_of(rank)]`` (identical replicas of one
            logical expert), and forward maps the router's logical choices to slots with
            :func:`moe.eplb.route`. The layer computes the same function as with R = 0 (same seed);
            train it with :meth:`reduce_replica_grads` after backward so that replicas stay identical.
            With ``capacity_factor`` the capacity applies per slot (C over E + R slots).
        placement: a :class:`moe.eplb.Placement` of E logical experts over E + R slots on P / T (EP)
            ranks, the same on every rank; default ``Placement.default(E, P / T, R)`` (the identity when R = 0).
        expert_tp_size: T, expert tensor parallelism (:mod:`moe.expert_tp`), dividing P and F; 1
            (default): none. With T > 1, ``comm`` is an EP x ETP grid (rank = ep_rank * T + etp_rank;
            ``ep_comm``, ``etp_comm``: :func:`moe.expert_tp.expert_tp_groups`): the experts (or EPLB
            slots) are spread over the P / T ranks of ``ep_comm`` as above, and each of them is
            sharded over the T ranks of ``etp_comm`` (:class:`~moe.expert_tp.ShardedExperts`: fc1
            by columns, fc2 by rows). Each rank still passes its own tokens and gets its own outputs
            (:func:`~moe.expert_tp.etp_forward` gathers an ETP group's tokens, routes them, runs the
            shards and reduce-scatters the result); the weights, drawn whole and then sliced, and so
            the function, do not depend on T. With T = 1, ``ep_comm`` is ``comm`` and ``etp_comm`` None.
        on_peer_failure: "raise" (default): a dead peer makes forward raise ``PeerFailedError`` naming
            it on every survivor; the survivors then call :meth:`shrink` and go on. "mask": forward
            masks the dead rank(s) itself (a communicator of the survivors, as :meth:`shrink`) and
            returns the step computed by the survivors. Either way the dead ranks' experts are served
            by their replicas (EPLB) or dropped, and :meth:`grow` takes newcomers in (elastic EP:
            :mod:`moe.elastic_layer`). Needs ``expert_tp_size=1`` and a store rendezvous.
        router_kwargs: ``score``, ``normalize``, ``aux_loss_coef``, ``z_loss_coef``, ``num_groups``,
            ``topk_groups``, ``bias``, ``routed_scaling_factor`` of :class:`TopKRouter`.

    Load statistics: ``expert_load`` ([E] int64 buffer, not saved) counts the router's (token, slot)
    choices per logical expert over the forwards since :meth:`reset_expert_load` (this rank's
    tokens; no host sync; summed over all P ranks they count the batch once, with ETP too).
    :meth:`rebalance` moves experts to a new placement; :class:`moe.rebalance.Balancer` does it from
    the loads every so many steps.

    :meth:`from_hf` builds one from a transformers MoE block (Mixtral, Qwen3-MoE, DeepSeek-V3), weights included.
    """

    expert_keys = ("experts.fc1", "experts.fc2")

    def __init__(self, comm: CommunicatorLike, hidden_size: int, ffn_hidden_size: int, num_experts: int,
                 top_k: int, *, activation: str = "swiglu", capacity_factor: float | None = None,
                 shared_ffn_hidden_size: int = 0, seed: int = 0, node_aware: bool | None = None,
                 num_redundant_experts: int = 0, placement: Placement | None = None, expert_tp_size: int = 1,
                 on_peer_failure: str = "raise", **router_kwargs: Any):
        super().__init__()
        check_communicator(comm, "MoELayer")
        options = {"score": "softmax", "normalize": True, "aux_loss_coef": 0.0, "z_loss_coef": 0.0, "num_groups": 1,
                   "topk_groups": None, "bias": False, "routed_scaling_factor": 1.0}
        err = None
        try:
            unknown = set(router_kwargs) - set(options)
            if unknown:
                raise TypeError(f"unknown keyword argument(s) {sorted(unknown)}")
            options.update(router_kwargs)
            check_router_arguments(hidden_size, num_experts, top_k, score=options["score"],
                                   aux_loss_coef=options["aux_loss_coef"], z_loss_coef=options["z_loss_coef"],
                                   num_groups=options["num_groups"], topk_groups=options["topk_groups"],
                                   routed_scaling_factor=options["routed_scaling_factor"])
            if on_peer_failure not in _ON_PEER_FAILURE:
                raise ValueError(f"on_peer_failure must be one of {_ON_PEER_FAILURE}, got {on_peer_failure!r}")
            if on_peer_failure != "raise" and expert_tp_size != 1:
                raise ValueError("on_peer_failure='mask' needs expert_tp_size=1 (an ETP group cannot lose a rank)")
            if activation not in _ACTIVATIONS:
                raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
            if not is_positive_int(ffn_hidden_size):
                raise ValueError(f"ffn_hidden_size must be a positive int, got {ffn_hidden_size!r}")
            if not (is_positive_int(shared_ffn_hidden_size) or shared_ffn_hidden_size == 0):
                raise ValueError(f"shared_ffn_hidden_size must be an int >= 0, got {shared_ffn_hidden_size!r}")
            router = TopKRouter(hidden_size, num_experts, top_k, seed=seed, **options)
            T = _check_expert_tp(comm.size, ffn_hidden_size, expert_tp_size)
            placement = _check_placement(comm.size // T, num_experts, num_redundant_experts, placement)
            if T > 1 and (num_experts + num_redundant_experts) % (comm.size // T):
                raise ValueError(f"num_experts={num_experts} is not divisible by the {comm.size // T} EP ranks "
                                 f"(comm.size / expert_tp_size); each must hold the same number of experts")
        except (TypeError, ValueError) as e:
            err, router = e, None
        R, T = num_redundant_experts, expert_tp_size
        names = sorted(_ACTIVATIONS)
        # The same keys on every rank, whatever failed locally: the all-gather needs equal lengths.
        values = {"hidden_size": hidden_size, "ffn_hidden_size": ffn_hidden_size, "num_experts": num_experts,
                  "top_k": top_k, "shared_ffn_hidden_size": shared_ffn_hidden_size, "seed": seed,
                  "activation": names.index(activation) if activation in names else None,
                  "score": SCORES.index(options["score"]) if options["score"] in SCORES else None,
                  "normalize": bool(options["normalize"]), "aux_loss_coef": options["aux_loss_coef"],
                  "z_loss_coef": options["z_loss_coef"],
                  "num_groups": options["num_groups"] if is_positive_int(options["num_groups"]) else None,
                  "topk_groups": options["topk_groups"] if is_positive_int(options["topk_groups"]) else None,
                  "bias": bool(options["bias"]),
                  "routed_scaling_factor": (float(options["routed_scaling_factor"])
                                            if isinstance(options["routed_scaling_factor"], (int, float)) else None),
                  "num_redundant_experts": R if isinstance(R, int) and not isinstance(R, bool) else None,
                  "expert_tp_size": T if is_positive_int(T) else None,
                  "on_peer_failure": (_ON_PEER_FAILURE.index(on_peer_failure) if on_peer_failure in _ON_PEER_FAILURE
                                      else None),
                  "placement (digest)": _rebalance.digest_int(placement) if isinstance(placement, Placement) else None}
        agree(comm, "MoELayer", values, error=err,
              formats={"activation": lambda i: repr(names[i]), "score": lambda i: repr(SCORES[i])},
              hint="Construct the layer with the same arguments on every rank.")
        self.comm, self.expert_tp_size = comm, T
        # EP x ETP (T > 1): rank = ep_rank * T + etp_rank; experts over ep_comm, each one's FFN sharded over etp_comm
        self.ep_comm, self.etp_comm = _etp.expert_tp_groups(comm, T) if T > 1 else (comm, None)
        try:
            self.dispatcher = ExpertDispatcher(self.ep_comm, num_experts + R, capacity_factor=capacity_factor,
                                               node_aware=node_aware, on_peer_failure=on_peer_failure)
        except BaseException:
            self._close_groups()
            raise
        self.router = router
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.num_experts, self.top_k, self.activation = num_experts, top_k, activation
        self.num_redundant_experts = R
        self.num_local_experts = self.dispatcher.num_local_experts  # slots of this rank: (E + R) / (P / T)
        self.placement = placement if placement is not None else Placement(torch.arange(num_experts),
                                                                          self.ep_comm.size, num_experts)
        self._identity = R == 0 and bool(torch.equal(self.placement.physical_to_logical, torch.arange(num_experts)))
        self._moving: str | None = None  # why forward refuses: a rebalance is under way or was interrupted
        slots = self.placement.slots_of(self.ep_comm.rank)
        args = (self.num_local_experts, slots.start, hidden_size, ffn_hidden_size, activation, seed)
        ids = self.placement.physical_to_logical[slots.start:slots.stop]
        self.experts: GroupedExperts | _etp.ShardedExperts = (
            GroupedExperts(*args, expert_ids=ids) if T == 1 else
            _etp.ShardedExperts(*args, etp_rank=self.etp_comm.rank, expert_tp_size=T, expert_ids=ids))
        self.shared = (SharedExpert(hidden_size, shared_ffn_hidden_size, activation, seed)
                       if shared_ffn_hidden_size else None)
        self.expert_load: torch.Tensor
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.last_handle = None
        self.on_peer_failure = on_peer_failure
        self.low_latency: Any = None  # the LowLatencyDispatcher of decode(), made by init_low_latency
        # what a newcomer needs to build this layer (MoELayer.join): the arguments but the communicator and placement
        self._config = {"hidden_size": hidden_size, "ffn_hidden_size": ffn_hidden_size, "num_experts": num_experts,
                        "top_k": top_k, "activation": activation, "capacity_factor": capacity_factor,
                        "shared_ffn_hidden_size": shared_ffn_hidden_size, "seed": seed, "node_aware": node_aware,
                        "num_redundant_experts": R, "expert_tp_size": T, "on_peer_failure": on_peer_failure,
                        **options}

    @classmethod
    def from_hf(cls, block: nn.Module, comm: CommunicatorLike, **kwargs: Any) -> MoELayer:
        """An expert-parallel layer computing what a transformers (>= 5) MoE block computes (collective).

        Supported blocks (and subclasses): ``MixtralSparseMoeBlock`` (softmax top-k, renormalised),
        ``Qwen3MoeSparseMoeBlock`` (softmax top-k, renormalised when ``norm_topk_prob``) and
        ``DeepseekV3MoE`` (group-limited sigmoid routing over ``n_group`` groups keeping
        ``topk_group``, ``e_score_correction_bias``, ``norm_topk_prob``, ``routed_scaling_factor``,
        and the shared experts as this layer's shared expert). Experts must be gated silu or exact
        gelu ("swiglu"/"geglu"). Mixtral's ``router_jitter_noise`` (training only) is not applied.

        The weights are copied in the block's dtype and device: expert ``e`` of this rank (``e`` in
        ``[ep_rank * L, (ep_rank + 1) * L)``, L = E / (P / T)) gets ``fc1 = gate_up_proj[e].T`` [H, 2I]
        and ``fc2 = down_proj[e].T`` [I, H] (with ``expert_tp_size`` T > 1 this rank's shard of them,
        as :func:`shard_state_dict` cuts it); the router ``gate.weight`` [E, H] (float32 for DeepSeek-V3,
        whose gate transformers runs in float32) and its bias; the shared MLP ``fc1 = [gate_proj;
        up_proj].T`` [H, 2I_s], ``fc2 = down_proj.T`` [I_s, H]. The copies are independent of the block.
        With a float32 or float64 block, ``layer(x)[0]`` equals ``block(x)`` up to the order of float
        sums (and the same expert choice); 16-bit blocks round their gate differently (our gate runs
        in float32). Routing: see :class:`~moe.router.TopKRouter`.

        Args:
            block: the transformers MoE block, the same on every rank (its class and expert count are
                checked to agree).
            comm: the expert-parallel group (every rank calls from_hf).
            kwargs: ``capacity_factor``, ``node_aware``, ``aux_loss_coef``, ``z_loss_coef``,
                ``expert_tp_size`` of :class:`MoELayer` (defaults: dropless, auto, no losses, no ETP);
                the rest comes from the block.

        Returns:
            A :class:`MoELayer` holding this rank's experts. An unsupported block class (or unknown
            keyword) raises ``TypeError``, naming the class; a block it cannot reproduce, or E not
            divisible by the P / T EP ranks, ``ValueError``: on every rank.
        """
        check_communicator(comm, "MoELayer.from_hf")
        err, args, full = None, {}, {}
        try:
            args, full = _hf_spec(block, kwargs)
        except (TypeError, ValueError) as e:
            err = e
        except AttributeError as e:  # a block of a supported class, changed: not one we know how to copy
            err = TypeError(f"{type(block).__qualname__}: {e}")
        E, T = args.get("num_experts"), kwargs.get("expert_tp_size", 1)
        T = T if is_positive_int(T) and comm.size % T == 0 else None  # else the layer's own check says why
        agree(comm, "MoELayer.from_hf", {"num_experts": E, "expert_tp_size": T}, error=err,
              hint="Pass the same block and expert_tp_size to from_hf on every rank.")
        if T is not None and E % (comm.size // T):  # agreed: every rank raises
            ranks = f"{comm.size} ranks of comm" if T == 1 else f"{comm.size // T} EP ranks (comm.size / expert_tp_size)"
            raise ValueError(f"MoELayer.from_hf: {type(block).__qualname__} has {E} experts, not divisible by the "
                             f"{ranks}; each rank must hold the same number of experts")
        layer = cls(comm, **args, **kwargs)
        with torch.no_grad():  # this rank's experts (with ETP: its shards of them), in the block's dtype and device
            for key, t in shard_state_dict(layer, full).items():
                path, attr = key.rsplit(".", 1)
                owner = layer.get_submodule(path)
                t = t.clone(memory_format=torch.contiguous_format)
                setattr(owner, attr, nn.Parameter(t) if isinstance(getattr(owner, attr), nn.Parameter) else t)
        return layer

    def close(self) -> None:
        """Close the dispatchers' sub-groups (the node-aware path's, the masks') and, with ETP, the EP and
        ETP groups (collective like their creation)."""
        try:
            try:
                self.dispatcher.close()
            finally:
                if self.low_latency is not None:
                    self.low_latency.close()
        finally:
            self._close_groups()

    def _close_groups(self) -> None:
        if self.etp_comm is not None:
            try:
                self.ep_comm.close()
            finally:
                self.etp_comm.close()

    def extra_repr(self) -> str:
        first = self.dispatcher.first_local_expert
        held = (f"experts {first}..{first + self.num_local_experts - 1} of {self.num_experts}" if self._identity else
                f"slots {first}..{first + self.num_local_experts - 1} of {self.num_experts} experts + "
                f"{self.num_redundant_experts} redundant (experts {self.experts.expert_ids})")
        etp = (f" (EP rank {self.ep_comm.rank}/{self.ep_comm.size} x ETP rank {self.etp_comm.rank}/"
               f"{self.expert_tp_size})" if self.etp_comm is not None else "")
        return (f"rank={self.comm.rank}/{self.comm.size}{etp}, {held}, top_k={self.top_k}, "
                f"capacity_factor={self.dispatcher.capacity_factor}")

    def reset_expert_load(self) -> None:
        """Zero ``expert_load`` (local)."""
        self.expert_load.zero_()

    def reduce_replica_grads(self) -> None:
        """Give every replica of a logical expert the sum of all its replicas' gradients (collective).

        Call it after backward and before the optimizer step, on every rank: then replicas stay
        identical under any optimizer, and training with redundant experts equals training without.
        It moves the gradients of all E experts (one all-reduce of [E, ...] fc1 and fc2 gradients over
        ``ep_comm``; with ETP, of this rank's shards); a no-op (no communication) when the layer has
        no redundant experts.
        """
        if self.num_redundant_experts:
            _rebalance.reduce_replica_grads(self)

    def rebalance(self, placement: Placement, optimizer: torch.optim.Optimizer | None = None, *,
                  max_experts_per_round: int = _rebalance.MAX_EXPERTS_PER_ROUND) -> _rebalance.Moved:
        """Move the experts to ``placement`` (collective): see :func:`moe.rebalance.rebalance`."""
        return _rebalance.rebalance(self, placement, optimizer, max_experts_per_round=max_experts_per_round)

    # ---- elastic EP: lose ranks, keep serving, take new ranks in (moe/elastic_layer.py) ----------
    @property
    def masked_ranks(self) -> tuple[int, ...]:
        """Ranks of ``comm`` this layer no longer uses (after :meth:`shrink` or a masked failure)."""
        return self.dispatcher.masked_ranks

    def shrink(self, exclude: Sequence[int]) -> None:
        """Go on without the ranks ``exclude`` (collective over the other ranks; the excluded take no part).

        For a rank that died: its forward raised ``PeerFailedError`` naming it on every survivor (or,
        with ``on_peer_failure="mask"``, this happened inside forward). The dispatchers run their next
        calls over a communicator of the survivors (``comm.shrink``, made here). The excluded ranks'
        experts are served by their replicas on the survivors (EPLB, :func:`moe.eplb.route` with
        ``masked_ranks``); an expert with none is dropped: the slots that chose it are left out of the
        sum and the remaining weights are used as they are. The survivors' tokens only are served.

        Args:
            exclude: ranks of ``comm`` (ints), the same on every survivor. Raises ValueError on every
                survivor when they differ or one is invalid; NotImplementedError with expert_tp_size > 1.
        """
        _elastic.shrink(self, exclude)

    def grow(self, comm: CommunicatorLike) -> None:
        """Take new ranks in, in place of the masked ones (collective over ``comm``; the newcomers call
        :meth:`join`), so that the layer runs over all its experts again.

        ``comm`` is the survivors' communicator grown by as many ranks as are masked
        (``layer.dispatcher.active_comm.grow(n)``; the newcomers' ``collectives.init(join=...)``): its first
        ranks are the survivors in order, newcomer i takes masked rank ``masked_ranks[i]``'s expert
        slots. The newcomers get the layer's arguments and its replicated weights (router, shared
        expert) from rank 0, and each of their experts' weights from a survivor holding a replica of
        it (EPLB), else from the ``expert_weights`` they pass to :meth:`join` (a checkpoint). The
        survivors keep their parameters (the same tensors); the layer's ``comm`` becomes ``comm``.
        Optimizer state is not moved (serving). Raises ValueError on every rank when the newcomers do
        not match the masked ranks or an expert has no source.
        """
        _elastic.grow(self, comm)

    @classmethod
    def join(cls, comm: CommunicatorLike, *, expert_weights: dict[str, torch.Tensor] | None = None) -> MoELayer:
        """The newcomers' side of :meth:`grow` (collective over ``comm``): a layer built from what the
        survivors send.

        Args:
            comm: the grown communicator (from ``collectives.init(join=...)``).
            expert_weights: optional full expert tensors (``experts.fc1`` [E, H, F or 2F],
                ``experts.fc2`` [E, F, H], as :func:`gather_state_dict` gives them): used for the
                experts no survivor holds.
        Returns:
            The layer, equal on every rank to the one the survivors hold.
        """
        return _elastic.join(cls, comm, expert_weights)

    # ---- decoding over the low-latency dispatcher -----------------------------------------------
    def init_low_latency(self, max_tokens_per_rank: int, *, dtype: torch.dtype = torch.bfloat16) -> None:
        """Make the :class:`~moe.low_latency.LowLatencyDispatcher` that :meth:`decode` uses (collective;
        needs the ipc transport: one node, CUDA, or ``MOECOMM_IPC_EMULATE=1`` on the CPU).

        Args:
            max_tokens_per_rank: M, the most tokens a rank passes to one :meth:`decode`.
            dtype: what travels (bfloat16, float16 or float32); the experts run in their own dtype.
        """
        _elastic.init_low_latency(self, max_tokens_per_rank, dtype)

    def decode(self, x: torch.Tensor, *, use_fp8: bool = False) -> torch.Tensor:
        """Inference forward through the low-latency dispatcher (collective; no autograd).

        Route, dispatch to fixed [L, P*M, H] buffers, run every local expert on all its rows (one
        batched GEMM pair; rows past the count are computed and ignored), combine, add the shared
        expert. Shapes depend only on T, so a step can be captured in a CUDA graph once warm (eagerly,
        the dispatcher waits for its kernels to raise errors on every rank, as its calls do).

        Args:
            x: [T, H] or [B, S, H] float, T (B * S) <= M of :meth:`init_low_latency`.
            use_fp8: dispatch in float8 e4m3 (per-128-channel scales), combine in the dispatcher's dtype.
        Returns:
            y of x's shape and dtype. ``on_peer_failure`` and :meth:`shrink` apply as in forward.
        """
        try:
            return _elastic.decode(self, x, use_fp8)
        except PeerFailedError:
            if self.on_peer_failure != "mask":
                raise
            _elastic.sync_masks(self)  # the low-latency dispatcher masked the dead rank(s) in a combine or hook
            return _elastic.decode(self, x, use_fp8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route, dispatch, run the experts, combine (collective; its backward is collective too).

        Args:
            x: [T, H] or [B, S, H] float (T, or B * S, may differ between ranks, and be 0).

        Returns:
            ``(y, aux_loss)``: y of x's shape and dtype; aux_loss a 0-d float32 tensor, this
            rank's share of the router losses of the whole batch over all ranks (see
            :class:`TopKRouter`): the shares of all ranks sum to the loss the same layer computes
            on one rank over all tokens. The dispatch handle of the call is kept as
            ``last_handle`` (e.g. ``.dropped``; its routing is by physical slot; with ETP, the EP
            dispatch of the ETP group's gathered tokens).

        Raises ``RuntimeError`` while a :meth:`rebalance` is under way, and for good after one that
        was interrupted (the experts' weights are then partly moved).
        """
        if self._moving is not None:  # every rank of the rebalance has it: no peer waits on this rank
            raise RuntimeError(f"MoELayer on {rank_label(self.comm)}: {self._moving}")
        if self.etp_comm is not None:
            return self._forward_etp(x)
        try:
            return self._forward(x)
        except PeerFailedError:
            if self.on_peer_failure != "mask":
                raise
            # the dispatcher masked the dead rank(s) (a dispatch it could not finish it re-ran on the
            # survivors; a combine it could not): run the whole step again on the survivors
            _elastic.sync_masks(self)
            return self._forward(x)

    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        comm = self.dispatcher.active_comm
        masked = self.dispatcher.masked_ranks
        # Local work between collectives runs under `rejecting`: a failure on this rank makes the peers'
        # next collective raise. Before dispatch that is its count exchange, which moves CPU tensors.
        with rejecting(comm):
            if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != self.hidden_size:
                raise ValueError(f"MoELayer on {rank_label(self.comm)}: x must be [T, {self.hidden_size}] or "
                                 f"[B, S, {self.hidden_size}], got "
                                 + shape_or_type(x))
            shape = x.shape
            x2 = x.reshape(-1, self.hidden_size)
            weights, experts, scores = self.router.route(x2)
            slots = experts if self._identity else route(experts, self.placement, offset=self.comm.rank,
                                                         masked_ranks=masked)
        recv_x, tokens_per_expert, handle = self.dispatcher.dispatch(x2, slots, weights=weights.detach())
        if self.dispatcher.masked_ranks != masked:
            # the dispatch lost a peer and ran again on the survivors (on_peer_failure="mask") with the slots
            # routed before: route again, so that the dead rank's experts go to their surviving replicas
            _elastic.sync_masks(self)
            return self._forward(x)
        with torch.no_grad():  # counted once per step, also when a step is run again
            self.expert_load += logical_loads(experts, self.num_experts).to(self.expert_load.device)
        with rejecting(comm, on=recv_x):  # the peers go on to combine's all-to-all
            expert_out = self.experts(recv_x, tokens_per_expert)
        y = self.dispatcher.combine(expert_out, handle, weights).to(x.dtype)
        if self.shared is not None:
            with rejecting(comm, on=y):
                y = y + self.shared(x2).to(x.dtype)
        lay = handle.layout
        per_expert = lay.global_tokens_per_expert  # [E + R] (CPU): fold the replicas' counts into their experts'
        if handle.masked_ranks:  # the survivors' slots: the masked ranks' count 0
            per_expert = _elastic.unmask_counts(per_expert, handle.masked_ranks, self.dispatcher.comm.size)
        if not self._identity:
            per_expert = fold_replicas(per_expert, self.placement)
        aux = self.router.aux_loss(scores, per_expert, lay.num_global_tokens)
        self.last_handle = handle
        return y.reshape(shape), aux

    def _forward_etp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward with T > 1: :func:`moe.expert_tp.etp_forward`, then the shared expert's output added."""
        shared, err = None, None
        # the shared expert runs first: a failure there goes into etp_forward's first agreement, so that
        # every rank raises (after the call, the peers' next collectives would be in backward)
        if self.shared is not None and isinstance(x, torch.Tensor) and x.shape[-1:] == (self.hidden_size,):
            try:
                shared = self.shared(x).to(x.dtype)
            except Exception as e:  # noqa: BLE001 - raised on every rank by etp_forward
                err = ValueError(f"the shared expert failed: {type(e).__name__}: {e}")
        y, aux, handle, chosen = _etp.etp_forward(x, self.router, self.dispatcher, self.experts, self.etp_comm,
                                                  return_routing=True, error=err,
                                                  placement=None if self._identity else self.placement)
        with torch.no_grad():  # this rank's own tokens: the sum over all P ranks counts the batch once
            self.expert_load += logical_loads(chosen, self.num_experts).to(self.expert_load.device)
        self.last_handle = handle
        return (y if shared is None else y + shared), aux


def gather_state_dict(layer: MoELayer) -> dict[str, torch.Tensor]:
    """The full (single-rank) state dict of an expert-parallel layer, on every rank (collective).

    Args:
        layer: the layer (every rank of its communicator calls this).

    Returns:
        name -> tensor: expert tensors (``MoELayer.expert_keys``, [L, ...] per rank; with ETP, the
        rank's shards of them) all-gathered into whole [E, ...] in logical expert order (with
        redundant experts or another placement: each expert from its first replica; ETP shards put
        together by :func:`moe.expert_tp.gather_expert_slots`); replicated tensors copied from this
        rank. It loads into a ``MoELayer`` over one rank with the same arguments (and no redundant
        experts, ``expert_tp_size=1``).
    """
    full = {}
    for name, t in layer.state_dict().items():
        if name in layer.expert_keys:
            full[name] = _etp.gather_expert_slots(layer, name, t)
            if not layer._identity:  # [E + R] slots -> [E] logical experts
                full[name] = full[name][layer.placement.logical_to_physical[:, 0].to(t.device)]
        else:
            full[name] = t.detach().clone()
    return full


def shard_state_dict(layer: MoELayer, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of a full state dict (local).

    Args:
        layer: the expert-parallel layer to load into.
        full: name -> tensor with expert tensors [E, ...], e.g. from :func:`gather_state_dict` or a
            single-rank layer's ``state_dict()``.

    Returns:
        A dict for ``layer.load_state_dict``: expert tensors sliced to this rank's experts [L, ...]
        (its slots' logical experts ``placement.physical_to_logical[slots_of(ep_rank)]``; with ETP
        this rank's shard of each, :func:`moe.expert_tp.shard_expert_slots`), the others as given.
        Raises ``ValueError`` on an expert tensor without E rows.
    """
    slots = layer.placement.slots_of(layer.ep_comm.rank)
    ids = layer.placement.physical_to_logical[slots.start: slots.stop]
    out = {}
    for name, t in full.items():
        if name in layer.expert_keys:
            if t.dim() == 0 or t.shape[0] != layer.num_experts:
                raise ValueError(f"shard_state_dict: {name} has shape {tuple(t.shape)}; a full state dict holds "
                                 f"all {layer.num_experts} experts along dim 0")
            out[name] = _etp.shard_expert_slots(layer, name, t[ids.to(t.device)].clone())
        else:
            out[name] = t
    return out
