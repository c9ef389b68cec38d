"""The autograd "regions" of tensor parallelism, named as in Megatron-LM's ``tensor_parallel/mappings.py``.

Each function is named for what it does in forward; its backward is the mirror:

=============================================  ========================  =========================
function                                       forward                   backward
=============================================  ========================  =========================
copy_to_tensor_parallel_region                 identity                  all-reduce
reduce_from_tensor_parallel_region             all-reduce                identity
scatter_to_tensor_parallel_region              split last dim            all-gather last dim
gather_from_tensor_parallel_region             all-gather last dim       split last dim
scatter_to_sequence_parallel_region            split first dim           all-gather first dim
gather_from_sequence_parallel_region           all-gather first dim      reduce-scatter first dim
reduce_scatter_to_sequence_parallel_region     reduce-scatter first dim  all-gather first dim
=============================================  ========================  =========================

Double backward is not supported (it raises).
"""

from __future__ import annotations

from typing import Callable, NoReturn

import torch
from torch.autograd.function import once_differentiable

from collectives.agreement import rank_label, reject
from collectives.protocols import CommunicatorLike


# ---- helpers ------------------------------------------------------------------------------------
def divide(numerator: int, denominator: int, *, what: str = "size") -> int:
    """``numerator // denominator``; local, pure.

    Args:
        numerator: e.g. a feature count. denominator: the tensor-parallel size.
        what: how to name ``numerator`` in the error.

    Returns:
        The quotient; raises ``ValueError`` naming both numbers when it does not divide.
    """
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}; "
                         f"use a multiple of {denominator} or another group size")
    return numerator // denominator


def _refuse(comm: CommunicatorLike, x: object, name: str, problem: str, kind: type = ValueError) -> NoReturn:
    """Raise here, and make the peers' next collective raise too (they may not have this problem)."""
    reject(comm, kind(f"{name} on {rank_label(comm)}: {problem}"), on=x)


def _shard_size(x: torch.Tensor, dim: int, comm: CommunicatorLike, name: str) -> int:
    """``x.shape[dim] / comm.size`` (dim 0 or -1), or refuse a 0-d or indivisible x (collectively)."""
    what = "last dim" if dim == -1 else "first (sequence) dim"
    if x.dim() == 0:
        _refuse(comm, x, name, f"got a 0-d tensor; need a {what}")
    try:
        return divide(x.shape[dim], comm.size, what=f"{what} of shape {tuple(x.shape)} =")
    except ValueError as e:
        _refuse(comm, x, name, str(e))


def _reduce(x: torch.Tensor, comm: CommunicatorLike, name: str) -> torch.Tensor:
    """All-reduce (sum) over the group."""
    if comm.size == 1:
        return x
    return comm.all_reduce(x.detach().contiguous())


def _split_last_dim(x: torch.Tensor, comm: CommunicatorLike, name: str) -> torch.Tensor:
    """This rank's block of the last dim."""
    if comm.size == 1:
        return x
    n = _shard_size(x, -1, comm, name)
    return x[..., comm.rank * n:(comm.rank + 1) * n].contiguous()


def _gather_last_dim(x: torch.Tensor, comm: CommunicatorLike, name: str) -> torch.Tensor:
    """Concatenate every rank's x along the last dim, in rank order."""
    if comm.size == 1:
        return x
    g = comm.all_gather(x.detach().contiguous().unsqueeze(0))  # [size, *x.shape]
    return torch.cat(g.unbind(0), dim=-1).contiguous()


def _split_first_dim(x: torch.Tensor, comm: CommunicatorLike, name: str) -> torch.Tensor:
    """This rank's block of the first dim."""
    if comm.size == 1:
        return x
    n = _shard_size(x, 0, comm, name)
    return x[comm.rank * n:(comm.rank + 1) * n].contiguous()


def _gather_first_dim(x: torch.Tensor, comm: CommunicatorLike, name: str) -> torch.Tensor:
    """Concatenate every rank's x along the first dim, in rank order."""
    if comm.size == 1:
        return x
    if x.dim() == 0:
        _refuse(comm, x, name, "got a 0-d tensor; need a first (sequence) dim")
    return comm.all_gather(x.detach().contiguous())


def _reduce_scatter_first_dim(x: torch.Tensor, comm: CommunicatorLike, name: str) -> torch.Tensor:
    """Sum over the group, keep this rank's block of the first dim."""
    if comm.size == 1:
        return x
    _shard_size(x, 0, comm, name)
    return comm.reduce_scatter(x.detach().contiguous())


# ---- autograd regions ---------------------------------------------------------------------------
def _identity(x: torch.Tensor, comm: CommunicatorLike, name: str) -> torch.Tensor:
    return x


