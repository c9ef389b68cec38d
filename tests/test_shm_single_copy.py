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
from transports._path_choice import size_class
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
    assert all(r[0] is True and r[3] == "cma_push" for r in ok), ok


def _body_writes_refused(comm):
    """Rank 1 cannot write its peers' memory: single copy stays on, and every rank's all_gather reads."""
    if comm.rank == 1:
        _cma.write = _refuse_reads  # this process only: the next probe's writes fail here
    sub = comm.split(0)
    shm = sub.transports["shm"]
    xs = [rank_input("writes-refused", r, (300_001,), torch.float32, 3) for r in range(comm.size)]
    assert torch.equal(sub.all_gather(xs[comm.rank]), torch.cat(xs))
    return shm.single_copy, shm.single_copy_status, sub.plan("all_gather", xs[0]).algorithm


def test_refused_writes_make_all_gather_read_and_say_why():
    res = collectives.launch(_body_writes_refused, 3, transport="shm", timeout=30.0,
                             options={"shm_single_copy": "always"})
    for single_copy, status, algorithm in res:
        assert single_copy is True and algorithm == "cma_pull", res
        assert "all_gather reads: rank 1 cannot write rank 0's memory" in status, status


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
    assert algorithm == ("cma_pull" if 0 in direct else "pull") and gather_algorithm == "cma_push"  # rank 0's rows


def _steer_rank_0(comm, shm, chooser: str, forced: int | None) -> None:
    """Rank 0's path choice ``shm.<chooser>`` in a test: with ``forced`` None it tries the other path every
    third call (both paths, and the switches between them), else it always chooses ``forced``."""
    if comm.rank != 0:
        return
    if forced is None:
        setattr(shm, chooser, _shm_single_copy.PathChooser(getattr(shm, chooser).paths, explore_every=3))
    else:
        steered = getattr(shm, chooser)
        steered.choose = lambda key: forced
        steered.record = lambda key, path, seconds: None


def _in_place_case(comm, counts: list[list[int]], width: int, dtype: torch.dtype, tag: int, out_of_place: set):
    """One all_to_all of rows ``counts[s][d]`` (rank s to rank d, rows of ``width`` ``dtype``), in place on
    the ranks not in ``out_of_place``, called three times with fresh data (the first call makes the plan,
    the others take the latency path); asserts the rows against each sender's input."""
    n, r = comm.size, comm.rank
    for again in range(3):
        inputs = [rank_input("a2a-swap", s, (sum(counts[s]), width), dtype, tag + again) for s in range(n)]
        x = inputs[r].clone()
        out = torch.empty((sum(c[r] for c in counts), width), dtype=dtype) if r in out_of_place else x
        got = comm.all_to_all(x, counts[r], out=out)
        want = torch.cat([inputs[s][sum(counts[s][:r]) : sum(counts[s][: r + 1])] for s in range(n)])
        assert got is out and torch.equal(out, want), f"rank {r}, counts {counts}, call {again}"


