"""Megatron-style tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Every parameter is either this rank's shard of a full tensor along its ``partition_dim`` or
replicated, marked with Megatron's attributes (``tensor_model_parallel``, ``partition_dim``).
Seeded initialisation, ``from_dense`` and ``to_dense`` work parameter by parameter from those
marks (:class:`_ShardedModule`), so the three layers share one body for each.

Building a layer is collective: one all-gather checks that every rank passed the same arguments
(for ``from_dense``: the same dense tensors) and agrees on the seed, so a bad argument on one
rank raises on every rank at once. Forward checks run on one rank only; a rank that refuses its
input makes the peers' next collective raise (:func:`collectives.agreement.rejecting`).
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from collectives.agreement import agree, rank_label, rejecting
from collectives.protocols import CommunicatorLike, check_communicator
from transports.base import dtype_code, dtype_name

from .init import global_init, seed_candidate, seed_error
from .mappings import (
    _gather_first_dim,
    _gather_last_dim,
    copy_to_tensor_parallel_region,
    divide,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)

Dense = dict[str, Any]  # from_dense: parameter name -> the dense layer's tensor (None: absent)


# ---- building -------------------------------------------------------------------------------------
def _fingerprint(tensors: list[Any]) -> torch.Tensor:
    """[5 * len(tensors)] float64: size, rows, sum, sum of squares and a row-weighted sum of each tensor.

    Equal tensors give equal fingerprints up to summation order; a non-tensor gives a marker.
    """
    fp: list[float] = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            fp += [-1.0, 0.0, 0.0, 0.0, 0.0]
            continue
        d = t.detach().to(torch.float64).reshape(t.shape[0] if t.dim() else 1, -1)
        ramp = torch.arange(1, d.shape[0] + 1, dtype=torch.float64, device=d.device) / max(d.shape[0], 1)
        fp += [float(t.numel()), float(d.shape[0]), float(d.sum()), float((d * d).sum()),
               float((d.sum(1) * ramp).sum())]
    return torch.tensor(fp, dtype=torch.float64)


def _agree_on_build(comm: CommunicatorLike, where: str, values: dict[str, Any], *, error: Exception | None,
                    seed: int | None = None, dense: Dense | None = None) -> int:
    """The one collective of building (or re-seeding) a layer.

    Args:
        comm, where: the group, and the caller for messages.
        values: the arguments that must be equal on every rank (ints, bools, a dtype code as "dtype").
        error: this rank's own verdict on its arguments, or None.
        seed: the seed argument; None: every rank draws a candidate and rank 0's is used. Unused
            with ``dense``.
        dense: from_dense's tensors, which must be equal on every rank (compared by fingerprint,
            up to summation order).

    Returns:
        The agreed seed (0 with ``dense``).
    """
    if dense is None:
        error = error or seed_error(seed)
        values = {**values, "seed": None if seed_error(seed) else seed}
    candidate = seed_candidate(seed) if dense is None and error is None else 0
    fp = _fingerprint(list(dense.values())) if dense is not None and comm.size > 1 else torch.zeros(0)
    extra = torch.cat([torch.tensor([candidate], dtype=torch.int64), fp.to(torch.float64).view(torch.int64)])
    rows = agree(comm, where, values, error=error, extra=extra, formats={"dtype": dtype_name},
                 hint="Build the layer with the same arguments on every rank.")
    if dense is None:
        return int(rows[0, 0]) if seed is None else operator.index(seed)
    if fp.numel():
        fps = rows[:, 1:].contiguous().view(torch.float64)
        tol = 1e-9 * (1.0 + fps.abs().amax(0))  # summation order may differ between ranks' thread counts
        differ = [rank_label(comm, r) for r in range(comm.size) if ((fps[r] - fps[0]).abs() > tol).any()]
        if differ:
            raise ValueError(f"{where}: the dense layer differs between ranks ({', '.join(differ)} differ from "
                             f"{rank_label(comm, 0)}); build it identically on every rank (same seed, or load the "
                             "same checkpoint) before sharding it")
    return 0


def _check_sizes(**sizes: Any) -> None:
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def _check_dtype(dtype: Any) -> None:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")


def _dtype_value(dtype: Any) -> int | None:
    return dtype_code(dtype) if isinstance(dtype, torch.dtype) else None


def _mark(param: nn.Parameter, partition_dim: int | None) -> None:
    # Megatron's attribute names, so its grad-norm / checkpoint tools count sharded and replicated params right.
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = -1 if partition_dim is None else partition_dim
    param.partition_stride = 1


def _check_input(layer: str, comm: CommunicatorLike, x: Any, want: int, hint: str, dtype: torch.dtype) -> None:
    """A linear layer's forward check of x (raise here; callers wrap it in ``rejecting``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{layer} on {rank_label(comm)}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.shape[-1:] != (want,):
        raise ValueError(f"{layer} on {rank_label(comm)}: got input of shape {tuple(x.shape)}; expected last dim "
                         f"{want} ({hint})")
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"{layer} on {rank_label(comm)}: x has dtype {x.dtype} but the layer's parameters are "
                        f"{dtype}; cast x, or build the layer with dtype={x.dtype}")


