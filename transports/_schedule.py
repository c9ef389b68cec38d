"""Round and partition plans for staged collectives.

A staged transport moves a message through fixed-size per-rank buffers in rounds. Which bytes go
in which round, which part of a window each rank reduces in a two-shot all-reduce, and where each
received all-to-all byte lands are pure functions of the sizes, kept here so every staged
transport (host shared memory now, peer-mapped GPU buffers next) follows one tested plan.
"""

from __future__ import annotations

import math

import numpy as np


def windows(total: int, window: int) -> list[tuple[int, int]]:
    """[lo, hi) windows of at most ``window`` covering [0, total); one empty window when total is 0.

    The empty round still synchronises, which is what carries the call signature.
    """
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    return [(lo, min(lo + window, total)) for lo in range(0, max(total, 1), window)]


def part_bounds(count: int, parts: int, align: int = 16) -> list[int]:
    """Boundaries of ``parts`` consecutive pieces of [0, count), each start a multiple of ``align``.

    Piece i is [b[i], b[i + 1]); trailing pieces may be empty when count is small.
    """
    per = -(-math.ceil(count / parts) // align) * align if count else 0
    return [min(count, i * per) for i in range(parts)] + [count]


def all_to_all_pulls(counts: np.ndarray, me: int, row_bytes: int, window: int
                     ) -> list[list[tuple[int, int, int, int]]]:
    """What rank ``me`` copies in each round of a windowed, pull-based uneven all-to-all.

    counts: [n, n] rows, counts[src, dst] = rows src sends to dst; each source's send buffer is
    its rows in destination order, staged ``window`` bytes a round. Returns, per round, tuples
    (src, offset in src's staged window, offset in me's output, nbytes). Every round all sources
    stage their next window, so the number of rounds is set by the largest sender.
    """
    counts = np.asarray(counts, dtype=np.int64)
    n = counts.shape[0]
    send_bytes = counts.sum(axis=1) * row_bytes
    src_off = counts[:, :me].sum(axis=1) * row_bytes  # where me's block starts in each source's buffer
    blk_len = counts[:, me] * row_bytes
    dst_off = np.concatenate([[0], np.cumsum(blk_len)[:-1]])
    n_rounds = max(1, math.ceil(int(send_bytes.max()) / window)) if n else 1
    plan: list[list[tuple[int, int, int, int]]] = []
    for j in range(n_rounds):
        w_lo, w_hi = j * window, (j + 1) * window
        copies = []
        for src in range(n):
            lo = max(int(src_off[src]), w_lo)
            hi = min(int(src_off[src] + blk_len[src]), w_hi)
            if hi > lo:
                copies.append((src, lo - w_lo, int(dst_off[src]) + lo - int(src_off[src]), hi - lo))
        plan.append(copies)
    return plan
