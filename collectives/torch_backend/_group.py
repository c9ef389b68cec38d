"""The moecomm process group: ``MoecommProcessGroup`` (torch's view) and the operations it runs on a
Communicator (``GroupOps``: the collectives of :mod:`._collectives`, point-to-point messages,
coalescing blocks, shutdown).

As torch's own backends are: the group is a ``ProcessGroup`` with a ``MoecommBackend`` registered
for CPU and CUDA, so ``dist.*`` calls, DDP's reducer and the functional collectives go through
torch's ``c10d.*`` operators (seen by ``CommDebugMode`` and other dispatch-level tools) to the
backend's methods (through the compiled trampoline of :mod:`._native`). Where that trampoline cannot
be built, the group is a ``PythonProcessGroup`` that runs the same methods itself.

Every collective runs to completion before it returns (CUDA tensors through NCCL: queued on the current
stream) and returns a finished Work whose future holds the outputs (point-to-point calls return a Work at
once and complete in its ``wait()``: :mod:`._p2p`); calls therefore complete in
the order they were issued, the same order on every rank. Errors are the Communicator's: a shape,
dtype or op that differs across ranks raises ValueError on every rank naming the ranks, a rank
that dies or never arrives makes the others raise TimeoutError (CollectiveTimeoutError /
PeerFailedError) naming it, within the timeout given to ``init_process_group``. A bad argument
found here on one rank (a wrong output size, an unsupported op) raises there and makes the
peers' matching call raise ValueError, through :meth:`Communicator.reject`.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ._collectives import Collectives
from ._mpi import free_mpi_communicator
from ._ops import completed
from ._p2p import BatchGuard, P2PTorchWork

log = logging.getLogger("collectives")

BACKEND_NAME = "moecomm"


class MoecommProcessGroup(dist.ProcessGroup):
    """torch.distributed's view of a moecomm group (one per process group, each with its Communicator).

    Created by ``init_process_group("moecomm")`` / ``new_group(backend="moecomm")`` (see
    :mod:`collectives.torch_backend`), not directly.

    Args:
        rank, size: this process's group rank and the group's size.
        backend: the group's :class:`MoecommBackend`, registered for CPU and CUDA tensors (the
            calls dispatch to it), or None for a :class:`PythonProcessGroup`.
    """

    def __init__(self, rank: int, size: int, backend: Any = None):
        super().__init__(rank, size)  # the (store, rank, size) form cannot make a Python subclass
        self._moecomm_group_name = ""
        self._moecomm_group_desc = ""
        self._backend = backend  # torch's C++ group holds the Backend; this keeps its Python half alive
        if backend is not None:
            for device in ("cpu", "cuda"):
                self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend)
            self._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)

    @property
    def comm(self) -> Any:
        """The group's :class:`~collectives.Communicator`."""
        return self._backend.comm

    # ---- identity -----------------------------------------------------------------------------
    def getBackendName(self) -> str:
        """Returns: "moecomm"."""
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        """Record the group's name (torch registers the group under it for functional collectives)."""
        self._moecomm_group_name = str(name)
        super()._set_group_name(name)

    def getGroupName(self) -> str:
        """Returns: the name torch gave this group."""
        return self._moecomm_group_name

    def _set_group_name(self, name: str) -> None:
        self.setGroupName(name)

    @property
    def group_name(self) -> str:
        """The name torch gave this group."""
        return self._moecomm_group_name

    def setGroupDesc(self, desc: str) -> None:
        """Record the group's description."""
        self._moecomm_group_desc = str(desc)
        super()._set_group_desc(desc)

    def getGroupDesc(self) -> str:
        """Returns: the group's description."""
        return self._moecomm_group_desc

    def _set_group_desc(self, desc: str) -> None:
        self.setGroupDesc(desc)

    @property
    def group_desc(self) -> str:
        """The group's description."""
        return self._moecomm_group_desc

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank()}, size={self.size()}, comm={self.comm!r})"


