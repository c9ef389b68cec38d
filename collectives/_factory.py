"""The Communicator of a launch's world rendezvous: what ``init``, ``launch`` and the torch backend
share once they have a rendezvous (topology facts exchanged, then the Communicator created).

Apart from collectives/__init__.py so that launcher.py and torch_backend import it without
importing the package that imports them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transports.base import Rendezvous

from .communicator import Communicator
from .topology import Topology, local_facts


def build_communicator(rdv: Rendezvous, transport: str, timeout: float, launch_mode: str, mpi_comm: Any = None,
                       settings: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None,
                       device: Any = None, global_ranks: Sequence[int] | None = None) -> Communicator:
    """The Communicator of ``rdv``'s group: exchange topology facts, then create it.

    Args:
        rdv: the world rendezvous of this launch.
        transport: "auto" or a transport name (overrides ``settings["transport"]``).
        timeout: seconds any wait may take; positive and finite.
        launch_mode: "mpi", "torchrun", "launch" or "single" (recorded in the topology).
        mpi_comm: the mpi4py world communicator under mpiexec, else None.
        settings: resolved :mod:`transports.settings` values (None: resolved by the Communicator
            from ``options`` and the environment, so that a bad value on one rank reaches every rank).
        options: settings by option name (used when ``settings`` is None).
        device: the device each rank binds to (see :func:`collectives.init`); None: cuda:local_rank.
        global_ranks: [size] world rank of each rank (default 0..size-1; a grown group's differ).

    Returns:
        The group's Communicator.
    """
    facts = rdv.allgather_bytes(local_facts())
    topo = Topology.from_facts(rdv.rank, facts, launch_mode)
    return Communicator(rdv, topo, timeout=timeout, transport=transport, mpi_comm=mpi_comm, settings=settings,
                        options=options, device=device, global_ranks=global_ranks)