def _body_in_place_swap(comm, seed: int, forced: int | None):
    """all_to_all with out=x read in one copy: swapped in place chunk by chunk when every sender is read
    in one copy and the counts are symmetric, received aside otherwise; ranks in and out of place mixed.
    The swap reads by single copy or goes through the slots, as rank 0 timed (``forced``: always that one;
    None: both in turns); returns how many calls swapped each way, per case."""
    n = comm.size
    _shm_single_copy.SWAP_CHUNK_BYTES = 1000  # this process: many chunks, ends that cut rows
    _shm_single_copy.STAGED_COPY_CHUNK_BYTES = 1000  # the same through the slots (2 ranks; 3 use the slot)
    _shm_single_copy.SINGLE_COPY_MIN_BYTES[OpCode.ALL_TO_ALL] = 32 << 10
    _shm_single_copy.SINGLE_COPY_WHEN_OVERSUBSCRIBED = True  # 3 ranks on this 2-core machine
    sub = comm.split(0, options={"shm_slot_bytes": 4096} if n > 2 else None)
    shm = sub.transports["shm"]
    assert shm._staged_chunk == (4096 if n > 2 else 1000)
    _steer_rank_0(sub, shm, "_swap_chooser", forced)
    swaps = {_shm_single_copy.SINGLE_PATH: 0, _shm_single_copy.STAGED_PATH: 0}
    can_swap = _shm_single_copy.SingleCopyPaths._can_swap

    def counted(self, counts):  # a call that swaps, by the swap rank 0 published for it
        swapping = can_swap(self, counts)
        if swapping:
            swaps[self._swap_path()] += 1
        return swapping
    _shm_single_copy.SingleCopyPaths._can_swap = counted
    cases = []

    def case_done():
        cases.append(dict(swaps))
        for path in swaps:
            swaps[path] = 0

    none = set()
    # even split, and rows of odd byte sizes (3 bytes of uint8, 10 of bfloat16)
    for k, (rows, width, dtype) in enumerate([(3000, 8, torch.float64), (17000, 3, torch.uint8),
                                              (2000, 5, torch.bfloat16)]):
        _in_place_case(sub, [[rows] * n for _ in range(n)], width, dtype, seed + 10 * k, none)
    case_done()
    # uneven but symmetric counts, an empty pair among them; then one rank in place, the others not
    sym = [[(5000 + 1700 * (s + d)) * ((s + d) % 3 != 1) for d in range(n)] for s in range(n)]
    _in_place_case(sub, sym, 4, torch.float32, seed + 40, none)
    _in_place_case(sub, sym, 4, torch.float32, seed + 50, set(range(1, n)))
    case_done()
    # not symmetric (each rank receives as many rows as it sends): received aside, then copied
    cyc = [[(0, 4000, 9000)[(d - s) % 3] if n == 3 else 6000 + 1000 * s * (s != d) for d in range(n)]
           for s in range(n)]
    if n == 3:
        _in_place_case(sub, cyc, 4, torch.float32, seed + 60, none)
    # a rank that stages (below the single-copy size): received aside on the others
    small = [[3000 if s < n - 1 and d < n - 1 else 10 for d in range(n)] for s in range(n)]
    small[n - 1][n - 1] = 0
    _in_place_case(sub, small, 4, torch.float32, seed + 70, none)
    case_done()
    return cases, dict(shm._swap_paths)


@pytest.mark.parametrize("nprocs,forced", [(2, None), (3, None), (2, _shm_single_copy.STAGED_PATH),
                                           (3, _shm_single_copy.SINGLE_PATH)])
def test_in_place_all_to_all_swaps_blocks_in_chunks(nprocs, forced):
    res = collectives.launch(_body_in_place_swap, nprocs, 5, forced, transport="shm", timeout=60.0)
    single, staged = _shm_single_copy.SINGLE_PATH, _shm_single_copy.STAGED_PATH
    for cases, paths in res:
        # every rank swapped on the latency path's calls: two of three per new shape, all three of the
        # mixed case (its shape's plan exists); the asymmetric and staged cases received aside
        assert [c[single] + c[staged] for c in cases] == [6, 5, 0], res
        if forced is None:  # rank 0 tried both swaps, and every rank followed it (the same counts, below)
            assert cases[0][single] and cases[0][staged], res
        else:
            assert [c[forced] for c in cases] == [6, 5, 0] and set(paths.values()) == {forced}, res
    assert all(r == res[0] for r in res), res


def _fail_reads_from_now_on(*args, **kwargs):
    raise OSError(errno.EFAULT, "Bad address (injected by the test)")


