"""Under mpiexec: rank 0 is interrupted in an mpi all_reduce while its peer is paused (see
tests/test_interrupted_calls.py); prints "interrupt job ok" on each rank whose outcome is right."""

import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import collectives  # noqa: E402
from test_interrupted_calls import check, interrupted_all_reduce  # noqa: E402

timeout = 20.0
comm = collectives.init(timeout=timeout, transport="mpi")
mine = interrupted_all_reduce(comm)
theirs = comm._mpi_comm.allgather(mine)  # outside moecomm: its communicator is broken on rank 0
check(theirs, timeout)
print("interrupt job ok", flush=True)
gc.freeze()  # no final garbage collection at exit (about 0.6 CPU-s with torch); exit handlers still run