def _tensor(x: object, comm: CommunicatorLike, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        _refuse(comm, x, name, f"x must be a torch.Tensor, got {type(x).__name__}", TypeError)
    return x


def _region(name: str, forward: Callable[..., torch.Tensor], backward: Callable[..., torch.Tensor]) -> type:
    """An autograd Function running ``forward(x, comm, name)`` forward and ``backward(grad, comm, name)`` backward."""

    class Region(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, comm):
            ctx.comm = comm
            return forward(_tensor(x, comm, name), comm, name)

        @staticmethod
        @once_differentiable  # the collectives run on detached tensors: a second derivative must raise
        def backward(ctx, grad):
            return backward(grad, ctx.comm, f"{name} (backward)"), None

    Region.__name__ = Region.__qualname__ = "".join(w.title() for w in name.split("_"))
    return Region


# The table of the module docstring: (forward, backward) of each region.
_COPY_TO = _region("copy_to_tensor_parallel_region", _identity, _reduce)
_REDUCE_FROM = _region("reduce_from_tensor_parallel_region", _reduce, _identity)
_SCATTER_TO = _region("scatter_to_tensor_parallel_region", _split_last_dim, _gather_last_dim)
_GATHER_FROM = _region("gather_from_tensor_parallel_region", _gather_last_dim, _split_last_dim)
_SCATTER_TO_SEQUENCE = _region("scatter_to_sequence_parallel_region", _split_first_dim, _gather_first_dim)
_GATHER_FROM_SEQUENCE = _region("gather_from_sequence_parallel_region", _gather_first_dim, _reduce_scatter_first_dim)
_GATHER_FROM_SEQUENCE_FULL_GRAD = _region("gather_from_sequence_parallel_region", _gather_first_dim, _split_first_dim)
_REDUCE_SCATTER_TO_SEQUENCE = _region("reduce_scatter_to_sequence_parallel_region", _reduce_scatter_first_dim,
                                      _gather_first_dim)


# Every region is collective (forward or backward) and checks its input on this rank only: a rank
# that refuses its input makes the peers' next collective raise (collectives.agreement.reject).
def copy_to_tensor_parallel_region(x: torch.Tensor, comm: CommunicatorLike) -> torch.Tensor:
    """Enter a TP region with a replicated tensor: forward identity, backward all-reduce (sum).

    Args:
        x: [*, h] float, the same on every rank.
        comm: the tensor-parallel group.

    Returns:
        x itself ([*, h], x.dtype). The gradient that reaches x is the sum of every rank's
        gradient, so each rank's partial contribution counts.
    """
    return _COPY_TO.apply(x, comm)


def reduce_from_tensor_parallel_region(x: torch.Tensor, comm: CommunicatorLike) -> torch.Tensor:
    """Leave a TP region by summing partial results: forward all-reduce, backward identity.

    Args:
        x: [*, h] float, this rank's partial sum (same shape and dtype on every rank).
        comm: the tensor-parallel group.

    Returns:
        [*, h] x.dtype: the sum over ranks, the same on every rank.
    """
    return _REDUCE_FROM.apply(x, comm)


def scatter_to_tensor_parallel_region(x: torch.Tensor, comm: CommunicatorLike) -> torch.Tensor:
    """Keep this rank's block of the last dim: forward split, backward all-gather (last dim).

    Args:
        x: [*, h] float, the same on every rank; h divisible by comm.size.
        comm: the tensor-parallel group.

    Returns:
        [*, h / size] x.dtype (contiguous): columns [rank * h / size, (rank + 1) * h / size).
    """
    return _SCATTER_TO.apply(x, comm)


def gather_from_tensor_parallel_region(x: torch.Tensor, comm: CommunicatorLike) -> torch.Tensor:
    """Concatenate every rank's block along the last dim: forward all-gather, backward split.

    Args:
        x: [*, h / size] float, this rank's block (same shape and dtype on every rank).
        comm: the tensor-parallel group.

    Returns:
        [*, h] x.dtype, the blocks in rank order. The backward keeps this rank's block of the
        (replicated) gradient.
    """
    return _GATHER_FROM.apply(x, comm)


def scatter_to_sequence_parallel_region(x: torch.Tensor, comm: CommunicatorLike) -> torch.Tensor:
    """Keep this rank's block of the first (sequence) dim: forward split, backward all-gather.

    Args:
        x: [s, *] float, the same on every rank; s divisible by comm.size.
        comm: the tensor-parallel group.

    Returns:
        [s / size, *] x.dtype: rows [rank * s / size, (rank + 1) * s / size).
    """
    return _SCATTER_TO_SEQUENCE.apply(x, comm)


def gather_from_sequence_parallel_region(x: torch.Tensor, comm: CommunicatorLike, *,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence shards along the first dim; backward reduce-scatter (or split).

    Args:
        x: [s / size, *] float, this rank's sequence shard (same shape and dtype on every rank).
        comm: the tensor-parallel group.
        tensor_parallel_output_grad: True (default) when what consumes the output is
            tensor-parallel, so each rank's gradient is a partial sum (backward reduce-scatters);
            False when the consumer is replicated and every rank holds the full gradient
            (backward only keeps this rank's block).

    Returns:
        [s, *] x.dtype, the shards in rank order.
    """
    return (_GATHER_FROM_SEQUENCE if tensor_parallel_output_grad else _GATHER_FROM_SEQUENCE_FULL_GRAD).apply(x, comm)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, comm: CommunicatorLike) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence shard: forward reduce-scatter, backward all-gather.

    Args:
        x: [s, *] float, this rank's partial sum (same shape and dtype on every rank); s divisible
            by comm.size.
        comm: the tensor-parallel group.

    Returns:
        [s / size, *] x.dtype: rows [rank * s / size, (rank + 1) * s / size) of the sum over ranks.
    """
    return _REDUCE_SCATTER_TO_SEQUENCE.apply(x, comm)