def _body_read_fails(comm, failing_rank: int, op: str):
    x = torch.randn(399_999)
    call = (lambda: comm.all_gather(x)) if op == "all_gather" else (lambda: comm.all_to_all(x, out=x))
    call()  # the path works first
    if comm.rank == failing_rank:
        _cma.read = _cma.write = _fail_reads_from_now_on
    kept = len(_shm_single_copy._WRITTEN_BY_PEERS)
    try:
        call()  # all_gather writes into the peers; all_to_all in place: the swap, reading in chunks
    except (CommunicatorBrokenError, PeerFailedError) as e:
        # the output peers write into stays allocated (a late write must not land in freed memory)
        assert len(_shm_single_copy._WRITTEN_BY_PEERS) - kept == (op == "all_gather")
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.parametrize("op", ["all_gather", "all_to_all_in_place"])
def test_a_failed_read_breaks_the_call_on_every_rank_naming_it(op):
    res = collectives.launch(_body_read_fails, 3, 2, op, transport="shm", timeout=30.0,
                             options={"shm_single_copy": "always"})
    name, msg = res[2]
    verb = "write" if op == "all_gather" else "read"
    assert name == "CommunicatorBrokenError" and f"could not {verb} rank" in msg and "MOECOMM_SHM_SINGLE_COPY=off" in msg, msg
    # the others raise instead of waiting, each naming the peer it saw fail: rank 2 aborting, or a rank
    # that aborted (or exited) because of it
    assert all(res[r][0] == "PeerFailedError" and ("aborted after a failure" in res[r][1] or "exited" in res[r][1])
               for r in (0, 1)), res


def _body_timed_all_gather(comm, forced: int | None, native: str = "auto"):
    """Large all_gathers whose path rank 0 chooses (single copy or staged) by timing: every rank takes
    rank 0's path on every call, and every result is right. ``forced``: rank 0 always chooses it."""
    _shm_single_copy.SINGLE_COPY_MIN_BYTES[OpCode.ALL_GATHER] = 32 << 10  # this process's table, read by the next transport
    _shm_single_copy.SINGLE_COPY_WHEN_OVERSUBSCRIBED = True  # 3 ranks on this 2-core machine
    comm = comm.split(0, options={"shm_slot_bytes": 4096, "shm_native": native})  # staged: several rounds a call
    shm = comm.transports["shm"]
    assert shm._timed_gather and (shm._gather_chooser is not None) == (comm.rank == 0)
    _steer_rank_0(comm, shm, "_gather_chooser", forced)
    n, numel = comm.size, 9001  # 36004 B: above the single-copy size set here, 9 staged rounds
    paths = []
    for call in range(12):
        in_place = call % 2 == 1
        xs = [rank_input("timed", r, (numel,), torch.float32, call) for r in range(n)]
        if in_place:
            out = torch.zeros(n * numel)
            out[comm.rank * numel : (comm.rank + 1) * numel] = xs[comm.rank]
            got = comm.all_gather(out[comm.rank * numel : (comm.rank + 1) * numel], out=out)
        else:
            got = comm.all_gather(xs[comm.rank])
        assert torch.equal(got, torch.cat(xs)), (comm.rank, call)
        paths.append(shm._gather_paths[(size_class(numel * 4), in_place)])
    return paths, comm.plan("all_gather", xs[comm.rank]).algorithm


@pytest.mark.parametrize("forced,native", [(None, "auto"), (None, "off"), (_shm_single_copy.STAGED_PATH, "auto"),
                                           (_shm_single_copy.SINGLE_PATH, "auto")])
def test_timed_all_gather_follows_rank_0_on_every_rank(forced, native):
    res = collectives.launch(_body_timed_all_gather, 3, forced, native, transport="shm", timeout=60.0)
    paths = [r[0] for r in res]
    assert all(p == paths[0] for p in paths), paths  # no call split the ranks between paths
    if forced is None:
        assert set(paths[0]) == {_shm_single_copy.SINGLE_PATH, _shm_single_copy.STAGED_PATH}, paths[0]
    else:
        assert set(paths[0]) == {forced}
        label = {_shm_single_copy.STAGED_PATH: "pull", _shm_single_copy.SINGLE_PATH: "cma_push"}[forced]
        assert all(r[1] == label for r in res), res


