"""Megatron-style tensor-parallel layers on a :class:`~collectives.Communicator`.

    from collectives.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    fc1 = ColumnParallelLinear(hidden, ffn, comm)            # weight [ffn / tp, hidden]
    fc2 = RowParallelLinear(ffn, hidden, comm)               # weight [hidden, ffn / tp]
    y = fc2(F.gelu(fc1(x)))                                  # x, y: [tokens, hidden], replicated

Every rank of ``comm`` is one tensor-parallel (TP) rank. The column layer splits the output
dim of the weight, the row layer its input dim, the vocab-parallel embedding its vocabulary.
The communication lives in autograd "region" functions named, as in Megatron-LM's
``tensor_parallel/mappings.py``, for what they do in forward (their backward is the mirror):

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

Sequence parallelism (``sequence_parallel=True``) keeps activations outside the TP region
sharded along the first (sequence) dim: the column layer all-gathers its input, the row layer
reduce-scatters its output. All ranks must run the same layers in the same order (forward and
backward), as for every collective. Double backward is not supported (it raises).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "divide",
]

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


# ---- initialisation ----------------------------------------------------------------------------
_INIT_BLOCK_ROWS = 64  # rows per generator; fixed so that the global matrix never depends on the TP size
_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64 over ``values``: a well-spread 63-bit generator seed."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h & ((1 << 63) - 1)


def _global_init(seed: int, tag: int, shape: tuple[int, ...], rows: slice, cols: slice | None, *, dist: str,
                 scale: float, dtype: torch.dtype, device) -> torch.Tensor:
    """Block ``[rows, cols]`` of a global init tensor that is a function of (seed, tag, shape) only.

    The global [R, C] (or [R]) tensor is drawn in blocks of ``_INIT_BLOCK_ROWS`` rows, each from its
    own generator, so a rank draws only the blocks that meet its rows (memory: its shard plus one
    block) and any split of the same tensor gives the same values. dist: "uniform" (in
    [-scale, scale)) or "normal" (std ``scale``). Values are drawn in float32, then cast.
    """
    R = shape[0]
    C = shape[1] if len(shape) > 1 else None
    r0, r1, _ = rows.indices(R)
    parts = []
    b = r0 // _INIT_BLOCK_ROWS
    while b * _INIT_BLOCK_ROWS < r1:
        lo = b * _INIT_BLOCK_ROWS
        hi = min(lo + _INIT_BLOCK_ROWS, R)
        g = torch.Generator().manual_seed(_mix(seed, tag, b))
        bshape = (hi - lo,) if C is None else (hi - lo, C)
        if dist == "uniform":
            blk = torch.rand(bshape, generator=g, dtype=torch.float32).mul_(2 * scale).sub_(scale)
        else:
            blk = torch.randn(bshape, generator=g, dtype=torch.float32).mul_(scale)
        blk = blk[max(r0, lo) - lo:min(r1, hi) - lo]
        if cols is not None:
            blk = blk[:, cols]
        parts.append(blk)
        b += 1
    return torch.cat(parts).to(dtype=dtype, device=device).contiguous()


def _agreed_seed(seed: int | None, comm: Comm) -> int:
    """``seed``, or one drawn from torch's global generator on rank 0 and broadcast (collective)."""
    if seed is not None:
        return int(seed)
    drawn = torch.randint(0, 2**62, (1,), dtype=torch.int64)  # every rank draws: global RNG streams stay in step
    if comm.size > 1:
        drawn = comm.broadcast(drawn, 0)
    return int(drawn.item())


