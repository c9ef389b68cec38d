"""Node-aware dispatch/combine for an expert-parallel group that spans nodes (DeepEP's internode design).

:class:`NodeAwarePath` is the strategy :class:`~moe.dispatcher.ExpertDispatcher` takes for such a group,
the sibling of the flat :class:`~moe.flat.FlatPath`, which it runs for two of its steps: the count
exchange over the whole group, and the forwarding inside each node.

Notation as in :mod:`moe.dispatcher`, plus: G nodes of Q ranks each (equal on every node); rank r
sits on node ``node_of[r]`` at local index ``local_of[r]``. Two sub-groups per rank:

* the rail group: the ranks with this rank's local index, one per node (``comm.split(color=local)``),
  its rank = the node's index; it is the only group whose traffic crosses nodes;
* the node group: the ranks of this rank's node (``comm.split(color=node)``), its rank = the local
  index; its traffic stays inside the node (shm on one host, NVLink on GPUs).

Dispatch: (1) over the rail group, each token goes once to every node that holds at least one of
its kept experts, to the rank there with the sender's local index (the forwarder), together with
the node-local expert ids of its slots on that node (``local_of[owner] * L + e % L``; -1 for slots
elsewhere) and their weights; (2) over the node group, the forwarder passes each row on with the
flat path (:class:`~moe.flat.FlatPath`, num_experts = Q * L), which again sends a row once per rank
that holds its experts. A token thus crosses the network at most once per destination
node, however many of its k experts live there.

Combine mirrors it: the node group's combine sums the weighted expert outputs of the node's experts
per forwarded row on the forwarder, the rail group carries one row per (token, node) back, and the
source sums the rows of its nodes. The sums run in another order than the flat path's (per node,
then over nodes): results agree with it within float rounding, not bit for bit.

Received rows (``recv_x``) are grouped by local expert like the flat path's, but within an expert
ordered by forwarder, then source node and token (the flat path: source rank, token), so the same
pairs arrive in another order; the expert function sees the same rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from collectives.agreement import agree
from collectives.protocols import CommunicatorLike, check_communicator

from .flat import FlatPath
from .records import (
    DispatchHandle,
    DispatchLayout,
    DispatchTraffic,
    _all_to_all,
    _bag_sum,
    _round8,
    _to_host,
    node_of_ranks,  # noqa: F401 - re-exported: moe.internode.node_of_ranks, where it was
    token_bags,
)

log = logging.getLogger("moe")


def node_placement(comm: CommunicatorLike) -> tuple[list[int], list[int]] | None:
    """``(node_of, local_of)`` per rank of ``comm`` when it spans several nodes with equal ranks per node, else None.

    Depends only on ``comm.topology.nodes``, which every rank holds alike, so every rank decides the same.
    A communicator without a topology (a wrapper that does not forward it) counts as one node.
    """
    nodes = getattr(getattr(comm, "topology", None), "nodes", None)
    if not nodes or len(nodes) < 2 or len({len(n) for n in nodes}) != 1 or not hasattr(comm, "split"):
        return None
    node_of, local_of = [0] * comm.size, [0] * comm.size
    for g, ranks in enumerate(nodes):
        for i, r in enumerate(ranks):
            node_of[r], local_of[r] = g, i
    return node_of, local_of


def node_rows(owner: torch.Tensor, node_of: torch.Tensor, num_nodes: int, num_rows: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rail rows of a dispatch: one per (token, destination node) with at least one kept slot there.

    Args:
        owner: [T, k] int64, the rank owning each slot's expert, P (= ``node_of.numel() - 1``) for a
            slot not sent (unused or dropped).
        node_of: [P + 1] int64, the node of each rank; entry P is ``num_nodes`` (nowhere).
        num_nodes: G.
        num_rows: S1 when the caller knows it (then no host sync), else None (one, on a GPU).
    Returns:
        ``(row_node, row_token, row_slots)``: row_node [S1] int64 and row_token [S1] int64, the
        destination node and token of each row, ordered by node, then token; row_slots [S1, k]
        bool, the token's slots that go to that node.
    """
    dest = node_of[owner]                                              # [T, k], G for unsent slots
    to_node = torch.zeros((owner.shape[0], num_nodes + 1), dtype=torch.bool, device=owner.device)
    to_node.scatter_(1, dest, True)
    to_node = to_node[:, :num_nodes].t()
    if num_rows is None:
        row_node, row_token = to_node.nonzero(as_tuple=True)
    else:
        rows = torch.nonzero_static(to_node, size=num_rows)
        row_node, row_token = rows[:, 0], rows[:, 1]
    row_slots = dest.index_select(0, row_token) == row_node.unsqueeze(1)
    return row_node, row_token, row_slots


