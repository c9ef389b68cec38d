"""Expert tensor parallelism (ETP): every expert's FFN sharded over a group of ranks, composed with expert parallelism.

Megatron-LM's ETP: each expert's fc1 is column-parallel and its fc2 row-parallel over an ETP group of
T ranks, while the experts themselves are spread over the other dimension of the rank grid (EP).

Notation (beside that of :mod:`moe.dispatcher`):

=======  ===================================================================================================
P        ranks of the whole group (``comm.size``).
T        the ETP size (``expert_tp_size``), dividing P; P / T is the EP size.
layout   rank = ep_rank * T + etp_rank: an ETP group is T consecutive ranks, an EP group the P / T ranks
         with the same etp_rank (:func:`expert_tp_groups`).
E, L     experts over all ranks, and per EP rank: L = E / (P / T); EP rank j holds experts [j*L, (j+1)*L),
         and each of the T ranks of its ETP group holds one shard of each of them.
H, F     hidden size; every expert's inner size, divisible by T; F_T = F / T.
T_i      tokens of ETP rank i (``x.shape[0]`` there); may differ between ranks, and be 0.
X        the ETP group's tokens gathered, [sum_i T_i, H], in etp-rank order; ``counts`` = (T_0, ..., T_{T-1}).
m        max_i T_i, the rows each rank pads to in the padded layout [T * m, *] (rank i's rows at
         [i*m, i*m + T_i)) that the uneven all-gather and reduce-scatter move.
shard    of one expert, for etp rank r: columns C_r = [r*F_T, (r+1)*F_T) of the inner dim. fc1 [H, F]
         -> fc1[:, C_r] [H, F_T]; gated ("swiglu", "geglu": fc1 [H, 2F] = [gate | up]) ->
         [gate[:, C_r] | up[:, C_r]] [H, 2 F_T], so the activation works on the shard; fc2 [F, H] ->
         fc2[C_r] [F_T, H]. The sum over r of act(x @ fc1_r) @ fc2_r is the expert's output.
=======  ===================================================================================================

The forward (:func:`etp_forward`) on each rank: gather X over the ETP group; route X (the router is
replicated, so every ETP rank routes the same tokens alike); dispatch X over the EP group; run this
rank's shards of its L experts (partial outputs); combine over EP (a partial y for X); reduce-scatter
over the ETP group (the sum of the partials, each rank keeping its own T_i rows).

The router sees the whole gradient of each token, once: the routing weights go to dispatch and
combine in X's precision (float64 for float64 tokens), and their gradient, partial on each rank of
the ETP group, is summed over the group (a reduce-scatter in the backward) and kept on the rows of
the rank that owns each token, zeros elsewhere; the aux losses are computed on this rank's own rows.
So the router's float32 softmax runs its backward on the same numbers as one process would, and
the router's (and the input's) gradients match a one-process layer's to float64 rounding, not
float32's.

The autograd regions over the ETP group, each named for its forward and its backward:

==================================  ===========================  ===========================
function                            forward                      backward
==================================  ===========================  ===========================
gather_tokens                       all-gather rows (uneven)     reduce-scatter rows (uneven)
reduce_scatter_tokens               reduce-scatter rows          all-gather rows
routing weights (etp_forward)       identity                     reduce-scatter to own rows
==================================  ===========================  ===========================

Weights do not depend on the layout: expert e's full fc1/fc2 are drawn as :class:`moe.layer.GroupedExperts`
draws them (``seeded_generator(seed, EXPERT_STREAM, e)``, :mod:`moe.ffn`), then sliced, so the same seed
gives the same function as a one-process :class:`moe.layer.MoELayer`. Double backward is not supported
(it raises).

``MoELayer(comm, ..., expert_tp_size=T)`` is built from these pieces (its ``ep_comm``, ``etp_comm``,
``ShardedExperts`` and ``etp_forward``). With EPLB (``num_redundant_experts``, a ``placement`` over the
P / T EP ranks) the dispatcher runs over E + R slots, ``ShardedExperts(expert_ids=)`` holds shards of
the slots' logical experts, and ``etp_forward(placement=)`` maps X's choices to slots with the same
offset on every rank of an ETP group. :func:`gather_expert_slots` / :func:`shard_expert_slots` put a
layer's shards together and cut them again, for ``moe.gather_state_dict`` / ``moe.shard_state_dict``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from collectives.agreement import agree, rank_label, reject
from collectives.protocols import CommunicatorLike, check_communicator
from transports.base import dtype_code, dtype_name

from .eplb import Placement, fold_replicas, route
from .ffn import _ACTIVATIONS, _GATED, _expert_weights
from .records import _FLOATS
from .router import is_positive_int, shape_or_type

__all__ = ["ShardedExperts", "etp_forward", "expert_tp_groups", "gather_expert_slots", "gather_tokens",
           "reduce_scatter_tokens", "shard_expert_slots", "shard_expert_weights", "shard_indices"]

# ---- helpers ------------------------------------------------------------------------------------
def _padded_rows(counts: Sequence[int], m: int, device: torch.device) -> torch.Tensor:
    """[sum(counts)] int64: where each gathered row sits in the padded layout [len(counts) * m, *]."""
    return torch.cat([torch.arange(i * m, i * m + c, device=device) for i, c in enumerate(counts)])


def _all_gather_rows(x: torch.Tensor, comm: CommunicatorLike, counts: Sequence[int]) -> torch.Tensor:
    """Every rank's rows concatenated in rank order ([sum(counts), *]): pad to m, all-gather, unpad."""
    m = max(counts)
    if m == 0:
        return x.new_zeros((0, *x.shape[1:]))
    x = x.detach().contiguous()
    if min(counts) == m:
        return comm.all_gather(x)
    padded = torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])
    return comm.all_gather(padded).index_select(0, _padded_rows(counts, m, x.device))