def _check_replicated(comm: Comm, what: str, tensors: list[torch.Tensor | None]) -> None:
    """Raise ValueError on every rank if the ranks hold different ``tensors`` (one all-gather of a fingerprint)."""
    if comm.size == 1:
        return
    fp = []
    for t in tensors:
        if t is None:
            fp += [-1.0, 0.0, 0.0, 0.0, 0.0]
            continue
        d = t.detach().to(torch.float64).reshape(t.shape[0] if t.dim() else 1, -1)
        ramp = torch.arange(1, d.shape[0] + 1, dtype=torch.float64, device=d.device) / max(d.shape[0], 1)
        fp += [float(t.numel()), float(d.shape[0]), float(d.sum()), float((d * d).sum()),
               float((d.sum(1) * ramp).sum())]
    mine = torch.tensor(fp, dtype=torch.float64)
    allfp = comm.all_gather(mine.unsqueeze(0))  # [size, k]
    tol = 1e-9 * (1.0 + allfp.abs().amax(0))  # summation order may differ between ranks' thread counts
    bad = [r for r in range(comm.size) if ((allfp[r] - allfp[0]).abs() > tol).any()]
    if bad:
        raise ValueError(f"{what}: the dense layer differs between ranks (tp ranks {bad} differ from tp rank 0; "
                         f"seen on {_where(comm)}); build it identically on every rank (same seed, or "
                         "load the same checkpoint) before sharding it")


def _mark(param: nn.Parameter, partition_dim: int | None) -> None:
    # Megatron's attribute names, so its grad-norm / checkpoint tools count sharded and replicated params right.
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = -1 if partition_dim is None else partition_dim
    param.partition_stride = 1


def _check_comm(comm: Comm, cls: str) -> None:
    if not (hasattr(comm, "size") and hasattr(comm, "rank") and hasattr(comm, "all_reduce")):
        raise TypeError(f"{cls}: comm must be a collectives.Communicator (got {type(comm).__name__})")


def _check_features(cls: str, **sizes: int) -> None:
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{cls}: {name} must be a positive int, got {v!r}")


def _meta_module(factory, device, dtype):
    """A module built on the meta device (no init, no RNG draw), then given real storage."""
    m = factory(device="meta", dtype=dtype)
    return m.to_empty(device=torch.device("cpu") if device is None else device)


