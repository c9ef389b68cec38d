"""``Communicator.all_reduce_rmsnorm``'s local parts: argument checks, the composed RMSNorm, and the
call of a transport's fused hook on contiguous [rows, hidden] tensors."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from transports.base import OpCode, Signature, Transport, view_code

from ._arrays import check_dense, overlaps
from ._calls import _FLOATS as FLOATS

RMSNORM_VIEW = view_code(OpCode.ALL_REDUCE_RMSNORM)  # its signature's F_VIEW: not a plain all_reduce


def check_rmsnorm_args(x: Any, residual: Any, weight: Any, eps: Any, out: Any, residual_out: Any, me: int
                        ) -> float:
    """``eps`` as a float once every argument of all_reduce_rmsnorm checks out on rank ``me``, else the
    TypeError/ValueError that names the rank and the argument."""
    what = f"all_reduce_rmsnorm: rank {me}"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} passed x of type {type(x).__name__}; x must be a torch.Tensor")
    try:
        check_dense(x, "x")
    except TypeError as e:
        raise TypeError(f"{what}: {e}") from None
    if x.dtype not in FLOATS:
        raise TypeError(f"{what} passed x of dtype {x.dtype}; use float64, float32, float16 or bfloat16")
    if x.dim() == 0:
        raise ValueError(f"{what} passed a 0-d x; x needs a last dim (hidden) to normalize over")
    hidden = x.shape[-1]
    expected = {"residual": (tuple(x.shape), (x.dtype,)), "weight": ((hidden,), tuple(dict.fromkeys((x.dtype, torch.float32)))),
                "out": (tuple(x.shape), (x.dtype,)), "residual_out": (tuple(x.shape), (x.dtype,))}
    for name, value in (("residual", residual), ("weight", weight), ("out", out), ("residual_out", residual_out)):
        if value is None and name in ("out", "residual_out"):
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what} passed {name} of type {type(value).__name__}; it must be a torch.Tensor")
        shape, dtypes = expected[name]
        if tuple(value.shape) != shape or value.dtype not in dtypes:
            allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{what} passed {name} of shape {tuple(value.shape)} and dtype {value.dtype}; expected "
                             f"shape {shape} and dtype {allowed} (x: {tuple(x.shape)}, {x.dtype})")
        if value.device != x.device:
            raise ValueError(f"{what} passed {name} on {value.device} but x on {x.device}; put them on one device")
        try:
            check_dense(value, name)
        except TypeError as e:
            raise TypeError(f"{what}: {e}") from None
        if name in ("out", "residual_out") and value.requires_grad:
            raise TypeError(f"{what} passed {name} that requires grad; collectives write out= outside autograd")
    if out is not None and residual_out is not None and overlaps(out, residual_out):
        raise ValueError(f"{what} passed out and residual_out that overlap; they receive different results")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{what} passed eps={eps!r} ({type(eps).__name__}); eps must be a float")
    e = float(eps)
    if not (math.isfinite(e) and e >= 0.0):
        raise ValueError(f"{what} passed eps={e!r}; eps must be finite and >= 0")
    return e


def rms_normed(n: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the new residual ``n`` ([*, H]) times ``weight`` ([H]), in float32 (float64 for float64 n),
    rounded once to n's dtype (a new tensor)."""
    acc = torch.float64 if n.dtype == torch.float64 else torch.float32
    f = n.to(acc)
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * weight.to(acc)).to(n.dtype)


def composed_rmsnorm(a: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None, residual_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) from ``a``, the all-reduced x (a new tensor, which this may overwrite), written
    into ``out``/``residual_out`` where given."""
    # the new residual: straight into residual_out unless that would overwrite what is still to read, or
    # its layout would change the order of the mean's sum (the results must not depend on out's strides)
    direct = residual_out is not None and residual_out.is_contiguous() and not overlaps(residual_out, weight) and (
        not overlaps(residual_out, residual) or _same_view(residual_out, residual))
    new_res = torch.add(a, residual, out=residual_out if direct else a)
    normed = rms_normed(new_res, weight, eps)
    if residual_out is not None and not direct:
        residual_out.copy_(new_res)
        new_res = residual_out
    if out is not None:
        out.copy_(normed)
        normed = out
    return normed, new_res


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the same elements in the same layout (in place is safe)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def fused_rmsnorm(tr: Transport, sig: Signature, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float, out: torch.Tensor | None, residual_out: torch.Tensor | None, rows: int, hidden: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``tr.all_reduce_rmsnorm`` on contiguous [rows, hidden] tensors: x and residual (copies where they are
    not contiguous), out and residual_out where they are contiguous and overlap nothing the kernel reads
    (or are x and residual themselves: in place), else temporaries copied into them afterwards."""
    def as_rows(t: torch.Tensor) -> torch.Tensor:
        return (t if t.is_contiguous() else t.contiguous()).view(rows, hidden)

    x2, r2, w2 = as_rows(x), as_rows(residual), weight.contiguous()
    reads = (x2, r2, w2)

    def target(o: torch.Tensor | None, alias: torch.Tensor) -> tuple[torch.Tensor, bool]:
        if o is not None and o.is_contiguous() and all(
                not overlaps(o, i) or (i is alias and o.data_ptr() == i.data_ptr()) for i in reads):
            return o.view(rows, hidden), True
        return torch.empty((rows, hidden), dtype=x.dtype, device=x.device), False

    (o2, o_direct), (ro2, ro_direct) = target(out, x2), target(residual_out, r2)
    tr.all_reduce_rmsnorm(x2, r2, w2, eps, o2, ro2, sig)
    shape = tuple(x.shape)
    if out is not None and not o_direct:
        out.copy_(o2.view(shape))
    if residual_out is not None and not ro_direct:
        residual_out.copy_(ro2.view(shape))
    return (out if out is not None else o2.view(shape)), (residual_out if residual_out is not None else ro2.view(shape))