def _reduce_scatter_rows(y: torch.Tensor, comm: CommunicatorLike, counts: Sequence[int]) -> torch.Tensor:
    """The sum over ranks of ``y`` [sum(counts), *], this rank's rows ([counts[rank], *]): pad, reduce-scatter, unpad."""
    m = max(counts)
    if m == 0:
        return y.new_zeros((0, *y.shape[1:]))
    y = y.detach().contiguous()
    if min(counts) == m:
        return comm.reduce_scatter(y)
    padded = y.new_zeros((len(counts) * m, *y.shape[1:]))
    padded.index_copy_(0, _padded_rows(counts, m, y.device), y)
    return comm.reduce_scatter(padded)[: counts[comm.rank]]


def _exchange_counts(x: Any, comm: CommunicatorLike, where: str, *, hidden: int | None = None,
                     error: Exception | None = None) -> tuple[int, ...]:
    """Check x [T_i, H] and agree on H, dtype and requires_grad over ``comm``; return every rank's T_i
    (collective: one all-gather; ValueError/TypeError on every rank for a bad x or ``error`` on any rank)."""
    err = error
    if err is None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or (hidden is not None and x.shape[1] != hidden):
            want = f"[num_tokens, {hidden}]" if hidden is not None else "[num_tokens, hidden]"
            err = ValueError(f"x must be {want}, got {shape_or_type(x)}")
        elif x.dtype not in _FLOATS:
            err = ValueError(f"x must be a float tensor, got {x.dtype}")
    ok = err is None
    rows = agree(comm, where, {"hidden": x.shape[1] if ok else None, "dtype": dtype_code(x.dtype) if ok else None,
                               "requires_grad": bool(torch.is_grad_enabled() and x.requires_grad) if ok else None},
                 error=err, extra=torch.tensor([x.shape[0] if ok else 0]),
                 formats={"dtype": dtype_name},
                 hint="Every rank of the ETP group must pass tokens of one width and dtype, all requiring grad or none.")
    return tuple(int(n) for n in rows[:, 0].tolist())


def _check_counts(counts: Any, comm: CommunicatorLike) -> str | None:
    if not (isinstance(counts, (tuple, list)) and len(counts) == comm.size
            and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)):
        return f"counts must be {comm.size} ints >= 0 (as gather_tokens returns them), got {counts!r}"
    return None