class _ShardedModule(nn.Module):
    """The body the TP layers share: parameters that are shards along their ``partition_dim`` or replicated."""

    comm: CommunicatorLike

    def _agree(self, comm: CommunicatorLike, values: dict[str, Any], check: Callable[[], None], *,
               seed: int | None, dense: Dense | None, error: Exception | None) -> int:
        """Check the arguments here (``check`` raises), then agree on them across ranks (collective).

        Returns the agreed seed; every rank raises if any rank's arguments are bad or differ.
        """
        where = type(self).__name__ + (".from_dense" if dense is not None else "")
        check_communicator(comm, where)
        if error is None:
            try:
                check()
            except (TypeError, ValueError) as e:
                error = e
        seed = _agree_on_build(comm, where, values, error=error, seed=seed, dense=dense)
        self.comm = comm
        return seed

    def _new_parameter(self, full_shape: tuple[int, ...], partition_dim: int | None, dtype: torch.dtype,
                       device: torch.device | str | None) -> nn.Parameter:
        """An uninitialised parameter: this rank's shard of ``full_shape`` along ``partition_dim`` (None: whole)."""
        shape = list(full_shape)
        if partition_dim is not None:
            shape[partition_dim] //= self.comm.size
        p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        _mark(p, partition_dim)
        return p

    def _full_shape(self, p: nn.Parameter) -> tuple[int, ...]:
        """The shape of the full tensor ``p`` is a shard of."""
        shape = list(p.shape)
        if p.tensor_model_parallel:
            shape[p.partition_dim] *= self.comm.size
        return tuple(shape)

    def _shard_index(self, p: nn.Parameter) -> tuple[slice, ...]:
        """Where ``p`` sits in its full tensor."""
        index = [slice(None)] * p.dim()
        if p.tensor_model_parallel:
            n = p.shape[p.partition_dim]
            index[p.partition_dim] = slice(self.comm.rank * n, (self.comm.rank + 1) * n)
        return tuple(index)

    def _init_spec(self) -> dict[str, tuple[int, str, float]]:
        """Parameter name -> (tag, distribution, scale) of its seeded initialisation (see ``init.global_init``)."""
        raise NotImplementedError

    def _dense_module(self, **factory: Any) -> nn.Module:
        """The dense torch.nn module this layer is a shard of (built with ``factory``: device, dtype)."""
        raise NotImplementedError

    def _fill(self, seed: int, dense: Dense | None) -> None:
        """Give the parameters their values: this rank's shard of ``dense``, or of the seeded initialisation."""
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                if dense is not None:
                    p.copy_(dense[name][self._shard_index(p)])
                    continue
                tag, dist, scale = self._init_spec()[name]
                p.copy_(global_init(seed, tag, self._full_shape(p), self._shard_index(p), dist=dist, scale=scale,
                                    dtype=p.dtype, device=p.device))

    def reset_parameters(self, *, seed: int | None = None) -> None:
        """Re-initialise from ``seed`` (collective: the ranks agree on it).

        Args:
            seed: an int, the same on every rank; None draws one from torch's global generator on
                rank 0. The values depend on the seed and the global shapes only (not on the TP size).
        """
        where = f"{type(self).__name__}.reset_parameters"
        self._fill(_agree_on_build(self.comm, where, {}, error=None, seed=seed), None)

    def to_dense(self) -> nn.Module:
        """The full layer on every rank (collective: all ranks call it).

        Returns:
            A ``torch.nn.Linear`` / ``torch.nn.Embedding`` with the full parameters, in this
            layer's dtype and on its device; the global random generator is not touched.
        """
        # built on the meta device: no initialisation, no draw from the global generator
        dense = self._dense_module(device="meta", dtype=self.weight.dtype).to_empty(device=self.weight.device)
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                t = p.detach()
                if p.tensor_model_parallel:
                    t = (_gather_first_dim(t, self.comm, "to_dense") if p.partition_dim == 0
                         else _gather_last_dim(t, self.comm, "to_dense"))
                getattr(dense, name).copy_(t)
        return dense


