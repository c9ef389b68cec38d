"""Collective arguments as tensors: NumPy/torch input and ``out=`` conversion and checks, overlap tests.

Everything here is local to one rank and raises TypeError/ValueError that the communicator then
carries to the peers (see ``Communicator._fail_locally``).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from transports.base import SUPPORTED_DTYPES

Array = Any  # torch.Tensor | numpy.ndarray

SUPPORTED_NAMES = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)


def as_tensor(x: Array) -> tuple[torch.Tensor, bool, torch.Tensor]:
    """(contiguous tensor, input was NumPy, tensor view of the original input), or TypeError."""
    if isinstance(x, torch.Tensor):
        check_dense(x, "x")
        orig = x.detach() if x.requires_grad else x  # collectives are not differentiable themselves
        was_numpy = False
    elif isinstance(x, np.ndarray):
        was_numpy = True
        torch_dtype(x.dtype, "x")
        arr = x if x.flags.c_contiguous or all(s >= 0 for s in x.strides) else np.ascontiguousarray(x)
        if arr.flags.writeable:
            orig = torch.from_numpy(arr)
        else:  # collectives only read x; torch's warning about writing read-only memory does not apply
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                orig = torch.from_numpy(arr)
    else:
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    return (orig if orig.is_contiguous() else orig.contiguous()), was_numpy, orig


def check_dense(t: torch.Tensor, what: str) -> None:
    """TypeError unless ``t`` is a strided tensor with storage (not sparse, not meta)."""
    if t.layout is not torch.strided:
        raise TypeError(f"{what} is a {str(t.layout).replace('torch.', '')} tensor; collectives move dense "
                        f"(strided) tensors: pass {what}.to_dense()")
    if t.device.type == "meta":
        raise TypeError(f"{what} is a meta tensor, which has no data to send; pass a tensor with storage "
                        "(e.g. torch.empty_like(t, device='cpu'))")


def torch_dtype(dtype: np.dtype, what: str = "out") -> torch.dtype:
    """The torch dtype of a NumPy dtype, or TypeError (non-native byte order, no torch equivalent)."""
    if not dtype.isnative:
        raise TypeError(f"{what} has non-native byte order (NumPy dtype {dtype.str!r}); convert it first: "
                        f"{what}.astype({what}.dtype.newbyteorder('='))")
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError:
        raise TypeError(f"{what}: NumPy dtype {dtype} is not supported; use one of {SUPPORTED_NAMES}") from None


def writable_view(out: Array, what: str) -> torch.Tensor | None:
    """A tensor aliasing ``out`` for writing (None for a NumPy array with negative strides, which
    torch cannot view: the result is copied into it); TypeError for anything that cannot be written."""
    if isinstance(out, torch.Tensor):
        check_dense(out, what)
        if out.requires_grad:
            raise TypeError(f"{what} requires grad; collectives write out= outside autograd. Pass a tensor "
                            "that does not require grad, or leave out= unset and use the returned tensor")
        return out
    if isinstance(out, np.ndarray):
        if not out.flags.writeable:
            raise TypeError(f"{what} is a read-only NumPy array")
        torch_dtype(out.dtype, what)
        return torch.from_numpy(out) if all(s >= 0 for s in out.strides) else None
    raise TypeError(f"{what} must be a torch.Tensor or numpy.ndarray to write the result into, "
                    f"got {type(out).__name__}")


def dtype_device(out: Array, out_t: torch.Tensor | None) -> tuple[torch.dtype, torch.device]:
    """The torch dtype and device of ``out=`` (``out_t``: its view from :func:`writable_view`)."""
    if out_t is not None:
        return out_t.dtype, out_t.device
    return torch_dtype(out.dtype), torch.device("cpu")


def write_out(out: Array, out_t: torch.Tensor | None, res: torch.Tensor) -> None:
    """Put the result ``res`` into ``out`` unless the transport wrote it there already."""
    if out_t is None:
        np.copyto(out, res.numpy())
    elif res.numel() and res.data_ptr() != out_t.data_ptr():
        out_t.copy_(res)


def device_of(x: Any) -> str:
    """The device type whose transport a rejected call of ``x`` meets its peers in."""
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return x.device.type
    return "cpu"


def as_int(value: Any, what: str) -> int:
    """``value`` as an int if it is a Python or NumPy integer (bool and float are refused), else TypeError."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise TypeError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors (from first to last element) intersect."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + span(a)
    b1 = b0 + span(b)
    return a0 < b1 and b0 < a1


def span(t: torch.Tensor) -> int:
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()
