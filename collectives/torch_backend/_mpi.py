"""The MPI communicator of a moecomm process group, when its ranks were started by mpiexec."""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping

from ..rendezvous import StoreRendezvous, detect_launch

log = logging.getLogger("collectives")


def mpi_communicator(rdv: StoreRendezvous, options: Mapping[str, Any]) -> Any:
    """This group's MPI communicator when every member was started by one mpiexec, else None.

    Collective over the group: the members agree over the store whether MPI is there on all of
    them (a member without it would leave the others inside MPI_Comm_create_group), then the
    world group uses COMM_WORLD and a sub-group MPI_Comm_create_group, which only its members call.
    MPI cannot bound that call by a timeout; it starts only after the store exchange (bounded) has
    seen every member arrive.

    Args:
        rdv: the group's store rendezvous.
        options: moecomm settings by option name (``"launch"`` overrides the launch detection).

    Returns:
        An mpi4py communicator of the group's ranks in group-rank order, or None.
    """
    mine: dict[str, Any] = {"mpi": None}
    try:
        if detect_launch(options) == "mpi":
            from mpi4py import MPI

            mine = {"mpi": MPI.COMM_WORLD.Get_rank(), "size": MPI.COMM_WORLD.Get_size()}
    except Exception as e:  # noqa: BLE001 - no mpi4py or no MPI library: the group goes on without it
        log.info("moecomm process group: no MPI communicator (%s)", e)
    facts = [json.loads(b) for b in rdv.allgather_bytes(json.dumps(mine).encode())]
    mpi_ranks = [f["mpi"] for f in facts]
    if None in mpi_ranks or len(set(mpi_ranks)) != len(mpi_ranks) or len({f["size"] for f in facts}) != 1:
        return None  # not one MPI job on every member
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if mpi_ranks == list(range(world.Get_size())):
        return world
    return world.Create_group(world.Get_group().Incl(mpi_ranks))


def free_mpi_communicator(comm: Any) -> None:
    """Free a communicator from :func:`mpi_communicator` (never COMM_WORLD; nothing after MPI_Finalize)."""
    if comm is None:
        return
    from mpi4py import MPI

    if comm != MPI.COMM_WORLD and not MPI.Is_finalized():
        try:
            comm.Free()
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
