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

The two autograd regions over the ETP group, each named for its forward and its backward:

==================================  ===========================  ===========================
function                            forward                      backward
==================================  ===========================  ===========================
gather_tokens                       all-gather rows (uneven)     reduce-scatter rows (uneven)
reduce_scatter_tokens               reduce-scatter rows          all-gather rows
==================================  ===========================  ===========================

Weights do not depend on the layout: expert e's full fc1/fc2 are drawn as :class:`moe.layer.GroupedExperts`
draws them (``seeded_generator(seed, EXPERT_STREAM, e)``), then sliced, so the same seed gives the same
function as a one-process :class:`moe.layer.MoELayer`. Double backward is not supported (it raises).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from collectives.agreement import agree, rank_label, reject
from collectives.protocols import CommunicatorLike, check_communicator
from transports.base import dtype_code, dtype_name

from .records import _FLOATS
from .router import EXPERT_STREAM, is_positive_int, seeded_generator, shape_or_type

__all__ = ["ShardedExperts", "etp_forward", "expert_tp_groups", "gather_tokens", "reduce_scatter_tokens",
           "shard_expert_weights", "shard_indices"]

# ---- the FFN pieces of moe.layer ----------------------------------------------------------------
# Copies of moe.layer's _ACTIVATIONS, _GATED and _ffn_weights: moe.layer is to import this module (for
# MoELayer(expert_tp_size=T)), and tests/test_import_graph.py rejects a circle even through an import
# inside a function. tests/test_expert_tp.py checks that they match moe.layer's.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "swiglu": lambda h: F.silu(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:],
    "geglu": lambda h: F.gelu(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:],
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}
_GATED = ("swiglu", "geglu")


