"""PathChooser (transports/_path_choice.py): the policy by which rank 0 times the paths of a repeated call."""

from __future__ import annotations

import pytest

from transports._path_choice import UNTIMED_FIRST_CALLS, WARM_UP_SAMPLES, PathChooser, size_class

A, B = 1, 2


def _run(chooser: PathChooser, key, times: dict[int, float], calls: int) -> list[int]:
    """``calls`` calls of ``key`` where path p takes ``times[p]`` seconds; the paths taken."""
    taken = []
    for _ in range(calls):
        p = chooser.choose(key)
        chooser.record(key, p, times[p])
        taken.append(p)
    return taken


def test_warm_up_takes_turns_untimed_then_timed_then_keeps_the_faster():
    chooser = PathChooser((A, B), explore_every=10)
    taken = _run(chooser, "k", {A: 3.0, B: 1.0}, 9)
    warm = (UNTIMED_FIRST_CALLS + WARM_UP_SAMPLES) * 2
    assert taken[:warm] == [A, B] * (UNTIMED_FIRST_CALLS + WARM_UP_SAMPLES)
    assert taken[warm:] == [B] * (9 - warm) and chooser.best("k") == B


def test_untimed_first_calls_do_not_count():
    chooser = PathChooser((A, B), explore_every=100)
    # each path's first call is slow (first touch), then A is the faster path
    for p, t in ((A, 50.0), (B, 50.0), (A, 1.0), (B, 2.0), (A, 1.0), (B, 2.0)):
        assert chooser.choose("k") == p
        chooser.record("k", p, t)
    assert chooser.choose("k") == A and chooser.best("k") == A


def test_explores_every_nth_call_and_follows_a_change_of_phase():
    chooser = PathChooser((A, B), explore_every=8, window=3)
    times = {A: 1.0, B: 2.0}
    taken = _run(chooser, "k", times, 32)
    explored = [i + 1 for i, p in enumerate(taken) if p == B and i >= 6]
    assert explored == [8, 16, 24, 32]  # the call numbers divisible by explore_every
    times[A] = 5.0  # A gets slower: within the window it is dropped, B kept
    taken = _run(chooser, "k", times, 6)
    assert taken[-3:] == [B, B, B], taken
    times[A] = 0.5  # ... and taken back once a try shows it faster again
    taken = _run(chooser, "k", times, 24)
    assert taken[-3:] == [A, A, A], taken


def test_one_slow_call_does_not_flip_the_choice():
    chooser = PathChooser((A, B), explore_every=1000, window=3)
    _run(chooser, "k", {A: 1.0, B: 2.0}, 8)
    p = chooser.choose("k")
    chooser.record("k", p, 10.0)  # one call of A delayed by the machine
    assert p == A and chooser.choose("k") == A


def test_keys_are_timed_apart():
    chooser = PathChooser((A, B), explore_every=100)
    _run(chooser, "small", {A: 1.0, B: 2.0}, 6)
    _run(chooser, "large", {A: 2.0, B: 1.0}, 6)
    assert chooser.best("small") == A and chooser.best("large") == B and chooser.best("other") is None


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="two or more distinct"):
        PathChooser((A, A))
    with pytest.raises(ValueError, match="explore_every"):
        PathChooser((A, B), explore_every=1)
    chooser = PathChooser((A, B))
    with pytest.raises(ValueError, match="no choice was made"):
        chooser.record("never", A, 1.0)


def test_size_class_groups_sizes_within_a_factor_of_two():
    assert size_class(1 << 20) == size_class((2 << 20) - 1) == 21
    assert size_class(2 << 20) == 22 and size_class(0) == 0
