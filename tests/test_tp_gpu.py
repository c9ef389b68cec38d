"""Tensor parallelism on CUDA: ColumnParallelLinear, RowParallelLinear (each option, with and without
sequence parallelism, and the column -> gelu -> row MLP) and VocabParallelEmbedding, at 1 rank and
at 2 ranks sharing cuda:0, float32 and bfloat16, forward and backward.

Each layer is sharded (``from_dense``) from a dense layer on the GPU whose values are random and
rounded to the dtype under test; the reference is that dense layer in float64 on the CPU, run on
the whole (unsharded) input with plain torch.nn. Every rank checks its block of the output, of the
input gradient and of the parameter gradients, and that ``to_dense`` gives the dense layer back.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gpu_harness import each_dtype, launch_on_gpu
from torch import nn

from collectives import tensor_parallel as tp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

F64 = torch.float64
S, B, H, FFN, V = 16, 2, 32, 64, 48  # sequence, batch, hidden, ffn, vocabulary: all divisible by 2
# Relative tolerance per dtype; the absolute one scales with the reference's magnitude (see _close).
TOL = {"float32": 1e-4, "bfloat16": 2e-2}
DTYPES = list(TOL)


def _close(got: torch.Tensor | None, want: torch.Tensor, tol: float, what: str, comm: Any) -> None:
    """``got`` (any device and dtype) against the float64 CPU reference ``want``."""
    where = f"tp={comm.size} rank {comm.rank}: {what}"
    assert got is not None, f"{where}: missing (no gradient reached it)"
    # atol relative to the largest reference value: low-precision GEMMs err relative to their operands, not per element
    atol = tol * max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got.detach().cpu().double(), want, rtol=tol, atol=atol,
                               msg=lambda m: f"{where}: {m}")


def _blk(t: torch.Tensor, dim: int, comm: Any) -> torch.Tensor:
    """This rank's block of ``t`` along ``dim``."""
    return t.chunk(comm.size, dim=dim)[comm.rank]


def _rand(g: torch.Generator, *shape: int, dtype: torch.dtype = F64, scale: float = 1.0) -> torch.Tensor:
    """Random float64 values (std ``scale``) exactly representable in ``dtype``."""
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype).double()


def _linear_ref(i: int, o: int, g: torch.Generator, dtype: torch.dtype) -> nn.Linear:
    """A float64 CPU nn.Linear(i, o) with random values that ``dtype`` holds exactly (weight std 1/sqrt(i))."""
    ref = nn.Linear(i, o, dtype=F64)
    with torch.no_grad():
        ref.weight.copy_(_rand(g, o, i, dtype=dtype, scale=i ** -0.5))
        ref.bias.copy_(_rand(g, o, dtype=dtype))
    return ref


def _on_device(ref: nn.Module, dtype: torch.dtype, device: str) -> nn.Module:
    """A copy of the float64 CPU module ``ref`` in ``dtype`` on ``device`` (exact: ref's values fit dtype)."""
    mod = type(ref)(*((ref.in_features, ref.out_features) if isinstance(ref, nn.Linear)
                      else (ref.num_embeddings, ref.embedding_dim)), dtype=dtype, device=device)
    mod.load_state_dict(ref.state_dict())
    return mod


def _check_layer(what: str, layer: nn.Module, ref: nn.Module, dtype: torch.dtype, device: str) -> None:
    """Parameters on the device in dtype, and to_dense (a gather over the group) gives ref's values back."""
    for name, p in layer.named_parameters():
        assert p.device == torch.device(device) and p.dtype == dtype, f"{what}: {name} on {p.device} {p.dtype}"
    back = layer.to_dense()
    for name, p in back.named_parameters():
        assert p.device == torch.device(device), f"{what}: to_dense {name} on {p.device}"
        assert torch.equal(p.detach().cpu().double(), getattr(ref, name).detach()), f"{what}: to_dense {name}"