class GroupOps(Collectives):
    """What a moecomm group runs on its Communicator: the collectives, point-to-point messages,
    coalescing blocks and shutdown. Mixed into :class:`MoecommBackend` (its C++ half dispatches
    torch's calls here) or :class:`PythonProcessGroup`.

    Args:
        comm: the Communicator of this group's ranks.
        global_ranks: [size] world rank of each group rank.
        mpi_comm: the group's MPI communicator under mpiexec (freed at shutdown), else None.
    """

    def _init_ops(self, comm: Any, global_ranks: Sequence[int], mpi_comm: Any) -> None:
        self._comm = comm
        self._mpi_comm = mpi_comm
        self._global_ranks = list(global_ranks)
        self._batches = BatchGuard()

    @property
    def comm(self) -> Any:
        """The group's :class:`~collectives.Communicator`."""
        return self._comm

    # ---- shutdown -----------------------------------------------------------------------------
    def abort(self) -> None:
        """Close the communicator: peers waiting on this rank raise instead of waiting (a call in
        flight in another thread ends first, within the timeout)."""
        self.comm.close()

    def shutdown(self) -> None:
        """Close the communicator (``destroy_process_group`` calls this); later calls raise."""
        self.comm.close()
        free_mpi_communicator(self._mpi_comm)
        self._mpi_comm = None
        self._batches.clear()

    # ---- point to point (the communicator's isend/irecv, see _p2p) -----------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        """Post ``tensors[0]`` for group rank ``dstRank`` (never blocks; the Work's ``wait()`` completes it).

        Returns:
            A :class:`P2PTorchWork`; its future holds ``tensors``.
        """
        t = self._one(tensors, "send")
        return self._post(tensors, "send", lambda: self.comm.isend(_wire_p2p(t), dstRank, tag))

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        """Post a receive of the next message from group rank ``srcRank`` with ``tag`` into ``tensors[0]``.

        Returns:
            A :class:`P2PTorchWork` (never blocks at creation); its future holds ``tensors``.
        """
        t = self._one(tensors, "recv")
        return self._post(tensors, "recv", lambda: self.comm.irecv(_wire_p2p(t), srcRank, tag))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """Receive the next message with ``tag`` from any rank into ``tensors[0]`` (over shm; the mpi
        and gloo channels raise NotImplementedError).

        Returns:
            A :class:`P2PTorchWork` whose ``_source_rank()`` is the sender's group rank.
        """
        t = self._one(tensors, "recv")
        return self._post(tensors, "recv", lambda: self.comm.irecv(_wire_p2p(t), None, tag))

    def _post(self, tensors: list[torch.Tensor], what: str, post: Any) -> P2PTorchWork:
        """``post()`` (the communicator's isend/irecv) as torch's Work, after :class:`BatchGuard`'s check
        that no earlier ``batch_isend_irecv`` of this thread was cut short."""
        batch = self._batches.before(self.comm, self._me(), what)
        try:
            work = P2PTorchWork(post(), list(tensors))
        except BaseException as e:
            self._batches.refused(batch, e)
            raise
        self._batches.posted(batch)
        return work

    # ---- coalescing (calls already run one by one, in order) ---------------------------------
    def start_coalescing(self, device: torch.device) -> None:
        """Nothing to do: the calls inside the block run as they are made, in order."""

    def end_coalescing(self, device: torch.device) -> dist.Work:
        """Returns: a finished Work (every call of the block has already run)."""
        return completed([])


class PythonProcessGroup(GroupOps, MoecommProcessGroup):
    """A moecomm group whose calls run in its own Python methods, past torch's dispatcher (where the
    trampoline of :mod:`._native` cannot be built): the same results, but dispatch-level tools
    (``CommDebugMode``) see none of its calls and ``_get_backend()`` has no backend to return.

    Args:
        comm, global_ranks, mpi_comm: as for :class:`GroupOps`.
    """

    def __init__(self, comm: Any, global_ranks: Sequence[int], *, mpi_comm: Any = None):
        MoecommProcessGroup.__init__(self, comm.rank, comm.size)
        self._init_ops(comm, global_ranks, mpi_comm)


_BACKEND_CLASSES: dict[type, type] = {}


def backend_class(native_base: type) -> type:
    """``MoecommBackend``: :class:`GroupOps` on the trampoline's ``PyBackend`` (a ``c10d.Backend``).

    Args:
        native_base: the ``PyBackend`` class of the built trampoline module.

    Returns:
        The class; ``cls(comm, global_ranks, timeout_s, mpi_comm=...)`` makes a group's backend.
    """
    cls = _BACKEND_CLASSES.get(native_base)
    if cls is None:
        def __init__(self, comm: Any, global_ranks: Sequence[int], timeout_s: float, *, mpi_comm: Any = None) -> None:
            native_base.__init__(self, comm.rank, comm.size, float(timeout_s))
            self._init_ops(comm, global_ranks, mpi_comm)

        def __repr__(self) -> str:
            return f"MoecommBackend(rank={self.rank()}, size={self.size()}, comm={self.comm!r})"

        cls = _BACKEND_CLASSES[native_base] = type("MoecommBackend", (GroupOps, native_base), {
            "__init__": __init__, "__repr__": __repr__, "__module__": __name__,
            "__doc__": "A moecomm group's c10d Backend: torch's c10d operators call its GroupOps methods."})
    return cls


def _wire_p2p(t: torch.Tensor) -> torch.Tensor:
    """``t`` outside autograd (received tensors are written in place)."""
    return t.detach() if t.requires_grad else t