@dataclass
class NodeAwareLayout:
    """A dispatch's layout on the node-aware path (:meth:`ExpertDispatcher.get_dispatch_layout` returns it).

    Attributes (notation in :mod:`moe.internode`):
        flat: the flat :class:`~moe.records.DispatchLayout` of the same call: the agreed counts,
            capacity dropping and checks (its own rows are not sent).
        send_token_idx: [S1] int64, the token of each rail row (by destination node, then token).
        send_slots: [S1, k] bool, the slots of each rail row that go to its node.
        send_counts, recv_counts: [G] Python ints, rail rows sent to / received from each node.
        recv_ids: [R1, k] int32, the node-local expert id (0..Q*L-1) of each slot of each received
            rail row, -1 for slots elsewhere. recv_weights: [R1, k] their weights, or None.
        inner: the node group's :class:`~moe.records.DispatchLayout` for the R1 received rows.
        traffic: :class:`~moe.records.DispatchTraffic`, token bytes this rank sends.
        token_bags: the rail rows of each token (:func:`~moe.records.token_bags`), for the per-token sums.
        masked_ranks: as :class:`~moe.records.DispatchLayout`'s (empty when none).
    The flat layout's attributes (``num_tokens``, ``top_k``, ``hidden``, ``dtype``, ``requires_grad``,
    ``dropped``, ``counts``, ``global_tokens_per_expert``, ``num_global_tokens``, ``capacity``,
    ``weights``, ``weights_id``) read through; ``tokens_per_expert`` is the inner layout's (the same
    counts: [L] int64).
    """

    flat: DispatchLayout
    send_token_idx: torch.Tensor
    send_slots: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    recv_ids: torch.Tensor
    recv_weights: torch.Tensor | None
    inner: DispatchLayout
    traffic: DispatchTraffic
    token_bags: tuple[torch.Tensor, torch.Tensor]
    masked_ranks: tuple[int, ...] = ()

    def __getattr__(self, name: str) -> Any:
        if name in ("num_tokens", "top_k", "hidden", "dtype", "requires_grad", "dropped", "counts",
                    "global_tokens_per_expert", "num_global_tokens", "capacity", "weights", "weights_id"):
            return getattr(self.flat, name)
        raise AttributeError(name)

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.inner.tokens_per_expert


@dataclass
class NodeAwareHandle:
    """What combine and the backward passes need: the layout and the node group's handle.

    Properties as :class:`~moe.records.DispatchHandle`: ``dropped`` [T, k] bool,
    ``tokens_per_expert`` [L] int64, ``num_recv_rows`` (rows received over the node group) and
    ``num_recv_pairs`` (N, the rows of recv_x); ``masked_ranks`` as :class:`~moe.records.DispatchHandle`'s.
    """

    layout: NodeAwareLayout
    inner: DispatchHandle
    masked_ranks: tuple[int, ...] = ()

    @property
    def dropped(self) -> torch.Tensor:
        return self.layout.dropped

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.inner.tokens_per_expert

    @property
    def num_recv_rows(self) -> int:
        return self.inner.num_recv_rows

    @property
    def num_recv_pairs(self) -> int:
        return self.inner.num_recv_pairs


