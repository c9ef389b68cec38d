"""Elastic expert parallelism for :class:`moe.MoELayer`: lose ranks, keep serving, take newcomers in.

Notation as in :mod:`moe.dispatcher`: P ranks of the layer's ``comm``, S = (E + R) / P expert slots
per rank (L without redundant experts), ``masked`` the ranks the layer no longer uses, ``active``
the others in order.

Call path: ``MoELayer.shrink`` -> :func:`shrink` -> ``ExpertDispatcher.mask`` (and the low-latency
dispatcher's): both run their next calls over ``comm.shrink(exclude=masked)`` (:mod:`moe.elastic`),
with the masked ranks' expert slots dropped or, with EPLB, routed to surviving replicas
(:func:`moe.eplb.route` with ``masked_ranks``). ``MoELayer.grow`` / ``MoELayer.join`` ->
:func:`grow` / :func:`join`: over the grown communicator (survivors first, then one newcomer per
masked rank), rank 0 sends the layer's arguments and the new placement (the survivors' slots as
they are, newcomer i in masked rank i's slots), every rank builds the layer's dispatcher there, the
newcomers receive the replicated weights (broadcast from rank 0) and their experts' rows (one
all-to-all from the survivors that hold a replica; a checkpoint's rows for experts none holds).

``decode`` is the inference forward over :class:`moe.LowLatencyDispatcher` (fixed buffers).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch

from collectives.agreement import agree, rank_label
from transports.base import DTYPE_BY_CODE, dtype_code

from .eplb import Placement, logical_loads, route
from .ffn import _ACTIVATIONS
from .low_latency import LowLatencyDispatcher, dequantize

MoELayer = Any  # moe.layer.MoELayer, which imports this module


def unmask_counts(per_slot: torch.Tensor, masked: Sequence[int], num_ranks: int) -> torch.Tensor:
    """Per-slot counts of a masked call ([len(active) * S], the survivors' slots) spread back over all
    P ranks' slots ([P * S], zeros on the masked ranks). Local."""
    active = [r for r in range(num_ranks) if r not in set(masked)]
    per_rank = per_slot.reshape(len(active), -1)
    full = per_slot.new_zeros(num_ranks, per_rank.shape[1])
    full[torch.tensor(active, dtype=torch.long, device=per_slot.device)] = per_rank
    return full.reshape(-1)


def shrink(layer: MoELayer, exclude: Sequence[int]) -> None:
    """``MoELayer.shrink``: mask ``exclude`` in the layer's dispatchers (collective over the others)."""
    if layer.etp_comm is not None:
        raise NotImplementedError(f"MoELayer.shrink on {rank_label(layer.comm)}: a layer with expert_tp_size > 1 "
                                  "cannot lose a rank (its ETP groups would lose a shard of every expert)")
    layer.dispatcher.mask(exclude)
    if layer.low_latency is not None:
        layer.low_latency.mask(exclude)


def sync_masks(layer: MoELayer) -> None:
    """After one of the layer's dispatchers masked a dead peer itself (``on_peer_failure="mask"``), mask it in
    the other too (collective over the survivors: they all met the death in the same call)."""
    ll = layer.low_latency
    if ll is None:
        return
    normal, low = set(layer.dispatcher.masked_ranks), set(ll.masked_ranks)
    if low - normal:
        layer.dispatcher.mask(sorted(low - normal))
    if normal - low:
        ll.mask(sorted(normal - low))


# ---- decode ----------------------------------------------------------------------------------
def init_low_latency(layer: MoELayer, max_tokens_per_rank: int, dtype: torch.dtype) -> None:
    """``MoELayer.init_low_latency`` (collective over ``layer.comm``)."""
    if layer.etp_comm is not None:
        raise NotImplementedError("MoELayer.decode needs expert_tp_size=1")
    if layer.low_latency is not None:
        layer.low_latency.close()
        layer.low_latency = None
    layer.low_latency = LowLatencyDispatcher(layer.comm, layer.num_experts + layer.num_redundant_experts,
                                             max_tokens_per_rank, layer.hidden_size, dtype=dtype,
                                             max_topk=layer.top_k, on_peer_failure=layer.on_peer_failure)
    if layer.masked_ranks:  # a layer that lost ranks before: the same ones are gone here
        layer.low_latency.mask(layer.masked_ranks)


def _padded_experts(layer: MoELayer, recv: torch.Tensor) -> torch.Tensor:
    """Every local expert on all its rows: recv [S, N, H] -> [S, N, H] (rows past the counts are garbage in,
    garbage out, and never read). One batched GEMM pair, no host sync."""
    ex = layer.experts
    h = torch.bmm(recv.to(ex.fc1.dtype), ex.fc1)
    return torch.bmm(_ACTIVATIONS[ex.activation](h), ex.fc2)


def decode(layer: MoELayer, x: torch.Tensor, use_fp8: bool) -> torch.Tensor:
    """``MoELayer.decode``: route, low-latency dispatch, padded experts, combine, shared expert."""
    ll = layer.low_latency
    if ll is None:
        raise RuntimeError(f"MoELayer.decode on {rank_label(layer.comm)}: call init_low_latency(max_tokens_per_rank) "
                           "first (collective)")
    with torch.no_grad():
        try:
            if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != layer.hidden_size:
                raise ValueError(f"MoELayer.decode on {rank_label(layer.comm)}: x must be [T, {layer.hidden_size}] "
                                 f"or [B, S, {layer.hidden_size}], got {getattr(x, 'shape', type(x).__name__)}")
            x2 = x.reshape(-1, layer.hidden_size)
            weights, experts, _ = layer.router.route(x2)
            slots = experts if layer._identity else route(experts, layer.placement, offset=layer.comm.rank,
                                                          masked_ranks=ll.masked_ranks)
        except Exception:
            # the peers are in the dispatch: a call with no valid input makes them raise, naming this rank
            try:
                ll.dispatch(None, None)
            except Exception:  # noqa: BLE001 - the rank's own error is the one to raise
                pass
            raise
        masked = ll.masked_ranks
        recv, _, handle = ll.dispatch(x2.to(ll.dtype), slots, use_fp8=use_fp8)
        if ll.masked_ranks != masked:  # it lost a peer and ran on the survivors: route again (EPLB replicas)
            sync_masks(layer)
            return decode(layer, x, use_fp8)
        layer.expert_load += logical_loads(experts, layer.num_experts).to(layer.expert_load.device)
        rows = dequantize(*recv) if use_fp8 else recv
        out = _padded_experts(layer, rows).to(ll.dtype)
        y = ll.combine(out, slots, weights, handle).to(x.dtype)
        if layer.shared is not None:
            y = y + layer.shared(x2).to(x.dtype)
    return y.reshape(x.shape)


# ---- grow / join -----------------------------------------------------------------------------
def _broadcast_json(comm: Any, obj: Any) -> Any:
    """``obj`` of rank 0 on every rank (two broadcasts: its length, then its JSON bytes)."""
    data = json.dumps(obj).encode() if comm.rank == 0 else b""
    n = int(comm.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0)[0])
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if comm.rank == 0 else torch.zeros(n, dtype=torch.uint8)
    return json.loads(bytes(comm.broadcast(buf, src=0).numpy()).decode())


