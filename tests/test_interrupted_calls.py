"""A call interrupted on one rank (KeyboardInterrupt: Ctrl-C, or a signal handler that raises) breaks
the communicator there and the peers raise instead of pairing their calls one step apart with it.

Driven deterministically: a peer is paused (it sleeps before its call, or inside the single-copy
write), and the rank waiting for it is interrupted by a SIGINT sent to its own main thread.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import collectives
from spmd import mpiexec_path, rank_input
from transports.base import CollectiveTimeoutError, CommunicatorBrokenError, PeerFailedError

HERE = Path(__file__).resolve().parent
PAUSE = 1.5  # the peer's delay; rank 0 is interrupted a third of the way into it


def _interrupt_soon(delay: float) -> threading.Timer:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(delay, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    return timer


def interrupted_all_reduce(comm, collective: str = "all_reduce"):
    """Rank 0 is interrupted while it waits for the others (paused); then every rank calls on.

    Returns, rank 0: ("interrupted", comm.closed, what its next call did); others: the error they
    raised (or "no error") and whether every result they got was right.
    """
    n, me = comm.size, comm.rank
    xs = [[rank_input("interrupt", r, (1001,), torch.int64, k) for r in range(n)] for k in range(3)]

    def call(x):
        if collective == "all_reduce":
            return comm.all_reduce(x)
        if collective == "all_gather":
            return comm.all_gather(x)
        return comm.broadcast(x, src=n - 1)

    def want(k):
        if collective == "all_reduce":
            return sum(xs[k][r] for r in range(n))
        if collective == "all_gather":
            return torch.cat(xs[k])
        return xs[k][n - 1]

    if me == 0:
        timer = _interrupt_soon(PAUSE / 3)
        try:
            call(xs[0][0])
            return ("not interrupted",)
        except KeyboardInterrupt:
            pass
        finally:
            timer.cancel()
        closed = comm.closed
        try:
            call(xs[1][0])
            after = "returned"
        except CommunicatorBrokenError as e:
            after = f"CommunicatorBrokenError: {e}"
        return ("interrupted", closed, after)
    time.sleep(PAUSE)
    right = []
    t0 = time.monotonic()
    try:
        for k in range(3):
            right.append(torch.equal(call(xs[k][me]), want(k)))
        return ("no error", "", right, 0.0)
    except (CollectiveTimeoutError, CommunicatorBrokenError) as e:
        return (type(e).__name__, str(e), right, time.monotonic() - t0)


def check(results, timeout: float) -> None:
    assert results[0][0] == "interrupted", results[0]
    _, closed, after = results[0]
    assert closed is True, results[0]
    assert after.startswith("CommunicatorBrokenError") and "KeyboardInterrupt interrupted" in after, after
    for kind, msg, right, waited in results[1:]:
        assert all(right), f"a peer got a wrong result: {results}"
        # told by rank 0, not left to its timeout
        assert kind == "PeerFailedError" and "rank 0" in msg and waited < timeout / 2, results


TRANSPORTS = {
    "shm": {},
    "shm-single-copy": {"shm_single_copy": "always"},
    "shm-fallback": {"shm_single_copy": "off", "shm_native": "off"},
    "gloo": {},
    "ipc": {"ipc_emulate": 1},
}


@pytest.mark.parametrize("name", list(TRANSPORTS))
def test_an_interrupted_call_breaks_the_communicator_and_the_peers_raise(name):
    if name == "ipc":
        pytest.importorskip("triton")
    transport = name.split("-")[0]
    timeout = 20.0
    collective = "all_gather" if name == "shm-single-copy" else "all_reduce"
    results = collectives.launch(interrupted_all_reduce, 2, collective, transport=transport, timeout=timeout,
                                 options=TRANSPORTS[name])
    check(results, timeout)


def test_an_interrupted_broadcast_at_three_ranks():
    timeout = 20.0
    results = collectives.launch(interrupted_all_reduce, 3, "broadcast", transport="shm", timeout=timeout)
    check(results, timeout)


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra: pip install '.[test]')")
def test_an_interrupted_call_over_mpi():
    p = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(HERE / "jobs" / "interrupt_job.py")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("interrupt job ok") == 2, p.stdout[-3000:]


def _single_copy_written_after_interrupt(comm):
    """Rank 1 writes its block into rank 0's output late (paused inside the write); rank 0 is
    interrupted while it waits, drops its output and allocates: the output must stay allocated."""
    from transports import _shm_single_copy

    shm = comm.transports["shm"]
    if not shm._push:
        return ("no push", shm.single_copy_status)
    n, me = comm.size, comm.rank
    numel = 1 << 20  # 4 MiB of float32 per rank
    x = rank_input("sc", me, (numel,), torch.float32, 0)
    if me == 1:
        write = shm._write_peer

        def late_write(r, local, remote, nbytes):
            time.sleep(PAUSE)
            write(r, local, remote, nbytes)

        shm._write_peer = late_write
        right = []
        try:
            for _ in range(2):  # the first may complete (rank 0 had done its part); the next cannot
                right.append(torch.equal(comm.all_gather(x), torch.cat([rank_input("sc", r, (numel,), torch.float32, 0)
                                                                          for r in range(n)])))
            return ("no error", "", right)
        except (CollectiveTimeoutError, CommunicatorBrokenError) as e:
            return (type(e).__name__, str(e), right)
    timer = _interrupt_soon(PAUSE / 3)
    out = torch.empty(n * numel)
    ptr = out.data_ptr()
    try:
        comm.all_gather(x, out=out)
        return ("not interrupted",)
    except KeyboardInterrupt:
        pass
    finally:
        timer.cancel()
    del out
    gc.collect()
    kept = any(t.data_ptr() == ptr for t in _shm_single_copy._WRITTEN_BY_PEERS)
    reuse = [torch.zeros(n * numel) for _ in range(4)]  # would take the freed block
    time.sleep(PAUSE)  # rank 1 writes now
    clean = all(bool((t == 0).all()) for t in reuse)
    return ("interrupted", kept, clean, comm.closed)


def test_an_interrupted_single_copy_all_gather_keeps_its_output_for_the_peers_writes():
    results = collectives.launch(_single_copy_written_after_interrupt, 2, transport="shm", timeout=20.0,
                                 options={"shm_single_copy": "always"})
    if results[0][0] == "no push":
        pytest.skip(f"all_gather does not write into peers here: {results[0][1]}")
    assert results[0] == ("interrupted", True, True, True), results
    kind, msg, right = results[1]
    assert kind == "PeerFailedError" and "rank 0" in msg and all(right), results