# ---- layers ---------------------------------------------------------------------------------------
def _linear_from_dense(cls, linear: nn.Linear, comm: Comm, kw: dict, options: dict) -> nn.Module:
    """Shared body of the linear layers' ``from_dense``: check, build without init, load this rank's shard."""
    name = cls.__name__
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{name}.from_dense needs a torch.nn.Linear, got {type(linear).__name__}")
    bad = set(kw) - set(options)
    if bad:
        raise TypeError(f"{name}.from_dense: unexpected options {sorted(bad)}")
    self = cls.__new__(cls)
    nn.Module.__init__(self)
    self._setup(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                **{k: kw.get(k, default) for k, default in options.items()},
                dtype=linear.weight.dtype, device=linear.weight.device)
    _check_replicated(comm, f"{name}.from_dense", [linear.weight, linear.bias])
    with torch.no_grad():
        self._load_dense(linear)
    return self


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W [out, in] split along the output dim (rows) across the TP group.

    Parameters on each rank: ``weight`` [out / tp, in], ``bias`` [out / tp] (this rank's block of
    output features). Input x: [*, in] replicated on every rank, or with ``sequence_parallel``
    [s / tp, *, in] (this rank's block of the first dim, which it all-gathers). Output:
    [*, out / tp] (or [s, *, out / tp] with sequence_parallel); [*, out] with ``gather_output``.

    Initialisation (as ``torch.nn.Linear``: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias) depends
    only on ``seed`` and the global shape, so the layer is the same function for every TP size.
    ``seed=None`` draws a seed from torch's global generator on rank 0 and broadcasts it (collective).
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 seed: int | None = None):
        super().__init__()
        self._setup(in_features, out_features, comm, bias=bias, gather_output=gather_output,
                    sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.reset_parameters(seed=seed)

    def _setup(self, in_features, out_features, comm, *, bias, gather_output, sequence_parallel, dtype, device):
        _check_comm(comm, "ColumnParallelLinear")
        _check_features("ColumnParallelLinear", in_features=in_features, out_features=out_features)
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output=True and sequence_parallel=True do not combine "
                             "(the gathered output would be full-sequence); gather with "
                             "gather_from_tensor_parallel_region after the layer if you need it")
        self.comm = comm
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = bool(gather_output)
        self.sequence_parallel = bool(sequence_parallel)
        self.out_features_per_partition = divide(
            out_features, comm.size, what="ColumnParallelLinear: out_features")
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.out_features_per_partition, in_features, dtype=dtype,
                                               device=device))
        _mark(self.weight, 0)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features_per_partition, dtype=dtype, device=device))
            _mark(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def _rows(self) -> slice:
        n = self.out_features_per_partition
        return slice(self.comm.rank * n, (self.comm.rank + 1) * n)

    def reset_parameters(self, *, seed: int | None = None) -> None:
        """Re-initialise from ``seed`` (see the class docstring); collective when seed is None."""
        seed = _agreed_seed(seed, self.comm)
        bound = 1.0 / math.sqrt(self.in_features)
        shape = (self.out_features, self.in_features)
        with torch.no_grad():
            self.weight.copy_(_global_init(seed, 0, shape, self._rows(), None, dist="uniform", scale=bound,
                                           dtype=self.weight.dtype, device=self.weight.device))
            if self.bias is not None:
                self.bias.copy_(_global_init(seed, 1, (self.out_features,), self._rows(), None, dist="uniform",
                                             scale=bound, dtype=self.bias.dtype, device=self.bias.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [*, in] (sequence_parallel: [s / tp, *, in]) -> [*, out / tp] ([s, *, out / tp]); gather_output: [*, out]."""
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"ColumnParallelLinear: {_where(self.comm)} got input of shape {tuple(x.shape)}; "
                             f"expected last dim in_features = {self.in_features}")
        if self.sequence_parallel:
            x_total = gather_from_sequence_parallel_region(x, self.comm)
        else:
            x_total = copy_to_tensor_parallel_region(x, self.comm)
        y = F.linear(x_total, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.comm)
        return y

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Comm, **kw: Any) -> "ColumnParallelLinear":
        """Shard ``linear`` (the same on every rank; checked, collective): keep this rank's output rows.

        kw: gather_output, sequence_parallel. The layer takes linear's dtype and device.
        """
        return _linear_from_dense(cls, linear, comm, kw, {"gather_output": False, "sequence_parallel": False})

    def _load_dense(self, linear: nn.Linear) -> None:
        self.weight.copy_(linear.weight[self._rows()])
        if linear.bias is not None:
            self.bias.copy_(linear.bias[self._rows()])

    def to_dense(self) -> nn.Linear:
        """The full layer as a ``torch.nn.Linear`` on every rank (collective: all ranks call it)."""
        dense = _meta_module(lambda **f: nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, **f),
                             self.weight.device, self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(_gather_first_dim(self.weight, self.comm, "to_dense"))
            if self.bias is not None:
                dense.bias.copy_(_gather_first_dim(self.bias, self.comm, "to_dense"))
        return dense

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_partition} per rank of {self.comm.size}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W [out, in] split along the input dim (columns) across the TP group.

    Parameters on each rank: ``weight`` [out, in / tp] (this rank's block of input features),
    ``bias`` [out], replicated and added once, after the reduction. Input: [*, in / tp] (this
    rank's block, e.g. a column layer's output) with ``input_is_parallel``, else [*, in]
    replicated (split here). Output: [*, out], the same on every rank; with ``sequence_parallel``
    [s / tp, *, out], this rank's block of the first dim (reduce-scattered). Under sequence
    parallelism each rank's bias sees only its shard of the sequence, so the layer all-reduces
    the bias gradient itself (in backward): ``bias.grad`` is already the full gradient.

    Initialisation as :class:`ColumnParallelLinear` (same function for every TP size).
    """

    def __init__(self, in_features: int, out_features: int, comm: Comm, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 seed: int | None = None):
        super().__init__()
        self._setup(in_features, out_features, comm, bias=bias, input_is_parallel=input_is_parallel,
                    sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.reset_parameters(seed=seed)

    def _setup(self, in_features, out_features, comm, *, bias, input_is_parallel, sequence_parallel, dtype, device):
        _check_comm(comm, "RowParallelLinear")
        _check_features("RowParallelLinear", in_features=in_features, out_features=out_features)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (its input "
                             "comes from a column layer); split a replicated input with "
                             "scatter_to_tensor_parallel_region first")
        self.comm = comm
        self.in_features = in_features
        self.out_features = out_features
        self.input_is_parallel = bool(input_is_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.in_features_per_partition = divide(in_features, comm.size, what="RowParallelLinear: in_features")
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_partition, dtype=dtype,
                                               device=device))
        _mark(self.weight, 1)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
            _mark(self.bias, None)
            # Not Megatron's `sequence_parallel` attribute: its finalize step would all-reduce this grad a second time.
            self.bias.grad_reduced_by_layer = self.sequence_parallel
        else:
            self.register_parameter("bias", None)

    def _cols(self) -> slice:
        n = self.in_features_per_partition
        return slice(self.comm.rank * n, (self.comm.rank + 1) * n)

    def reset_parameters(self, *, seed: int | None = None) -> None:
        """Re-initialise from ``seed`` (see :class:`ColumnParallelLinear`); collective when seed is None."""
        seed = _agreed_seed(seed, self.comm)
        bound = 1.0 / math.sqrt(self.in_features)
        shape = (self.out_features, self.in_features)
        with torch.no_grad():
            self.weight.copy_(_global_init(seed, 0, shape, slice(None), self._cols(), dist="uniform", scale=bound,
                                           dtype=self.weight.dtype, device=self.weight.device))
            if self.bias is not None:
                self.bias.copy_(_global_init(seed, 1, (self.out_features,), slice(None), None, dist="uniform",
                                             scale=bound, dtype=self.bias.dtype, device=self.bias.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [*, in / tp] (input_is_parallel) or [*, in] -> [*, out]; sequence_parallel: [s, *, in / tp] -> [s / tp, *, out]."""
        want = self.in_features_per_partition if self.input_is_parallel else self.in_features
        if x.shape[-1:] != (want,):
            hint = (f"this rank's block in_features / tp = {self.in_features} / {self.comm.size}; pass "
                    "input_is_parallel=False for a replicated full input") if self.input_is_parallel else \
                f"in_features = {self.in_features}"
            raise ValueError(f"RowParallelLinear: {_where(self.comm)} got input of shape {tuple(x.shape)}; "
                             f"expected last dim {want} ({hint})")
        x_par = x if self.input_is_parallel else scatter_to_tensor_parallel_region(x, self.comm)
        y_par = F.linear(x_par, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y_par, self.comm)
        else:
            y = reduce_from_tensor_parallel_region(y_par, self.comm)
        if self.bias is None:
            return y
        # Under sequence parallelism this rank's rows are a shard: the bias grad must be summed over the group,
        # which is exactly the backward of copy-to (identity forward).
        b = copy_to_tensor_parallel_region(self.bias, self.comm) if self.sequence_parallel else self.bias
        return y + b

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: Comm, **kw: Any) -> "RowParallelLinear":
        """Shard ``linear`` (the same on every rank; checked, collective): keep this rank's input columns.

        kw: input_is_parallel, sequence_parallel. The layer takes linear's dtype and device.
        """
        return _linear_from_dense(cls, linear, comm, kw, {"input_is_parallel": True, "sequence_parallel": False})

    def _load_dense(self, linear: nn.Linear) -> None:
        self.weight.copy_(linear.weight[:, self._cols()])
        if linear.bias is not None:
            self.bias.copy_(linear.bias)

    def to_dense(self) -> nn.Linear:
        """The full layer as a ``torch.nn.Linear`` on every rank (collective: all ranks call it)."""
        dense = _meta_module(lambda **f: nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, **f),
                             self.weight.device, self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(_gather_last_dim(self.weight.detach(), self.comm))
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_partition} per rank of {self.comm.size}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table [num_embeddings, embedding_dim] split along the vocabulary across the TP group.

    Parameter on each rank: ``weight`` [num_embeddings / tp, embedding_dim], rows
    [rank * V / tp, (rank + 1) * V / tp) of the table. Input ids: [*] int64/int32, the same on
    every rank, each in [0, num_embeddings) (checked: ValueError otherwise). A rank looks up the
    ids in its range, zeroes the others, and the ranks all-reduce. Output [*, embedding_dim] on
    every rank; with ``sequence_parallel`` the all-reduce is a reduce-scatter and the output is
    [s / tp, *, embedding_dim] (this rank's block of the first dim of ids [s, *]).

    Initialisation N(0, 1) as ``torch.nn.Embedding``, a function of ``seed`` and the shape only.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Comm, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, sequence_parallel: bool = False,
                 seed: int | None = None):
        super().__init__()
        self._setup(num_embeddings, embedding_dim, comm, dtype=dtype, device=device,
                    sequence_parallel=sequence_parallel)
        self.reset_parameters(seed=seed)

    def _setup(self, num_embeddings, embedding_dim, comm, *, dtype, device, sequence_parallel):
        _check_comm(comm, "VocabParallelEmbedding")
        _check_features("VocabParallelEmbedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.comm = comm
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sequence_parallel = bool(sequence_parallel)
        self.num_embeddings_per_partition = divide(num_embeddings, comm.size,
                                                   what="VocabParallelEmbedding: num_embeddings")
        self.vocab_start_index = comm.rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype,
                                               device=device))
        _mark(self.weight, 0)

    def reset_parameters(self, *, seed: int | None = None) -> None:
        """Re-initialise from ``seed``; collective when seed is None."""
        seed = _agreed_seed(seed, self.comm)
        with torch.no_grad():
            self.weight.copy_(_global_init(seed, 2, (self.num_embeddings, self.embedding_dim),
                                           slice(self.vocab_start_index, self.vocab_end_index), None,
                                           dist="normal", scale=1.0, dtype=self.weight.dtype,
                                           device=self.weight.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [*] int -> [*, embedding_dim]; sequence_parallel: ids [s, *] -> [s / tp, *, embedding_dim]."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"VocabParallelEmbedding: ids must be int64 or int32, got {ids.dtype}")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise ValueError(f"VocabParallelEmbedding: {_where(self.comm)} got ids in [{lo}, {hi}]; "
                                 f"valid ids are in [0, {self.num_embeddings})")
        if self.comm.size > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        else:
            outside, local = None, ids
        y = F.embedding(local, self.weight)
        if outside is not None:
            y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.comm)
        return reduce_from_tensor_parallel_region(y, self.comm)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, comm: Comm, **kw: Any) -> "VocabParallelEmbedding":
        """Shard ``embedding`` (the same on every rank; checked, collective): keep this rank's vocabulary rows.

        kw: sequence_parallel. padding_idx, max_norm, scale_grad_by_freq and sparse are not supported.
        """
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding.from_dense needs a torch.nn.Embedding, "
                            f"got {type(embedding).__name__}")
        unsupported = {k: v for k, v in (("padding_idx", embedding.padding_idx), ("max_norm", embedding.max_norm),
                                         ("scale_grad_by_freq", embedding.scale_grad_by_freq or None),
                                         ("sparse", embedding.sparse or None)) if v is not None}
        if unsupported:
            raise ValueError(f"VocabParallelEmbedding.from_dense: {unsupported} not supported; "
                             "use a plain nn.Embedding")
        bad = set(kw) - {"sequence_parallel"}
        if bad:
            raise TypeError(f"VocabParallelEmbedding.from_dense: unexpected options {sorted(bad)}")
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(embedding.num_embeddings, embedding.embedding_dim, comm, dtype=embedding.weight.dtype,
                    device=embedding.weight.device, sequence_parallel=kw.get("sequence_parallel", False))
        _check_replicated(comm, "VocabParallelEmbedding.from_dense", [embedding.weight])
        with torch.no_grad():
            self.weight.copy_(embedding.weight[self.vocab_start_index:self.vocab_end_index])
        return self

    def to_dense(self) -> nn.Embedding:
        """The full table as a ``torch.nn.Embedding`` on every rank (collective: all ranks call it)."""
        dense = _meta_module(lambda **f: nn.Embedding(self.num_embeddings, self.embedding_dim, **f),
                             self.weight.device, self.weight.dtype)
        with torch.no_grad():
            dense.weight.copy_(_gather_first_dim(self.weight, self.comm, "to_dense"))
        return dense

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} ({self.num_embeddings_per_partition} rows per rank "
                f"of {self.comm.size}), sequence_parallel={self.sequence_parallel}")
