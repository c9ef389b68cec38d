"""mpiexec -n 2: rank 1 arrives late at an MPI rendezvous exchange that rank 0 already gave up on.

Rank 0 must keep the abandoned exchange's buffers alive (MPI still writes into them when rank 1
arrives) and survive; prints one JSON line per rank.
"""

import json
import os
import sys
import time

from mpi4py import MPI

from collectives import rendezvous
from transports import mpi as mpi_transport
from transports.base import CollectiveTimeoutError

world = MPI.COMM_WORLD
rank = world.Get_rank()
report = {"rank": rank}
if rank == 0:
    rdv = rendezvous.MPIRendezvous(world, 0.3)
    try:
        rdv.allgather_bytes(b"x" * 8)
        report["error"] = "no timeout"
    except CollectiveTimeoutError as e:
        report["timeout"] = str(e)
    report["kept"] = len(mpi_transport._ABANDONED)  # the polled wait of the rendezvous (transports.mpi.wait_posted)
    world.Barrier()  # rank 1 now completes the abandoned lengths exchange late
    time.sleep(0.5)
    junk = [bytearray(os.urandom(64)) for _ in range(2000)]  # reuse freed memory, as a program would
    report["alive"] = True
else:
    world.Barrier()
    rdv = rendezvous.MPIRendezvous(world, 0.3)
    try:
        rdv.allgather_bytes(b"y" * 100)
    except CollectiveTimeoutError as e:  # rank 0 never posts the data step
        report["timeout"] = str(e)
    report["alive"] = True
    print(json.dumps(report), flush=True)
    time.sleep(3)  # Hydra stops the job when one rank exits without MPI_Finalize: let rank 0 report first
    os._exit(0)
print(json.dumps(report), flush=True)
sys.stdout.flush()
os._exit(0)  # MPI_Finalize would wait on the exchanges that can never complete
