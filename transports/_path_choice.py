"""Which of two ways to run a repeated collective, from how long each took on this run's recent calls.

The shm transport's large all_gather and all_to_all can stage through the shared slots or copy in
one step between the processes (transports/_shm_single_copy.py). Which is faster changes while a job runs: on the CI
VM the staged path was 1.2-1.6x faster in one phase and 2-2.5x slower in the next, while single copy
held steady (benchmarks/results/shm-single-copy-tuning.txt, last section). A constant switch point
can only be right in one of them, so rank 0 times both on the first calls of each size and then
keeps the faster, trying the other again every :data:`EXPLORE_EVERY` calls (sizes are grouped by
:func:`size_class` and timed per byte); it publishes its choice
in the call's first synchronisation and every rank follows it, so the ranks never split between
paths. This module is the policy alone (no communication), so it is tested on its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

# Calls between two tries of the path not in use. A try of the slower path costs at most its time
# ratio (2-2.5x above) once in this many calls: ~2% on average; and a change of phase is noticed
# within this many calls.
EXPLORE_EVERY = 64
# Recent times kept per path; the median of them decides, so one call delayed by the VM does not
# flip the choice, and a lasting change does within two calls of the path in use.
WINDOW = 3
# A path's first call of a kind is not timed: it pays for first touches (page faults, cold caches).
UNTIMED_FIRST_CALLS = 1
# Timed calls of every path before the choice: the paths take turns, so the first calls of a size,
# which on the CI VM ran 1.3-2.5x slower for several calls whatever the path, weigh on both alike.
WARM_UP_SAMPLES = 2


def size_class(nbytes: int) -> int:
    """The kind of a call by its size: sizes within a factor of two share one (their bit length), so
    calls whose size changes every time (an MoE exchange) are timed together and the kinds stay few;
    callers time them per byte."""
    return int(nbytes).bit_length()


@dataclass
class _History:
    calls: int = 0
    runs: dict[int, int] = field(default_factory=dict)  # path -> calls sent down it
    untimed: dict[int, int] = field(default_factory=dict)  # path -> first calls still to skip
    times: dict[int, deque] = field(default_factory=dict)  # path -> recent seconds


class PathChooser:
    """Rank 0's choice between ``paths`` for each kind of call (its ``key``), by timing.

    Args:
        paths: the candidates (ints: they are published in shared memory), in the order tried first.
        explore_every: calls between tries of the path not in use.
        window: recent times kept per path.
    """

    def __init__(self, paths: tuple[int, ...], *, explore_every: int = EXPLORE_EVERY, window: int = WINDOW) -> None:
        if len(paths) < 2 or len(set(paths)) != len(paths):
            raise ValueError(f"PathChooser needs two or more distinct paths, got {paths!r}")
        if explore_every < 2 or window < 1:
            raise ValueError(f"explore_every must be >= 2 and window >= 1, got {explore_every}, {window}")
        self.paths, self.explore_every, self.window = tuple(paths), explore_every, window
        self._history: dict[Hashable, _History] = {}

    def choose(self, key: Hashable) -> int:
        """The path for the next call of kind ``key`` (then :meth:`record` how long it took).

        The paths first take turns until each has :data:`UNTIMED_FIRST_CALLS` untimed and
        :data:`WARM_UP_SAMPLES` timed calls; from then on the path with the lowest median recent
        time, except every ``explore_every``-th call, which tries another path.
        """
        h = self._history.setdefault(key, _History(runs={p: 0 for p in self.paths},
                                                   untimed={p: UNTIMED_FIRST_CALLS for p in self.paths},
                                                   times={p: deque(maxlen=self.window) for p in self.paths}))
        h.calls += 1
        warming = self._warming(h)
        if warming:  # the path run least so far (the first on a tie)
            p = min(warming, key=lambda p: (h.runs[p], self.paths.index(p)))
        else:
            p = self._fastest(h)
            if h.calls % self.explore_every == 0:
                others = [q for q in self.paths if q != p]
                p = others[h.calls // self.explore_every % len(others)]
        h.runs[p] += 1
        return p

    def record(self, key: Hashable, path: int, seconds: float) -> None:
        """How long the call of kind ``key`` that :meth:`choose` sent down ``path`` took."""
        h = self._history.get(key)
        if h is None or path not in h.times:
            raise ValueError(f"record: no choice was made for {key!r} on path {path!r}")
        if h.untimed[path]:
            h.untimed[path] -= 1
            return
        h.times[path].append(seconds)

    def best(self, key: Hashable) -> int | None:
        """The path the next ordinary call of ``key`` would take, or None while warming up."""
        h = self._history.get(key)
        return None if h is None or self._warming(h) else self._fastest(h)

    def _warming(self, h: _History) -> list[int]:
        """The paths still short of their untimed and timed warm-up calls."""
        return [p for p in self.paths if h.untimed[p] or len(h.times[p]) < min(WARM_UP_SAMPLES, self.window)]

    def _fastest(self, h: _History) -> int:
        """The path with the lowest median recent time (the first on a tie)."""
        return min(self.paths, key=lambda p: (_median(h.times[p]), self.paths.index(p)))


def _median(values: deque) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
