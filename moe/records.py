"""The records of a dispatch (layout, handle, traffic counters) and the helpers shared by the flat path
(:mod:`moe.flat`), the node-aware one (:mod:`moe.internode`) and :class:`~moe.dispatcher.ExpertDispatcher`
in front of them: all-to-all, row sums, dtypes, the node of each rank.

Notation in :mod:`moe.dispatcher`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from collectives.protocols import CommunicatorLike


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate 16-bit sums in float32 (and float64 in float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # the dtypes of tokens, expert outputs, weights


@dataclass
class DispatchTraffic:
    """Token bytes this rank sends in one dispatch, by where they go (combine sends the same rows back,
    in expert_out's dtype). Bytes = rows x H x x.element_size(): the token payload only (the k slot
    ids and weights riding along are not counted). Nodes as in ``comm.topology.nodes`` (one node
    when the communicator has no topology).

    Attributes:
        internode_bytes: sent to ranks on other nodes by the path this layout takes.
        intranode_bytes: sent to other ranks of this node by that path (the node-aware path's
            forwarding included; rows to this rank itself are not counted).
        flat_internode_bytes: what the flat path (one row per (token, destination rank)) sends
            to other nodes for the same routing: equal to ``internode_bytes`` on the flat path.
    """

    internode_bytes: int
    intranode_bytes: int
    flat_internode_bytes: int


@dataclass
class DispatchLayout:
    """Who sends which token where: the result of the one count exchange (:meth:`ExpertDispatcher.get_dispatch_layout`).

    Attributes (notation in the module docstring):
        num_tokens, top_k, hidden, dtype, requires_grad: T, k, H, x.dtype and whether x
            required grad, for the x this layout was made for.
        send_token_idx: [S] int64, the token of each sent row (rows by destination rank, then token).
        send_slot_ids: [S, k] int32, for each sent row the destination-local expert (0..L-1) of
            each of the token's k slots, or -1 where that slot goes elsewhere or nowhere.
        send_counts: [P] Python ints, rows sent to each rank.
        send_weights: [S, k] the weights' dtype, the router weights travelling with the rows (0 for
            other ranks' slots); None when dispatch got no weights.
        weights, weights_id: a copy of those weights [T, k] and the identity of the tensor given
            (combine checks it gets the same values); None without weights.
        dropped: [T, k] bool, the pairs removed by the capacity limit.
        counts: [P, E] int64 (CPU), kept pairs per (source rank, expert); the same on every rank.
        global_tokens_per_expert: [E] int64 (CPU), pairs per expert over all ranks, before dropping.
        num_global_tokens: T_global. capacity: C, or None (dropless).
        tokens_per_expert: [L] int64 (CPU), the pairs this rank receives per local expert (sums to N).
        recv_counts: [P] Python ints, rows this rank receives from each rank in dispatch; None when
            capacity dropping changed the rows after the count exchange (dispatch then gets them
            from the all_to_all).
        traffic: a :class:`DispatchTraffic`, token bytes this rank sends within and across nodes.
    """

    num_tokens: int
    top_k: int
    hidden: int
    dtype: torch.dtype
    requires_grad: bool
    send_token_idx: torch.Tensor
    send_slot_ids: torch.Tensor
    send_counts: list[int]
    send_weights: torch.Tensor | None
    weights: torch.Tensor | None
    weights_id: tuple | None
    dropped: torch.Tensor
    counts: torch.Tensor
    global_tokens_per_expert: torch.Tensor
    num_global_tokens: int
    capacity: int | None
    tokens_per_expert: torch.Tensor
    recv_counts: list[int] | None = None
    traffic: DispatchTraffic | None = None


@dataclass
class DispatchHandle:
    """Everything ``combine`` and the backward passes need, cached by ``dispatch``.

    Attributes (notation in the module docstring):
        layout: the :class:`DispatchLayout` of the dispatch.
        recv_counts: [P] Python ints, rows received from each rank (they sum to R).
        pair_row: [N] int64, for each row of ``recv_x`` the received row (0..R-1) it copies.
        pair_slot: [N] int64, the source token's slot (0..k-1) of each pair.
        pair_weight: [N] the weights' dtype, the router weight of each pair; None when dispatch
            got no weights.
    Properties: ``dropped`` ([T, k] bool, ``layout.dropped``), ``tokens_per_expert`` ([L] int64),
    ``num_recv_rows`` (R) and ``num_recv_pairs`` (N).
    """

    layout: DispatchLayout
    recv_counts: list[int] = field(default_factory=list)
    pair_row: torch.Tensor | None = None
    pair_slot: torch.Tensor | None = None
    pair_weight: torch.Tensor | None = None

    @property
    def dropped(self) -> torch.Tensor:
        return self.layout.dropped

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.layout.tokens_per_expert

    @property
    def num_recv_rows(self) -> int:
        return int(sum(self.recv_counts))

    @property
    def num_recv_pairs(self) -> int:
        return 0 if self.pair_row is None else int(self.pair_row.numel())


def _all_to_all(comm: CommunicatorLike, x: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None,
                *, return_counts: bool = False):
    """comm.all_to_all of x's rows; ``recv_counts``: the rows from each rank when known (checked by the
    communicator against what the peers send), else None: exchanged there."""
    if comm.size == 1:  # nothing crosses a process boundary; skip the copy
        return (x, [x.shape[0]]) if return_counts else x
    if recv_counts is not None:
        out = comm.all_to_all(x, send_counts, recv_counts=recv_counts)
        return (out, list(recv_counts)) if return_counts else out
    if return_counts:
        out, rc = comm.all_to_all(x, send_counts, return_counts=True)
        return out, [int(c) for c in rc.tolist()]
    return comm.all_to_all(x, send_counts)


def _sum_rows(src: torch.Tensor, index: torch.Tensor, num_rows: int, *,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[i] = sum of src rows j with index[j] == i: [num_rows, H] in out_dtype (default src.dtype).

    Accumulates in float32 for 16-bit inputs (float64 for float64).
    """
    acc = _acc_dtype(src.dtype)
    out = torch.zeros((num_rows, src.shape[1]), dtype=acc, device=src.device)
    out.index_add_(0, index, src if src.dtype == acc else src.to(acc))
    want = src.dtype if out_dtype is None else out_dtype
    return out if want == acc else out.to(want)


def _tensor_id(t: torch.Tensor) -> tuple:
    """Same storage, view and version => same values (detach() and views of one tensor share the version)."""
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t._version)


def node_of_ranks(comm: CommunicatorLike) -> list[int] | None:
    """The node (index in ``comm.topology.nodes``) of each rank of ``comm`` when it spans several nodes, of any
    sizes, else None (one node, or no topology). For the traffic counters, which need the real node boundary
    also where the node-aware path does not apply (nodes with unequal rank counts)."""
    nodes = getattr(getattr(comm, "topology", None), "nodes", None)
    if not nodes or len(nodes) < 2:
        return None
    node_of = [0] * comm.size
    for g, ranks in enumerate(nodes):
        for r in ranks:
            node_of[r] = g
    return node_of