def _plan(layer: MoELayer, comm: Any) -> dict[str, Any]:
    """What rank 0 tells every rank of the grown group (only called there)."""
    P = layer.comm.size
    masked = list(layer.masked_ranks)
    order = [r for r in range(P) if r not in set(masked)] + masked  # rank i of the grown group holds these slots
    p2l = layer.placement.physical_to_logical
    new = torch.cat([p2l[layer.placement.slots_of(r).start: layer.placement.slots_of(r).stop] for r in order])
    ll = layer.low_latency
    replicated = {k: dtype_code(t.dtype) for k, t in layer.state_dict().items() if k not in layer.expert_keys}
    return {"config": layer._config, "physical_to_logical": new.tolist(), "members": P - len(masked),
            "size": P, "dtype": dtype_code(layer.experts.fc1.dtype), "replicated": replicated,
            "low_latency": None if ll is None else [ll.max_tokens_per_rank, dtype_code(ll.dtype)]}


def _rebuild(cls: type, comm: Any, plan: dict[str, Any], error: Exception | None) -> MoELayer:
    """Every rank: check the grown group against the plan, build the layer (``cls``) over it (collective)."""
    if "error" in plan:  # rank 0 could not make one: every rank raises it
        raise ValueError(f"MoELayer.grow on {rank_label(comm)}: rank 0 says: {plan['error']}")
    members, size = plan["members"], plan["size"]
    if error is None and comm.size != size:
        error = ValueError(f"MoELayer.grow on {rank_label(comm)}: the grown communicator has {comm.size} ranks; the "
                           f"layer had {size} ({members} survivors + {size - members} newcomers, one per masked rank)")
    agree(comm, "MoELayer.grow", {"members": members, "size": size}, error=error,
          hint="Grow the survivors' communicator (layer.dispatcher.active_comm) by as many ranks as are masked.")
    placement = Placement(torch.tensor(plan["physical_to_logical"], dtype=torch.int64), size,
                          plan["config"]["num_experts"])
    return cls(comm, **plan["config"], placement=placement)


