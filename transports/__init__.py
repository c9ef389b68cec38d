"""How bytes move between ranks: one module per transport, all behind :class:`transports.base.Transport`.

- ``shm``  (:mod:`transports.shm`): POSIX shared memory between the processes of one node (CPU tensors).
- ``mpi``  (:mod:`transports.mpi`): mpi4py, zero-copy through the buffer protocol; spans nodes.
- ``nccl`` (:mod:`transports.nccl`): CUDA tensors through libnccl via cupy.cuda.nccl.
- ``ipc``  (:mod:`transports.ipc`): our Triton kernels over peer-mapped buffers of one node (CUDA IPC);
  with ``MOECOMM_IPC_EMULATE=1`` CPU tensors through POSIX shared memory and Triton's interpreter.
- ``gloo`` (:mod:`transports.gloo`): torch.distributed's gloo over the rendezvous's torch store (CPU
  tensors); spans nodes without MPI.
"""

from .base import (
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    PeerFailedError,
    ReduceOp,
    Rendezvous,
    Transport,
)

__all__ = [
    "CollectiveTimeoutError", "CommunicatorBrokenError", "GroupInfo", "OpCode", "PeerFailedError",
    "ReduceOp", "Rendezvous", "Transport", "transport_class", "TRANSPORT_NAMES",
]

TRANSPORT_NAMES = ("shm", "mpi", "nccl", "ipc", "gloo")


def transport_class(name: str) -> type[Transport]:
    """The class of a transport by name, imported on first use (mpi4py is only loaded when asked for)."""
    if name == "shm":
        from .shm import SharedMemoryTransport

        return SharedMemoryTransport
    if name == "mpi":
        from .mpi import MPITransport

        return MPITransport
    if name == "nccl":
        from .nccl import NCCLTransport

        return NCCLTransport
    if name == "ipc":
        from .ipc import IPCTransport

        return IPCTransport
    if name == "gloo":
        from .gloo import GlooTransport

        return GlooTransport
    raise ValueError(f"unknown transport {name!r}; available: {', '.join(TRANSPORT_NAMES)}")
