"""One communicator, several threads: concurrent calls are refused loudly, never mixed silently."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import collectives
from collectives import CommunicatorBrokenError, PeerFailedError
from spmd import UNDER_MPI

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="spawns its own ranks")

CALLS = 1000


def _thread_input(thread: int, call: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * thread + 10 * call + rank)
    return torch.rand(4, generator=g, dtype=torch.float64) + thread  # the threads' sums differ


def _hammer(comm, thread: int, start: threading.Barrier, report: dict) -> None:
    right = wrong = 0
    error = None
    start.wait()
    try:
        for i in range(CALLS):
            y = comm.all_reduce(_thread_input(thread, i, comm.rank))
            expect = sum(_thread_input(thread, i, r) for r in range(comm.size))
            if torch.allclose(y, expect):
                right += 1
            else:
                wrong += 1
    except Exception as e:  # noqa: BLE001 - the test inspects it
        error = e
    report[thread] = (right, wrong, error)


def _body_two_threads(comm, shared: bool):
    """Two threads doing all_reduces, on one communicator (shared) or on one each (split)."""
    comms = [comm, comm] if shared else [comm.split(0), comm.split(0)]
    report: dict = {}
    start = threading.Barrier(2)
    threads = [threading.Thread(target=_hammer, args=(c, t, start, report), name=f"worker{t}")
               for t, c in enumerate(comms)]
    # Switch threads every few microseconds, as truly parallel threads (GIL-free code, GPU calls)
    # would interleave: the default 5 ms lets one thread run alone for dozens of calls, and
    # calls that never overlap cannot be told apart from a correct hand-over between threads.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    after = None
    try:
        comm.all_reduce(torch.ones(2))
    except Exception as e:  # noqa: BLE001
        after = e
    return [(right, wrong, type(err).__name__ if err else None, str(err) if err else "")
            for right, wrong, err in (report[0], report[1])], type(after).__name__ if after else None


def test_two_threads_on_one_communicator_raise_instead_of_mixing():
    """The adversarial run: 2 threads x 200 all_reduces per rank on one communicator returned
    wrong results with no exception. Now the overlap is refused, the call in flight raises too,
    and the communicator closes, so no thread runs to its end and no rank waits for the timeout.
    (Results of calls before the first overlap can still be mismatched across ranks: calls that
    never overlap cannot be told apart from a correct hand-over between threads.)"""
    res = collectives.launch(_body_two_threads, 2, True, timeout=30.0)
    conflicts = 0
    for threads, after in res:
        assert after == "CommunicatorBrokenError", res  # closed, so its peers do not wait on it
        for right, wrong, name, msg in threads:
            # every thread stopped with the refusal, or with its peer closing because of it
            assert name in ("RuntimeError", "PeerFailedError", "CommunicatorBrokenError"), res
            assert right + wrong < CALLS, res
            conflicts += name == "RuntimeError" and "while another thread was inside a call" in msg
    assert conflicts >= 1, res


def test_one_communicator_per_thread_is_fine():
    for threads, after in collectives.launch(_body_two_threads, 2, False, timeout=30.0):
        assert after is None
        assert [t[:3] for t in threads] == [(CALLS, 0, None)] * 2, threads


def _body_second_thread_refused(comm):
    """Rank 0: a worker thread waits inside a call (rank 1 is late) when the main thread calls."""
    x = torch.full((3,), float(comm.rank + 1))
    if comm.rank == 1:
        time.sleep(3)
        first = comm.all_reduce(x).tolist()  # pairs with rank 0's worker thread
        try:
            comm.all_reduce(x)
        except PeerFailedError as e:
            return first, type(e).__name__
        return first, None
    outcome = {}

    def worker():
        try:
            outcome["worker"] = comm.all_reduce(x).tolist()
        except Exception as e:  # noqa: BLE001
            outcome["worker"] = (type(e).__name__, str(e))

    t = threading.Thread(target=worker, name="worker")
    t.start()
    time.sleep(0.5)  # the worker is inside all_reduce now, waiting for rank 1
    try:
        comm.using("auto").barrier()  # a view shares its parent's transports, so it counts as the same
        main = None
    except RuntimeError as e:
        main = str(e)
    t.join()
    late = None
    try:
        comm.all_gather(x)
    except CommunicatorBrokenError as e:
        late = str(e)
    return outcome["worker"], main, late


def test_call_from_second_thread_is_refused_and_breaks_the_communicator():
    (worker, main, late), (first, peer_error) = collectives.launch(
        _body_second_thread_refused, 2, timeout=20.0)
    assert main is not None and "barrier was called from thread 'MainThread'" in main and "split" in main
    assert worker[0] == "RuntimeError" and "another thread" in worker[1]  # it does not return its result
    assert late is not None and "two threads" in late
    assert first == [3.0, 3.0, 3.0] and peer_error == "PeerFailedError"  # rank 1 is told, does not time out