def _send_experts(new: MoELayer, plan: dict[str, Any], own: MoELayer | None,
                  expert_weights: dict[str, torch.Tensor] | None) -> None:
    """The newcomers' expert rows from the survivors that hold a replica, else from ``expert_weights``
    (collective: one all-to-all per expert tensor, rows of every newcomer slot whose source is a survivor)."""
    comm, members = new.comm, plan["members"]
    p2l, S = plan["physical_to_logical"], new.placement.slots_per_rank
    held = {}
    for s in range(members * S):
        held.setdefault(p2l[s], s)  # the first survivor slot of each expert
    wanted = range(members * S, len(p2l))
    missing = sorted({p2l[d] for d in wanted if p2l[d] not in held})
    err = None
    if comm.rank >= members and missing and expert_weights is None:
        err = ValueError(f"MoELayer.join on {rank_label(comm)}: no survivor holds experts {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} (they had no replica on the survivors): pass "
                         "expert_weights (the full experts.fc1 / experts.fc2, e.g. from a checkpoint)")
    agree(comm, "MoELayer.grow (expert sources)", {"sources": len(missing)}, error=err)
    mine = range(comm.rank * S, (comm.rank + 1) * S)
    for name in new.expert_keys:
        dest = getattr(new.experts, name.split(".")[1])
        rows, counts = [], [0] * comm.size
        if own is not None:  # a survivor: send the rows of the newcomers' slots whose source is one of ours
            src = getattr(own.experts, name.split(".")[1])
            for d in wanted:
                s = held.get(p2l[d])
                if s is not None and s // S == comm.rank:
                    rows.append(src[s - comm.rank * S].detach())
                    counts[d // S] += 1
        send = torch.stack(rows) if rows else dest.detach().new_zeros((0, *dest.shape[1:]))
        recv = comm.all_to_all(send.reshape(send.shape[0], dest[0].numel()), counts)
        if comm.rank < members:
            continue
        # rows arrive by source rank, and from each source in slot order
        order = sorted((held[p2l[d]] // S, d) for d in mine if p2l[d] in held)
        with torch.no_grad():
            for i, (_, d) in enumerate(order):
                dest[d - mine.start].copy_(recv[i].view(dest.shape[1:]))
            for d in mine:
                if p2l[d] not in held:
                    full = expert_weights[name]
                    dest[d - mine.start].copy_(full[p2l[d]].to(dest.dtype))


def _send_replicated(new: MoELayer, plan: dict[str, Any]) -> None:
    """Router and shared-expert tensors of rank 0 on every rank, in its dtypes (broadcasts, in a fixed order)."""
    comm = new.comm
    with torch.no_grad():
        for key, t in sorted(new.state_dict(keep_vars=True).items()):
            if key in new.expert_keys:
                continue
            t.data = t.data.to(DTYPE_BY_CODE.get(plan["replicated"].get(key), t.dtype))
            t.data.copy_(comm.broadcast(t.detach(), src=0))


def grow(layer: MoELayer, comm: Any) -> None:
    """``MoELayer.grow`` on a survivor (collective over ``comm`` with the newcomers' :func:`join`)."""
    err = None
    if layer.etp_comm is not None:
        err = "a layer with expert_tp_size > 1 cannot grow"
    elif not layer.masked_ranks:
        err = "the layer has no masked ranks to replace"
    plan = _broadcast_json(comm, ({"error": err} if err else _plan(layer, comm)) if comm.rank == 0 else {})
    mine = None
    if comm.rank != layer.dispatcher.active_comm.rank:
        mine = ValueError(f"MoELayer.grow on {rank_label(comm)}: the survivors must be the first ranks of the grown "
                          "communicator, in their order (grow layer.dispatcher.active_comm)")
    new = _rebuild(type(layer), comm, plan, mine)
    # a survivor keeps its own modules (the same parameter tensors: its slots are the same); rank 0's are sent
    new.router, new.shared, new.experts = layer.router, layer.shared, layer.experts
    _send_replicated(new, plan)
    _send_experts(new, plan, layer, None)
    old_ll = layer.low_latency
    old = layer.dispatcher
    layer.comm, layer.ep_comm, layer.dispatcher = new.comm, new.ep_comm, new.dispatcher
    layer.placement, layer._identity = new.placement, new._identity
    layer.last_handle, layer.low_latency = None, None
    layer.reset_expert_load()
    try:
        if plan["low_latency"] is not None:  # collective: before the local closes, which may fail on one rank
            init_low_latency(layer, plan["low_latency"][0], DTYPE_BY_CODE[plan["low_latency"][1]])
    finally:
        try:
            old.close()
        finally:
            if old_ll is not None:
                old_ll.close()


def join(cls: type, comm: Any, expert_weights: dict[str, torch.Tensor] | None) -> MoELayer:
    """``MoELayer.join`` on a newcomer."""
    plan = _broadcast_json(comm, {})
    err = None
    if comm.rank < plan.get("members", 0):
        err = ValueError(f"MoELayer.join on {rank_label(comm)}: a newcomer must come after the survivors")
    new = _rebuild(cls, comm, plan, err)
    device = comm.device if getattr(comm.device, "type", "cpu") == "cuda" else torch.device("cpu")
    new.to(device=device)
    new.experts.to(dtype=DTYPE_BY_CODE[plan["dtype"]])
    _send_replicated(new, plan)
    _send_experts(new, plan, None, expert_weights)
    if plan["low_latency"] is not None:
        init_low_latency(new, plan["low_latency"][0], DTYPE_BY_CODE[plan["low_latency"][1]])
    return new
