"""The round/partition plans of staged transports (shared by shm and the GPU IPC kernels)."""

from __future__ import annotations

import numpy as np
import pytest

from transports._schedule import all_to_all_pulls, part_bounds, staged_segments, windows


@pytest.mark.parametrize("total,window", [(0, 4), (1, 4), (4, 4), (5, 4), (1001, 64)])
def test_windows_cover_exactly_once(total, window):
    w = windows(total, window)
    assert w[0][0] == 0 and w[-1][1] == total and len(w) == max(1, -(-total // window))
    assert all(a[1] == b[0] for a, b in zip(w, w[1:])) and all(0 <= hi - lo <= window for lo, hi in w)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_part_bounds_are_aligned_and_cover(count, parts):
    b = part_bounds(count, parts, align=16)
    assert len(b) == parts + 1 and b[0] == 0 and b[-1] == count
    assert all(x <= y for x, y in zip(b, b[1:]))
    assert all(x % 16 == 0 or x == count for x in b[:-1])


def _simulate(counts: np.ndarray, row_bytes: int, window: int) -> list[np.ndarray]:
    """Run every rank's staging and pull plan over random send buffers; return what each rank received."""
    n = counts.shape[0]
    rng = np.random.default_rng(0)
    sends = [rng.integers(0, 256, size=int(counts[s].sum()) * row_bytes, dtype=np.uint8) for s in range(n)]
    own = [(int(counts[s, :s].sum()) * row_bytes, int(counts[s, s]) * row_bytes) for s in range(n)]
    received = []
    for me in range(n):
        out = np.full(int(counts[:, me].sum()) * row_bytes, -1, dtype=np.int16)
        at = int(counts[:me, me].sum()) * row_bytes
        start, length = own[me]
        out[at : at + length] = sends[me][start : start + length]  # own block, straight from the input
        for j, copies in enumerate(all_to_all_pulls(counts, me, row_bytes, window)):
            staged = {}
            for src in range(n):  # what every source staged in round j
                buf = np.zeros(window, dtype=np.int16) - 2
                for off, pos, nb in staged_segments(*own[src], sends[src].size, j * window, (j + 1) * window):
                    buf[off : off + nb] = sends[src][pos : pos + nb]
                staged[src] = buf
            for src, off, dst, nb in copies:
                assert src != me and 0 <= off and off + nb <= window
                assert (out[dst : dst + nb] == -1).all(), "a byte was written twice"
                assert (staged[src][off : off + nb] >= 0).all(), "read a byte that was not staged"
                out[dst : dst + nb] = staged[src][off : off + nb]
        received.append(out)
    return sends, received


@pytest.mark.parametrize("seed", range(6))
def test_all_to_all_pulls_deliver_every_row_once(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    counts = rng.integers(0, 9, size=(n, n))
    counts[rng.integers(0, n)] = 0  # a rank that sends nothing
    row_bytes = int(rng.integers(1, 13))
    window = int(rng.integers(1, 50))
    sends, received = _simulate(counts, row_bytes, window)
    for me in range(n):
        offs = [np.concatenate([[0], np.cumsum(counts[s])]) * row_bytes for s in range(n)]
        expect = np.concatenate([sends[s][offs[s][me] : offs[s][me + 1]] for s in range(n)])
        assert np.array_equal(received[me], expect.astype(np.int16))
