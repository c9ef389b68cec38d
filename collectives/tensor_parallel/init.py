"""Seeded initialisation of sharded parameters: a rank draws only its shard of a global tensor
that depends on (seed, tag, shape) alone, so a layer is the same function for every TP size."""

from __future__ import annotations

import torch

from .mappings import Comm


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
