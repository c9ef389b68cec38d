"""Round and partition plans for staged collectives.

A staged transport moves a message through fixed-size per-rank buffers in rounds. Which bytes go
in which round, which part of a window each rank reduces in a two-shot all-reduce, and where each
received all-to-all byte lands are pure functions of the sizes, kept here so every staged
transport (host shared memory now, peer-mapped GPU buffers next) follows one tested plan.
"""

from __future__ import annotations

import math
from typing import Collection



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


def all_to_all_pulls(counts, me: int, row_bytes: int, window: int, skip: Collection[int] = ()
                     ) -> list[list[tuple[int, int, int, int]]]:
    """What rank ``me`` copies from its peers in each round of a windowed, pull-based uneven all-to-all.

    counts: [n][n] rows (nested lists or an array), counts[src][dst] = rows src sends to dst.
    Each source stages its send buffer (rows in destination order) *without its block to itself*
    -- see :func:`staged_segments` -- ``window`` bytes a round; a rank takes its own block
    straight from its input. Returns, per round, tuples (src, offset in src's staged window,
    offset in me's output, nbytes) for src != me. All sources stage every round, so the number of
    rounds is set by the largest sender. Sources in ``skip`` stage nothing (the shm transport's
    single-copy senders): they get no copies and do not count towards the rounds. Plain Python arithmetic: for the handful of ranks of a
    node it is several times faster than NumPy on tiny arrays, and it is on every call's path.
    """
    rows = counts.tolist() if hasattr(counts, "tolist") else counts
    n = len(rows)
    spans = []  # (src, start of me's block in src's staged stream, its length, where it lands in me's output)
    at = 0
    largest = 0
    for src in range(n):
        row = rows[src]
        length = row[me] * row_bytes
        if src != me and src not in skip:
            start = (sum(row[:me]) - (row[src] if src < me else 0)) * row_bytes
            spans.append((src, start, length, at))
        at += length
        if src not in skip:
            largest = max(largest, (sum(row) - row[src]) * row_bytes)
    plan: list[list[tuple[int, int, int, int]]] = []
    for j in range(max(1, -(-largest // window))):
        w_lo, w_hi = j * window, (j + 1) * window
        copies = []
        for src, start, length, dst in spans:
            lo = start if start > w_lo else w_lo
            hi = start + length if start + length < w_hi else w_hi
            if hi > lo:
                copies.append((src, lo - w_lo, dst + lo - start, hi - lo))
        plan.append(copies)
    return plan


def staged_segments(own_start: int, own_len: int, total: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Where window [lo, hi) of a rank's staged stream (its send buffer minus its own block
    [own_start, own_start + own_len)) comes from: (offset in the window, offset in the send
    buffer, nbytes) pieces."""
    pieces = []
    a, b = lo, min(hi, own_start)  # before the own block: same offsets
    if b > a:
        pieces.append((a - lo, a, b - a))
    a, b = max(lo, own_start), min(hi, total - own_len)  # after it: shifted by its length
    if b > a:
        pieces.append((a - lo, a + own_len, b - a))
    return pieces