def _colors(comm: CommunicatorLike, expert_tp_size: int) -> tuple[int, int]:
    """The split colors of this rank's ETP group and EP group (rank = ep_rank * T + etp_rank)."""
    return comm.rank // expert_tp_size, comm.rank % expert_tp_size


# What each step of etp_forward leaves ahead: the groups whose peers may still be on their way to a
# collective of this call when this rank stops at that step (a collective's own group knows already).
_AHEAD = {"gather": ("ep",), "route": ("ep", "etp"), "dispatch": ("etp",), "experts": ("ep", "etp"),
          "combine": ("etp",), "reduce_scatter": ()}


@contextmanager
def _step(name: str, groups: dict[str, tuple[CommunicatorLike, str]], where: str) -> Iterator[None]:
    """Around one step of etp_forward: an error there makes the peers' next collective in each group
    still ahead (``_AHEAD``) raise too, instead of waiting for the timeout; then it is raised here."""
    try:
        yield
    except Exception as e:
        relayed = ValueError(f"{where} stopped at {name}: {type(e).__name__}: {e}")
        for g in _AHEAD[name]:
            comm, device = groups[g]
            if comm.size > 1:
                try:
                    comm.reject(relayed, device=device)
                except Exception:  # noqa: BLE001 - reject raises `relayed` by design; tell the next group too
                    pass
        e._moecomm_rejected = True  # an enclosing `rejecting` must not tell the peers again
        raise


def _slot_experts(placement: Placement | None, dispatcher: Any) -> list[int]:
    """The logical experts of the dispatcher's local slots in ``placement`` (None: slot = expert)."""
    first, L = dispatcher.first_local_expert, dispatcher.num_local_experts
    if placement is None:
        return list(range(first, first + L))
    return placement.physical_to_logical[first: first + L].tolist()


# ---- autograd regions ---------------------------------------------------------------------------
class _AllGatherRowsReduceScatterGrad(torch.autograd.Function):
    """Forward: all-gather rows with uneven counts; backward: reduce-scatter (sum) the rows' gradients."""

    @staticmethod
    def forward(ctx, x, comm, counts):
        ctx.comm, ctx.counts = comm, counts
        return _all_gather_rows(x, comm, counts)

    @staticmethod
    @once_differentiable  # the collectives run on detached tensors: a second derivative must raise
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.comm, ctx.counts), None, None


class _SumGradOnOwnRows(torch.autograd.Function):
    """Forward: identity on rows replicated over the group ([sum(counts), *]); backward: the gradient summed
    over the group (reduce-scatter rows) on this rank's own rows, zeros on the other ranks' rows."""

    @staticmethod
    def forward(ctx, w, comm, counts):
        ctx.comm, ctx.counts = comm, counts
        return w.view_as(w)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out = grad.new_zeros(grad.shape)
        start = sum(ctx.counts[:ctx.comm.rank])
        out[start: start + ctx.counts[ctx.comm.rank]] = _reduce_scatter_rows(grad, ctx.comm, ctx.counts)
        return out, None, None


class _ReduceScatterRowsAllGatherGrad(torch.autograd.Function):
    """Forward: reduce-scatter (sum) rows with uneven counts; backward: all-gather the rows' gradients."""

    @staticmethod
    def forward(ctx, y, comm, counts):
        ctx.comm, ctx.counts = comm, counts
        return _reduce_scatter_rows(y, comm, counts)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.comm, ctx.counts), None, None


