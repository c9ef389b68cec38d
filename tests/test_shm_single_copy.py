"""The shm transport's single-copy path (process_vm_readv): probe and agreement, fallback, mixed
all_to_all senders, and a failed read that must fail loudly on every rank.

The collectives themselves run on every shm path in tests/test_collectives.py and tests/test_faults.py
(``spmd.SHM_PATHS``); these are the cases only the single-copy path has.
"""

from __future__ import annotations

import errno

import pytest
import torch

import collectives
from spmd import rank_input
from transports import _cma, _shm_single_copy
from transports.base import CommunicatorBrokenError, OpCode, PeerFailedError

pytestmark = pytest.mark.skipif(not _cma.available(), reason="no process_vm_readv on this platform")


def _refuse_reads(*args, **kwargs):
    raise OSError(errno.EPERM, "Operation not permitted (refused by the test)")


def _body_refused(comm, refusing_rank: int):
    """Rank ``refusing_rank`` cannot read its peers: every rank of a new group must stage, and say why."""
    if comm.rank == refusing_rank:
        _cma.read = _refuse_reads  # this process only: the next probe fails here
    sub = comm.split(0)
    shm = sub.transports["shm"]
    x = rank_input("refused", comm.rank, (300_001,), torch.float32, 1)
    y = sub.all_reduce(x)
    xs = [rank_input("refused", r, (300_001,), torch.float32, 1) for r in range(comm.size)]
    ref = sum(t.double() for t in xs)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    g = sub.all_gather(x)
    assert torch.equal(g, torch.cat(xs))
    return shm.single_copy, shm.single_copy_status, str(sub.plan("all_gather", x)), sub.plan("all_gather", x).algorithm


def test_a_rank_refused_makes_every_rank_stage_and_say_why():
    always = {"shm_single_copy": "always"}
    res = collectives.launch(_body_refused, 3, 1, transport="shm", timeout=30.0, options=always)
    for single_copy, status, plan, algorithm in res:
        assert single_copy is False and algorithm == "pull", res
        assert "rank 1 cannot read rank 0's memory" in status and "Operation not permitted" in status, status
        assert "unavailable" in plan, plan
    # the same group without the refusal reads in one copy (the probe is not what fails here)
    ok = collectives.launch(_body_refused, 3, -1, transport="shm", timeout=30.0, options=always)
    assert all(r[0] is True and r[3] == "cma_pull" for r in ok), ok


def _body_mixed_senders(comm, seed: int, native: str = "auto"):
    """all_to_all where some senders are read in one copy (>= 32 KiB here) and the others stage through
    4 KiB slots in several rounds (``native``: the compiled helper's setting; its split barrier at the
    end is compiled, the Python one a plain store)."""
    n, r = comm.size, comm.rank
    _shm_single_copy.SINGLE_COPY_MIN_BYTES[OpCode.ALL_TO_ALL] = 32 << 10  # this process's table, read by the next transport
    _shm_single_copy.SINGLE_COPY_MIN_BYTES[OpCode.ALL_GATHER] = 32 << 10
    _shm_single_copy.SINGLE_COPY_WHEN_OVERSUBSCRIBED = True  # 3 and 4 ranks on this 2-core machine
    sub = comm.split(0, options={"shm_slot_bytes": 4096, "shm_native": native})
    # odd ranks send >= 36 KB (direct), even ranks 4.8-12.8 KB (staged in 2-4 rounds); 80-byte rows
    rows = lambda s, d: (150 + (s + d + seed) % 3) if s % 2 else 20 + 10 * ((s + d) % 3)
    width = 20
    send = [rows(r, d) for d in range(n)]
    x = rank_input("mixed", r, (sum(send), width), torch.float32, seed)
    got = sub.all_to_all(x, send_counts=send)
    expected = []
    for s in range(n):
        xs = rank_input("mixed", s, (sum(rows(s, d) for d in range(n)), width), torch.float32, seed)
        start = sum(rows(s, d) for d in range(r))
        expected.append(xs[start : start + rows(s, r)])
    assert torch.equal(got, torch.cat(expected)), f"rank {r}"
    gathered = sub.all_gather(rank_input("gather", r, (9001,), torch.float32, seed))  # 36 KB: single copy
    assert torch.equal(gathered, torch.cat([rank_input("gather", s, (9001,), torch.float32, seed) for s in range(n)]))
    direct = [s for s in range(n) if sum(rows(s, d) for d in range(n)) * width * 4 >= 32 << 10]
    return direct, sub.plan("all_to_all", x).algorithm, sub.plan("all_gather", torch.empty(9001)).algorithm


@pytest.mark.parametrize("nprocs,native", [(3, "auto"), (4, "auto"), (3, "off")])
def test_all_to_all_with_direct_and_staged_senders(nprocs, native):
    res = collectives.launch(_body_mixed_senders, nprocs, 2, native, transport="shm", timeout=30.0)
    direct, algorithm, gather_algorithm = res[0]
    assert direct and len(direct) < nprocs, res  # both kinds of sender took part
    assert algorithm == "pull+cma" and gather_algorithm == "cma_pull"


def _fail_reads_from_now_on(*args, **kwargs):
    raise OSError(errno.EFAULT, "Bad address (injected by the test)")


def _body_read_fails(comm, failing_rank: int):
    x = torch.randn(400_000)
    comm.all_gather(x)  # the path works first
    if comm.rank == failing_rank:
        _cma.read = _fail_reads_from_now_on
    try:
        comm.all_gather(x)
    except (CommunicatorBrokenError, PeerFailedError) as e:
        return type(e).__name__, str(e)
    return "no error", ""


def test_a_failed_read_breaks_the_call_on_every_rank_naming_it():
    res = collectives.launch(_body_read_fails, 3, 2, transport="shm", timeout=30.0,
                             options={"shm_single_copy": "always"})
    name, msg = res[2]
    assert name == "CommunicatorBrokenError" and "could not read rank" in msg and "MOECOMM_SHM_SINGLE_COPY=off" in msg, msg
    # the others raise instead of waiting, each naming the peer it saw fail: rank 2 aborting, or a rank
    # that aborted (or exited) because of it
    assert all(res[r][0] == "PeerFailedError" and ("aborted after a failure" in res[r][1] or "exited" in res[r][1])
               for r in (0, 1)), res
