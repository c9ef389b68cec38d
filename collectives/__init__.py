"""moecomm's topology-aware collectives: one :class:`Communicator`, a transport picked per call.

    import collectives
    comm = collectives.init()                 # mpirun / torchrun / single process, detected
    y = comm.all_reduce(x, op="sum")
    results = collectives.launch(fn, 4)       # fn(comm) on 4 local ranks (under a __main__ guard)
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from transports.base import CollectiveTimeoutError, CommunicatorBrokenError, PeerFailedError
from transports.settings import check_timeout, parse_options

from ._factory import build_communicator as _build
from ._p2p import P2POp, P2PWork
from .communicator import Communicator
from .launcher import RankFailedError, RemoteTraceback, launch, launch_preload
from .rendezvous import detect_launch
from .selection import Plan
from .topology import Topology

__all__ = ["init", "launch", "launch_preload", "Communicator", "P2POp", "P2PWork", "Topology", "Plan", "CollectiveTimeoutError", "PeerFailedError",
           "CommunicatorBrokenError", "RankFailedError", "RemoteTraceback", "detect_launch"]

log = logging.getLogger("collectives")

# torchrun: this process's store per (address, port), kept across init() calls so that a retry
# reuses it (rank 0 may host the server: a second server on MASTER_PORT would lose the peers' keys).
_torchrun_stores: dict[tuple[str, int], Any] = {}


def _torchrun_key_base() -> str:
    """Store key prefix of this torchrun attempt: an elastic restart reuses the agent's store, so
    the run id and restart count keep a restarted job clear of the previous attempt's keys."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"moecomm/init/{run_id}/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def init(transport: str = "auto", timeout: float = 300.0, *, options: Mapping[str, Any] | None = None,
         device: Any = None, join: str | None = None) -> Communicator:
    """A Communicator over all ranks of this job.

    Detects the launch: ``mpirun``/``mpiexec`` (rendezvous over MPI; the mpi transport is
    available), ``torchrun`` (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, torch's TCPStore), or a
    single process; ``MOECOMM_LAUNCH`` (or ``options={"launch": ...}``) overrides the detection.
    Every rank calls it; a rank that retries after an error meets the others' retry (under
    torchrun the k-th rendezvous of the job is matched by a counter in the store, not by what
    each process did before).

    Args:
        transport: "auto" (pick per call), "shm", "mpi", "nccl", "ipc" or "gloo"; anything but "auto"
            overrides ``MOECOMM_TRANSPORT``.
        timeout: seconds any wait may take before it raises; positive and finite (0, negative,
            inf and nan raise ValueError, a non-number TypeError, before anything is started).
        options: settings by option name, overriding their ``MOECOMM_*`` environment variables
            (``{"shm_slot_bytes": 1 << 16}``; see :data:`transports.settings.SETTINGS` or the
            README's table). Unknown names or bad values raise ValueError.
        device: the device this rank binds to, kept as ``comm.device``: None (default) for
            ``cuda:local_rank`` (modulo the GPUs this process sees; cpu when it sees none), an
            int N, "cuda:N", a torch.device, or "cpu" for no GPU (no NCCL; CUDA tensors are then
            copied through host memory). A CUDA device is made the current device, and CUDA
            tensors passed to a collective must be on it. A bad value on one rank makes every
            rank raise (ValueError/TypeError). If NCCL cannot start (e.g. two ranks on one GPU),
            every rank raises RuntimeError saying what to do, unless ``transport`` is "shm" or "mpi".
        join: a running group's ``comm.join_address()``: this process joins that group instead of
            starting one (the launch is not detected). It connects to the group's store at that
            address, waits (bounded by ``timeout``) for the members' ``comm.grow(count)`` that takes
            it, and returns its communicator of the grown group: rank ``size + i`` for the i-th
            newcomer, a world rank (``global_ranks``) never used in that world before. The settings
            every rank must share and the forced transport come from the members (this process's
            ``MOECOMM_*`` variables for them are ignored; an options= or transport= that differs
            raises ValueError on every rank); its other settings, ``timeout`` and ``device`` are its own.

    Returns:
        The world Communicator of this process (``comm.rank``, ``comm.size``); with ``join``, the
        grown group's. With ``join``: ValueError for a malformed address, one the store does not know, or
        a grow the members aborted over its count; RuntimeError when the address cannot be reached;
        CollectiveTimeoutError when no grow took this process within ``timeout``; PeerFailedError
        naming a member that died meanwhile.
    """
    timeout = check_timeout(timeout, source="collectives.init: timeout")
    # options= come from the code, the same on every rank: checked up front. The environment may
    # differ per rank: only how the job was launched is read before the rendezvous (a bad
    # MOECOMM_LAUNCH can only raise here); the Communicator resolves the rest inside its first
    # exchange, so a bad value on one rank makes every rank raise instead of leaving them waiting.
    parse_options(options or {}, source="collectives.init")
    if join is not None:
        return _join(join, transport, timeout, options, device)
    mode = detect_launch(options)
    if mode == "mpi":
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise RuntimeError(f"collectives.init: launched by mpiexec/mpirun, but mpi4py cannot be imported ({e}); "
                               "MPI is optional: pip install \"moecomm[mpi]\"") from e

        from .rendezvous import MPIRendezvous

        world = MPI.COMM_WORLD
        return _build(MPIRendezvous(world, timeout), transport, timeout, "mpi", mpi_comm=world, options=options,
                      device=device)
    if mode == "torchrun":
        from .rendezvous import StoreRendezvous

        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = _torchrun_store(rank, timeout)
        # The n-th arrival of the job lands in generation (n - 1) // size, so the k-th collective
        # init meets whatever each process tried before (a local error before this point is not
        # counted, nor is an error on every rank after it). A rank that timed out waiting here was
        # counted without its peers, so the counts no longer line up: that calls for a restart.
        base = _torchrun_key_base()
        generation = (store.add(f"{base}/arrivals", 1) - 1) // size
        # without torchrun's agent, rank 0 hosts the store: its death is what an unreachable store means
        host = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        rdv = StoreRendezvous(store, rank, size, timeout, f"{base}/g{generation}", range(size), host_rank=host)
        comm = _build(rdv, transport, timeout, "torchrun", options=options, device=device)
        comm._store = store  # rank 0 hosts the server in the no-agent case; keep it alive
        return comm
    from .rendezvous import LocalRendezvous

    return _build(LocalRendezvous(timeout), transport, timeout, "single", options=options, device=device)


