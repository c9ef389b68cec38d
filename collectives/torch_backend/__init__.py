"""moecomm as a torch.distributed backend: ``init_process_group("moecomm")``.

    import collectives                                  # registers the "moecomm" backend
    import torch.distributed as dist
    dist.init_process_group("moecomm")                  # env://, tcp://, file://, or store=
    dist.all_reduce(x)                                  # DDP, FSDP2, functional collectives alike

``import collectives`` registers the backend once (:func:`register`), for CPU and CUDA tensors.
Every group torch creates with it (the default group, ``new_group``, a DeviceMesh's dimensions)
gets its own :class:`~collectives.Communicator`, which picks a transport per call as
``collectives.init()`` does (shm on one node, mpi under mpiexec, NCCL/ipc for CUDA tensors).
As for torch's own backends, the group is a ``ProcessGroup`` with a c10d ``Backend`` registered for
both devices, so its calls go through torch's ``c10d.*`` operators (``CommDebugMode`` counts them;
``pg._get_backend(device)`` is the backend): see :mod:`._native` for the compiled part, built on
first use, and what happens without it.

Rendezvous goes through the store torch hands in (a PrefixStore over TCPStore, FileStore or
HashStore), so every ``init_method`` works. Under mpiexec, the ranks also share an MPI
communicator (COMM_WORLD for the world, MPI_Comm_create_group for sub-groups), so the mpi
transport can span nodes. ``pg_options`` (of ``init_process_group`` / ``new_group``) may be a dict
of moecomm settings by option name (``{"shm_slot_bytes": 1 << 16}``) plus ``"transport"`` and
``"device"`` as for :func:`collectives.init`. The timeout given to ``init_process_group`` is the
communicator's: every wait raises within it, naming the ranks that did not arrive.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..rendezvous import StoreRendezvous
from . import _native
from ._group import BACKEND_NAME, MoecommProcessGroup, PythonProcessGroup, backend_class
from ._mpi import mpi_communicator

__all__ = ["BACKEND_NAME", "MoecommProcessGroup", "group_communicator", "register"]

log = logging.getLogger("collectives")

# communicators made over the ranks of groups of other backends (group_communicator), by group name
_OVER_GROUP: dict[str, Any] = {}


def register() -> bool:
    """Register the "moecomm" backend with torch.distributed (once; later calls do nothing).

    Returns:
        True if the backend is registered (False: this torch build has no torch.distributed).
    """
    if not dist.is_available():
        return False
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        # a list: a string would be iterated per character. extended_api: sub-groups get their
        # global ranks and group name.
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"])
    return True


def create_process_group(opts: Any, backend_options: Mapping[str, Any] | None = None) -> MoecommProcessGroup:
    """torch's creator of a moecomm group (collective over the group's ranks; called by torch).

    Args:
        opts: ``torch._C._distributed_c10d._DistributedBackendOptions``: ``store`` (torch's
            PrefixStore for this group), ``group_rank``, ``group_size``, ``timeout``
            (timedelta), ``group_id``, ``global_ranks_in_group`` (empty for the default group).
        backend_options: ``pg_options``: None, or moecomm settings by option name plus
            ``"transport"`` and ``"device"`` (see :func:`collectives.init`).

    Returns:
        The group's :class:`MoecommProcessGroup`, its ``MoecommBackend`` registered for CPU and
        CUDA (a :class:`PythonProcessGroup` where the backend's trampoline cannot be built). A bad
        option or value on any rank raises ValueError/TypeError on every rank; a rank that never
        arrives makes the others raise CollectiveTimeoutError naming it, within the timeout.
    """
    from .._factory import build_communicator

    if backend_options is not None and not isinstance(backend_options, Mapping):
        raise TypeError(f"moecomm: pg_options must be a dict of moecomm settings (option names as for "
                        f"collectives.init(options=...), plus 'transport' and 'device'), got "
                        f"{type(backend_options).__name__}")
    native = _native.load()  # before the rendezvous: the ranks waiting for one build meet after it
    options = dict(backend_options or {})
    transport = options.pop("transport", "auto")
    device = options.pop("device", None)
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout = opts.timeout.total_seconds()
    global_ranks = list(opts.global_ranks_in_group) or list(range(size))
    # The n-th arrival on this store belongs to incarnation (n - 1) // size, so a group created
    # again on a store that outlived the previous one (one FileStore, destroy + init) starts
    # clear of the old keys.
    generation = (store.add(f"{BACKEND_NAME}/arrivals", 1) - 1) // size
    prefix = f"{BACKEND_NAME}/g{generation}"
    rdv = StoreRendezvous(store, rank, size, timeout, prefix, global_ranks)
    mpi_comm = mpi_communicator(rdv, options)
    comm = build_communicator(rdv, transport, timeout, "torch.distributed", mpi_comm=mpi_comm,
                              options=options or None, device=device)
    log.debug("moecomm process group %s: rank %d of %d, transports %s", opts.group_id, rank, size,
              sorted(comm.transports))
    if native is None:
        return PythonProcessGroup(comm, global_ranks, mpi_comm=mpi_comm)
    backend = backend_class(native.PyBackend)(comm, global_ranks, timeout, mpi_comm=mpi_comm)
    return MoecommProcessGroup(comm.rank, comm.size, backend)


def group_communicator(group: Any = None, *, timeout: float = 300.0, transport: str = "auto", device: Any = None) -> Any:
    """The moecomm :class:`~collectives.Communicator` of a torch.distributed group.

    A group of the "moecomm" backend has one already (``group.comm``). For a group of another backend
    (gloo, nccl), one is made over the group's ranks the first time (collective over them: every rank
    of the group calls this), meeting through torch's default store, and kept for later calls.

    Args:
        group: a ProcessGroup (a DeviceMesh dimension's ``get_group()``); None: the default group.
        timeout, transport, device: for a communicator made here, as for :func:`collectives.init`.

    Returns:
        The Communicator; ``comm.rank`` is this process's rank in ``group``.
    """
    from .._factory import build_communicator

    if not dist.is_initialized():
        raise RuntimeError("group_communicator: torch.distributed is not initialized (init_process_group first)")
    group = dist.group.WORLD if group is None else group
    if isinstance(group, MoecommProcessGroup):
        return group.comm
    name = group.group_name
    comm = _OVER_GROUP.get(name)
    if comm is None or comm.closed:
        store = dist.distributed_c10d._get_default_store()
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        key = f"{BACKEND_NAME}/over/{name}"
        generation = (store.add(f"{key}/arrivals", 1) - 1) // size  # a group name reused after destroy: new keys
        rdv = StoreRendezvous(store, rank, size, timeout, f"{key}/g{generation}", dist.get_process_group_ranks(group))
        comm = _OVER_GROUP[name] = build_communicator(rdv, transport, timeout, "torch.distributed", device=device)
        log.debug("moecomm communicator over %s group %s: rank %d of %d", dist.get_backend(group), name, rank, size)
    return comm
