"""What the moecomm process group hands back to torch, and how it reads torch's arguments.

Work objects: every call runs to completion (or, for CUDA tensors through NCCL, is queued on the
current stream) before it returns, so the Work is complete at once and its future already holds
the output tensors. Torch's C++ callers need that value: DDP's reducer reads the bucket from the
future, and a Work without a future crashed DDP with SIGSEGV (issue 14).

Reduce ops: torch's ``ReduceOp`` (or its ``RedOpType``) to the communicator's op name, with the
scalar factor of PREMUL_SUM, which FSDP2 uses to divide gradients by the data-parallel size
(``_fsdp_collectives._get_gradient_divide_factors``) and which NCCL applies to every rank's input
before summing (``ncclRedOpCreatePreMulSum``).

Tensors: the helpers that take torch's arguments apart (``plain``, ``flat_view``) and move dtypes
the Communicator does not know as bytes (``wire``, ``unwire``, ``wire_count``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from transports.base import SUPPORTED_DTYPES

_RED = dist.ReduceOp.RedOpType
# torch's reductions the communicator runs, by name; BAND/BOR/BXOR only on bool (any/all)
_OP_NAMES = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.PRODUCT: "prod", _RED.MIN: "min", _RED.MAX: "max",
             _RED.PREMUL_SUM: "sum"}
# on bool, SUM is "any" and PRODUCT "all" (gloo's a + b and a * b stored as bool, NCCL's max and min):
# DTensor reduces Tensor.any() with SUM and Tensor.all() with PRODUCT
_BOOL_OPS = {_RED.BAND: "min", _RED.BOR: "max", _RED.SUM: "max", _RED.PRODUCT: "min"}


def reduction(op: Any, dtype: torch.dtype) -> tuple[str, float | torch.Tensor | None]:
    """The communicator's op for torch's ``op`` on tensors of ``dtype``.

    Args:
        op: a ``dist.ReduceOp`` (as in the options objects) or a ``ReduceOp.RedOpType``.
        dtype: the dtype reduced (BAND/BOR exist for bool only; AVG and PREMUL_SUM for floating dtypes).

    Returns:
        (name, factor): name is "sum", "avg", "prod", "min" or "max" (on bool SUM and BOR are "max",
        PRODUCT and BAND "min"); factor is PREMUL_SUM's scalar (a float or a 0-d tensor) that
        multiplies every rank's input, else None. Raises TypeError for an op moecomm does not run
        on ``dtype`` (the caller reports it to the peers).
    """
    kind = getattr(op, "op", op)
    name = _BOOL_OPS.get(kind) if dtype == torch.bool else None
    name = name or _OP_NAMES.get(kind)
    if name is None:
        raise TypeError(f"reduce op {kind} is not supported by moecomm for {dtype}; use SUM, AVG, PRODUCT, MIN, "
                        "MAX or PREMUL_SUM (BAND/BOR on bool tensors)")
    if name == "avg" and not dtype.is_floating_point:  # named here: int8 reaches the communicator as uint8
        raise TypeError(f"reduce op AVG needs a floating dtype, got {dtype}; use SUM and divide")
    if kind != _RED.PREMUL_SUM:
        return name, None
    if not dtype.is_floating_point:
        raise TypeError(f"PREMUL_SUM needs a floating dtype (as in NCCL), got {dtype}")
    factor = getattr(op, "factor", None)
    if factor is None:  # a bare RedOpType.PREMUL_SUM, or a torch that does not expose the factor
        raise TypeError("PREMUL_SUM without its factor: pass dist._make_nccl_premul_sum(factor)")
    return name, factor


def int8_wire(t: torch.Tensor, name: str) -> torch.Tensor:
    """int8 ``t`` as the uint8 tensor whose uint8 reduction ``name`` has the int8 result's bits.

    The communicator reduces uint8, not int8: int8 sum and product wrap modulo 256 as uint8's do on
    the same bits (two's complement), so those reduce ``t``'s bytes as they are; max and min reduce
    ``t``'s bytes with the sign bit flipped (``v ^ 0x80`` orders int8 as uint8), undone by
    :func:`int8_unwire_`.

    Args:
        t: int8 tensor [*] (any strides).
        name: the communicator's op ("sum", "prod", "max" or "min").

    Returns:
        [*] uint8: a view of ``t`` (sum, prod) or a new tensor (max, min).
    """
    u = t.view(torch.uint8)
    return u ^ 0x80 if name in ("max", "min") else u


def int8_unwire_(u: torch.Tensor, name: str) -> torch.Tensor:
    """Undo :func:`int8_wire` on a reduced uint8 tensor, in place.

    Returns:
        ``u``'s memory as int8.
    """
    if name in ("max", "min"):
        u.bitwise_xor_(0x80)
    return u.view(torch.int8)


def completed(outputs: Any, tensors: Sequence[torch.Tensor] = ()) -> dist.Work:
    """A finished Work whose future holds ``outputs``.

    Args:
        outputs: the future's value (a list of tensors, or a list of lists for allgather).
        tensors: the tensors written, to find CUDA devices: for those the future records an event
            on the current stream, and waiting on it orders the caller's stream after the call.

    Returns:
        A ``torch.distributed.Work``: ``wait()`` returns True, ``get_future().value()`` is ``outputs``.
    """
    devices = sorted({str(t.device) for t in tensors if t.device.type != "cpu"})
    fut = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    fut.set_result(outputs)
    return _create_work_from_future(fut)


def wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` for a collective that only moves bytes: itself for a dtype moecomm supports, else its
    bytes as uint8 (float8, int8, int16, complex: all-gather, broadcast, all-to-all, scatter, gather).

    Args:
        t: [n, *rest] contiguous tensor of any dtype (rows stay rows: the last dim grows by the
            element size).

    Returns:
        [n, *rest] ``t`` itself, or [n, *rest[:-1], rest[-1] * element_size] uint8 viewing its memory
        ([n * element_size] for a 1-d t).
    """
    if t.dtype in SUPPORTED_DTYPES:
        return t
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8)


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` outside autograd (parameters are written in place by broadcast)."""
    return t.detach() if t.requires_grad else t


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """[numel] contiguous: a view of ``t`` when it is contiguous, else a copy."""
    return t.reshape(-1)


def unwire(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Undo :func:`wire` on a 1-d slice: ``like``'s dtype and shape."""
    flat = flat.reshape(-1)
    if like.dtype not in SUPPORTED_DTYPES:
        flat = flat.view(like.dtype)
    return flat.view(like.shape)


def wire_count(t: torch.Tensor) -> int:
    """Elements of ``wire(t)``: t.numel(), times the element size for a dtype moved as bytes."""
    return t.numel() * (1 if t.dtype in SUPPORTED_DTYPES else t.element_size())


def option(opts: Any, name: str, default: Any) -> Any:
    """``opts.name`` of torch's options object, or ``default`` (no options, or an older torch without the field)."""
    return getattr(opts, name, default) if opts is not None else default