def _linear_body(comm: Any, device: str, dtype_name: str) -> int:
    """Column and row layers (every option) and the sequence-parallel MLP vs their dense float64 twins."""
    dtype, tol = getattr(torch, dtype_name), TOL[dtype_name]
    g = torch.Generator().manual_seed(1234)
    cases = 0
    for gather_output, sp in ((False, False), (True, False), (False, True)):
        what = f"{dtype_name} column gather_output={gather_output} sequence_parallel={sp}"
        ref = _linear_ref(H, FFN, g, dtype)
        layer = tp.ColumnParallelLinear.from_dense(_on_device(ref, dtype, device), comm,
                                                   gather_output=gather_output, sequence_parallel=sp)
        _check_layer(what, layer, ref, dtype, device)
        X, G = _rand(g, S, B, H, dtype=dtype), _rand(g, S, B, FFN)
        xd = X.clone().requires_grad_()
        yd = ref(xd)
        (yd * G).sum().backward()
        x = (_blk(X, 0, comm) if sp else X).to(device=device, dtype=dtype).requires_grad_()
        y = layer(x)
        assert y.device == x.device and y.dtype == dtype, f"{what}: output on {y.device} {y.dtype}"
        (y.double() * (G if gather_output else _blk(G, -1, comm)).to(device)).sum().backward()
        _close(y, yd.detach() if gather_output else _blk(yd.detach(), -1, comm), tol, f"{what}: forward", comm)
        _close(x.grad, _blk(xd.grad, 0, comm) if sp else xd.grad, tol, f"{what}: input grad", comm)
        _close(layer.weight.grad, _blk(ref.weight.grad, 0, comm), tol, f"{what}: weight grad", comm)
        _close(layer.bias.grad, _blk(ref.bias.grad, 0, comm), tol, f"{what}: bias grad", comm)
        cases += 1

    for input_is_parallel, sp in ((True, False), (False, False), (True, True)):
        what = f"{dtype_name} row input_is_parallel={input_is_parallel} sequence_parallel={sp}"
        ref = _linear_ref(FFN, H, g, dtype)
        layer = tp.RowParallelLinear.from_dense(_on_device(ref, dtype, device), comm,
                                                input_is_parallel=input_is_parallel, sequence_parallel=sp)
        _check_layer(what, layer, ref, dtype, device)
        X, G = _rand(g, S, B, FFN, dtype=dtype), _rand(g, S, B, H)
        xd = X.clone().requires_grad_()
        yd = ref(xd)
        (yd * G).sum().backward()
        x = (_blk(X, -1, comm) if input_is_parallel else X).to(device=device, dtype=dtype).requires_grad_()
        y = layer(x)
        assert y.device == x.device and y.dtype == dtype, f"{what}: output on {y.device} {y.dtype}"
        # under sequence parallelism each rank's loss covers its rows; their sum is the dense loss
        (y.double() * (_blk(G, 0, comm) if sp else G).to(device)).sum().backward()
        _close(y, _blk(yd.detach(), 0, comm) if sp else yd.detach(), tol, f"{what}: forward", comm)
        _close(x.grad, _blk(xd.grad, -1, comm) if input_is_parallel else xd.grad, tol, f"{what}: input grad", comm)
        _close(layer.weight.grad, _blk(ref.weight.grad, 1, comm), tol, f"{what}: weight grad", comm)
        # replicated bias: the full gradient on every rank (the layer reduces it under sequence parallelism)
        _close(layer.bias.grad, ref.bias.grad, tol, f"{what}: bias grad", comm)
        cases += 1

    # the Megatron MLP with sequence parallelism: all-gather in, reduce-scatter out
    what = f"{dtype_name} sequence-parallel MLP"
    refs = [_linear_ref(H, FFN, g, dtype), _linear_ref(FFN, H, g, dtype)]
    fc1 = tp.ColumnParallelLinear.from_dense(_on_device(refs[0], dtype, device), comm, sequence_parallel=True)
    fc2 = tp.RowParallelLinear.from_dense(_on_device(refs[1], dtype, device), comm, sequence_parallel=True)
    X, G = _rand(g, S, B, H, dtype=dtype), _rand(g, S, B, H)
    xd = X.clone().requires_grad_()
    yd = refs[1](F.gelu(refs[0](xd)))
    (yd * G).sum().backward()
    x = _blk(X, 0, comm).to(device=device, dtype=dtype).requires_grad_()
    y = fc2(F.gelu(fc1(x)))
    (y.double() * _blk(G, 0, comm).to(device)).sum().backward()
    _close(y, _blk(yd.detach(), 0, comm), tol, f"{what}: forward", comm)
    _close(x.grad, _blk(xd.grad, 0, comm), tol, f"{what}: input grad", comm)
    _close(fc1.weight.grad, _blk(refs[0].weight.grad, 0, comm), tol, f"{what}: fc1 weight grad", comm)
    _close(fc1.bias.grad, _blk(refs[0].bias.grad, 0, comm), tol, f"{what}: fc1 bias grad", comm)
    _close(fc2.weight.grad, _blk(refs[1].weight.grad, 1, comm), tol, f"{what}: fc2 weight grad", comm)
    _close(fc2.bias.grad, refs[1].bias.grad, tol, f"{what}: fc2 bias grad", comm)
    return cases + 1


def _embedding_body(comm: Any, device: str) -> int:
    """VocabParallelEmbedding (with and without sequence parallelism, both dtypes) vs the dense table."""
    g = torch.Generator().manual_seed(4321)
    cases = 0
    for dtype_name, tol in TOL.items():
        dtype = getattr(torch, dtype_name)
        for sp in (False, True):
            what = f"{dtype_name} embedding sequence_parallel={sp}"
            ref = nn.Embedding(V, H, dtype=F64)
            with torch.no_grad():
                ref.weight.copy_(_rand(g, V, H, dtype=dtype))
            layer = tp.VocabParallelEmbedding.from_dense(_on_device(ref, dtype, device), comm, sequence_parallel=sp)
            _check_layer(what, layer, ref, dtype, device)
            ids = torch.randint(0, V, (S, B), generator=g)
            ids.view(-1)[:4] = torch.tensor([0, V - 1, V // 2 - 1, V // 2])  # both ends and the shard boundary
            G = _rand(g, S, B, H)
            yd = ref(ids)
            (yd * G).sum().backward()
            y = layer(ids.to(device))
            assert y.device == torch.device(device) and y.dtype == dtype, f"{what}: output on {y.device} {y.dtype}"
            (y.double() * (_blk(G, 0, comm) if sp else G).to(device)).sum().backward()
            _close(y, _blk(yd.detach(), 0, comm) if sp else yd.detach(), tol, f"{what}: forward", comm)
            _close(layer.weight.grad, _blk(ref.weight.grad, 0, comm), tol, f"{what}: weight grad", comm)
            cases += 1
    return cases


@pytest.mark.parametrize("nprocs", [1, 2])
def test_column_and_row_parallel_on_cuda_match_dense(nprocs: int) -> None:
    # per dtype: 3 column + 3 row cases + the MLP
    assert launch_on_gpu(each_dtype, nprocs, _linear_body, DTYPES) == [[7] * len(DTYPES)] * nprocs


@pytest.mark.parametrize("nprocs", [1, 2])
def test_vocab_parallel_embedding_on_cuda_matches_dense(nprocs: int) -> None:
    assert launch_on_gpu(_embedding_body, nprocs) == [4] * nprocs  # 2 dtypes x sequence_parallel off/on
