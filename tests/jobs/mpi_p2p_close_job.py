"""Under mpiexec -n 2 (tests/test_p2p_hardening.py::test_mpi_p2p_close_and_deferred_errors, issue #51):
a deferred mismatch leaves nothing half-posted over mpi, and close() with unfinished operations ends
their MPI requests (cancels the receives) instead of leaving them to MPI_Finalize, which mpi4py runs
after the interpreter freed their buffers (a pending receive completed into freed memory: "corrupted
double-linked list" or a segfault at exit); the receiver of the withdrawn send raises PeerFailedError.
Prints "mpi p2p job ok" on each rank whose outcome is right.
"""

import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]  # repo, tests

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from test_p2p_hardening import N, _deferred_body  # noqa: E402

import collectives  # noqa: E402
from transports.base import PeerFailedError  # noqa: E402

world = MPI.COMM_WORLD
comm = collectives.init(timeout=20.0, transport="mpi")
got, n_errors, extra = _deferred_body(comm)
ok = n_errors == 1 and (got == [0.0, 1.0, 2.0] if comm.rank == 0 else got == [10.0, 11.0, 12.0] and not extra)
report = f"deferred: {got} {n_errors} {extra}"
if comm.rank == 0:
    comm.irecv((4,), 1, tag=9)  # never sent
    comm.isend(torch.zeros(N), 1, tag=2)  # its reply is never answered: withdrawn by close
    ch = comm.transports["mpi"].p2p
    reqs = [r for op in ch.ops for r in op.reqs if r is not None]
    comm.close()
    ended = MPI.Request.Testall(reqs)
    ok = ok and ended
    report += f"; requests ended at close: {ended}"
else:
    time.sleep(0.5)
    try:
        comm.recv((N,), 0, tag=2)
        report += "; received the withdrawn send"
        ok = False
    except PeerFailedError as e:
        ok = ok and e.missing_ranks == [0] and "closed" in str(e)
        report += f"; {e}"
    comm.close()
reports = world.allgather((ok, report))
if all(r[0] for r in reports):
    print("mpi p2p job ok", flush=True)
else:
    print(f"mpi p2p job failed: {reports}", flush=True)
    sys.exit(1)
