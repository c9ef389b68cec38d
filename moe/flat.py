"""The flat dispatch/combine path: one row per (token, destination rank) over one all-to-all.

:class:`FlatPath` is one of the two strategies behind :class:`~moe.dispatcher.ExpertDispatcher` (the
other, for a group that spans nodes, is :class:`~moe.internode.NodeAwarePath`, which runs a
``FlatPath`` inside each node). Notation in :mod:`moe.dispatcher`'s docstring; the records and
all-to-all helpers are in :mod:`moe.records`.

What ``dispatch`` and ``combine`` do on this path, and their collective calls per step, are in
:mod:`moe.dispatcher`'s docstring.

Wire format of a dispatched row (``uint8``, every part starting at a multiple of 8 bytes):
``[k x int32 local expert id or -1 | k x weight (when dispatch got weights) | H x x.dtype]``.
Packing the slot ids (and weights) into the row keeps dispatch to one count exchange plus one
all-to-all, and lets ``combine`` run as a single all-to-all when dispatch was given the weights.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from collectives.agreement import agree, reject
from collectives.protocols import CommunicatorLike
from transports.base import dtype_code, dtype_name

from .records import (
    _FLOATS,
    DispatchHandle,
    DispatchLayout,
    DispatchTraffic,
    _acc_dtype,
    _all_to_all,
    _bag_sum,
    _round8,
    _tensor_id,
    _to_device,
    _to_host,
    node_of_ranks,
    token_bags,
)
from .router import shape_or_type

log = logging.getLogger("moe")


def check_inputs(x: Any, experts: Any, weights: Any, *, need_weights: bool) -> str | None:
    """The first problem with dispatch's arguments on this rank (a message without the rank), or None.

    Checks what the host knows (types, shapes, dtypes, devices), with no host sync; the values of
    ``experts`` are checked by :func:`range_error` on the layout's one device-to-host copy.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return f"x must be a 2-D tensor [num_tokens, hidden], got {shape_or_type(x)}"
    if x.dtype not in _FLOATS:
        return f"x must be float64/32/16 or bfloat16, got {x.dtype}"
    if not isinstance(experts, torch.Tensor) or experts.dim() != 2 or experts.shape[0] != x.shape[0]:
        return f"experts must be an int tensor [num_tokens={x.shape[0]}, top_k], got {shape_or_type(experts)}"
    if experts.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return f"experts must be an integer tensor, got {experts.dtype}"
    if experts.device != x.device:
        return f"experts is on {experts.device} but x is on {x.device}"
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or tuple(weights.shape) != tuple(experts.shape) \
                or weights.dtype not in _FLOATS or weights.device != x.device:
            return (f"weights must be a float tensor of the experts' shape {tuple(experts.shape)} on "
                    f"{x.device}, got " + (f"{tuple(weights.shape)} {weights.dtype} on {weights.device}"
                                           if isinstance(weights, torch.Tensor) else type(weights).__name__))
    elif need_weights:
        return ("capacity_factor is set, so dispatch needs weights=... (the router weights, [T, k]) "
                "to decide which pairs to drop")
    return None


def range_error(lo: int, hi: int, num_experts: int, shown: int | None = None) -> str | None:
    """The message for expert ids outside [-1, E), given their least and greatest value (host ints), or None.

    ``shown``: the E the caller's ids refer to, when they were mapped into a group with fewer experts
    (a masked call: :meth:`moe.elastic.MaskedGroup.map_experts` passes bad ids through unchanged)."""
    if lo < -1 or hi >= num_experts:
        return (f"expert indices must lie in [0, {num_experts if shown is None else shown}) (or -1 for an "
                f"unused slot), got values in [{lo}, {hi}]")
    return None