class _RailRows(torch.autograd.Function):
    """Forward: each token's row to its destination nodes over the rail group. Backward: the row
    gradients back, summed per token."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lay: NodeAwareLayout, rail: CommunicatorLike) -> torch.Tensor:
        rows = x.detach().index_select(0, lay.send_token_idx)
        ctx.lay, ctx.rail = lay, rail
        return _all_to_all(rail, rows, lay.send_counts, lay.recv_counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lay = ctx.lay
        back = _all_to_all(ctx.rail, grad.contiguous(), lay.recv_counts, lay.send_counts)
        return _bag_sum(back, *lay.token_bags), None, None


class _RailReturn(torch.autograd.Function):
    """Forward: each forwarder's per-row sums back to the source over the rail group, summed per token.
    Backward: the output gradient to the forwarders."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, lay: NodeAwareLayout, rail: CommunicatorLike) -> torch.Tensor:
        back = _all_to_all(rail, partial.detach().contiguous(), lay.recv_counts, lay.send_counts)
        ctx.lay, ctx.rail = lay, rail
        return _bag_sum(back, *lay.token_bags)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        lay = ctx.lay
        g = grad_y.index_select(0, lay.send_token_idx)
        return _all_to_all(ctx.rail, g, lay.send_counts, lay.recv_counts), None, None


