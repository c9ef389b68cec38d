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

from typing import Any

import torch
from torch.autograd.function import once_differentiable

Comm = Any  # collectives.Communicator, or anything with .rank, .size and its collectives


# ---- helpers ------------------------------------------------------------------------------------
def divide(numerator: int, denominator: int, *, what: str = "size") -> int:
    """``numerator // denominator``; raises ValueError (with the numbers) when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}; "
                         f"use a multiple of {denominator} or another group size")
    return numerator // denominator


def _where(comm: Comm) -> str:
    ranks = getattr(comm, "global_ranks", None)
    r = ranks[comm.rank] if ranks else comm.rank
    return f"rank {r} (tp rank {comm.rank} of {comm.size})"


def _reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """All-reduce (sum) over the group."""
    if comm.size == 1:
        return x
    return comm.all_reduce(x.detach().contiguous())


def _split_last_dim(x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
    """This rank's block of the last dim."""
    if comm.size == 1:
        return x
    if x.dim() == 0:
        raise ValueError(f"{name}: {_where(comm)} got a 0-d tensor; need at least 1 dim")
    n = divide(x.shape[-1], comm.size, what=f"{name}: last dim of shape {tuple(x.shape)} =")
    return x[..., comm.rank * n:(comm.rank + 1) * n].contiguous()


def _gather_last_dim(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Concatenate every rank's x along the last dim, in rank order."""
    if comm.size == 1:
        return x
    g = comm.all_gather(x.detach().contiguous().unsqueeze(0))  # [size, *x.shape]
    return torch.cat(g.unbind(0), dim=-1).contiguous()


def _split_first_dim(x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
    """This rank's block of the first dim."""
    if comm.size == 1:
        return x
    if x.dim() == 0:
        raise ValueError(f"{name}: {_where(comm)} got a 0-d tensor; need a first (sequence) dim")
    n = divide(x.shape[0], comm.size, what=f"{name}: first (sequence) dim of shape {tuple(x.shape)} =")
    return x[comm.rank * n:(comm.rank + 1) * n].contiguous()


def _gather_first_dim(x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
    """Concatenate every rank's x along the first dim, in rank order."""
    if comm.size == 1:
        return x
    if x.dim() == 0:
        raise ValueError(f"{name}: {_where(comm)} got a 0-d tensor; need a first (sequence) dim")
    return comm.all_gather(x.detach().contiguous())


def _reduce_scatter_first_dim(x: torch.Tensor, comm: Comm, name: str) -> torch.Tensor:
    """Sum over the group, keep this rank's block of the first dim."""
    if comm.size == 1:
        return x
    if x.dim() == 0:
        raise ValueError(f"{name}: {_where(comm)} got a 0-d tensor; need a first (sequence) dim")
    divide(x.shape[0], comm.size, what=f"{name}: first (sequence) dim of shape {tuple(x.shape)} =")
    return comm.reduce_scatter(x.detach().contiguous())

# ---- autograd regions ---------------------------------------------------------------------------
class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _reduce(grad, ctx.comm), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """Forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, comm):
        return _reduce(x, comm)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Forward split of the last dim, backward all-gather of the last dim."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_last_dim(x, comm, "scatter_to_tensor_parallel_region")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.comm), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward all-gather of the last dim, backward split of the last dim."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_last_dim(x, comm)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.comm, "gather_from_tensor_parallel_region (backward)"), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward split of the first dim, backward all-gather of the first dim."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _split_first_dim(x, comm, "scatter_to_sequence_parallel_region")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.comm, "scatter_to_sequence_parallel_region (backward)"), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """Forward all-gather of the first dim; backward reduce-scatter (or split, see the public function)."""

    @staticmethod
    def forward(ctx, x, comm, tensor_parallel_output_grad):
        ctx.comm = comm
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return _gather_first_dim(x, comm, "gather_from_sequence_parallel_region")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        name = "gather_from_sequence_parallel_region (backward)"
        if ctx.tensor_parallel_output_grad:
            return _reduce_scatter_first_dim(grad, ctx.comm, name), None, None
        return _split_first_dim(grad, ctx.comm, name), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Forward reduce-scatter of the first dim, backward all-gather of the first dim."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _reduce_scatter_first_dim(x, comm, "reduce_scatter_to_sequence_parallel_region")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.comm, "reduce_scatter_to_sequence_parallel_region (backward)"), None


def copy_to_tensor_parallel_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Enter a TP region with a replicated tensor: forward identity, backward all-reduce (sum).

    x: [*, h] any float dtype, the same on every rank. Returns x (a view). The gradient that
    reaches x is the sum of every rank's gradient, so each rank's partial contribution counts.
    """
    return _CopyToTensorParallelRegion.apply(x, comm)


def reduce_from_tensor_parallel_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Leave a TP region by summing partial results: forward all-reduce, backward identity.

    x: [*, h] this rank's partial sum. Returns [*, h], the sum over ranks (same on every rank).
    """
    return _ReduceFromTensorParallelRegion.apply(x, comm)


def scatter_to_tensor_parallel_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Keep this rank's block of the last dim: forward split, backward all-gather (last dim).

    x: [*, h], the same on every rank, h divisible by comm.size. Returns [*, h / size] (contiguous).
    """
    return _ScatterToTensorParallelRegion.apply(x, comm)


def gather_from_tensor_parallel_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Concatenate every rank's block along the last dim: forward all-gather, backward split.

    x: [*, h / size] this rank's block (same leading shape on every rank). Returns [*, h] in
    rank order. The backward keeps this rank's block of the (replicated) gradient.
    """
    return _GatherFromTensorParallelRegion.apply(x, comm)


def scatter_to_sequence_parallel_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Keep this rank's block of the first (sequence) dim: forward split, backward all-gather.

    x: [s, *], the same on every rank, s divisible by comm.size. Returns [s / size, *].
    """
    return _ScatterToSequenceParallelRegion.apply(x, comm)


def gather_from_sequence_parallel_region(x: torch.Tensor, comm: Comm, *,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence shards along the first dim; backward reduce-scatter.

    x: [s / size, *] this rank's sequence shard. Returns [s, *] in rank order.
    tensor_parallel_output_grad: True (default) when what consumes the output is tensor-parallel,
    so each rank's gradient is a partial sum (backward reduce-scatters); False when the consumer
    is replicated and every rank holds the full gradient (backward only keeps this rank's block).
    """
    return _GatherFromSequenceParallelRegion.apply(x, comm, bool(tensor_parallel_output_grad))


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence shard: forward reduce-scatter, backward all-gather.

    x: [s, *] this rank's partial sum, s divisible by comm.size. Returns [s / size, *].
    """
    return _ReduceScatterToSequenceParallelRegion.apply(x, comm)
