"""Seeded initialisation of sharded parameters: a rank draws only its shard of a global tensor
that depends on (seed, tag, shape) alone, so a layer is the same function for every TP size.

Local: nothing here communicates; the layers agree on the seed (collectives.agreement) first.
"""

from __future__ import annotations

import operator

import torch

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


def global_init(seed: int, tag: int, shape: tuple[int, ...], index: tuple[slice, ...], *, dist: str,
                scale: float, dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """Block ``index`` of a global init tensor that is a function of (seed, tag, shape) only.

    The global tensor is drawn in blocks of ``_INIT_BLOCK_ROWS`` rows, each from its own
    generator, so a rank draws only the blocks that meet its rows (memory: its shard plus one
    block) and any split of the same tensor gives the same values.

    Args:
        seed: the layer's seed (equal on every rank). tag: which tensor of the layer (weight,
            bias, ...), so that its tensors differ.
        shape: the global shape, [R] or [R, C].
        index: this rank's block: (rows,) or (rows, cols), slices with step 1.
        dist: "uniform" (in [-scale, scale)) or "normal" (std ``scale``).
        dtype, device: of the result; values are drawn in float32 on the CPU, then cast.

    Returns:
        ``global[index]``: [rows] or [rows, cols] dtype on device, contiguous.
    """
    R = shape[0]
    C = shape[1] if len(shape) > 1 else None
    r0, r1, _ = index[0].indices(R)
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
        parts.append(blk[(slice(max(r0, lo) - lo, min(r1, hi) - lo), *index[1:])])
        b += 1
    return torch.cat(parts).to(dtype=dtype, device=device).contiguous()


def seed_error(seed: object) -> TypeError | None:
    """Why ``seed`` is not a valid seed argument (an int, or None to draw one), or None."""
    if seed is None:
        return None
    try:
        if not isinstance(seed, bool):
            operator.index(seed)  # int or NumPy integer
            return None
    except TypeError:
        pass
    return TypeError(f"seed must be an int or None, got {type(seed).__name__} {seed!r}")


def seed_candidate(seed: int | None) -> int:
    """What this rank proposes for ``seed=None``: a draw from torch's global generator (rank 0's is used).

    Every rank draws, so the ranks' global random streams stay in step; 0 when a seed was given.
    """
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64)) if seed is None else 0