# ---- linear layers --------------------------------------------------------------------------------
class _ParallelLinear(_ShardedModule):
    """``y = x W^T + b`` with W [out, in] split along ``partition_dim`` across the TP group.

    ``partition_dim`` 0 splits the output features (W's rows and the bias); 1 splits the input
    features (W's columns; the bias is replicated).
    """

    partition_dim: int
    option_defaults: dict[str, bool]  # the subclass's keyword options

    def _check_options(self, **options: bool) -> None:
        """Raise ``ValueError`` for options that do not combine."""

    def _build(self, in_features: int, out_features: int, comm: CommunicatorLike, *, bias: bool,
               dtype: torch.dtype | None, device: torch.device | str | None, options: dict[str, Any],
               seed: int | None = None, dense: Dense | None = None, error: Exception | None = None) -> None:
        dtype = torch.get_default_dtype() if dtype is None else dtype
        split, split_name = (out_features, "out_features") if self.partition_dim == 0 else (in_features, "in_features")

        def check() -> None:
            _check_sizes(in_features=in_features, out_features=out_features)
            _check_dtype(dtype)
            self._check_options(**options)
            divide(split, comm.size, what=split_name)

        values = {"in_features": in_features, "out_features": out_features, "bias": bool(bias),
                  **{k: bool(v) for k, v in options.items()}, "dtype": _dtype_value(dtype)}
        seed = self._agree(comm, values, check, seed=seed, dense=dense, error=error)
        self.in_features, self.out_features = in_features, out_features
        for k, v in options.items():
            setattr(self, k, bool(v))
        self.weight = self._new_parameter((out_features, in_features), self.partition_dim, dtype, device)
        if bias:
            self.bias = self._new_parameter((out_features,), 0 if self.partition_dim == 0 else None, dtype, device)
        else:
            self.register_parameter("bias", None)
        self._after_build()
        self._fill(seed, dense)

    def _after_build(self) -> None:
        """Subclass hook once the parameters exist."""

    def _init_spec(self) -> dict[str, tuple[int, str, float]]:
        bound = 1.0 / math.sqrt(self.in_features)  # torch.nn.Linear's default
        return {"weight": (0, "uniform", bound), "bias": (1, "uniform", bound)}

    def _dense_module(self, **factory: Any) -> nn.Module:
        return nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, **factory)

    @classmethod
    def from_dense(cls, linear: nn.Linear, comm: CommunicatorLike, **options: bool) -> "_ParallelLinear":
        """Shard ``linear`` (collective): keep this rank's block of its parameters.

        Args:
            linear: a ``torch.nn.Linear`` [out, in], the same on every rank (checked).
            comm: the tensor-parallel group.
            options: the layer's keyword options (see the class); the layer takes linear's dtype
                and device.

        Returns:
            The layer, holding this rank's shard of ``linear``; no draw from any random generator.
        """
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        ok = isinstance(linear, nn.Linear)
        error = None
        if not ok:
            error = TypeError(f"needs a torch.nn.Linear, got {type(linear).__name__}")
        elif set(options) - set(cls.option_defaults):
            error = TypeError(f"unexpected options {sorted(set(options) - set(cls.option_defaults))}")
        self._build(linear.in_features if ok else 0, linear.out_features if ok else 0, comm,
                    bias=ok and linear.bias is not None, dtype=linear.weight.dtype if ok else None,
                    device=linear.weight.device if ok else None,
                    options={k: options.get(k, v) for k, v in cls.option_defaults.items()},
                    dense={"weight": linear.weight if ok else None, "bias": linear.bias if ok else None},
                    error=error)
        return self


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W [out, in] split along the output dim (rows) across the TP group.

    Parameters on each rank: ``weight`` [out / tp, in], ``bias`` [out / tp] (this rank's block of
    output features). Initialisation (as ``torch.nn.Linear``: U(-1/sqrt(in), 1/sqrt(in)) for weight
    and bias) depends only on ``seed`` and the global shape, so the layer is the same function for
    every TP size.

    Args:
        in_features, out_features: the full layer's sizes; out_features divisible by the TP size.
        comm: the tensor-parallel group (construction is collective: every rank must pass the same
            arguments, checked).
        bias: whether the layer has a bias.
        gather_output: all-gather the output to [*, out] on every rank (else [*, out / tp]).
        sequence_parallel: the input is this rank's block of the first (sequence) dim; the layer
            all-gathers it (not with gather_output).
        dtype: the parameters' floating dtype (default: torch's default dtype). device: theirs.
        seed: an int, the same on every rank; None draws one from torch's global generator on rank 0.
    """

    partition_dim = 0
    option_defaults = {"gather_output": False, "sequence_parallel": False}

    def __init__(self, in_features: int, out_features: int, comm: CommunicatorLike, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 seed: int | None = None):
        super().__init__()
        self._build(in_features, out_features, comm, bias=bias, dtype=dtype, device=device, seed=seed,
                    options={"gather_output": gather_output, "sequence_parallel": sequence_parallel})

    def _check_options(self, *, gather_output: bool, sequence_parallel: bool) -> None:
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True and sequence_parallel=True do not combine (the gathered output "
                             "would be full-sequence); gather with gather_from_tensor_parallel_region after the "
                             "layer if you need it")

    @property
    def out_features_per_partition(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply this rank's block of output features (collective when sequence_parallel or gather_output).

        Args:
            x: [*, in] the layer's dtype, the same on every rank; with sequence_parallel
                [s / tp, *, in], this rank's block of the first dim.

        Returns:
            [*, out / tp] (sequence_parallel: [s, *, out / tp]), or [*, out] with gather_output;
            the layer's dtype.
        """
        with rejecting(self.comm, on=self.weight):
            _check_input("ColumnParallelLinear", self.comm, x, self.in_features,
                         f"in_features = {self.in_features}", self.weight.dtype)
        if self.sequence_parallel:
            x_total = gather_from_sequence_parallel_region(x, self.comm)
        else:
            x_total = copy_to_tensor_parallel_region(x, self.comm)
        with rejecting(self.comm, on=self.weight):  # e.g. out of memory on one rank
            y = F.linear(x_total, self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.comm)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_partition} per rank of {self.comm.size}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with W [out, in] split along the input dim (columns) across the TP group.

    Parameters on each rank: ``weight`` [out, in / tp] (this rank's block of input features),
    ``bias`` [out], replicated and added once, after the reduction. Under sequence parallelism
    each rank's bias sees only its shard of the sequence, so the layer all-reduces the bias
    gradient itself (in backward): ``bias.grad`` is already the full gradient. Initialisation as
    :class:`ColumnParallelLinear` (same function for every TP size).

    Args:
        in_features, out_features: the full layer's sizes; in_features divisible by the TP size.
        comm: the tensor-parallel group (construction is collective: every rank must pass the same
            arguments, checked).
        bias: whether the layer has a bias.
        input_is_parallel: the input is this rank's block [*, in / tp] (e.g. a column layer's
            output); False: a replicated [*, in], split here.
        sequence_parallel: reduce-scatter the output along the first (sequence) dim instead of
            all-reducing it (needs input_is_parallel).
        dtype: the parameters' floating dtype (default: torch's default dtype). device: theirs.
        seed: an int, the same on every rank; None draws one from torch's global generator on rank 0.
    """

    partition_dim = 1
    option_defaults = {"input_is_parallel": True, "sequence_parallel": False}

    def __init__(self, in_features: int, out_features: int, comm: CommunicatorLike, *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 seed: int | None = None):
        super().__init__()
        self._build(in_features, out_features, comm, bias=bias, dtype=dtype, device=device, seed=seed,
                    options={"input_is_parallel": input_is_parallel, "sequence_parallel": sequence_parallel})

    def _check_options(self, *, input_is_parallel: bool, sequence_parallel: bool) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (its input comes from a column "
                             "layer); split a replicated input with scatter_to_tensor_parallel_region first")

    def _after_build(self) -> None:
        if self.bias is not None:
            # Not Megatron's `sequence_parallel` attribute: its finalize step would all-reduce this grad a second time.
            self.bias.grad_reduced_by_layer = self.sequence_parallel

    @property
    def in_features_per_partition(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply this rank's block of input features and sum over the group (collective).

        Args:
            x: [*, in / tp] the layer's dtype with input_is_parallel (this rank's block), else
                [*, in] the same on every rank; with sequence_parallel [s, *, in / tp].

        Returns:
            [*, out] the layer's dtype, the same on every rank; with sequence_parallel
            [s / tp, *, out], this rank's block of the first dim.
        """
        want = self.in_features_per_partition if self.input_is_parallel else self.in_features
        hint = (f"this rank's block in_features / tp = {self.in_features} / {self.comm.size}; pass "
                "input_is_parallel=False for a replicated full input") if self.input_is_parallel else \
            f"in_features = {self.in_features}"
        with rejecting(self.comm, on=self.weight):
            _check_input("RowParallelLinear", self.comm, x, want, hint, self.weight.dtype)
        x_par = x if self.input_is_parallel else scatter_to_tensor_parallel_region(x, self.comm)
        with rejecting(self.comm, on=self.weight):  # e.g. out of memory on one rank
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

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_partition} per rank of {self.comm.size}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


