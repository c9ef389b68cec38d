"""Host-side helpers shared by the CPU transports: raw NumPy views and reductions.

NumPy has no bfloat16, so host transports move every tensor as raw bytes and
reduce through :func:`reduce_into`, which knows the real dtype. 16-bit floats
accumulate in float32 and round once, the same rule the GPU kernels follow, and
every rank sums in rank order, so all ranks get bitwise-identical results.
"""

from __future__ import annotations

import ctypes
import os
from typing import Sequence

import numpy as np
import torch

from .base import GroupInfo, ReduceOp
from .settings import resolve as resolve_settings

_NP_STORAGE = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,  # raw bits; reductions go through torch
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}

_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
          ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}
_TORCH_BINARY = {ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PROD: torch.mul,
                 ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """memmove between two addresses (cheaper than building NumPy views for small blocks)."""
    if nbytes > 0:
        ctypes.memmove(dst, src, nbytes)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy flat NumPy view of a contiguous CPU tensor (bfloat16 as uint16 bits)."""
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().reshape(-1).view(np.uint16)
    return t.numpy().reshape(-1)  # NumPy's reshape is several times cheaper than torch's


def reduce_into(dst: np.ndarray, srcs: Sequence[np.ndarray], op: ReduceOp, dtype: torch.dtype,
                divisor: int = 1) -> None:
    """dst = op(srcs[0], srcs[1], ...) in that order; ``divisor`` divides the result for AVG.

    dst may alias srcs[0] but no other source. All arrays are flat storage views of one length.
    """
    if dtype == torch.bfloat16 or (dtype == torch.float16 and op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD)):
        _reduce_16bit(dst, srcs, op, dtype, divisor)
        return
    ufunc = _UFUNC[op]
    if len(srcs) == 1:
        if dst is not srcs[0]:
            np.copyto(dst, srcs[0])
    else:
        ufunc(srcs[0], srcs[1], out=dst)
        for s in srcs[2:]:
            ufunc(dst, s, out=dst)
    if op == ReduceOp.AVG and divisor != 1:
        np.divide(dst, divisor, out=dst, casting="unsafe")


def _reduce_16bit(dst, srcs, op, dtype, divisor):
    # float32 accumulation, one rounding at the end.
    def as_f32(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        return (t.view(torch.bfloat16) if dtype == torch.bfloat16 else t).float()

    acc = as_f32(srcs[0])
    fn = _TORCH_BINARY[op]
    for s in srcs[1:]:
        t = torch.from_numpy(s)
        t = t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
        fn(acc, t, out=acc)
    if op == ReduceOp.AVG and divisor != 1:
        acc.div_(divisor)
    out = torch.from_numpy(dst)
    (out.view(torch.bfloat16) if dtype == torch.bfloat16 else out).copy_(acc)


def group_settings(group: GroupInfo) -> dict:
    """The resolved settings a transport reads (``group.settings``; a GroupInfo built by hand has none:
    then the environment and defaults, through :func:`transports.settings.resolve`)."""
    return group.settings or resolve_settings()


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` on this node, from /proc: 'R', 'S', 'D', 'T' (stopped),
    't' (stopped by a tracer), 'Z' (zombie) ...; 'X' when it is gone; '?' when it exists but /proc
    cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        at = stat.rindex(b")") + 2  # the state follows the parenthesised command name
        return stat[at : at + 1].decode()
    except FileNotFoundError:
        return "X"
    except (OSError, ValueError):
        try:
            os.kill(pid, 0)
            return "?"
        except ProcessLookupError:
            return "X"
        except PermissionError:
            return "?"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this node still runs (a zombie does not)."""
    return process_state(pid) not in ("Z", "X")