class _RailWeights(torch.autograd.Function):
    """Forward: the router weights of the forwarded rows on the forwarders ([R1, k]; already there
    when dispatch got them). Backward: their gradients back over the rail group, summed per token."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor, lay: NodeAwareLayout, rail: CommunicatorLike) -> torch.Tensor:
        ctx.lay, ctx.rail = lay, rail
        if lay.recv_weights is not None:
            return lay.recv_weights.clone()
        w = weights.detach().index_select(0, lay.send_token_idx)
        w = torch.where(lay.send_slots, w, torch.zeros((), dtype=w.dtype, device=w.device))
        return _all_to_all(rail, w, lay.send_counts, lay.recv_counts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        lay = ctx.lay
        back = _all_to_all(ctx.rail, grad.contiguous(), lay.recv_counts, lay.send_counts)
        back = torch.where(lay.send_slots, back, torch.zeros((), dtype=back.dtype, device=back.device))
        out = torch.zeros((lay.num_tokens, lay.top_k), dtype=grad.dtype, device=grad.device)
        out.index_add_(0, lay.send_token_idx, back)
        return out, None, None


class NodeAwarePath:
    """The node-aware strategy of one :class:`~moe.dispatcher.ExpertDispatcher`: its rail and node groups and steps.

    Construction is collective over ``comm`` (two splits, and the node group's agreement on its flat path).

    Args:
        flat: the flat path over the whole expert-parallel group (``flat.comm``): the count exchange,
            checks and capacity dropping of each layout. placement: ``(node_of, local_of)`` from
            :func:`node_placement`.
    """

    def __init__(self, flat: FlatPath, placement: tuple[list[int], list[int]]):
        comm, num_local_experts = flat.comm, flat.num_local_experts
        node_of, local_of = placement
        self.flat = flat
        self.comm, self.L = comm, num_local_experts
        self.node, self.local = node_of[comm.rank], local_of[comm.rank]
        self.num_nodes = max(node_of) + 1
        self.ranks_per_node = comm.size // self.num_nodes
        self.node_of = torch.tensor(node_of + [self.num_nodes], dtype=torch.int64)
        self.local_of = torch.tensor(local_of + [0], dtype=torch.int64)
        self._placement_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rail = comm.split(self.local, key=self.node)
        self.node_group = comm.split(self.node, key=self.local)
        # the node group's flat path; its members agree on it as on a flat dispatcher's construction (one
        # all_gather over the node group; the values follow from agreed ones, so a mismatch means a bad split)
        inner_experts = self.ranks_per_node * num_local_experts
        check_communicator(self.node_group, "ExpertDispatcher")
        agree(self.node_group, "ExpertDispatcher", {"num_experts": inner_experts, "capacity_factor": None,
                                                    "node_aware (-1: auto)": 0},
              hint="Construct the dispatcher with the same num_experts, capacity_factor and node_aware on every rank.")
        self.inner = FlatPath(self.node_group, inner_experts)

    # The collective stages of each step, in order: a rank that stops in one stage must tell the
    # groups of the later stages, whose peers would otherwise wait there for it (a rejection is a
    # participation in the peers' next collective of that group, so it is sent only where they come).
    STAGES = {"layout": ("rail", "node"), "dispatch": ("rail", "node"),
              "combine": ("node", "rail"), "combine_weights": ("rail", "node", "rail")}

    def _groups_after(self, step: str, stage: int) -> list[Any]:
        """The groups of ``step``'s stages after ``stage`` (-1: all), without the failed stage's group, once each."""
        names = self.STAGES[step]
        failed = names[stage] if stage >= 0 else None
        seen: list[str] = []
        for name in names[stage + 1:]:
            if name != failed and name not in seen:
                seen.append(name)
        return [self.rail if n == "rail" else self.node_group for n in seen]

    def reject(self, error: Exception, *, step: str, on: Any = None) -> NoReturn:
        """Raise ``error`` here, before ``step`` (a key of STAGES), and make the peers raise in each group they meet next.

        A peer that learns it there tells the groups of its own later stages (:meth:`relay`), so every
        rank raises instead of waiting for the timeout.
        """
        device = on.device.type if isinstance(on, torch.Tensor) else "cpu"
        for group in self._groups_after(step, -1):
            try:
                group.reject(error, device=device)
            except Exception:  # noqa: BLE001 - reject raises `error` by design; tell the next group too
                pass
        error._moecomm_rejected = True  # an enclosing `rejecting` must not tell the peers again
        raise error

    def relay(self, step: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` for ``step``; ``fn`` sets ``self.stage`` as it enters each stage. An error there
        (a peer's rejection, a timeout) is passed on to the groups of the later stages, then raised."""
        self.stage = 0
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised below
            me = self.comm.global_ranks[self.comm.rank]
            relayed = ValueError(f"node-aware {step} on rank {me} stopped: {type(e).__name__}: {e}")
            for group in self._groups_after(step, self.stage):
                try:
                    group.reject(relayed, device="cpu")
                except Exception:  # noqa: BLE001 - reject raises by design
                    pass
            raise

    def close(self) -> None:
        for c in (self.rail, self.node_group):
            if hasattr(c, "close"):
                c.close()

    def layout(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor | None) -> NodeAwareLayout:
        """The flat path's count exchange over the whole group (checks, agreement, capacity dropping), then the
        rail rows' metadata exchange and the node group's layout (collective; see the module docstring).

        Args: as :meth:`moe.dispatcher.ExpertDispatcher.get_dispatch_layout`.
        Returns:
            A :class:`NodeAwareLayout`.
        """
        flat = self.flat.layout(x, experts, weights, extra_counts=self._rows_per_node)
        return self.relay("layout", self._layout, flat, experts, weights)

    def _placement(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(node_of, local_of)`` on ``device``, copied there once."""
        if device not in self._placement_on:
            self._placement_on[device] = (self.node_of.to(device), self.local_of.to(device))
        return self._placement_on[device]

    def _owners(self, e: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[T, k] int64: the rank of each sent slot's expert, P for a slot not sent."""
        return torch.where(valid, torch.div(e, self.L, rounding_mode="floor"), torch.full_like(e, self.comm.size))

    def _rows_per_node(self, e: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[G] int64 on e's device: rail rows to each node (one per token with a slot there); they ride in
        the flat layout's one host copy."""
        dest = self._placement(e.device)[0][self._owners(e, valid)]
        to_node = torch.zeros((e.shape[0], self.num_nodes + 1), dtype=torch.bool, device=e.device)
        to_node.scatter_(1, dest, True)
        return to_node[:, :self.num_nodes].sum(0)

    def _layout(self, flat: DispatchLayout, experts: torch.Tensor, weights: torch.Tensor | None) -> NodeAwareLayout:
        """Args: flat, the flat layout of this call (checked, agreed, capacity applied); experts: [T, k] int
        global expert ids; weights: [T, k] float or None."""
        L, k, dev = self.L, flat.top_k, flat.dropped.device
        e = experts.to(torch.int64)
        valid = (e >= 0) & ~flat.dropped
        node_of, local_of = self._placement(dev)
        owner = self._owners(e, valid)
        if flat.recv_counts is not None:   # no pair dropped after the count exchange: its counts still hold
            send_counts = flat.extra_counts
        else:                              # capacity dropping changed the rows: one more host copy
            send_counts = _to_host(self._rows_per_node(e, valid)).tolist()
        _, row_tok, row_slots = node_rows(owner, node_of, self.num_nodes, sum(send_counts))
        node_local_id = local_of[owner] * L + torch.remainder(e, L)
        ids = torch.where(row_slots, node_local_id.index_select(0, row_tok), torch.full((), -1, device=dev))
        # one exchange: ids (int32) and weights ride in one uint8 row, each part 8-byte aligned
        ids_b = _round8(4 * k)
        w_b = 0 if weights is None else _round8(k * weights.element_size())
        buf = torch.zeros((row_tok.numel(), ids_b + w_b), dtype=torch.uint8, device=dev)
        # fresh row-major storage before the byte view (an empty result may have 0 strides)
        buf[:, :4 * k] = torch.empty(ids.shape, dtype=torch.int32, device=dev).copy_(ids).view(torch.uint8)
        if weights is not None:
            w = weights.detach().index_select(0, row_tok)
            w = torch.empty(w.shape, dtype=w.dtype, device=dev).copy_(
                torch.where(row_slots, w, torch.zeros((), dtype=w.dtype, device=dev)))
            buf[:, ids_b: ids_b + k * weights.element_size()] = w.view(torch.uint8)
        self.stage = 0
        recv, recv_counts = _all_to_all(self.rail, buf, send_counts, None, return_counts=True)
        self.stage = 1
        recv_ids = recv[:, :4 * k].contiguous().view(torch.int32)
        recv_w = None
        if weights is not None:
            recv_w = recv[:, ids_b: ids_b + k * weights.element_size()].contiguous().view(weights.dtype)
        # only shape, dtype and requires_grad of x matter to the layout: a stride-0 stand-in for the rows
        stand_in = torch.empty((1, 1), dtype=flat.dtype, device=dev).expand(recv_ids.shape[0], flat.hidden)
        with torch.set_grad_enabled(flat.requires_grad):
            inner = self.inner.layout(stand_in.requires_grad_(flat.requires_grad), recv_ids, recv_w)
        row_bytes = flat.hidden * flat.dtype.itemsize
        traffic = DispatchTraffic(
            internode_bytes=sum(c for g, c in enumerate(send_counts) if g != self.node) * row_bytes,
            intranode_bytes=sum(c for j, c in enumerate(inner.send_counts) if j != self.local) * row_bytes,
            flat_internode_bytes=flat.traffic.flat_internode_bytes)
        return NodeAwareLayout(flat=flat, send_token_idx=row_tok, send_slots=row_slots, send_counts=send_counts,
                               recv_counts=recv_counts, recv_ids=recv_ids, recv_weights=recv_w, inner=inner,
                               traffic=traffic, token_bags=token_bags(row_tok, flat.num_tokens))

    def dispatch(self, x: torch.Tensor, lay: NodeAwareLayout) -> tuple[torch.Tensor, torch.Tensor, NodeAwareHandle]:
        """Rail rows, then the node group's dispatch (collective, differentiable in x). Returns as ``dispatch``."""
        return self.relay("dispatch", self._dispatch, x, lay)

    def _dispatch(self, x: torch.Tensor, lay: NodeAwareLayout) -> tuple[torch.Tensor, torch.Tensor, NodeAwareHandle]:
        x1 = _RailRows.apply(x, lay, self.rail)
        self.stage = 1
        recv_x, tokens_per_expert, inner = self.inner.dispatch(x1, lay.inner)
        return recv_x, tokens_per_expert, NodeAwareHandle(lay, inner)

    def combine(self, expert_out: torch.Tensor, handle: NodeAwareHandle, weights: torch.Tensor) -> torch.Tensor:
        """Node group's combine on the forwarders, then one row per (token, node) back (collective)."""
        step = "combine" if handle.layout.recv_weights is not None else "combine_weights"
        return self.relay(step, self._combine, expert_out, handle, weights)

    def _combine(self, expert_out: torch.Tensor, handle: NodeAwareHandle, weights: torch.Tensor) -> torch.Tensor:
        lay = handle.layout
        travelled = lay.recv_weights is not None
        w1 = _RailWeights.apply(weights, lay, self.rail)     # a rail stage only when the weights did not travel
        self.stage = 0 if travelled else 1
        partial = self.inner.combine(expert_out, handle.inner, w1)
        self.stage += 1
        return _RailReturn.apply(partial, lay, self.rail)
