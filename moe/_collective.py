"""Collective-safe argument checks shared by the MoE classes.

A rank that rejects its input must not leave its peers waiting in a collective until the
timeout; every check here either runs on data all ranks have already exchanged (so all raise
together) or tells the peers before raising.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

# Stable codes so ranks can compare dtypes as integers (hash() is salted per process).
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
           getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
DTYPE_CODE = {d: i + 1 for i, d in enumerate(_DTYPES) if d is not None}
_DTYPE_BY_CODE = {c: d for d, c in DTYPE_CODE.items()}


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODE.get(dtype, 1000)


def dtype_name(code: int) -> str:
    d = _DTYPE_BY_CODE.get(int(code))
    return str(d).replace("torch.", "") if d is not None else f"<dtype {code}>"


def agree(comm: Any, where: str, values: Mapping[str, float], *, error: str | None = None,
          extra: torch.Tensor | None = None, hint: str = "",
          formats: Mapping[str, Callable[[float], str]] | None = None) -> torch.Tensor | None:
    """All-gather ``values`` (and ``extra``), raise ``ValueError`` on every rank if any differ or any rank erred.

    values: name -> number that must be equal on every rank (NaN-free; None is sent as -1).
    error: this rank's own local error message, or None. extra: an optional 1-D int64 tensor of
    per-rank data gathered along (same length on every rank). formats: name -> how to show a value
    in the error message. Returns the gathered ``extra`` as
    [size, len(extra)] int64 (None without extra).
    """
    names = list(values)
    vec = [1.0 if error else 0.0]
    for n in names:
        v = values[n]
        try:
            vec.append(-1.0 if v is None else float(v))
        except (TypeError, ValueError):
            vec.append(math.nan)
    head = torch.tensor(vec, dtype=torch.float64)
    if comm.size == 1:
        if error:
            raise ValueError(error)
        return None if extra is None else extra.reshape(1, -1)
    if extra is not None:
        # int64 carries every count exactly; the header rides along as float64 bits.
        payload = torch.cat([head.view(torch.int64), extra.reshape(-1).to(torch.int64).cpu()])
    else:
        payload = head.view(torch.int64)
    gathered = comm.all_gather(payload.reshape(1, -1))
    heads = gathered[:, : head.numel()].contiguous().view(torch.float64)
    bad = [comm.global_ranks[r] for r in range(comm.size) if heads[r, 0] != 0]
    if error:
        raise ValueError(error)
    if bad:
        raise ValueError(f"{where}: rank(s) {bad} rejected their input (see the error raised there); "
                         "every rank aborted the call")
    for i, n in enumerate(names, start=1):
        col = heads[:, i]
        if not bool((col == col[0]).all()):
            fmt = (formats or {}).get(n, _fmt)
            shown = ", ".join(f"rank {comm.global_ranks[r]}: {fmt(col[r].item())}" for r in range(comm.size))
            raise ValueError(f"{where}: ranks disagree on {n} ({shown}). {hint}".rstrip())
    return None if extra is None else gathered[:, head.numel():]


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "invalid"
    return str(int(v)) if v == int(v) else repr(v)
