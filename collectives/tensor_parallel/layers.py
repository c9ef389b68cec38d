"""Megatron-style tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .init import _agreed_seed, _global_init
from .mappings import (
    Comm,
    _gather_first_dim,
    _gather_last_dim,
    _where,
    copy_to_tensor_parallel_region,
    divide,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)


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