# ---- public functions ---------------------------------------------------------------------------
def expert_tp_groups(comm: CommunicatorLike, expert_tp_size: int) -> tuple[CommunicatorLike, CommunicatorLike]:
    """The EP and ETP groups of this rank (collective: ``comm.split`` twice).

    Args:
        comm: the whole group, P ranks.
        expert_tp_size: T, a positive int dividing P, the same on every rank.

    Returns:
        ``(ep_comm, etp_comm)``: ranks ``comm.rank % T + j * T`` (j < P / T; ``ep_comm.rank`` =
        ``comm.rank // T``) and ranks ``(comm.rank // T) * T + i`` (i < T; ``etp_comm.rank`` =
        ``comm.rank % T``). Close both when done. A bad or differing T on any rank raises
        ``ValueError`` on every rank (before any split).
    """
    check_communicator(comm, "expert_tp_groups")
    T, P, err = expert_tp_size, comm.size, None
    if not is_positive_int(T):
        err = ValueError(f"expert_tp_size must be a positive int, got {T!r}")
    elif P % T:
        err = ValueError(f"expert_tp_size={T} does not divide the {P} ranks of comm")
    agree(comm, "expert_tp_groups", {"expert_tp_size": T if is_positive_int(T) else None}, error=err,
          hint="Pass the same expert_tp_size on every rank.")
    etp_color, ep_color = _colors(comm, T)
    etp_comm = comm.split(etp_color, comm.rank)
    try:
        ep_comm = comm.split(ep_color, comm.rank)
    except BaseException:
        etp_comm.close()
        raise
    return ep_comm, etp_comm


def gather_tokens(x: torch.Tensor, etp_comm: CommunicatorLike) -> tuple[torch.Tensor, tuple[int, ...]]:
    """All-gather the ETP group's tokens (collective; backward: reduce-scatter, collective too).

    Args:
        x: [T_i, H] float, this rank's tokens (T_i may differ between ranks, and be 0; H, the dtype
            and whether x requires grad must agree: ``ValueError`` on every rank otherwise).
        etp_comm: the ETP group.

    Returns:
        ``(X, counts)``: X [sum_i T_i, H] x.dtype, every rank's rows in rank order; counts the tuple
        of every rank's T_i (one all-gather exchanges them, then one all-gather of the rows padded to
        max T_i). The gradient that reaches x is the sum over the group of the gradients of X's rows
        of this rank (each rank's X feeds a partial computation).
    """
    counts = _exchange_counts(x, etp_comm, "gather_tokens")
    if etp_comm.size == 1:
        return x, counts
    return _AllGatherRowsReduceScatterGrad.apply(x, etp_comm, counts), counts


def reduce_scatter_tokens(y_partial: torch.Tensor, etp_comm: CommunicatorLike,
                          counts: Sequence[int]) -> torch.Tensor:
    """Sum the ranks' partial outputs for X, keep this rank's rows (collective; backward: all-gather).

    Args:
        y_partial: [sum(counts), H'] float, this rank's partial result for every row of X (H' and the
            dtype the same on every rank).
        etp_comm: the ETP group.
        counts: every rank's T_i, as :func:`gather_tokens` returned them.

    Returns:
        [counts[rank], H'] y_partial.dtype: rows [sum(counts[:rank]), sum(counts[:rank + 1])) of
        the sum over the group. The backward gives every rank's y_partial the full gradient of
        every row (all-gathered). A bad y_partial or counts raises ``ValueError`` here and makes the
        peers' reduce-scatter raise.
    """
    err = _check_counts(counts, etp_comm)
    if err is None and not (isinstance(y_partial, torch.Tensor) and y_partial.dim() == 2
                            and y_partial.shape[0] == sum(counts) and y_partial.dtype in _FLOATS):
        err = f"y_partial must be a float [{sum(counts)}, hidden] tensor, got " + (
            f"{tuple(y_partial.shape)} {y_partial.dtype}" if isinstance(y_partial, torch.Tensor)
            else type(y_partial).__name__)
    if err is not None:
        reject(etp_comm, ValueError(f"reduce_scatter_tokens on {rank_label(etp_comm)}: {err}"), on=y_partial)
    if etp_comm.size == 1:
        return y_partial
    return _ReduceScatterRowsAllGatherGrad.apply(y_partial, etp_comm, tuple(counts))