def _ffn_weights(hidden: int, ffn: int, activation: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1 [H, F or 2F] ~ N(0, 1/H), fc2 [F, H] ~ N(0, 1/F), drawn in that order from ``gen``."""
    width = 2 * ffn if activation in _GATED else ffn
    fc1 = torch.randn(hidden, width, generator=gen) / math.sqrt(hidden)
    fc2 = torch.randn(ffn, hidden, generator=gen) / math.sqrt(ffn)
    return fc1, fc2


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

    Local expert ``i`` is global expert ``first_expert + i``; its full weights are drawn from
    ``seeded_generator(seed, EXPERT_STREAM, first_expert + i)`` exactly as
    :class:`moe.layer.GroupedExperts` draws them, then sliced by :func:`shard_expert_weights`, so they
    depend on neither the EP nor the ETP layout. Local (no communication); ``ValueError`` on a bad argument.

    Args:
        num_local_experts: L. first_expert: the global id of local expert 0.
        hidden_size: H. ffn_hidden_size: F, divisible by T. activation: a key of ``_ACTIVATIONS``.
        seed: an int >= 0. etp_rank: r in [0, T). expert_tp_size: T.
    """

    def __init__(self, num_local_experts: int, first_expert: int, hidden_size: int, ffn_hidden_size: int,
                 activation: str, seed: int, *, etp_rank: int, expert_tp_size: int):
        super().__init__()
        shard_indices(ffn_hidden_size, activation, etp_rank, expert_tp_size)  # checks the arguments
        self.activation, self.etp_rank, self.expert_tp_size = activation, etp_rank, expert_tp_size
        self.first_expert, self.ffn_hidden_size = first_expert, ffn_hidden_size
        shards = [shard_expert_weights(*_ffn_weights(hidden_size, ffn_hidden_size, activation,
                                                     seeded_generator(seed, EXPERT_STREAM, first_expert + i)),
                                       activation, etp_rank, expert_tp_size) for i in range(num_local_experts)]
        w1, w2 = zip(*shards) if shards else ((), ())
        width = (2 if activation in _GATED else 1) * (ffn_hidden_size // expert_tp_size)
        self.fc1 = nn.Parameter(torch.stack(w1) if w1 else torch.zeros(0, hidden_size, width))
        self.fc2 = nn.Parameter(torch.stack(w2) if w2 else torch.zeros(0, ffn_hidden_size // expert_tp_size,
                                                                          hidden_size))

    def extra_repr(self) -> str:
        L = self.fc1.shape[0]
        return (f"experts {self.first_expert}..{self.first_expert + L - 1}, shard {self.etp_rank} of "
                f"{self.expert_tp_size}, fc1 {tuple(self.fc1.shape)}, fc2 {tuple(self.fc2.shape)}, "
                f"activation={self.activation!r}")

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


def etp_forward(x: torch.Tensor, router: nn.Module, dispatcher: Any, experts: ShardedExperts,
                etp_comm: CommunicatorLike, *, return_routing: bool = False) -> tuple[torch.Tensor, ...]:
    """Gather over ETP, route, dispatch over EP, run the expert shards, combine, reduce-scatter over ETP.

    Collective over both groups, and so is its backward: every rank calls it (and backward on a loss
    that depends on y, even with 0 tokens). An error on one rank (a bad x, a failing step) raises
    there and makes every other rank raise too, each at its next collective of this call; after one,
    the groups may be out of step: close them and split again.

    Args:
        x: [T_i, H] or [B, S, H] float (T_i, or B * S, may differ between ranks, and be 0).
        router: a :class:`moe.router.TopKRouter`, the same (replicated) on every rank.
        dispatcher: an :class:`moe.dispatcher.ExpertDispatcher` over this rank's EP group (E experts).
        experts: this rank's :class:`ShardedExperts`: L = dispatcher.num_local_experts experts from
            dispatcher.first_local_expert, shard etp_comm.rank of etp_comm.size.
        etp_comm: this rank's ETP group (:func:`expert_tp_groups`).
        return_routing: also return the dispatch handle and this rank's routing (for a layer's
            ``last_handle`` and expert-load counters).

    Returns:
        ``(y, aux_loss)``: y of x's shape and dtype, the layer's output for this rank's tokens;
        aux_loss a 0-d float32 tensor: the router losses of the ETP group's tokens (over the whole
        batch's counts) divided by T, so that the shares of all P ranks sum to the loss one
        process computes over all tokens. With ``return_routing``: ``(y, aux_loss, handle, chosen)``,
        handle the EP dispatch handle (of X's rows: the ETP group's tokens), chosen [T_i, k] int64
        the global experts of this rank's own tokens (summed over all P ranks, their counts are the
        batch's, each token counted once).
    """
    ep_comm = dispatcher.comm
    where = f"etp_forward on {rank_label(ep_comm) if etp_comm.size == 1 else rank_label(etp_comm)}"
    device = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    # dispatch starts with its count exchange, on the CPU; the other collectives move x's device's tensors
    groups = {"ep": (ep_comm, device), "etp": (etp_comm, device)}
    gather_groups = {"ep": (ep_comm, "cpu"), "etp": (etp_comm, device)}
    H = router.hidden_size
    shape = x.shape if isinstance(x, torch.Tensor) and x.dim() in (2, 3) else None
    err = None
    if shape is None or x.shape[-1] != H:
        err = ValueError(f"x must be [T, {H}] or [B, S, {H}], got {shape_or_type(x)}")
    elif (experts.expert_tp_size, experts.etp_rank) != (etp_comm.size, etp_comm.rank) or (
            experts.fc1.shape[0], experts.first_expert) != (dispatcher.num_local_experts, dispatcher.first_local_expert):
        err = ValueError(f"experts hold experts {experts.first_expert}.. ({experts.fc1.shape[0]}), shard "
                         f"{experts.etp_rank} of {experts.expert_tp_size}; the dispatcher and etp_comm want "
                         f"{dispatcher.first_local_expert}.. ({dispatcher.num_local_experts}), shard "
                         f"{etp_comm.rank} of {etp_comm.size}")
    x2 = x.reshape(-1, H) if err is None else x
    with _step("gather", gather_groups, where):
        counts = _exchange_counts(x2, etp_comm, "etp_forward", hidden=H, error=err)
        X = x2 if etp_comm.size == 1 else _AllGatherRowsReduceScatterGrad.apply(x2, etp_comm, counts)
    with _step("route", gather_groups, where):
        weights, chosen, scores = router.route(X)
    with _step("dispatch", groups, where):
        recv_x, tokens_per_expert, handle = dispatcher.dispatch(X, chosen, weights=weights.detach())
    with _step("experts", groups, where):
        out = experts(recv_x, tokens_per_expert)
    with _step("combine", groups, where):
        y_partial = dispatcher.combine(out, handle, weights)
    with _step("reduce_scatter", groups, where):
        y = reduce_scatter_tokens(y_partial, etp_comm, counts).to(x.dtype)
    lay = handle.layout
    aux = router.aux_loss(scores, lay.global_tokens_per_expert, lay.num_global_tokens) / etp_comm.size
    if not return_routing:
        return y.reshape(shape), aux
    start = sum(counts[:etp_comm.rank])
    return y.reshape(shape), aux, handle, chosen[start:start + counts[etp_comm.rank]]
