"""IPCTransport.close() with ipc kernels still queued, on a GPU (issue #50, point 4): two ranks on cuda:0.

Rank 1 sleeps 10 s before it joins; rank 0 queues ipc all_reduces (the first spins on rank 1, the
others wait behind it in the stream) and closes at once. close() must set ABORT, wait for those
kernels and only then unmap: it returns in under 2 s, and a later ``torch.cuda.synchronize()`` on
rank 0 is clean (no kernel touched unmapped memory, which would be a sticky error). Rank 1 then
calls and must raise promptly (rank 0's STATE says it aborted), not hang.

Rank 1's call reaches rank 0's region after rank 0 freed it (CUDA calls freeing an exported region
before its importers close it undefined behaviour); a CUDA error on rank 1 would show that, not this
fix. Skipped without CUDA; tests/test_ipc_close.py is the same in emulation. About 20 s.
"""

from __future__ import annotations

import time

import pytest
import torch

from gpu_harness import DEVICE
from spmd import mark_done, wait_done

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLEEP = 10.0  # rank 1's absence
TIMEOUT = 5.0  # the communicators' timeout: bounds rank 1's wait if rank 0's STATE is not seen


def _close_with_calls_queued(comm, device: str, flags: str) -> tuple:
    view = comm.using("ipc")
    ipc = comm.transports["ipc"]
    x = torch.ones(1024, device=device)  # 4 KiB of float32: a Lamport all_reduce
    view.all_reduce(x)  # both ranks: the first call of a signature compares it on the host
    view.synchronize()
    if comm.rank == 1:
        time.sleep(SLEEP)
        t0 = time.monotonic()
        try:
            # a Lamport call has no barrier: the first may complete with the data rank 0 pushed before
            # its close aborted it; rank 0's other calls were skipped, so a later one cannot
            for _ in range(4):
                view.all_reduce(x)
                view.synchronize()
            return ("no error", "", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - inspected by the test
            return (type(e).__name__, str(e), time.monotonic() - t0)
        finally:
            mark_done(flags, 1)
    for _ in range(3):  # the first waits for rank 1's data; the others are queued behind it
        view.all_reduce(x)
    in_flight = ipc._busy()  # launched, not DONE (host-mapped, no sync)
    t0 = time.monotonic()
    ipc.close()
    took = time.monotonic() - t0
    comm.close()  # the communicator's other transports; the ipc one is closed already
    try:
        torch.cuda.synchronize()
        synced = "clean"
    except Exception as e:  # noqa: BLE001 - inspected by the test
        synced = f"{type(e).__name__}: {e}"
    wait_done(flags, [1], limit=SLEEP + 30)  # alive (not dead, closed) until rank 1 has called
    return ("closed", in_flight, took, synced)


def test_close_with_ipc_kernels_queued_returns_fast_and_leaves_cuda_clean(tmp_path):
    import collectives

    results = collectives.launch(_close_with_calls_queued, 2, DEVICE, str(tmp_path), device=DEVICE,
                                 transport="ipc", timeout=TIMEOUT)
    _, in_flight, took, synced = results[0]
    assert in_flight, results[0]  # else close() had nothing to abort and this proves nothing
    assert took < 2.0, results[0]
    assert synced == "clean", results[0]  # a kernel that touched unmapped memory fails every later call
    kind, msg, waited = results[1]
    assert kind in ("PeerFailedError", "CollectiveTimeoutError") and "rank 0" in msg, results[1]
    assert waited < TIMEOUT + 2.0, results[1]
