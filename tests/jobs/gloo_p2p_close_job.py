"""One rank of tests/test_p2p_hardening.py::test_gloo_close_with_unfinished_p2p_ends_cleanly (issue #51
item 13), started torchrun-style against the test's store (TORCHELASTIC_USE_AGENT_STORE: no rank hosts it).

Rank 0 closes with a receive from rank 1 still posted (a gloo work that only a close can end: after a
peer died, the survivor's receives from the other ranks are left so); it must release the process
group's descriptors and exit normally (it aborted at exit with "terminate called without an active
exception"). Rank 1 waits for a message rank 0 never sends and must be told that rank 0 closed.
Prints "fds <before init> <after close>", what rank 1's receive raised, and "done".
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import collectives  # noqa: E402
from transports.base import PeerFailedError  # noqa: E402


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


before = _fds()
comm = collectives.init(timeout=20.0, transport="gloo")
if comm.rank == 0:
    never = comm.irecv((1 << 16,), 1, tag=9)
    time.sleep(0.3)  # rank 1 waits in its receive now
    comm.close()
    time.sleep(0.2)  # gloo's threads let go of the descriptors
    print(f"fds {before} {_fds()}", flush=True)
else:
    t0 = time.monotonic()
    try:
        comm.recv((3,), 0, tag=7)
        print("no error", flush=True)
    except PeerFailedError as e:
        print(f"raised after {time.monotonic() - t0:.1f}s: {str(e).splitlines()[0][:200]}", flush=True)
    comm.close()
print("done", flush=True)