class _DispatchAllToAll(torch.autograd.Function):
    """Forward: send token rows to their experts' ranks and expand them into (token, expert) pairs.
    Backward: sum each received row's pair gradients, send them back (reverse all-to-all), sum per token."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, handle: DispatchHandle, comm: CommunicatorLike) -> torch.Tensor:
        lay = handle.layout
        k, hidden = lay.top_k, lay.hidden
        ids_b = 4 * k
        w_off = _round8(ids_b)
        w_b = 0 if lay.send_weights is None else k * lay.send_weights.element_size()
        meta_b = _round8(w_off + w_b)
        row_b = hidden * x.element_size()
        width = _round8(meta_b + row_b)
        s = lay.send_token_idx.numel()
        buf = torch.empty((s, width), dtype=torch.uint8, device=x.device)
        buf[:, :ids_b] = lay.send_slot_ids.view(torch.uint8)
        if w_b:
            buf[:, w_off: w_off + w_b] = lay.send_weights.view(torch.uint8)
        for a, b in ((ids_b, w_off), (w_off + w_b, meta_b), (meta_b + row_b, width)):
            if b > a:
                buf[:, a:b] = 0  # padding: keep the wire deterministic
        # Gather the token rows straight into the wire buffer (no temporary).
        torch.index_select(x.detach().contiguous().view(torch.uint8), 0, lay.send_token_idx,
                           out=buf[:, meta_b: meta_b + row_b])
        recv, recv_counts = _all_to_all(comm, buf, lay.send_counts, lay.recv_counts, return_counts=True)
        ids = recv[:, :ids_b].view(torch.int32)
        rows = recv[:, meta_b: meta_b + row_b].view(x.dtype)
        used = ids >= 0
        # pairs in (source, token, slot) order; the layout's counts give their number (no host sync)
        pairs = torch.nonzero_static(used, size=int(lay.tokens_per_expert.sum()))
        row, slot = pairs[:, 0], pairs[:, 1]
        order = torch.argsort(ids[row, slot], stable=True)       # group by local expert, keep that order
        handle.pair_row, handle.pair_slot = row[order], slot[order]
        # the inverse permutation: each received row's pairs (slot order) as rows of recv_x, for the per-row sums
        handle.bag_index = torch.empty_like(order)
        handle.bag_index[order] = torch.arange(order.numel(), device=order.device)
        per_row = used.sum(1)
        handle.bag_offsets = torch.cumsum(per_row, 0) - per_row
        if w_b:
            w_recv = recv[:, w_off: w_off + w_b].view(lay.send_weights.dtype)
            handle.pair_weight = w_recv[handle.pair_row, handle.pair_slot]
        handle.recv_counts = recv_counts
        ctx.handle, ctx.comm, ctx.num_tokens, ctx.dtype = handle, comm, x.shape[0], x.dtype
        return rows.index_select(0, handle.pair_row)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h, comm = ctx.handle, ctx.comm
        g_rows = _bag_sum(grad, h.bag_index, h.bag_offsets)                # pairs -> received rows
        back = _all_to_all(comm, g_rows, h.recv_counts, h.layout.send_counts)
        return _bag_sum(back, *h.layout.token_bags), None, None


class _CombineAllToAll(torch.autograd.Function):
    """Forward: weight and sum each received token's expert outputs on the expert rank, send one row
    per (token, rank) back, sum per token. Backward: send the output gradient to the expert ranks,
    form the expert-output and weight gradients there, send the weight gradients back."""

    @staticmethod
    def forward(ctx, expert_out: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle, comm: CommunicatorLike):
        lay = handle.layout
        w_dtype = weights.dtype
        if handle.pair_weight is not None:
            w_pair = handle.pair_weight          # travelled with the tokens (combine checked they match)
        else:
            # The expert rank needs the weights of the pairs it holds: one small exchange, same layout.
            ok = lay.send_slot_ids >= 0
            w_rows = torch.where(ok, weights.detach().index_select(0, lay.send_token_idx),
                                 torch.zeros((), dtype=w_dtype, device=weights.device))
            w_recv = _all_to_all(comm, w_rows, lay.send_counts, handle.recv_counts)
            w_pair = w_recv[handle.pair_row, handle.pair_slot]
        eo = expert_out.detach()
        # One weighted pass over expert_out per received row (embedding_bag, no [N, H] float32 temporaries:
        # the converted copy, the product and the index_add_ took 3/4 of combine on the CPU).
        partial = _bag_sum(eo, handle.bag_index, handle.bag_offsets,
                           weights=w_pair.index_select(0, handle.bag_index))
        back = _all_to_all(comm, partial, handle.recv_counts, lay.send_counts)
        ctx.save_for_backward(eo, w_pair)
        ctx.handle, ctx.comm, ctx.w_dtype = handle, comm, w_dtype
        return _bag_sum(back, *lay.token_bags)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        eo, w_pair = ctx.saved_tensors
        h, comm = ctx.handle, ctx.comm
        lay = h.layout
        acc = _acc_dtype(eo.dtype)
        g_send = grad_y.to(eo.dtype).index_select(0, lay.send_token_idx)
        g_recv = _all_to_all(comm, g_send, lay.send_counts, h.recv_counts)
        g_pair = g_recv.index_select(0, h.pair_row).to(acc)
        # Weight gradients are born on the expert rank; the k-wide grid mirrors the dispatched rows.
        gw_grid = torch.zeros((h.num_recv_rows, lay.top_k), dtype=ctx.w_dtype, device=eo.device)
        # (a * b).sum(-1): 2.4x faster than linalg.vecdot for [N, H] rows on the CPU (torch 2.13, one thread)
        gw_grid[h.pair_row, h.pair_slot] = (g_pair * eo.to(acc)).sum(-1).to(ctx.w_dtype)
        grad_eo = g_pair.mul_(w_pair.to(acc).unsqueeze(1)).to(eo.dtype)
        gw_back = _all_to_all(comm, gw_grid, h.recv_counts, lay.send_counts)
        grad_w = torch.zeros((lay.num_tokens, lay.top_k), dtype=ctx.w_dtype, device=eo.device)
        grad_w.index_add_(0, lay.send_token_idx, gw_back)
        return grad_eo, grad_w, None, None


class FlatPath:
    """The flat strategy over ``comm``: the count exchange, capacity dropping and one all-to-all each way.

    Construction is local (``ExpertDispatcher`` has checked and agreed on the arguments). The layout
    checks and agrees on dispatch's arguments in its count exchange; :meth:`dispatch` and
    :meth:`combine` take arguments their caller has checked.

    Args:
        comm: the group. num_experts: E, divisible by ``comm.size``.
        capacity_factor: None (dropless) or a positive float (see :class:`~moe.dispatcher.ExpertDispatcher`).
    """

    def __init__(self, comm: CommunicatorLike, num_experts: int, capacity_factor: float | None = None):
        self.comm = comm
        self.num_experts = num_experts
        self.num_local_experts = num_experts // comm.size
        self.capacity_factor = capacity_factor
        # the E that the caller's expert ids refer to, for messages: larger in a masked group (moe.elastic)
        self.shown_num_experts = num_experts
        # the node of each rank (None: one node): for the traffic counters, from the topology itself (node-aware
        # placement does not apply to nodes of unequal rank counts, which still have a node boundary)
        self.node_of = node_of_ranks(comm)

    def layout(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor | None, *,
               extra_counts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> DispatchLayout:
        """The one count exchange of a dispatch (collective), which also checks and agrees on its arguments,
        then capacity dropping: see :meth:`moe.dispatcher.ExpertDispatcher.get_dispatch_layout`.

        Host syncs: one device-to-host copy (:func:`~moe.records._to_host`) carries this rank's counts
        and the least and greatest expert id (the range check, read there); capacity dropping with an
        over-full expert adds one (the weights of the pairs routed to it, for the global ranking).

        Args:
            x, experts, weights: as ``get_dispatch_layout``.
            extra_counts: ``f(e, valid)`` -> [n] int64 on x's device, more counts for the caller
                (the node-aware path's rows per node) computed from e [T, k] int64 (the expert ids)
                and valid [T, k] bool (the slots sent, before capacity dropping); they ride in the
                same copy and come back as ``layout.extra_counts`` (host ints).
        """
        comm, E, L, P = self.comm, self.num_experts, self.num_local_experts, self.comm.size
        err = check_inputs(x, experts, weights, need_weights=self.capacity_factor is not None)
        ok_shapes = err is None
        T = x.shape[0] if ok_shapes else 0
        k = experts.shape[1] if ok_shapes else 0
        hidden = x.shape[1] if ok_shapes else 0
        requires_grad = bool(ok_shapes and torch.is_grad_enabled() and x.requires_grad)
        counts_local = torch.zeros(E, dtype=torch.int64)
        rows_local = torch.zeros(P, dtype=torch.int64)
        extra: list[int] | None = None
        if ok_shapes:
            dev = x.device
            e = experts.to(torch.int64)
            # ids out of range go nowhere (no out-of-bounds index on the device) until the agreement rejects them
            valid = (e >= 0) & (e < E)
            dest, to_rank = self._rows_to_ranks(e, valid)
            per_expert = torch.zeros(E + 1, dtype=torch.int64, device=dev)
            per_expert.index_add_(0, torch.where(valid, e, E).reshape(-1), torch.ones_like(e).reshape(-1))
            lo_hi = torch.stack((e.amin(), e.amax())) if e.numel() else e.new_full((2,), -1)
            parts = [lo_hi, per_expert[:E], to_rank[:, :P].sum(0)]
            if extra_counts is not None:
                parts.append(extra_counts(e, valid).to(torch.int64))
            host = _to_host(torch.cat(parts))                 # the layout's one device-to-host copy
            err = range_error(int(host[0]), int(host[1]), E, self.shown_num_experts)
            counts_local, rows_local = host[2:2 + E], host[2 + E:2 + E + P]
            extra = host[2 + E + P:].tolist()
        # each rank's rows per destination ride along: they are everyone's receive counts
        header = torch.cat([torch.tensor([T], dtype=torch.int64), counts_local, rows_local])
        gathered = agree(comm, "dispatch", {"hidden size (x.shape[1])": hidden, "top_k (experts.shape[1])": k,
                                            "x.dtype": dtype_code(x.dtype) if ok_shapes else 0,
                                            "x.requires_grad": int(requires_grad),
                                            "weights.dtype (0: no weights passed)":
                                                dtype_code(weights.dtype) if ok_shapes and weights is not None else 0},
                         error=err and ValueError(err), extra=header,
                         formats={"x.dtype": dtype_name, "weights.dtype (0: no weights passed)": dtype_name},
                         hint="Every rank must pass x [T, H] with the same H and dtype, experts [T, k] with the "
                              "same k, and x.requires_grad set alike, and pass weights= on all ranks or on "
                              "none (T may differ).")
        num_global_tokens = int(gathered[:, 0].sum())
        counts = gathered[:, 1:1 + E].clone()                  # [P, E] pairs per (source rank, expert)
        recv_counts = gathered[:, 1 + E:][:, comm.rank].tolist()  # rows from each rank (before dropping)
        send_counts = rows_local.tolist()
        global_tpe = counts.sum(0)
        dropped = torch.zeros((T, k), dtype=torch.bool, device=x.device)
        capacity = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * num_global_tokens * k / E)
            over = global_tpe > capacity
            if bool(over.any()):
                keep_local, counts, send_counts = self._capacity_keep(e, valid, dest, weights, counts, over,
                                                                      capacity, rows_local)
                dropped = valid & ~keep_local
                valid = valid & keep_local
                dest, to_rank = self._rows_to_ranks(e, valid)
                recv_counts = None  # rows changed after the exchange: dispatch's all_to_all learns them
        # (rank, token) order, sized by the counts already on the host (nonzero would sync to learn its size)
        rows = torch.nonzero_static(to_rank[:, :P].t(), size=sum(send_counts))
        rank_of_row, send_tok = rows[:, 0], rows[:, 1]
        slot_here = valid.index_select(0, send_tok) & (dest.index_select(0, send_tok) == rank_of_row.unsqueeze(1))
        # Fresh row-major storage: the rows are later viewed as bytes (an empty result may have 0 strides).
        slot_ids = torch.empty((send_tok.numel(), k), dtype=torch.int32, device=x.device)
        slot_ids.copy_(torch.where(slot_here, e.index_select(0, send_tok) - (rank_of_row * L).unsqueeze(1),
                                   torch.full((), -1, dtype=torch.int64, device=x.device)))
        send_w = w_copy = w_id = None
        if weights is not None:
            w = weights.detach()
            send_w = torch.empty((send_tok.numel(), k), dtype=w.dtype, device=x.device)
            send_w.copy_(torch.where(slot_here, w.index_select(0, send_tok), torch.zeros((), dtype=w.dtype,
                                                                                         device=x.device)))
            w_copy, w_id = w.clone(), _tensor_id(weights)
        r = comm.rank
        row_bytes = hidden * x.element_size() if ok_shapes else 0
        node_of = self.node_of or [0] * P
        mine = node_of[r]
        traffic = DispatchTraffic(
            internode_bytes=sum(c for d, c in enumerate(send_counts) if node_of[d] != mine) * row_bytes,
            intranode_bytes=sum(c for d, c in enumerate(send_counts) if node_of[d] == mine and d != r) * row_bytes,
            flat_internode_bytes=sum(c for d, c in enumerate(send_counts) if node_of[d] != mine) * row_bytes)
        return DispatchLayout(num_tokens=T, top_k=k, hidden=hidden, dtype=x.dtype, requires_grad=requires_grad,
                              send_token_idx=send_tok, send_slot_ids=slot_ids, send_counts=send_counts,
                              send_weights=send_w, weights=w_copy, weights_id=w_id,
                              dropped=dropped, counts=counts, global_tokens_per_expert=global_tpe,
                              num_global_tokens=num_global_tokens, capacity=capacity,
                              tokens_per_expert=counts[:, r * L:(r + 1) * L].sum(0), recv_counts=recv_counts,
                              traffic=traffic, token_bags=token_bags(send_tok, T), extra_counts=extra)

    def _rows_to_ranks(self, e: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per (token, destination rank); the token's slots for that rank ride in the row.

        Args:
            e: [T, k] int64 global expert ids; valid: [T, k] bool, the slots that are sent.
        Returns:
            ``(dest, to_rank)``: dest [T, k] int64, each slot's rank (P for a slot not sent);
            to_rank [T, P + 1] bool, whether the token goes to each rank (column P: nowhere).
        """
        P, L = self.comm.size, self.num_local_experts
        dest = torch.where(valid, torch.div(e, L, rounding_mode="floor"), torch.full_like(e, P))
        to_rank = torch.zeros((e.shape[0], P + 1), dtype=torch.bool, device=e.device)
        to_rank.scatter_(1, dest, True)
        return dest, to_rank

    def _capacity_keep(self, e: torch.Tensor, valid: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor,
                       counts: torch.Tensor, over: torch.Tensor, capacity: int,
                       rows_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Global lowest-weight dropping for the over-capacity experts (collective: one all_gather).

        Every rank all-gathers the weights of its pairs routed to over-capacity experts (ordered by
        expert, then token, then slot; padded to the longest), then ranks all of them identically:
        by expert, weight descending, then (rank, token, slot).

        Args:
            e: [T, k] int64 expert ids; valid: [T, k] bool, the slots sent before dropping; dest:
                [T, k] int64, each slot's rank (P: none); weights: [T, k] float. counts: [P, E]
                int64 (CPU), the agreed pairs per (source rank, expert); over: [E] bool (CPU), the
                experts over ``capacity``; rows_local: [P] int64 (CPU), this rank's rows per
                destination before dropping.

        Returns:
            this rank's keep mask [T, k] bool (device), the kept counts [P, E] (CPU, identical on
            every rank) and this rank's rows per destination after dropping (host ints).

        One device-to-host copy (:func:`~moe.records._to_host`) brings the weights of this rank's
        pairs to over-full experts and what the row counts after dropping need; the keep mask goes
        back without a host sync.
        """
        comm, P, E, L = self.comm, self.comm.size, self.num_experts, self.num_local_experts
        T, k = e.shape
        dev = e.device
        flat_e = e.reshape(-1)
        over_e = over.nonzero(as_tuple=True)[0]                       # CPU, ascending
        per_rank = counts[:, over_e]                                  # [P, n_over]
        n = per_rank.sum(1)                                           # pairs each rank contributes
        n_mine = int(n[comm.rank])
        to_over = valid & _to_device(over, dev)[e.clamp(0, E - 1)]
        idx = torch.nonzero_static(to_over.reshape(-1), size=n_mine).reshape(-1)   # (token, slot) order
        idx = idx[torch.argsort(flat_e[idx], stable=True)]            # -> (expert, token, slot)
        w_mine = weights.detach().reshape(-1)[idx].to(torch.float64)
        tok, to_rank = idx // k, flat_e[idx] // L
        # a row (token, rank) survives when one of its slots there is kept: count the slots that cannot be dropped
        safe = torch.zeros((T, P + 1), dtype=torch.int64, device=dev)
        safe.scatter_add_(1, torch.where(to_over, P, dest), torch.ones_like(dest))
        host = _to_host(torch.cat((w_mine.view(torch.int64), tok, to_rank, safe[tok, to_rank])))
        w_host = host[:n_mine].view(torch.float64)
        tok_h, rank_h, safe_h = host[n_mine:2 * n_mine], host[2 * n_mine:3 * n_mine], host[3 * n_mine:]
        width = int(n.max())
        padded = torch.zeros(width, dtype=torch.float64)
        padded[:n_mine] = w_host
        all_w = comm.all_gather(padded.reshape(1, -1)) if P > 1 else padded.reshape(1, -1)
        valid_e = torch.arange(width).unsqueeze(0) < n.unsqueeze(1)   # [P, width]
        w_flat = all_w[valid_e]                                       # (rank, expert, token, slot) order
        exp_flat = torch.repeat_interleave(over_e.repeat(P), per_rank.reshape(-1))
        rank_flat = torch.repeat_interleave(torch.arange(P), n)
        # Stable sorts, last key first: weight descending, then expert ascending.
        o = torch.argsort(-w_flat, stable=True)
        o = o[torch.argsort(exp_flat[o], stable=True)]
        e_sorted = exp_flat[o]
        seg_start = torch.searchsorted(e_sorted, e_sorted, side="left")
        keep_sorted = (torch.arange(o.numel()) - seg_start) < capacity
        keep_flat = torch.empty_like(keep_sorted)
        keep_flat[o] = keep_sorted
        kept = counts.clone()
        kept[:, over_e] = 0
        kept.view(-1).index_add_(0, rank_flat * E + exp_flat, keep_flat.to(torch.int64))
        start = int(n[: comm.rank].sum())
        keep_mine = keep_flat[start: start + n_mine]
        # rows per destination after dropping: a (token, rank) row goes when all its slots there were dropped
        key = tok_h * P + rank_h
        kept_slots = torch.zeros(T * P, dtype=torch.int64).index_add_(0, key, keep_mine.to(torch.int64))
        gone = torch.unique(key[(safe_h == 0) & (kept_slots[key] == 0)])
        send_counts = (rows_local - torch.bincount(gone % P, minlength=P)).tolist()
        keep = torch.ones(flat_e.numel(), dtype=torch.bool, device=dev)
        keep[idx] = _to_device(keep_mine, dev)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: capacity %d per expert, %d experts over it, %d of this rank's pairs dropped",
                      comm.global_ranks[comm.rank], capacity, over_e.numel(), n_mine - int(keep_mine.sum()))
        return keep.view_as(e), kept, send_counts

    def dispatch(self, x: torch.Tensor, layout: DispatchLayout) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """One all-to-all of the rows (collective, differentiable in x). Returns as ``ExpertDispatcher.dispatch``."""
        handle = DispatchHandle(layout)
        recv_x = _DispatchAllToAll.apply(x, handle, self.comm)
        return recv_x, layout.tokens_per_expert, handle

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor) -> torch.Tensor:
        """One all-to-all back (+1 for the weights when dispatch did not get them); collective."""
        return _CombineAllToAll.apply(expert_out, weights, handle, self.comm)

    def reject(self, error: Exception, *, step: str, on: Any = None) -> NoReturn:
        """Raise ``error`` here, before ``step``, and make the peers' next collective on ``comm`` raise."""
        reject(self.comm, error, on=on)

    def close(self) -> None:
        """Nothing to close (the flat path makes no sub-groups)."""
