"""The host transports (shm, mpi) on their own: failure detection without false alarms, settings, NaN.

The shm cases drive SharedMemoryTransport objects of one process directly (built in threads over an
in-process rendezvous), so an interleaving of two ranks can be forced step by step. The mpi cases run
tests/jobs/host_transport_job.py under mpiexec.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import collectives
from spmd import ThreadRendezvous, UNDER_MPI, left_behind, mpiexec_path, shm_segments
from transports.base import (
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    PeerFailedError,
    ReduceOp,
    Rendezvous,
    Signature,
)
from transports.shm import SharedMemoryTransport

HERE = Path(__file__).parent
ROOT = HERE.parent


# ---- shm transports of one process ------------------------------------------------------------
def _shm_group(size: int, *, pids=None, settings=None, oversubscribed=False, timeout=5.0):
    """``size`` SharedMemoryTransport objects of one group, all in this process."""
    shared = {"barrier": threading.Barrier(size), "slots": [b""] * size}
    pids = pids or [os.getpid()] * size
    made: list = [None] * size

    def make(r):
        info = GroupInfo(rank=r, size=size, timeout=timeout, rendezvous=ThreadRendezvous(shared, r, size),
                         global_ranks=list(range(size)), pids=list(pids), hosts=["here"] * size,
                         oversubscribed=oversubscribed, settings=dict(settings or {}))
        made[r] = SharedMemoryTransport(info)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(made), "could not build the shm group"
    return made


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


BARRIER = Signature.of(OpCode.BARRIER)


@pytest.mark.parametrize("how", ["closed", "exited"])
def test_shm_peer_that_arrives_then_leaves_before_the_check_is_no_failure(how):
    """Bug 1: rank 0 computed its pending list, then rank 1 arrived and closed (or exited) before rank 0
    checked its peers. The call completed, so rank 0 must return, not raise PeerFailedError."""
    pids = [os.getpid(), _dead_pid() if how == "exited" else os.getpid()]
    t0, t1 = _shm_group(2, pids=pids)
    real_check = t0._check_peers
    seen = []

    def peer_arrives_then_leaves(*args, **kwargs):
        if not seen:  # the first check: rank 0 is already waiting, with rank 1 pending
            seen.append(args)
            t1.barrier(BARRIER)  # rank 0 has published its epoch, so rank 1 passes at once
            if how == "closed":
                t1.close()
        return real_check(*args, **kwargs)

    t0._check_peers = peer_arrives_then_leaves
    try:
        t0.barrier(BARRIER)  # raised PeerFailedError before the fix
        assert seen, "the interleaving was not exercised"
        # and the next call does see a real failure: rank 1 is gone and never arrives again
        with pytest.raises(PeerFailedError, match="rank 1 (closed its communicator|.*died)"):
            t0.barrier(BARRIER)
    finally:
        t0.close()
        t1.close()


@pytest.mark.parametrize("how", ["closed", "exited"])
def test_shm_peer_that_leaves_without_arriving_fails_at_once(how):
    pids = [os.getpid(), _dead_pid() if how == "exited" else os.getpid()]
    t0, t1 = _shm_group(2, pids=pids, timeout=30.0)
    if how == "closed":
        t1.close()
    try:
        with pytest.raises(PeerFailedError) as info:
            t0.barrier(BARRIER)
        assert info.value.missing_ranks == [1]
        assert ("rank 1 closed its communicator" if how == "closed" else "died") in str(info.value)
    finally:
        t0.close()
        t1.close()


def test_shm_use_after_close_says_closed():
    """Adversarial 10: a call after close() raised TypeError ('NoneType' object is not subscriptable)."""
    t0, t1 = _shm_group(2)
    x = torch.arange(4, dtype=torch.float32)
    sig = Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype, shape=x.shape, op=ReduceOp.SUM)
    t0.close()
    t1.close()
    calls = {
        "all_reduce": lambda t: t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig),
        "all_gather": lambda t: t.all_gather(x, torch.empty(8), sig),
        "reduce_scatter": lambda t: t.reduce_scatter(x, torch.empty(2), ReduceOp.SUM, sig),
        "broadcast": lambda t: t.broadcast(x, torch.empty_like(x), 0, sig),
        "all_to_all": lambda t: t.all_to_all(x, [2, 2], 1, lambda c: torch.empty(sum(c)), sig),
        "barrier": lambda t: t.barrier(BARRIER),
        "exchange_meta": lambda t: t.exchange_meta(BARRIER),
    }
    wrong = {}
    for name, call in calls.items():
        try:
            call(t0)
            wrong[name] = "no error"
        except CommunicatorBrokenError as e:
            if "closed" not in str(e):
                wrong[name] = str(e)
        except Exception as e:  # noqa: BLE001 - collected and reported together
            wrong[name] = f"{type(e).__name__}: {e}"
    assert not wrong, wrong


def test_shm_reads_its_settings_from_the_group(monkeypatch):
    """Bug 5 / one place for settings: slot size, one-shot limit, spin and yield come from group.settings
    and oversubscription from group.oversubscribed; the environment only fills an empty GroupInfo."""
    from transports.settings import resolve

    for var, value in (("MOECOMM_SHM_SLOT_BYTES", "65536"), ("MOECOMM_SHM_ONE_SHOT_MAX", "999"),
                       ("MOECOMM_SHM_SPIN", "7"), ("MOECOMM_SHM_YIELD", "3")):
        monkeypatch.setenv(var, value)
    settings = resolve({"shm_slot_bytes": 1 << 14, "shm_one_shot_max": 4096, "shm_yield": 11})
    settings["shm_spin"] = None  # not set: the default follows oversubscription
    got = {}
    for over in (False, True):
        t0, t1 = _shm_group(2, settings=settings, oversubscribed=over)
        got[over] = (t0.slot_bytes, t0._one_shot_limit, t0._spin_iters, t0._yield_iters)
        t0.close()
        t1.close()
    assert got == {False: (1 << 14, 4096, 400, 11), True: (1 << 14, 4096, 16, 11)}
    t0, t1 = _shm_group(2)  # a GroupInfo built by hand, without settings: the environment
    got = (t0.slot_bytes, t0._one_shot_limit, t0._spin_iters, t0._yield_iters)
    t0.close()
    t1.close()
    assert got == (65536, 999, 7, 3)


# ---- many ranks on 2 cores, leaving right after their last collective ----------------------------
def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _body_leave_right_after(comm, rounds: int):
    rng = random.Random(comm.rank)
    x = torch.rand(4, generator=torch.Generator().manual_seed(comm.rank))
    want = comm.all_gather(x).view(comm.size, 4).sum(0)
    for _ in range(rounds):
        sub = comm.split(0)  # a fresh group each round, closed right after its last collective
        for _ in range(3):
            _busy(rng.random() * 3e-3)  # uneven arrivals keep the 2 cores contended
            got = sub.all_reduce(x)
            assert torch.allclose(got, want), (got, want)
        sub.close()
    comm.all_reduce(x)
    return "done"  # the process exits right after: its peers may still be waiting in that last call


@pytest.mark.skipif(UNDER_MPI, reason="spawns its own ranks")
@pytest.mark.parametrize("nprocs,launches", [(6, 1), (8, 2)])
def test_shm_ranks_that_leave_right_after_the_last_collective_fail_nobody(nprocs, launches):
    """Bug 1 as the adversarial run saw it: more ranks than cores, each leaving (closing, exiting) as soon
    as its last collective returns, must never make a peer raise PeerFailedError. (The race is rare here:
    before the fix about 1 launch in 15 failed; the deterministic test above forces it.)"""
    before = shm_segments()
    for _ in range(launches):
        res = collectives.launch(_body_leave_right_after, nprocs, 15, transport="shm", timeout=10.0,
                                 return_exceptions=True)
        assert res == ["done"] * nprocs, [f"rank {r}: {e!r}" for r, e in enumerate(res) if e != "done"]
    assert not left_behind(before)


# ---- nccl: its one setting comes from the group too (a fake NCCL: this runs without a GPU) ----------
class _OneRankRendezvous(Rendezvous):
    rank, size, timeout = 0, 1, 5.0

    def __init__(self):
        self.calls = 0

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        self.calls += 1
        return [data]

    def split(self, color, key, new_rank, new_size, ranks):
        raise NotImplementedError


@pytest.mark.parametrize("check,exchanges", [("first", 1), ("always", 3)])
def test_nccl_reads_its_check_setting_from_the_group(monkeypatch, check, exchanges):
    import contextlib
    import types

    import transports.nccl as nccl_mod
    from transports.settings import resolve

    fake = types.SimpleNamespace(get_unique_id=lambda: (1, 2, 3), NcclCommunicator=lambda *a: object())
    monkeypatch.setattr(nccl_mod, "nccl_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setenv("MOECOMM_NCCL_CHECK", "first" if check == "always" else "always")  # not read
    rdv = _OneRankRendezvous()
    info = GroupInfo(rank=0, size=1, timeout=5.0, rendezvous=rdv, global_ranks=[0],
                     settings=resolve({"nccl_check": check}))
    t = nccl_mod.NCCLTransport(info)
    t.comm = None  # nothing to destroy
    before = rdv.calls
    sig = Signature.of(OpCode.ALL_REDUCE, dtype=torch.float32, shape=(4,), op=ReduceOp.SUM)
    for _ in range(3):
        t._agree(sig)
    assert rdv.calls - before == exchanges


# ---- the mpi transport (and shm beside it) under mpiexec --------------------------------------------
def _run_job(which: str, nprocs: int, out: Path, *mpiexec_args: str) -> dict[int, dict]:
    """Run tests/jobs/host_transport_job.py: every rank's {case: (ok, detail)} (asserted all there)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("MOECOMM_TRANSPORT", None)
    p = subprocess.run([mpiexec_path(), *mpiexec_args, "-n", str(nprocs), sys.executable,
                        str(HERE / "jobs" / "host_transport_job.py"), which, str(out)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    reports = {}
    for f in out.glob("rank*.json"):
        rep = json.loads(f.read_text())
        reports[rep["rank"]] = rep["results"]
    assert sorted(reports) == list(range(nprocs)), f"missing rank reports\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return reports


def _assert_cases_passed(reports: dict[int, dict], cases: set[str]) -> None:
    """Every rank ran ``cases`` (among others) and none failed: all failures asserted at once."""
    missing = [f"rank {r}: {sorted(cases - set(res))}" for r, res in sorted(reports.items()) if cases - set(res)]
    assert not missing, f"cases not run: {missing}; {reports}"
    failed = [f"rank {r} {case}: {detail}" for r, res in sorted(reports.items()) for case, (ok, detail) in res.items()
              if case in cases and not ok]
    assert not failed, "\n".join(failed)


needs_mpiexec = pytest.mark.skipif(UNDER_MPI or mpiexec_path() is None,
                                   reason="starts its own mpiexec (needs the mpich wheel of the test extra)")

MAIN_CASES = {"nan_max_min", "closed_peer_named_at_once", "sleep_rank_named", "stop_rank_named", "use_after_close"}
LATE_CASES = {"late_setup_peer_times_out"}


@pytest.fixture(scope="module")
def main_and_late_job(tmp_path_factory) -> dict[int, dict]:
    """One 3-rank launch of the main cases, then the late one (it leaves MPI_COMM_WORLD out of step, so
    it comes last). -disable-auto-cleanup: the ranks exit without MPI_Finalize after the late case, and by
    default mpiexec kills the whole job when one rank does."""
    reports = _run_job("main+late", 3, tmp_path_factory.mktemp("host_main"), "-disable-auto-cleanup")
    return reports


@needs_mpiexec
def test_mpi_transport_nan_close_stall_stop_and_use_after_close(main_and_late_job):
    """Adversarial 4, 9 and 10 over the mpi transport (3 ranks, one launch, every case reported):

    - all_reduce/reduce_scatter max/min with NaN on some ranks: the same bits on every rank, NaN
      propagated, over mpi and shm, for float64/32/16 and bfloat16 (MPI's own MAX/MIN gave rank 0
      [nan, 1.0] and rank 1 [1.0, nan]);
    - a peer that closed is named within a second (it was noticed only at the timeout);
    - a rank that stalls (sleeps, or is stopped by SIGSTOP) after the signatures matched is named on
      every other rank (it was "some rank never arrived (MPI cannot say which ...)");
    - a call after close() raises CommunicatorBrokenError saying so (it was "Invalid MPI_Request").
    """
    reports = main_and_late_job
    assert all(set(res) == MAIN_CASES | LATE_CASES for res in reports.values()), reports
    _assert_cases_passed(reports, MAIN_CASES)
    stopped = [res["stop_rank_named"][1] for r, res in reports.items() if r != 1]
    assert any("rank 1: pid" in d and "is stopped" in d for d in stopped), stopped


@needs_mpiexec
def test_mpi_transport_notices_a_dead_peer_before_the_timeout(tmp_path):
    """A rank that exits without closing (as a crash looks) is named within seconds, not at the timeout.
    (-disable-auto-cleanup: by default mpiexec kills the whole job when one rank dies.)"""
    reports = _run_job("dead", 2, tmp_path, "-disable-auto-cleanup")
    _assert_cases_passed(reports, {"dead_peer_noticed_before_timeout"})


@needs_mpiexec
def test_mpi_transport_set_up_is_bounded_when_a_peer_comes_late(main_and_late_job):
    """A rank that never reaches the mpi transport's set-up (here: rank 1 of the main launch, held back
    until ranks 0 and 2 gave up on their 2 s timeout) makes the others raise CollectiveTimeoutError naming
    the set-up; it used to block in MPI_Comm_dup."""
    _assert_cases_passed(main_and_late_job, LATE_CASES)
