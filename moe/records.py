"""The records of a dispatch (layout, handle, traffic counters) and the helpers shared by the flat path
(:mod:`moe.flat`), the node-aware one (:mod:`moe.internode`) and :class:`~moe.dispatcher.ExpertDispatcher`
in front of them: all-to-all, row sums (bags), host copies, dtypes, the node of each rank.

Notation in :mod:`moe.dispatcher`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

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
        token_bags: ``(index, offsets)`` from :func:`token_bags`: the sent rows of each token, for
            the per-token sums of combine and of dispatch's backward.
        extra_counts: host ints a caller of the flat path's layout had copied along with the
            counts (see :meth:`moe.flat.FlatPath.layout`), else [].
        masked_ranks: the ranks of the dispatcher's ``comm`` masked in the call that made this layout,
            ascending (empty when none): the layout is then the masked group's (:mod:`moe.elastic`),
            in its numbering (P = the unmasked ranks, E = their experts).
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
    token_bags: tuple[torch.Tensor, torch.Tensor] | None = None
    extra_counts: list[int] | None = None
    masked_ranks: tuple[int, ...] = ()


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
        bag_index, bag_offsets: [N] and [R] int64, each received row's pairs as rows of ``recv_x``
            (in slot order) and where each row's run starts in ``bag_index``: the bags of
            :func:`_bag_sum` for combine's per-row sums and dispatch's backward.
        masked_ranks: the ranks of the dispatcher's ``comm`` masked in the dispatch, ascending (empty
            when none); ``combine`` and the backward passes run over the same masked group.
    Properties: ``dropped`` ([T, k] bool, ``layout.dropped``), ``tokens_per_expert`` ([L] int64),
    ``num_recv_rows`` (R) and ``num_recv_pairs`` (N).
    """

    layout: DispatchLayout
    recv_counts: list[int] = field(default_factory=list)
    pair_row: torch.Tensor | None = None
    pair_slot: torch.Tensor | None = None
    pair_weight: torch.Tensor | None = None
    bag_index: torch.Tensor | None = None
    bag_offsets: torch.Tensor | None = None
    masked_ranks: tuple[int, ...] = ()

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


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """The layout's device-to-host copy: one host sync on a GPU (none on the CPU, where it returns ``t``).

    Every count a layout needs travels through this one call (tests count its calls: one per flat
    layout, two with capacity dropping over an over-full expert), so a new ``.cpu()``, ``.tolist()``
    or ``nonzero`` on device data in the layout belongs in its argument instead.
    """
    return t.cpu()


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync (pinned and non-blocking on a GPU)."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _split16(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w [N] float -> [2N] ``dtype`` (16-bit): ``hi, lo`` per element with hi + lo = w to about 16 (bfloat16)
    or 22 (float16) significant bits, where one 16-bit number keeps 8 or 11."""
    hi = w.to(dtype)
    lo = (w.to(torch.float32) - hi.to(torch.float32)).to(dtype)
    lo = torch.where(hi.isfinite(), lo, torch.zeros((), dtype=dtype, device=w.device))  # inf - inf is no NaN here
    return torch.stack((hi, lo), 1).reshape(-1)


def _sums16_in_float32(device: torch.device) -> bool:
    """Whether embedding_bag sums 16-bit rows in float32 on ``device``: its CUDA kernel does, and fbgemm's
    on the CPU (a CPU build without fbgemm may sum in the 16-bit type)."""
    return device.type == "cuda" or (device.type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines)


def _bag_sum(src: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor, *,
             weights: torch.Tensor | None = None) -> torch.Tensor:
    """out[b] = sum over i in bag b of weights[i] * src[index[i]] (weights 1 when None): [B, H] src.dtype.

    Bag b is ``index[offsets[b]:offsets[b + 1]]`` (the last one runs to the end; an empty bag sums
    to 0), summed in that order: deterministic, unlike ``index_add_`` on a GPU. One pass of
    ``embedding_bag`` over the 16-bit rows as they are, without the [N, H] float32 copies of a
    converted index_add_ (on the CPU those copies cost more than the sums: the rows are memory-bound).

    Args:
        src: [N, H] float. index: [M] int64 rows of src. offsets: [B] int64, ascending.
        weights: [M] float or None.

    Sums accumulate in float32 for 16-bit src (float64 for float64) and round once to src.dtype
    (to nearest; fbgemm on the CPU rounds an exact bfloat16 tie away from zero, not to even). For
    16-bit src each weight enters as two 16-bit parts, high and low (:func:`_split16`: two products
    per element), so the weights keep about 16 significant bits instead of bfloat16's 8.
    """
    if src.shape[0] == 0 and index.numel() == 0:  # embedding_bag wants rows to index, even when none are used
        return torch.zeros((offsets.numel(), src.shape[1]), dtype=src.dtype, device=src.device)
    src = src.contiguous()
    if src.element_size() == 2 and not _sums16_in_float32(src.device):
        return _bag_sum(src.float(), index, offsets, weights=weights).to(src.dtype)
    if weights is None:
        return F.embedding_bag(index, src, offsets, mode="sum")
    if src.element_size() == 2:
        index = index.unsqueeze(1).expand(-1, 2).reshape(-1)
        return F.embedding_bag(index, src, offsets * 2, mode="sum", per_sample_weights=_split16(weights, src.dtype))
    return F.embedding_bag(index, src, offsets, mode="sum", per_sample_weights=weights.to(src.dtype))


def token_bags(send_token_idx: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sent rows of each token as :func:`_bag_sum` bags: ``(index [S] int64, offsets [T] int64)``.

    Args:
        send_token_idx: [S] int64, the token of each sent row (by destination, then token).
        num_tokens: T.
    Returns:
        index lists the rows token by token (each token's rows in destination order); token t's
        run starts at offsets[t]. No host sync (argsort and searchsorted on the rows' device).
    """
    index = torch.argsort(send_token_idx, stable=True)
    tokens = torch.arange(num_tokens, dtype=send_token_idx.dtype, device=send_token_idx.device)
    return index, torch.searchsorted(send_token_idx.index_select(0, index), tokens)


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
