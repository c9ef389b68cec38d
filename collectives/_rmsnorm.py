"""``Communicator.all_reduce_rmsnorm``'s local parts: argument checks, the composed RMSNorm, and the
call of a transport's fused hook on contiguous [rows, hidden] tensors."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from transports.base import OpCode, Signature, Transport, dtype_code, view_code

from ._arrays import check_dense, device_of, overlaps
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


class RMSNormCalls:
    """all_reduce_rmsnorm() of :class:`collectives.Communicator`: checks, then the transport's fused
    kernel where it has one, else all_reduce and the composed RMSNorm."""

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                           *, out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """All-reduce ``x``, add ``residual``, RMSNorm: what a tensor-parallel transformer block runs after
        its attention and after its MLP (TensorRT-LLM, FlashInfer and vLLM fuse it).

        Defined as the composition (``n`` = the new residual; the float32 below is float64 for float64 x)::

            a = comm.all_reduce(x)                        # sum, in x's dtype
            n = a + residual                              # torch, in x's dtype
            normed = (n.float() * torch.rsqrt(n.float().pow(2).mean(-1, keepdim=True) + eps)
                      * weight.float()).to(x.dtype)

        which the communicator runs unless the transport that serves the all-reduce fuses the call
        (``Transport.fuses_all_reduce_rmsnorm``; ``comm.plan("all_reduce_rmsnorm", x)`` says which): a
        fused transport computes the same up to float32 rounding of the mean. Every rank gets the same
        ``a``; ``residual``, ``weight`` and ``eps`` are this rank's own (replicated in tensor
        parallelism, then every rank's results are bitwise identical). Not differentiable.

        The call's signature marks it (``OpCode.ALL_REDUCE_RMSNORM`` in ``F_VIEW``, the weight's dtype in
        ``F_WEIGHT_DTYPE``), so a rank's all_reduce_rmsnorm against a peer's plain all_reduce of the same
        shape, or different weight dtypes, raise ``ValueError`` on every rank naming the ranks.

        Args:
            x: [*, H] (at least 1 dim) float64, float32, float16 or bfloat16 torch tensor, same shape and
                dtype on every rank, on a device this communicator serves.
            residual: x's shape, dtype and device.
            weight: [H], x's dtype or float32, x's device; the same dtype on every rank.
            eps: a finite float >= 0.
            out: optional tensor of x's shape, dtype and device for ``normed`` (may be x itself).
            residual_out: optional tensor of x's shape, dtype and device for the new residual (may be
                ``residual`` itself: in place, as vLLM's fused_add_rms_norm); it must not overlap ``out``.
        Returns:
            ``(normed, new_residual)``, both x's shape and dtype: new tensors, or ``out`` and ``residual_out``.
        Raises:
            TypeError, ValueError: a bad argument (not a tensor, a non-float dtype, a residual, weight or
                out of another shape, dtype or device, eps negative or not finite, a 0-d x) on this rank,
                naming it; its peers raise ``ValueError`` naming it.
        """
        return self._guarded("all_reduce_rmsnorm", self._all_reduce_rmsnorm, x, residual, weight, eps, out,
                             residual_out)

    def _all_reduce_rmsnorm(self, x: Any, residual: Any, weight: Any, eps: Any, out: Any, residual_out: Any
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._state.closed is not None:
            self._state.raise_closed()
        try:
            eps = check_rmsnorm_args(x, residual, weight, eps, out, residual_out, self.global_ranks[self.rank])
        except (TypeError, ValueError) as e:
            dense = isinstance(x, torch.Tensor) and x.layout is torch.strided
            self._fail_locally(OpCode.ALL_REDUCE, device_of(x), e, x.numel() * x.element_size() if dense else 0,
                               call=self._rmsnorm_call(x, weight) if dense else None)
        t, res, w = x.detach(), residual.detach(), weight.detach()
        code = dtype_code(w.dtype)
        ent = self._entry(OpCode.ALL_REDUCE, t, "sum", code, RMSNORM_VIEW)
        shape = tuple(t.shape)
        hidden, rows = shape[-1], math.prod(shape[:-1])
        fused = None if ent.staged else ent.transport.fuses_all_reduce_rmsnorm(t.numel(), hidden, t.dtype, w.dtype)
        if fused is not None:
            return fused_rmsnorm(ent.transport, ent.sig, t, res, w, eps, out, residual_out, rows, hidden)
        a = self._run(OpCode.ALL_REDUCE, t, None, "sum", code, RMSNORM_VIEW)  # a new tensor on x's device
        return composed_rmsnorm(a, res, w, eps, out, residual_out)

    def _rmsnorm_call(self, x: torch.Tensor, weight: Any) -> tuple[Any, torch.Tensor, tuple[int, int]] | None:
        """The all_reduce_rmsnorm call a rank rejected (another argument was wrong), for
        :meth:`_fail_locally`, where x and weight make the signature its peers use; else None."""
        t = x.detach()
        if not isinstance(weight, torch.Tensor) or t.dtype not in FLOATS or weight.dtype not in FLOATS \
                or t.dim() == 0 or t.device.type != self.device.type or (t.is_cuda and t.device != self.device):
            return None
        ent = self._entry(OpCode.ALL_REDUCE, t, "sum", dtype_code(weight.dtype), RMSNORM_VIEW)
        return ent, t, (t.numel() // t.shape[-1], t.shape[-1])
