"""Rendezvous: how the ranks of a job find each other before any data moves.

Three sources, tried in this order by :func:`detect_launch` (the ``launch`` setting,
``MOECOMM_LAUNCH``, overrides it):

- ``mpi``: launched by ``mpirun``/``mpiexec`` (MPI/PMI variables in the environment); the
  exchange rides on mpi4py, non-blocking and bounded by the timeout.
- ``torchrun``: ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; torch's ``TCPStore``
  (the elastic agent's store when torchrun provides one, else rank 0 hosts it, listening only
  on ``MASTER_ADDR``).
- ``launch``: :func:`collectives.launch` hosts a ``TCPStore`` bound to 127.0.0.1.
- otherwise a single process.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Sequence

from typing import Any, Mapping

import numpy as np

from transports.base import CollectiveTimeoutError, Rendezvous
from transports.mpi import wait_posted
from transports.settings import option_or_environment

# Variables that MPI launchers (MPICH/Hydra, Open MPI, Intel MPI, MVAPICH, PMIx, Slurm's PMI) set.
_MPI_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",
            "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")


def detect_launch(options: Mapping[str, Any] | None = None) -> str:
    """How this process was started: the ``launch`` setting if set (``options["launch"]``, else
    ``MOECOMM_LAUNCH``), else detected from the launchers' own variables.

    Args:
        options: settings by option name; only ``"launch"`` is read (a bad value raises ValueError).

    Returns:
        "mpi", "torchrun" or "single".
    """
    forced = option_or_environment("launch", options, source="detect_launch")
    if forced is not None:
        return forced
    if launched_by_mpi():
        return "mpi"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    return "single"


def launched_by_mpi() -> bool:
    """Whether an MPI launcher (mpiexec/mpirun/srun with PMI) started this process."""
    return any(v in os.environ for v in _MPI_ENV)


class LocalRendezvous(Rendezvous):
    """The trivial rendezvous of a one-rank group.

    Args:
        timeout: seconds (kept for the communicator; nothing here waits).
    """

    def __init__(self, timeout: float):
        self.rank, self.size, self.timeout = 0, 1, timeout

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Returns: [1] ``data`` itself."""
        return [bytes(data)]

    def split(self, color: int, key: int, new_rank: int, new_size: int, ranks: list[int]) -> "LocalRendezvous":
        """Returns: a new one-rank rendezvous (see :meth:`Rendezvous.split`)."""
        return LocalRendezvous(self.timeout)


class StoreRendezvous(Rendezvous):
    """Exchange through a torch.distributed Store (TCPStore/FileStore), keys under a private prefix.

    Args:
        store: a ``torch.distributed.Store`` every rank of the group reaches.
        rank: this rank in the group.
        size: ranks in the group.
        timeout: seconds an exchange may wait for the other ranks.
        prefix: key prefix every rank of the group uses and no other group does.
        global_ranks: [size] world rank of each group rank, for messages.
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: float, prefix: str,
                 global_ranks: Sequence[int]):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.prefix = prefix
        self.global_ranks = list(global_ranks)
        self._round = 0
        self._splits = 0

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank contributes ``data``.

        Returns:
            [size] every rank's bytes in rank order. Raises CollectiveTimeoutError naming the
            ranks that did not arrive within the timeout.
        """
        k = self._round
        self._round += 1
        keys = [f"{self.prefix}/ag{k}/{r}" for r in range(self.size)]
        self.store.set(keys[self.rank], data)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                left = max(0.01, deadline - time.monotonic())
                self.store.wait(keys, datetime.timedelta(seconds=left))
                break
            except Exception as e:  # torch raises DistStoreError / RuntimeError on timeout
                missing = [self.global_ranks[r] for r, key in enumerate(keys) if not self.store.check([key])]
                if not missing:
                    continue
                if time.monotonic() >= deadline:
                    raise CollectiveTimeoutError(
                        f"rendezvous timed out on rank {self.global_ranks[self.rank]} after the timeout of "
                        f"{self.timeout:.1f}s: "
                        f"rank(s) {missing} never arrived", missing) from e
        values = [bytes(self.store.get(key)) for key in keys]
        if k >= 2:  # every rank has finished round k-1, hence read round k-2
            try:
                self.store.delete_key(f"{self.prefix}/ag{k - 2}/{self.rank}")
            except Exception:  # noqa: BLE001 - best-effort cleanup; FileStore lacks delete on old torch
                pass
        return values

    def split(self, color: int, key: int, new_rank: int, new_size: int, ranks: list[int]) -> "StoreRendezvous":
        """Returns: the sub-group's rendezvous on the same store, under a prefix per split and color."""
        self._splits += 1
        return StoreRendezvous(self.store, new_rank, new_size, self.timeout,
                               f"{self.prefix}/s{self._splits}/c{color}",
                               [self.global_ranks[r] for r in ranks])