def _join(address: str, transport: str, timeout: float, options: Mapping[str, Any] | None, device: Any) -> Communicator:
    """init(join=address): this process's communicator in the group that grows to take it."""
    from transports.settings import SETTINGS, resolve

    from .rendezvous import join_group

    rdv, offer = join_group(address, timeout)
    # The settings every rank shares come from the members, unless this process asks for a value
    # explicitly (options=, transport=): then the creation's agreement check names the difference on
    # every rank. The others (how this process's waits sleep, its model file) are its own.
    explicit = set(parse_options(options or {}, source="collectives.init"))
    if transport != "auto":
        explicit.add("transport")
    try:
        settings: dict[str, Any] | None = resolve(options, source="collectives.init")
    except ValueError:
        settings = None  # a bad variable here: the Communicator resolves it again and tells every rank
    if settings is not None:
        settings.update({k: v for k, v in offer.get("settings", {}).items() if k in SETTINGS and k not in explicit})
    comm = _build(rdv, transport, timeout, offer.get("launch", "launch"), settings=settings, options=options,
                  device=device, global_ranks=rdv.global_ranks)
    comm._store = rdv.store
    return comm


def _torchrun_store(rank: int, timeout: float) -> Any:
    """This process's TCPStore for the torchrun job (created on first use, then reused)."""
    from .rendezvous import bound_store_server, store_client

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    store = _torchrun_stores.get((addr, port))
    if store is None:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or rank != 0:
            store = store_client(addr, port, timeout)  # torchrun's agent hosts the store
        else:
            store, _ = bound_store_server(addr, port, timeout)  # listen only where we were told
        _torchrun_stores[(addr, port)] = store
    return store


from .torch_backend import register as _register_torch_backend  # noqa: E402 - needs the names above

_register_torch_backend()  # torch.distributed.init_process_group("moecomm")
