"""moecomm's topology-aware collectives: one :class:`Communicator`, a transport picked per call.

    import collectives
    comm = collectives.init()                 # mpirun / torchrun / single process, detected
    y = comm.all_reduce(x, op="sum")
    results = collectives.launch(fn, 4)       # fn(comm) on 4 local ranks
"""

from __future__ import annotations

import logging
import os

from transports.base import CollectiveTimeoutError, CommunicatorBrokenError, PeerFailedError, Rendezvous

from .communicator import Communicator
from .launcher import RankFailedError, RemoteTraceback, launch
from .rendezvous import detect_launch
from .selection import Plan
from .topology import Topology, local_facts

__all__ = ["init", "launch", "Communicator", "Topology", "Plan", "CollectiveTimeoutError", "PeerFailedError",
           "CommunicatorBrokenError", "RankFailedError", "RemoteTraceback", "detect_launch"]

log = logging.getLogger("collectives")
_init_count = 0


def _build(rdv: Rendezvous, transport: str, timeout: float, launch_mode: str, mpi_comm=None) -> Communicator:
    facts = rdv.allgather_bytes(local_facts())
    topo = Topology.from_facts(rdv.rank, facts, launch_mode)
    return Communicator(rdv, topo, timeout=timeout, transport=transport, mpi_comm=mpi_comm)


def init(transport: str = "auto", timeout: float = 300.0) -> Communicator:
    """A Communicator over all ranks of this job.

    Detects the launch: ``mpirun``/``mpiexec`` (rendezvous over MPI; the mpi transport is
    available), ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, torch's TCPStore), or a
    single process. transport: "auto" (pick per call), "shm" or "mpi"; MOECOMM_TRANSPORT
    overrides "auto". timeout: seconds any wait may take before it raises.
    """
    global _init_count
    _init_count += 1
    mode = detect_launch()
    if mode == "mpi":
        from mpi4py import MPI

        from .rendezvous import MPIRendezvous

        world = MPI.COMM_WORLD
        return _build(MPIRendezvous(world, timeout), transport, timeout, "mpi", mpi_comm=world)
    if mode == "torchrun":
        from .rendezvous import StoreRendezvous, bound_store_server, store_client

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "29500"))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or rank != 0:
            store = store_client(addr, port, timeout)  # torchrun's agent hosts the store
        else:
            store, _ = bound_store_server(addr, port, timeout)  # listen only where we were told
        rdv = StoreRendezvous(store, rank, size, timeout, f"moecomm/init{_init_count}", range(size))
        comm = _build(rdv, transport, timeout, "torchrun")
        comm._store = store  # rank 0 hosts the server in the no-agent case; keep it alive
        return comm
    from .rendezvous import LocalRendezvous

    return _build(LocalRendezvous(timeout), transport, timeout, "single")