def _body_timed_all_to_all(comm, forced: int | None, native: str = "auto", declared: bool = False):
    """Out-of-place all_to_all whose senders are all read in one copy: rank 0 chooses single copy or
    staged by timing (``forced``: always that one), every rank follows; calls with a staged sender or
    in place are not timed. Every result is checked."""
    _shm_single_copy.SINGLE_COPY_MIN_BYTES[OpCode.ALL_TO_ALL] = 32 << 10  # this process's table
    _shm_single_copy.SINGLE_COPY_WHEN_OVERSUBSCRIBED = True  # 3 ranks on this 2-core machine
    comm = comm.split(0, options={"shm_slot_bytes": 4096, "shm_native": native})  # staged: several rounds a call
    shm = comm.transports["shm"]
    assert shm._timed_a2a and (shm._a2a_chooser is not None) == (comm.rank == 0)
    _steer_rank_0(comm, shm, "_a2a_chooser", forced)
    n, r, width = comm.size, comm.rank, 20  # 80-byte rows
    paths = []
    for call in range(12):
        rows = [150 + (2 * s + d + call) % 5 for s in range(n) for d in range(n)]  # >= 36 KB per sender: direct;
        # not symmetric (rank s sends rank d other than it receives from d): the staged path exchanges pairwise
        send = [rows[r * n + d] for d in range(n)]
        xs = [rank_input("timed-a2a", s, (sum(rows[s * n : (s + 1) * n]), width), torch.float32, call) for s in range(n)]
        recv = [rows[s * n + r] for s in range(n)] if declared else None  # what every sender sends us
        got = comm.all_to_all(xs[r], send_counts=send, recv_counts=recv)
        expected = [xs[s][sum(rows[s * n : s * n + r]) : sum(rows[s * n : s * n + r + 1])] for s in range(n)]
        assert torch.equal(got, torch.cat(expected)), (r, call)
        paths.append(shm._a2a_paths[size_class(sum(rows[:n]) * width * 4)])
    timed, timed_algorithm = dict(shm._a2a_paths), comm.plan("all_to_all", xs[r]).algorithm
    # a staged sender (rank 1 sends 4 KB) or an exchange in place: not timed, and still right
    per = lambda s: 12 if s == 1 else 600  # rows rank s sends to each rank
    xs = [rank_input("untimed", s, (3 * per(s), width), torch.float32, 0) for s in range(n)]
    got = comm.all_to_all(xs[r], send_counts=[per(r)] * 3)
    assert torch.equal(got, torch.cat([xs[s][r * per(s) : (r + 1) * per(s)] for s in range(n)]))
    y = rank_input("in-place", r, (3 * 600, width), torch.float32, 0)
    ref = torch.cat([rank_input("in-place", s, (3 * 600, width), torch.float32, 0)[r * 600 : (r + 1) * 600]
                     for s in range(n)])
    assert torch.equal(comm.all_to_all(y, out=y), ref)
    assert shm._a2a_paths == timed
    return paths, timed_algorithm


@pytest.mark.parametrize("forced,native,declared", [
    (None, "auto", False), (None, "auto", True), (None, "off", False), (None, "off", True),
    (_shm_single_copy.STAGED_PATH, "auto", False), (_shm_single_copy.SINGLE_PATH, "auto", False)])
def test_timed_all_to_all_follows_rank_0_on_every_rank(forced, native, declared):
    res = collectives.launch(_body_timed_all_to_all, 3, forced, native, declared, transport="shm", timeout=60.0)
    paths = [p for p, _ in res]
    assert all(p == paths[0] for p in paths), paths
    if forced is None:
        assert set(paths[0]) == {_shm_single_copy.SINGLE_PATH, _shm_single_copy.STAGED_PATH}, paths[0]
    else:
        assert set(paths[0]) == {forced}
        # the staged path is a pairwise exchange, not pull's rounds: the bench rows and the model tell them apart
        label = {_shm_single_copy.STAGED_PATH: "staged_pairwise", _shm_single_copy.SINGLE_PATH: "cma_pull"}[forced]
        assert all(algorithm == label for _, algorithm in res), res