def shard_indices(ffn_hidden_size: int, activation: str, etp_rank: int,
                  expert_tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ETP rank r's shard sits in an expert's full weights (local, pure).

    Args:
        ffn_hidden_size: F, divisible by T. activation: a key of ``_ACTIVATIONS``.
        etp_rank: r in [0, T). expert_tp_size: T.

    Returns:
        ``(fc1_columns, fc2_rows)`` int64 (CPU): fc1_columns [F_T] (or [2 F_T] gated: the gate's
        C_r, then the up half's F + C_r), fc2_rows [F_T] = C_r, so ``fc1[:, fc1_columns]`` and
        ``fc2[fc2_rows]`` are the shard (``index_copy`` / ``index_add`` put a shard back).
        ``ValueError`` on a bad argument.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    if not is_positive_int(expert_tp_size):
        raise ValueError(f"expert_tp_size must be a positive int, got {expert_tp_size!r}")
    if isinstance(etp_rank, bool) or not isinstance(etp_rank, int) or not 0 <= etp_rank < expert_tp_size:
        raise ValueError(f"etp_rank must be an int in [0, {expert_tp_size}), got {etp_rank!r}")
    if not is_positive_int(ffn_hidden_size) or ffn_hidden_size % expert_tp_size:
        raise ValueError(f"ffn_hidden_size {ffn_hidden_size!r} is not divisible by expert_tp_size={expert_tp_size}")
    n = ffn_hidden_size // expert_tp_size
    rows = torch.arange(etp_rank * n, (etp_rank + 1) * n)
    return (torch.cat([rows, rows + ffn_hidden_size]) if activation in _GATED else rows), rows


def shard_expert_weights(fc1: torch.Tensor, fc2: torch.Tensor, activation: str, etp_rank: int,
                         expert_tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ETP rank r's shard of one expert's full weights (local; see the module docstring).

    Args:
        fc1: [H, F] ([H, 2F] = [gate | up] for a gated activation). fc2: [F, H].
        activation: a key of ``_ACTIVATIONS``. etp_rank: r in [0, T). expert_tp_size: T, dividing F.

    Returns:
        ``(fc1_shard, fc2_shard)``: [H, F_T] ([H, 2 F_T] = [gate[:, C_r] | up[:, C_r]]) and
        [F_T, H], new contiguous tensors of the inputs' dtypes. ``ValueError`` on bad shapes or arguments.
    """
    if not (isinstance(fc1, torch.Tensor) and isinstance(fc2, torch.Tensor) and fc1.dim() == 2 and fc2.dim() == 2):
        raise ValueError(f"fc1 and fc2 must be 2-D tensors, got {shape_or_type(fc1)} and {shape_or_type(fc2)}")
    ffn, hidden = fc2.shape
    width = 2 * ffn if activation in _GATED else ffn
    if activation in _ACTIVATIONS and tuple(fc1.shape) != (hidden, width):
        raise ValueError(f"fc1 must be [{hidden}, {width}] for fc2 {tuple(fc2.shape)} and activation {activation!r}, "
                         f"got {tuple(fc1.shape)}")
    cols, rows = shard_indices(ffn, activation, etp_rank, expert_tp_size)
    return fc1[:, cols.to(fc1.device)].contiguous(), fc2[rows.to(fc2.device)].contiguous()


class ShardedExperts(nn.Module):
    """This rank's shards of its L experts, stacked: ``fc1`` [L, H, F_T or 2 F_T], ``fc2`` [L, F_T, H] float32.

    Local expert ``i`` is logical expert ``expert_ids[i]`` (default: ``first_expert + i``); its full
    weights are drawn from ``seeded_generator(seed, EXPERT_STREAM, expert_ids[i])`` exactly as
    :class:`moe.layer.GroupedExperts` draws them, then sliced by :func:`shard_expert_weights`, so they
    depend on neither the EP nor the ETP layout, nor on how many replicas an expert has (EPLB: a
    logical id may appear several times, identical copies). Local (no communication); ``ValueError``
    on a bad argument.

    Args:
        num_local_experts: L. first_expert: the global id (or EPLB slot) of local expert 0.
        hidden_size: H. ffn_hidden_size: F, divisible by T. activation: a key of ``_ACTIVATIONS``.
        seed: an int >= 0. etp_rank: r in [0, T). expert_tp_size: T.
        expert_ids: L logical ids, one per local slot (an EPLB placement's slots of this EP rank), or None.
    """

    def __init__(self, num_local_experts: int, first_expert: int, hidden_size: int, ffn_hidden_size: int,
                 activation: str, seed: int, *, etp_rank: int, expert_tp_size: int,
                 expert_ids: Sequence[int] | None = None):
        super().__init__()
        shard_indices(ffn_hidden_size, activation, etp_rank, expert_tp_size)  # checks the arguments
        self.activation, self.etp_rank, self.expert_tp_size = activation, etp_rank, expert_tp_size
        self.first_expert, self.ffn_hidden_size = first_expert, ffn_hidden_size
        ids, drawn = _expert_weights("ShardedExperts", num_local_experts, first_expert, expert_ids, hidden_size,
                                     ffn_hidden_size, activation, seed)
        self.expert_ids = ids
        shards = {e: shard_expert_weights(*w, activation, etp_rank, expert_tp_size) for e, w in drawn.items()}
        width = (2 if activation in _GATED else 1) * (ffn_hidden_size // expert_tp_size)
        self.fc1 = nn.Parameter(torch.stack([shards[e][0] for e in ids]) if ids else
                                torch.zeros(0, hidden_size, width))
        self.fc2 = nn.Parameter(torch.stack([shards[e][1] for e in ids]) if ids else
                                torch.zeros(0, ffn_hidden_size // expert_tp_size, hidden_size))

    def extra_repr(self) -> str:
        L = self.fc1.shape[0]
        held = (f"experts {self.first_expert}..{self.first_expert + L - 1}"
                if self.expert_ids == list(range(self.first_expert, self.first_expert + L))
                else f"slots {self.first_expert}..{self.first_expert + L - 1} (experts {self.expert_ids})")
        return (f"{held}, shard {self.etp_rank} of {self.expert_tp_size}, fc1 {tuple(self.fc1.shape)}, "
                f"fc2 {tuple(self.fc2.shape)}, activation={self.activation!r}")

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Run each local expert's shard on its rows: one GEMM pair per local expert.

        Args:
            x: [N, H] float, rows grouped by local expert (as ``ExpertDispatcher.dispatch`` returns them).
            tokens_per_expert: [L] int64 (CPU), rows per local expert (sums to N).

        Returns:
            [N, H] fc1.dtype, row i this shard's partial output for row i (the sum over the ETP
            group's shards is the expert's output).
        """
        act = _ACTIVATIONS[self.activation]
        x = x.to(self.fc1.dtype)
        # empty experts still run, so that every parameter gets a (zero) gradient on every rank
        chunks = torch.split(x, tokens_per_expert.tolist())
        outs = [act(c @ self.fc1[i]) @ self.fc2[i] for i, c in enumerate(chunks)]
        return torch.cat(outs) if outs else x.new_zeros((0, self.fc2.shape[-1]))


def _check_call(x: Any, H: int, experts: ShardedExperts, dispatcher: Any, etp_comm: CommunicatorLike,
                placement: Placement | None) -> ValueError | None:
    """What is wrong with etp_forward's arguments on this rank (local), or None."""
    ep_comm = dispatcher.comm
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.shape[-1] != H:
        return ValueError(f"x must be [T, {H}] or [B, S, {H}], got {shape_or_type(x)}")
    if (experts.expert_tp_size, experts.etp_rank) != (etp_comm.size, etp_comm.rank) or (
            experts.fc1.shape[0], experts.first_expert) != (dispatcher.num_local_experts, dispatcher.first_local_expert):
        return ValueError(f"experts hold experts {experts.first_expert}.. ({experts.fc1.shape[0]}), shard "
                          f"{experts.etp_rank} of {experts.expert_tp_size}; the dispatcher and etp_comm want "
                          f"{dispatcher.first_local_expert}.. ({dispatcher.num_local_experts}), shard "
                          f"{etp_comm.rank} of {etp_comm.size}")
    if placement is not None and not (isinstance(placement, Placement) and (
            placement.num_physical, placement.num_ranks) == (dispatcher.num_experts, ep_comm.size)):
        return ValueError(f"placement must be a moe.eplb.Placement of the dispatcher's {dispatcher.num_experts} "
                          f"slots on the {ep_comm.size} EP ranks, got {placement!r}")
    want = _slot_experts(placement, dispatcher)
    if experts.expert_ids != want:
        return ValueError(f"experts hold logical experts {experts.expert_ids}; the slots of this EP rank hold {want}"
                          + (" in the placement" if placement is not None else " (no placement given)"))
    return None


def etp_forward(x: torch.Tensor, router: nn.Module, dispatcher: Any, experts: ShardedExperts,
                etp_comm: CommunicatorLike, *, return_routing: bool = False, placement: Placement | None = None,
                error: Exception | None = None) -> tuple[torch.Tensor, ...]:
    """Gather over ETP, route, dispatch over EP, run the expert shards, combine, reduce-scatter over ETP.

    Collective over both groups, and so is its backward: every rank calls it (and backward on a loss
    that depends on y, even with 0 tokens). An error on one rank (a bad x, a failing step) raises
    there and makes every other rank raise too, each at its next collective of this call; after one,
    the groups may be out of step: close them and split again.

    Args:
        x: [T_i, H] or [B, S, H] float (T_i, or B * S, may differ between ranks, and be 0).
        router: a :class:`moe.router.TopKRouter`, the same (replicated) on every rank.
        dispatcher: an :class:`moe.dispatcher.ExpertDispatcher` over this rank's EP group (E experts,
            or E + R slots with a ``placement``).
        experts: this rank's :class:`ShardedExperts`: L = dispatcher.num_local_experts experts from
            dispatcher.first_local_expert, shard etp_comm.rank of etp_comm.size (with a placement:
            the logical experts of its slots, ``expert_ids``).
        etp_comm: this rank's ETP group (:func:`expert_tp_groups`).
        return_routing: also return the dispatch handle and this rank's routing (for a layer's
            ``last_handle`` and expert-load counters).
        placement: EPLB (:mod:`moe.eplb`): a :class:`~moe.eplb.Placement` of the E logical experts over
            the dispatcher's slots on the P / T EP ranks, the same on every rank; the router's logical
            choices of X go to slots by :func:`moe.eplb.route` with offset ``ep_comm.rank`` (the same on
            every rank of an ETP group, so that all its ranks send X's rows alike), and the aux loss
            counts tokens per logical expert (:func:`moe.eplb.fold_replicas`). None: slot = expert.
        error: a failure of this rank's own work before the call (a layer's shared expert), or None:
            raised as ``ValueError`` on every rank at the first step, as a bad x is.

    Returns:
        ``(y, aux_loss)``: y of x's shape and dtype, the layer's output for this rank's tokens;
        aux_loss a 0-d float32 tensor: this rank's tokens' share of the router losses (over the
        whole batch's counts), so that the shares of all P ranks sum to the loss one process
        computes over all tokens. With ``return_routing``: ``(y, aux_loss, handle, chosen)``,
        handle the EP dispatch handle (of X's rows: the ETP group's tokens; routed by slot),
        chosen [T_i, k] int64 the global (logical) experts of this rank's own tokens (summed over
        all P ranks, their counts are the batch's, each token counted once).

    The router's parameters must require grad alike on every rank (its backward runs a collective).
    """
    ep_comm = dispatcher.comm
    where = f"etp_forward on {rank_label(ep_comm) if etp_comm.size == 1 else rank_label(etp_comm)}"
    device = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    # dispatch starts with its count exchange, on the CPU; the other collectives move x's device's tensors
    groups = {"ep": (ep_comm, device), "etp": (etp_comm, device)}
    gather_groups = {"ep": (ep_comm, "cpu"), "etp": (etp_comm, device)}
    H = router.hidden_size
    shape = x.shape if isinstance(x, torch.Tensor) else None
    err = error if error is not None else _check_call(x, H, experts, dispatcher, etp_comm, placement)
    x2 = x.reshape(-1, H) if err is None else x
    with _step("gather", gather_groups, where):
        counts = _exchange_counts(x2, etp_comm, "etp_forward", hidden=H, error=err)
        X = x2 if etp_comm.size == 1 else _AllGatherRowsReduceScatterGrad.apply(x2, etp_comm, counts)
    with _step("route", gather_groups, where):
        weights, chosen, scores = router.route(X)
        slots = chosen if placement is None else route(chosen, placement, offset=ep_comm.rank)
        if etp_comm.size > 1:  # see the module docstring: the router's backward on whole gradients, once per token
            weights = weights.to(torch.promote_types(weights.dtype, X.dtype))
            if weights.requires_grad:
                weights = _SumGradOnOwnRows.apply(weights, etp_comm, counts)
    with _step("dispatch", groups, where):
        recv_x, tokens_per_expert, handle = dispatcher.dispatch(X, slots, weights=weights.detach())
    with _step("experts", groups, where):
        out = experts(recv_x, tokens_per_expert)
    with _step("combine", groups, where):
        y_partial = dispatcher.combine(out, handle, weights)
    with _step("reduce_scatter", groups, where):
        y = reduce_scatter_tokens(y_partial, etp_comm, counts).to(x.dtype)
    lay = handle.layout
    per_expert = lay.global_tokens_per_expert if placement is None else fold_replicas(lay.global_tokens_per_expert,
                                                                                      placement)
    mine = slice(sum(counts[:etp_comm.rank]), sum(counts[:etp_comm.rank + 1]))  # this rank's rows of X
    aux = router.aux_loss(type(scores)(*(t[mine] for t in scores)), per_expert, lay.num_global_tokens)
    if not return_routing:
        return y.reshape(shape), aux
    return y.reshape(shape), aux, handle, chosen[mine]


# ---- state dicts of a layer with ETP (moe.layer.gather_state_dict / shard_state_dict) ----------------
# the dim of an expert tensor [L, ...] that ETP shards, and which of shard_indices' index tensors is its shard
_SHARDED = {"experts.fc1": (2, 0), "experts.fc2": (1, 1)}


def gather_expert_slots(layer: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """Every slot's whole expert tensor ``name`` of a :class:`moe.MoELayer` (collective over ``layer.comm``).

    Args:
        layer: the layer (every rank of ``layer.comm`` calls this, in the same order of names).
        name: ``"experts.fc1"`` or ``"experts.fc2"``.
        t: this rank's tensor [L, ...] (its ETP shards when ``layer.expert_tp_size`` T > 1).

    Returns:
        [(E + R), H, F or 2F] for fc1, [(E + R), F, H] for fc2, in slot order (EP rank, then local
        slot): one all-gather over ``layer.comm`` (rank = ep_rank * T + etp_rank), each ETP rank's
        shard put back where :func:`shard_indices` took it from. With T = 1 the all-gather alone.
    """
    comm, T = layer.comm, layer.expert_tp_size
    t = t.detach().contiguous()
    parts = comm.all_gather(t) if comm.size > 1 else t.clone()  # [P * L, ...]: EP rank-major, then ETP rank
    if T == 1:
        return parts
    dim, which = _SHARDED[name]
    L, rest = t.shape[0], t.shape[1:]
    parts = parts.view(comm.size // T, T, L, *rest)
    shape = [comm.size // T * L, *rest]
    shape[dim] *= T
    full = t.new_zeros(shape)
    for r in range(T):
        idx = shard_indices(layer.ffn_hidden_size, layer.activation, r, T)[which].to(t.device)
        full.index_copy_(dim, idx, parts[:, r].reshape(-1, *rest))
    return full


def shard_expert_slots(layer: nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's ETP shard of whole expert tensors ``t`` [n, ...] of ``name`` (local): ``t`` itself when T = 1."""
    T = layer.expert_tp_size
    if T == 1:
        return t
    dim, which = _SHARDED[name]
    return t.index_select(dim, shard_indices(layer.ffn_hidden_size, layer.activation, layer.etp_comm.rank,
                                             T)[which].to(t.device))
