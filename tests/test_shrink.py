"""Communicator.shrink: the survivors of a dead rank make a new group without it (issue #55)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import collectives
from collectives import PeerFailedError
from _joiner import check_group
from spmd import UNDER_MPI, left_behind, outcome, shm_segments

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="fault injection needs spawned ranks")


def _body_death(comm, victim: int):
    comm.barrier()
    if comm.rank == victim:
        os._exit(1)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.randn(1000))
    except PeerFailedError as e:
        failed = (str(e), list(e.missing_ranks), time.monotonic() - t0)
    else:
        raise AssertionError("the all_reduce with a dead peer returned")
    if victim == 0:
        comm.close()  # shrink works from a closed communicator too (its rendezvous says this rank left it)
    t0 = time.monotonic()
    new = comm.shrink(exclude=[victim])
    shrink_s = time.monotonic() - t0
    shape = (new.size, new.rank, list(new.global_ranks), new.timeout == comm.timeout)
    check_group(new, "s")
    new.close()
    comm.close()
    return failed, shrink_s, shape


@pytest.mark.parametrize("victim", [2, 0])
def test_shrink_after_a_rank_died(victim):
    """Rank 2 (or rank 0, the store's host under torchrun but not under launch) dies before an
    all_reduce; the others raise PeerFailedError naming it, shrink without it and go on."""
    before = shm_segments()
    res = collectives.launch(_body_death, 4, victim, timeout=30, return_exceptions=True)
    survivors = [r for r in range(4) if r != victim]
    assert isinstance(res[victim], Exception), res[victim]
    for new_rank, r in enumerate(survivors):
        assert not isinstance(res[r], BaseException), res[r]
        (msg, missing, fail_s), shrink_s, shape = res[r]
        assert f"rank {victim}" in msg and missing == [victim], msg
        assert fail_s < 5, fail_s
        assert shrink_s < 5, shrink_s
        assert shape == (3, new_rank, survivors, True)
    assert not left_behind(before)


def _body_bad_exclude(comm):
    r = comm.rank
    out = {}
    # every survivor (all four ranks) shrinks; one passes a bad exclude
    out["self"] = outcome(lambda: comm.shrink([1] if r == 1 else []))
    out["range"] = outcome(lambda: comm.shrink([4] if r == 2 else []))
    out["dup"] = outcome(lambda: comm.shrink([0, 0] if r == 3 else []))
    # ranks 0 and 2 keep rank 2, rank 1 drops it; rank 3 sits this one out (excluded by all)
    if r != 3:
        out["differ"] = outcome(lambda: comm.shrink([2, 3] if r == 1 else [3]))
    comm.barrier()  # the communicator itself is untouched
    return out


def test_bad_exclude_raises_on_every_survivor():
    res = collectives.launch(_body_bad_exclude, 4, timeout=20, return_exceptions=True)
    for r, out in enumerate(res):
        assert not isinstance(out, BaseException), out
        for case, bad in (("self", 1), ("range", 2), ("dup", 3)):
            kind, msg = out[case]
            assert kind == "ValueError" and f"rank {bad}" in msg, (r, case, msg)
        assert "excludes itself" in out["self"][1]
        assert "out of range" in out["range"][1]
        assert "twice" in out["dup"][1]
        if r != 3:
            kind, msg = out["differ"]
            assert kind == "ValueError" and "disagree" in msg, (r, msg)
            assert ("rank 0 keeps [0, 1, 2]" if r == 1 else "rank 1 keeps [0, 1]") in msg, (r, msg)


def test_store_hosted_by_an_excluded_rank_raises_a_clear_error():
    from torch.distributed import HashStore

    from collectives.rendezvous import StoreRendezvous

    rdv = StoreRendezvous(HashStore(), 1, 4, 5.0, "t", range(4), host_rank=0)
    with pytest.raises(RuntimeError, match="the rendezvous store lived in rank 0's process"):
        rdv.shrink([1, 2, 3])
    # a store hosted outside the ranks (collectives.launch): rank 0 may go; here a one-survivor group
    alone = StoreRendezvous(HashStore(), 1, 4, 5.0, "t", range(4)).shrink([1])
    assert (alone.rank, alone.size, alone.global_ranks) == (0, 1, [1])
    assert alone.allgather_bytes(b"x") == [b"x"]


def test_shrink_under_mpi_is_not_implemented():
    from collectives.rendezvous import MPIRendezvous

    rdv = object.__new__(MPIRendezvous)
    with pytest.raises(NotImplementedError, match="ULFM"):
        rdv.shrink([0, 1])


def test_shrink_of_a_one_rank_group():
    comm = collectives.init()
    try:
        with pytest.raises(ValueError, match="rank 0 excludes itself"):
            comm.shrink([0])
        new = comm.shrink([])
        assert (new.size, new.rank) == (1, 0)
        torch.testing.assert_close(new.all_reduce(torch.ones(3)), torch.ones(3))
        new.close()
    finally:
        comm.close()