class MPIRendezvous(Rendezvous):
    """Exchange through mpi4py, posted non-blocking and polled so it is bounded by the timeout.

    Args:
        comm: the group's mpi4py communicator.
        timeout: seconds an exchange may wait.
        global_ranks: [size] world rank of each group rank (default 0..size-1).
    """

    def __init__(self, comm: Any, timeout: float, global_ranks: Sequence[int] | None = None):
        self.comm = comm
        self.rank, self.size, self.timeout = comm.Get_rank(), comm.Get_size(), timeout
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(self.size))

    def _wait(self, req: Any, what: str, *buffers: Any) -> None:
        """Poll ``req`` until done or the timeout (:func:`transports.mpi.wait_posted`: on a timeout
        ``buffers`` are kept alive for good, as a late peer may still write into them)."""
        wait_posted(req, self.timeout, f"MPI rendezvous ({what})", self.global_ranks[self.rank], *buffers)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank contributes ``data``.

        Returns:
            [size] every rank's bytes in rank order (CollectiveTimeoutError after the timeout).
        """
        lens = np.zeros(self.size, dtype=np.int64)
        mine = np.array([len(data)], dtype=np.int64)
        self._wait(self.comm.Iallgather(mine, lens), "lengths", mine, lens)
        buf = np.empty(int(lens.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(lens)[:-1]])
        from mpi4py import MPI

        send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, dtype=np.uint8)
        self._wait(self.comm.Iallgatherv([send, MPI.BYTE], [buf, (lens.tolist(), displs.tolist()), MPI.BYTE]),
                   "data", send, buf, data)
        return [buf[d : d + n].tobytes() for d, n in zip(displs, lens)]

    def split(self, color: int, key: int, new_rank: int, new_size: int,
              ranks: list[int]) -> "MPIRendezvous | None":
        """Returns: the sub-group's rendezvous over ``MPI_Comm_split``; None where color < 0."""
        from mpi4py import MPI

        sub = self.comm.Split(color if color >= 0 else MPI.UNDEFINED, key)
        if color < 0:
            return None
        return MPIRendezvous(sub, self.timeout, [self.global_ranks[r] for r in ranks])

    def close(self) -> None:
        """Free the sub-communicator (never COMM_WORLD/COMM_SELF)."""
        from mpi4py import MPI

        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
            try:
                self.comm.Free()
            except Exception:  # noqa: BLE001
                pass


def loopback_store_server(timeout: float) -> tuple[Any, int]:
    """A TCPStore server that listens on 127.0.0.1 only (torch's own binds every interface).

    Args:
        timeout: seconds the store's operations may wait.

    Returns:
        (store, port): the server-side ``TCPStore`` and the port it listens on.
    """
    return bound_store_server("127.0.0.1", 0, timeout)


def bound_store_server(addr: str, port: int, timeout: float) -> tuple[Any, int]:
    """A TCPStore server listening on ``addr`` only.

    Args:
        addr: the address to listen on (IPv4, IPv6 or a name).
        port: the port, or 0 to let the system pick.
        timeout: seconds the store's operations may wait.

    Returns:
        (store, port): the server-side ``TCPStore`` and the port it listens on.
    """
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(512)
    port = sock.getsockname()[1]
    store = dist.TCPStore(addr, port, None, True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def store_client(addr: str, port: int, timeout: float) -> Any:
    """A TCPStore client of the server at ``addr:port``.

    Args:
        addr: the server's address.
        port: the server's port.
        timeout: seconds to connect and for the store's operations.

    Returns:
        The client ``TCPStore``.
    """
    import torch.distributed as dist

    return dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=timeout))