# ---- embedding ------------------------------------------------------------------------------------
class VocabParallelEmbedding(_ShardedModule):
    """An embedding table [num_embeddings, embedding_dim] split along the vocabulary across the TP group.

    Parameter on each rank: ``weight`` [num_embeddings / tp, embedding_dim], rows
    [rank * V / tp, (rank + 1) * V / tp) of the table. A rank looks up the ids in its range,
    zeroes the others, and the ranks all-reduce. Initialisation N(0, 1) as ``torch.nn.Embedding``,
    a function of ``seed`` and the shape only.

    Args:
        num_embeddings: the vocabulary size V, divisible by the TP size. embedding_dim: D.
        comm: the tensor-parallel group (construction is collective: every rank must pass the same
            arguments, checked).
        dtype: the table's floating dtype (default: torch's default dtype). device: its device.
        sequence_parallel: reduce-scatter the output along the first (sequence) dim instead of
            all-reducing it.
        seed: an int, the same on every rank; None draws one from torch's global generator on rank 0.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: CommunicatorLike, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 sequence_parallel: bool = False, seed: int | None = None):
        super().__init__()
        self._build(num_embeddings, embedding_dim, comm, dtype=dtype, device=device,
                    sequence_parallel=sequence_parallel, seed=seed)

    def _build(self, num_embeddings: int, embedding_dim: int, comm: CommunicatorLike, *,
               dtype: torch.dtype | None, device: torch.device | str | None, sequence_parallel: bool,
               seed: int | None = None, dense: Dense | None = None, error: Exception | None = None) -> None:
        dtype = torch.get_default_dtype() if dtype is None else dtype

        def check() -> None:
            _check_sizes(num_embeddings=num_embeddings, embedding_dim=embedding_dim)
            _check_dtype(dtype)
            divide(num_embeddings, comm.size, what="num_embeddings")

        values = {"num_embeddings": num_embeddings, "embedding_dim": embedding_dim,
                  "sequence_parallel": bool(sequence_parallel), "dtype": _dtype_value(dtype)}
        seed = self._agree(comm, values, check, seed=seed, dense=dense, error=error)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = bool(sequence_parallel)
        self.weight = self._new_parameter((num_embeddings, embedding_dim), 0, dtype, device)
        self.num_embeddings_per_partition = self.weight.shape[0]
        self.vocab_start_index = comm.rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self._fill(seed, dense)

    def _init_spec(self) -> dict[str, tuple[int, str, float]]:
        return {"weight": (2, "normal", 1.0)}

    def _dense_module(self, **factory: Any) -> nn.Module:
        return nn.Embedding(self.num_embeddings, self.embedding_dim, **factory)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up ``ids`` in the table (collective).

        Args:
            ids: [*] int64 or int32, the same on every rank, each in [0, num_embeddings) (checked);
                with sequence_parallel [s, *].

        Returns:
            [*, embedding_dim] the table's dtype, the same on every rank; with sequence_parallel
            [s / tp, *, embedding_dim], this rank's block of the first dim.
        """
        with rejecting(self.comm, on=self.weight):
            where = f"VocabParallelEmbedding on {rank_label(self.comm)}"
            if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{where}: ids must be an int64 or int32 tensor, got "
                                + (str(ids.dtype) if isinstance(ids, torch.Tensor) else type(ids).__name__))
            if ids.numel():
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= self.num_embeddings:
                    raise ValueError(f"{where}: got ids in [{lo}, {hi}]; valid ids are in [0, {self.num_embeddings})")
            if self.comm.size > 1:
                outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
                y = F.embedding((ids - self.vocab_start_index).masked_fill(outside, 0), self.weight)
                y = y.masked_fill(outside.unsqueeze(-1), 0.0)
            else:
                y = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.comm)
        return reduce_from_tensor_parallel_region(y, self.comm)

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, comm: CommunicatorLike, **options: bool) -> "VocabParallelEmbedding":
        """Shard ``embedding`` (collective): keep this rank's vocabulary rows.

        Args:
            embedding: a plain ``torch.nn.Embedding`` [V, D], the same on every rank (checked);
                padding_idx, max_norm, scale_grad_by_freq and sparse are not supported.
            comm: the tensor-parallel group.
            options: sequence_parallel. The layer takes the table's dtype and device.

        Returns:
            The layer, holding rows [rank * V / tp, (rank + 1) * V / tp) of the table.
        """
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        ok = isinstance(embedding, nn.Embedding)
        error = None
        if not ok:
            error = TypeError(f"needs a torch.nn.Embedding, got {type(embedding).__name__}")
        elif set(options) - {"sequence_parallel"}:
            error = TypeError(f"unexpected options {sorted(set(options) - {'sequence_parallel'})}")
        else:
            unsupported = {k: v for k, v in (("padding_idx", embedding.padding_idx), ("max_norm", embedding.max_norm),
                                             ("scale_grad_by_freq", embedding.scale_grad_by_freq or None),
                                             ("sparse", embedding.sparse or None)) if v is not None}
            if unsupported:
                error = ValueError(f"{unsupported} not supported; use a plain nn.Embedding")
        self._build(embedding.num_embeddings if ok else 0, embedding.embedding_dim if ok else 0, comm,
                    dtype=embedding.weight.dtype if ok else None, device=embedding.weight.device if ok else None,
                    sequence_parallel=options.get("sequence_parallel", False),
                    dense={"weight": embedding.weight if ok else None}, error=error)
        return self

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} ({self.num_embeddings_per_partition} rows per rank "
                f"of {self.comm.size}), sequence_parallel={self.sequence_parallel}")
