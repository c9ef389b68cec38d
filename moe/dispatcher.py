"""Expert-parallel token dispatch and combine over a Communicator's uneven all-to-all.

Notation (the names the code and its docstrings use):

====  ==========================================================================================
P     ranks in the group (``comm.size``).
E     experts over all ranks (``num_experts``), divisible by P.
L     local experts per rank, E / P (``num_local_experts``): rank ``i`` owns global experts
      ``[i*L, (i+1)*L)``; local expert ``j`` there is global expert ``i*L + j``.
T     tokens on this rank (``x.shape[0]``); may differ between ranks, and be 0. T_global: the
      sum of T over ranks.
H     hidden size of the tokens (``x.shape[1]``), equal on every rank; H' the width of the
      expert outputs given to ``combine`` (may differ from H).
k     slots per token (top-k, ``experts.shape[1]``), equal on every rank; a slot holds a global
      expert id, or -1 for an unused slot.
S     rows this rank sends in dispatch: one per (token, destination rank) with at least one
      kept slot there, ordered by destination rank, then token; S <= T * min(k, P).
R     rows this rank receives in dispatch (the sum of its receive counts), one per (source
      token, this rank); combine sends R rows back.
N     (token, expert) pairs this rank receives: the rows of ``recv_x`` and of ``expert_out``,
      grouped by local expert, then source rank, token and slot. N >= R, as a token that
      picked several experts here crosses the wire once.
C     the per-expert capacity with ``capacity_factor``: ceil(capacity_factor * T_global * k / E)
      kept pairs per expert over all ranks.
====  ==========================================================================================

Rank ``i`` owns global experts ``[i*L, (i+1)*L)``. ``dispatch`` sends each token
once to every rank that holds at least one of its experts (DeepEP-style de-duplication: a token
that picks three experts on one rank crosses the wire once) together with the local expert
slots it picked there, and the receiver expands the rows into one row per (token, expert) pair,
grouped by local expert. ``combine`` reduces the weighted expert outputs of each received token
on the expert rank, sends one row per (token, rank) back, and sums them on the token's rank.

:class:`ExpertDispatcher` checks and agrees on its arguments and forwards each call to one of two
sibling strategies, which share the interface ``layout`` / ``dispatch`` / ``combine`` / ``reject`` /
``close``:

* the flat path, :class:`moe.flat.FlatPath`: one row per (token, destination rank) over one
  all-to-all (its wire format is in :mod:`moe.flat`);
* the node-aware path, :class:`moe.internode.NodeAwarePath`, taken when the group spans several
  nodes (equal ranks per node): a token crosses the network once per destination node and is
  forwarded inside the node by a flat path over the node's ranks; its layout and handle have the
  same attributes.

The records and the all-to-all helpers the paths share are in :mod:`moe.records`.

Collective calls per step (the flat path): dispatch = 1 all_gather (counts; + 1 when capacity dropping has to
rank an over-full expert) + 1 all_to_all; combine = 1 all_to_all (+1 small one for the weights
when dispatch did not get them); backward: dispatch 1, combine 2 (rows out, weight grads back).
Every all_to_all passes the receive counts the layout already knows (``recv_counts=``), so a
transport that would exchange counts first (nccl) moves the rows at once: dispatch's own come from
the layout's all_gather (each rank's rows per destination ride along), except when capacity
dropping changed the rows after it; combine and the backward passes reuse dispatch's counts.

Masks (issue #55, :mod:`moe.elastic`): a masked rank is one the others treat as gone (dead, or
stopped); no call of the unmasked ranks waits for it. A call with ``masked_ranks`` (or after
:meth:`ExpertDispatcher.mask`, or after a peer failure with ``on_peer_failure="mask"``) runs on a
:class:`~moe.elastic.MaskedGroup` of the unmasked ranks (built on first use of that set: one
``comm.shrink``, collective over the unmasked ranks) through an inner dispatcher over
``A * L`` experts (A unmasked ranks), the expert ids mapped into its layout: slots routed to a
masked rank's experts are dropped and the other slots' weights are used as they are (not
renormalised). This rank's local experts, the order of ``recv_x`` and ``tokens_per_expert`` [L] are
those of an unmasked call. Calls without masks take the path above unchanged.

Host syncs (device-to-host copies that wait for a GPU; none of them costs anything on the CPU): a
layout makes one, :func:`moe.records._to_host`, which carries every count it needs and the least
and greatest expert id (the range check is read there, so a bad id still raises ``ValueError`` on
every rank, naming the rank); capacity dropping with an over-full expert adds one (the weights of
that expert's pairs, ranked on the host). The node-aware path runs two flat layouts (the group's
and its node group's), so two (four with such dropping). ``dispatch`` with a layout and ``combine``
make none: the sizes they need come from the layout (``torch.nonzero_static``), the per-row and
per-token sums use no data-dependent sizes, and host counts reach the device without waiting.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NoReturn, Sequence

import torch

from collectives.agreement import agree, rank_label
from collectives.protocols import CommunicatorLike, check_communicator

from .elastic import ON_PEER_FAILURE, MaskedGroup, MaskSet, mapped
from .flat import FlatPath, check_inputs
from .internode import NodeAwareHandle, NodeAwareLayout, NodeAwarePath, node_placement
from .records import _FLOATS, DispatchHandle, DispatchLayout, _tensor_id
from .router import is_positive_int, shape_or_type

log = logging.getLogger("moe")


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two float tensors of one shape and dtype hold the same values, NaN equal to NaN (``torch.equal``
    says NaN != NaN, which rejected NaN router weights passed alike to dispatch and combine)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


class ExpertDispatcher:
    """Moves tokens to the ranks that hold their experts and the expert outputs back.

    Rank ``i`` of ``P = comm.size`` owns experts ``[i*L, (i+1)*L)``, ``L = E / P`` (notation in the
    module docstring). All calls are collective and must be made in the same order on every rank;
    so must the backward passes, which run the reverse all-to-alls (call ``backward`` on a loss
    that depends on the combined output on every rank, even one with zero tokens).

    Args:
        comm: the expert-parallel group. Construction is collective: ``num_experts`` and
            ``capacity_factor`` are compared across ranks (``ValueError`` on every rank if they
            differ, are invalid on some rank, or if E is not divisible by P).
        num_experts: E, the number of experts over all ranks.
        capacity_factor: None for dropless; otherwise each expert keeps at most C =
            ceil(capacity_factor * T_global * k / E) (token, expert) pairs over all ranks, dropping
            the pairs with the lowest router weight (ties: the later of (rank, token, slot) is
            dropped, so the result does not depend on how tokens are split over ranks, as long as
            the split is contiguous in rank order).
        node_aware: None (default) takes the node-aware path (:mod:`moe.internode`: a token crosses
            the network once per destination node, forwarded inside the node) exactly when the group
            spans several nodes with equal ranks per node, which depends only on ``comm.topology``,
            so every rank chooses alike; False forces the flat path (one row per (token, rank)
            over one all-to-all); True requires the node-aware path (ValueError where the topology
            does not allow it). ``self.node_aware`` tells which was taken. The node-aware path
            splits ``comm`` into two sub-groups: call :meth:`close` when done.
        on_peer_failure: what a ``PeerFailedError`` (a peer died or left) in a call does.
            "raise" (default): it propagates; the survivors may then call :meth:`mask` and go on.
            "mask": in :meth:`get_dispatch_layout` / :meth:`dispatch` the failed ranks (those the error
            names) join the permanent masks, the survivors build their group, agree that they were all
            in the same call of this dispatcher (else ``ValueError`` on every survivor, saying so), log a
            warning and run the call again on the survivors, returning its result; in :meth:`combine`
            the ranks are masked and the group built alike, then the error is raised again: the
            dispatch it belongs to cannot be completed without being redone (the caller, e.g.
            :class:`~moe.MoELayer`, runs its step again). Every other error propagates as with "raise".

    Masks: see :meth:`dispatch` (``masked_ranks``), :meth:`mask`, :attr:`masked_ranks`, :attr:`active_comm`
    and the module docstring. :meth:`close` closes the masked groups too.
    """

    def __init__(self, comm: CommunicatorLike, num_experts: int, *, capacity_factor: float | None = None,
                 node_aware: bool | None = None, on_peer_failure: str = "raise"):
        check_communicator(comm, "ExpertDispatcher")
        err = None
        placement = node_placement(comm)
        if not is_positive_int(num_experts):
            err = ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        elif capacity_factor is not None and (isinstance(capacity_factor, bool) or not (
                isinstance(capacity_factor, (int, float)) and math.isfinite(capacity_factor) and capacity_factor > 0)):
            err = ValueError(f"capacity_factor must be None or a positive number, got {capacity_factor!r}")
        elif node_aware not in (None, True, False):
            err = ValueError(f"node_aware must be None, True or False, got {node_aware!r}")
        elif node_aware and placement is None:
            err = ValueError("node_aware=True needs a group that spans several nodes with equal ranks per node "
                             f"(comm.topology.nodes: {getattr(getattr(comm, 'topology', None), 'nodes', None)})")
        elif on_peer_failure not in ON_PEER_FAILURE:
            err = ValueError(f"on_peer_failure must be one of {ON_PEER_FAILURE}, got {on_peer_failure!r}")
        agree(comm, "ExpertDispatcher", {"num_experts": num_experts, "capacity_factor": capacity_factor,
                                         "node_aware (-1: auto)": -1 if node_aware is None else int(node_aware),
                                         "on_peer_failure (0: raise, 1: mask)": ON_PEER_FAILURE.index(on_peer_failure)
                                         if on_peer_failure in ON_PEER_FAILURE else None},
              error=err, hint="Construct the dispatcher with the same num_experts, capacity_factor, node_aware "
                              "and on_peer_failure on every rank.")
        if num_experts % comm.size:  # agreed values: every rank raises
            raise ValueError(f"ExpertDispatcher: num_experts={num_experts} is not divisible by the number of "
                             f"ranks {comm.size}; each rank must own the same number of experts")
        self.comm = comm
        self.num_experts = num_experts
        self.num_local_experts = num_experts // comm.size
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.first_local_expert = comm.rank * self.num_local_experts
        self.node_aware = placement is not None and node_aware is not False
        self.on_peer_failure = on_peer_failure
        # the permanent masks, each set's group and inner dispatcher (built on first use), the calls per set
        self._masks = MaskSet(self, comm, num_experts, self._build_masked, name="ExpertDispatcher",
                              on_peer_failure=on_peer_failure)
        # the strategy every call goes to; the flat one over the whole group also serves the node-aware one
        self._flat = FlatPath(comm, num_experts, self.capacity_factor)
        self._path: FlatPath | NodeAwarePath = self._flat
        if self.node_aware:
            self._path = NodeAwarePath(self._flat, placement)
            log.debug("rank %d: node-aware dispatch over %d nodes x %d ranks", comm.global_ranks[comm.rank],
                      self._path.num_nodes, self._path.ranks_per_node)

    def _reject(self, error: Exception, *, step: str, on: torch.Tensor) -> NoReturn:
        """Raise ``error`` here, skipping ``step``; the peers' next collective raises too (on the node-aware
        path: in each sub-group where they are next; see :meth:`moe.internode.NodeAwarePath.reject`)."""
        self._path.reject(error, step=step, on=on)

    def close(self) -> None:
        """Close the masked groups (and their dispatchers) and the node-aware path's sub-groups (collective with
        the other ranks' close; the flat path has none)."""
        first: Exception | None = None
        try:
            self._masks.close()  # each group, even after another failed to close
        except Exception as e:  # noqa: BLE001 - raised below, after the path's
            first = e
        self._path.close()
        self._path = self._flat
        if first is not None:
            raise first

    def __repr__(self) -> str:
        return (f"ExpertDispatcher(rank={self.comm.rank}, size={self.comm.size}, num_experts={self.num_experts}, "
                f"capacity_factor={self.capacity_factor}, node_aware={self.node_aware}"
                + (f", masked_ranks={list(self._masks.masked)}" if self._masks.masked else "") + ")")

    # ---- masks ----------------------------------------------------------------------------------
    @property
    def masked_ranks(self) -> tuple[int, ...]:
        """The permanent masks: ranks of ``comm`` (ascending) that every call leaves out, from :meth:`mask`
        or a peer failure with ``on_peer_failure="mask"``."""
        return self._masks.masked

    @property
    def active_comm(self) -> CommunicatorLike | None:
        """The communicator the next call without per-call masks runs on: ``comm``, or the permanent masks'
        group's. None only when that group is not built yet (after a failure in a call that had more
        masks of its own; the next call without them builds it)."""
        return self._masks.active_comm

    def mask(self, ranks: Sequence[int]) -> None:
        """Add ``ranks`` (of ``comm``) to the permanent masks and build their group now (collective over the
        unmasked ranks; the masked ones take no part), e.g. after a ``PeerFailedError`` with
        ``on_peer_failure="raise"``, or to time the shrink apart from the next call.

        Raises ``ValueError`` naming this rank for an invalid rank (out of range, listed twice, this rank
        itself); the build raises as :class:`~moe.elastic.MaskedGroup` does (e.g. ``PeerFailedError`` when
        another rank died).
        """
        self._masks.mask(ranks, "ExpertDispatcher.mask")

    def _build_masked(self, group: MaskedGroup) -> ExpertDispatcher:
        """The dispatcher over a masked group (``A * L`` experts): the node-aware path where the smaller group
        still allows it (equal ranks per node), else flat."""
        inner = ExpertDispatcher(group.comm, group.num_active_experts, capacity_factor=self.capacity_factor,
                                 node_aware=self.node_aware and node_placement(group.comm) is not None)
        inner._flat.shown_num_experts = self.num_experts  # range errors name the caller's E
        return inner

    # ---- layout ---------------------------------------------------------------------------------
    def get_dispatch_layout(self, x: torch.Tensor, experts: torch.Tensor, *, weights: torch.Tensor | None = None,
                            masked_ranks: Sequence[int] | None = None) -> DispatchLayout | NodeAwareLayout:
        """The one count exchange of a dispatch (collective): who sends what where, after capacity dropping.

        Args:
            x: [T, H] float64/32/16 or bfloat16. Only its shape, dtype and requires_grad are used;
                H, the dtype and whether x requires grad must agree across ranks (the backward
                all-to-all must run on every rank); T may differ, and be 0.
            experts: [T, k] int64/32/16 or uint8, the global expert id (0..E-1) of each slot, or -1
                for an unused slot; k must agree across ranks.
            weights: [T, k] float router weights, or None, on every rank alike; required with a
                capacity factor (the lowest-weight pairs are dropped). Given weights travel with
                the tokens, and :meth:`combine` must then get the same values.
            masked_ranks: ranks of ``comm`` to leave out of this call (with the permanent
                :attr:`masked_ranks`), or None: see :meth:`dispatch`.

        Returns:
            A :class:`DispatchLayout` (a :class:`~moe.internode.NodeAwareLayout` on the node-aware
            path, with the same attributes), reusable with ``dispatch(..., layout=)`` for any x of
            the same shape, dtype and requires_grad; ``.traffic`` counts the bytes within and across
            nodes. Every rank raises ``ValueError`` (naming the ranks and values) if any rank's
            arguments are invalid or they disagree. With masks the layout is the masked group's (in
            its numbering: its ``counts`` are [A, A*L], ``global_tokens_per_expert`` [A*L]) and
            ``.masked_ranks`` names them; ``dispatch(layout=)`` then runs on that group.

        Host syncs: one on the flat path (+1 when capacity dropping finds an over-full expert), two
        on the node-aware path (+2); see the module docstring. Masks add none.
        """
        masks = self._masks
        if masked_ranks is None and not masks.masked and self.on_peer_failure == "raise":
            return self._path.layout(x, experts, weights)
        mask = masks.call_mask(masked_ranks, "get_dispatch_layout")

        def run(d: ExpertDispatcher, group: MaskedGroup | None) -> DispatchLayout | NodeAwareLayout:
            if group is None:
                return d._path.layout(x, experts, weights)
            lay = d._path.layout(x, mapped(group, experts), weights)
            lay.masked_ranks = group.masked
            return lay

        return masks.run("layout", mask, run)

    # ---- dispatch / combine ---------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, *, weights: torch.Tensor | None = None,
                 layout: DispatchLayout | NodeAwareLayout | None = None, masked_ranks: Sequence[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle | NodeAwareHandle]:
        """Send every (token, expert) pair to the expert's rank (collective, differentiable in x).

        Args:
            x: [T, H] float64/32/16 or bfloat16 (T may differ between ranks, and be 0).
            experts: [T, k] int, the global expert id of each slot (-1: unused slot).
            weights: [T, k] float router weights or None (see :meth:`get_dispatch_layout`).
            layout: a :meth:`get_dispatch_layout` result for these experts (it carries the
                weights, so ``weights`` is then ignored); None computes it here (the count exchange).
                The call runs on the group of the layout's masks, which must include the permanent
                ones (``ValueError`` here otherwise: recompute the layout after :meth:`mask`).
            masked_ranks: ranks of ``comm`` (ints, in range, unique, not this rank: ``ValueError``
                naming this rank otherwise) that this call leaves out, together with the permanent
                :attr:`masked_ranks`; None or empty: none but those. Every unmasked rank must pass the
                same set, and the masked ranks do not call. The call then runs on the unmasked ranks'
                group (built on the first call with that set, collective over them; cached): slots of
                the masked ranks' experts are dropped, and the other slots keep their weights as they
                are (not renormalised); with a capacity factor, C counts the unmasked ranks' tokens and
                experts (T_global and E of the group). Unmasked ranks that pass different sets wait on
                different groups: a masked call raises ``ValueError`` after the communicator's timeout,
                naming the ranks that never came (a rank in a call without masks gets that call's
                ``CollectiveTimeoutError``).

        Returns:
            ``(recv_x, tokens_per_expert, handle)``: recv_x [N, H] x.dtype, one row per pair routed
            to this rank, grouped by local expert, then source rank, token and slot (masked or not:
            local expert j is this rank's expert j); tokens_per_expert [L] int64 on the CPU, rows of
            recv_x per local expert; handle, a :class:`DispatchHandle` for :meth:`combine`, whose
            ``masked_ranks`` names the call's masks (its layout is then the masked group's;
            ``handle.dropped`` marks capacity drops only, not the slots of masked ranks' experts).

        Host syncs: none with ``layout=`` (the given experts are then checked for shape only: the
        layout holds the routing), else those of :meth:`get_dispatch_layout`.
        """
        masks = self._masks
        if layout is None:
            if masked_ranks is None and not masks.masked and self.on_peer_failure == "raise":
                    return self._dispatch(x, experts, weights, None)
            mask = masks.call_mask(masked_ranks, "dispatch")
        else:
            mask = tuple(getattr(layout, "masked_ranks", ()))
            if not mask and masked_ranks is None and not masks.masked and self.on_peer_failure == "raise":
                    return self._dispatch(x, experts, weights, layout)
            if masked_ranks is not None and masks.call_mask(masked_ranks, "dispatch") != mask:
                raise ValueError(f"dispatch on {rank_label(self.comm)}: masked_ranks={list(masked_ranks)} (with the "
                                 f"permanent masks {list(masks.masked)}) differ from the layout's {list(mask)}")
            if not set(masks.masked) <= set(mask):
                raise ValueError(f"dispatch on {rank_label(self.comm)}: the layout was made with masks {list(mask)}, "
                                 f"but ranks {list(masks.masked)} are masked now; recompute the layout")

        def run(d: ExpertDispatcher, group: MaskedGroup | None, lay: Any = layout, w: Any = weights
                ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle | NodeAwareHandle]:
            if group is None:
                return d._dispatch(x, experts, w, lay)
            out = d._dispatch(x, experts if lay is not None else mapped(group, experts), w, lay)
            out[2].masked_ranks = out[2].layout.masked_ranks = group.masked
            return out

        # after a failure the layout (of the failed group) is made again on the survivors, with its weights
        rerun = None if layout is None else (lambda d, group: run(d, group, None, layout.weights))
        return masks.run("dispatch", mask, run, rerun=rerun)

    def _dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor | None,
                  layout: DispatchLayout | NodeAwareLayout | None
                  ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle | NodeAwareHandle]:
        """:meth:`dispatch` on this dispatcher's own group (no masks)."""
        if layout is None:
            layout = self._path.layout(x, experts, weights)
        else:
            err = check_inputs(x, experts, weights, need_weights=False)
            if err is None and (x.shape[0] != layout.num_tokens or x.shape[1] != layout.hidden
                                or x.dtype != layout.dtype or tuple(experts.shape) != (layout.num_tokens, layout.top_k)
                                or (torch.is_grad_enabled() and x.requires_grad) != layout.requires_grad):
                err = (f"x {tuple(x.shape)} "
                       f"{x.dtype} requires_grad={x.requires_grad} / experts {tuple(experts.shape)} do not match the "
                       f"layout ([{layout.num_tokens}, {layout.hidden}] {layout.dtype} "
                       f"requires_grad={layout.requires_grad}, k={layout.top_k}); recompute the layout")
            if err is not None:  # the peers are already in dispatch's all-to-all
                self._reject(ValueError(f"dispatch on {rank_label(self.comm)}: {err}"), step="dispatch", on=x)
        return self._path.dispatch(x, layout)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle | NodeAwareHandle,
                weights: torch.Tensor) -> torch.Tensor:
        """Bring expert outputs back and sum them per token (collective, differentiable in expert_out and weights).

        Args:
            expert_out: [N, H'] float, row i the expert output for row i of ``recv_x`` (same order).
            handle: from :meth:`dispatch`; a masked dispatch's handle runs combine (and the backward
                passes) over the same masked group.
            weights: [T, k] float router weights: the same values as given to dispatch, if any
                (those already sit on the expert ranks, so combine is then a single all-to-all).

        Returns:
            y: [T, H'] expert_out.dtype, ``y[t] = sum_j weights[t, j] * out(t, j)``, where dropped
            pairs, -1 slots and (masked dispatch) slots of masked ranks' experts contribute 0; sums
            accumulate in float32 (float64 for float64), in a fixed order (deterministic). With 16-bit
            outputs each weight enters as two 16-bit parts (about 16 significant bits; see
            :func:`moe.records._bag_sum`).

        With ``on_peer_failure="mask"``, a ``PeerFailedError`` here masks the failed ranks (as in
        :meth:`dispatch`) and is raised again: this combine's dispatch must be redone on the survivors.

        Host syncs: none, except one to compare ``weights`` by value when they are not the tensor
        (or a view of it) given to dispatch.
        """
        mask = tuple(getattr(handle, "masked_ranks", ()))
        if not mask and self.on_peer_failure == "raise":
            return self._combine(expert_out, handle, weights)
        return self._masks.run("combine", mask, lambda d, group: d._combine(expert_out, handle, weights), build=False,
                               retry=False)

    def _combine(self, expert_out: torch.Tensor, handle: DispatchHandle | NodeAwareHandle,
                 weights: torch.Tensor) -> torch.Tensor:
        """:meth:`combine` on this dispatcher's own group (no masks)."""
        lay = handle.layout
        err = None
        if not isinstance(expert_out, torch.Tensor) or expert_out.dim() != 2 or \
                expert_out.shape[0] != handle.num_recv_pairs:
            err = (f"expert_out must be [{handle.num_recv_pairs}, hidden] (one row per row of recv_x), got "
                   f"{shape_or_type(expert_out)}")
        elif expert_out.dtype not in _FLOATS:
            err = f"expert_out must be a float tensor, got {expert_out.dtype}"
        elif not isinstance(weights, torch.Tensor) or tuple(weights.shape) != (lay.num_tokens, lay.top_k) \
                or weights.dtype not in _FLOATS:
            err = (f"weights must be a float tensor [{lay.num_tokens}, {lay.top_k}], got "
                   + (f"{tuple(weights.shape)} {weights.dtype}" if isinstance(weights, torch.Tensor)
                      else type(weights).__name__))
        elif lay.weights is not None and _tensor_id(weights) != lay.weights_id and not (
                weights.dtype == lay.weights.dtype and _same_values(weights.detach(), lay.weights)):
            err = ("weights differ from the weights given to dispatch, which travelled with "
                   "the tokens; pass the same weights (or none to dispatch without a capacity factor)")
        if err is not None:  # the peers are already in combine's all-to-all
            self._reject(ValueError(f"combine on {rank_label(self.comm)}: {err}"),
                         step="combine" if getattr(lay, "recv_weights", None) is not None else "combine_weights",
                         on=expert_out)
        return self._path.combine(expert_out, handle, weights)
