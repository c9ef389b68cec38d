"""The paths bytes can take between two ranks, by name, and the error for a path that was not taken.

Shared by path discovery (:mod:`collectives.topology.paths`: what this machine offers), NCCL's path
forcing and log verification (:mod:`transports.nccl_paths`) and the benchmarks' ``--path``. Kept in the
bottom layer so that each of them can import it.

* ``nvlink``, ``pcie``: GPU peer-to-peer over NVLink or PCIe (NCCL's P2P transport between two GPUs);
* ``cuda-ipc``: peer-mapped GPU memory through CUDA IPC (the ipc transport; NCCL's P2P/IPC);
* ``shm``: host shared memory (the shm transport; NCCL's SHM transport);
* ``ib``, ``roce``: RDMA over an InfiniBand port, or over an Ethernet port (RoCE) (NCCL's NET/IB);
* ``socket``: TCP (the gloo transport; NCCL's NET/Socket).
"""

from __future__ import annotations

PATHS = ("nvlink", "pcie", "cuda-ipc", "shm", "ib", "roce", "socket")
# paths that stay inside one node: on several nodes they are measured within each node
NODE_LOCAL_PATHS = ("nvlink", "pcie", "cuda-ipc", "shm")


class PathMismatchError(RuntimeError):
    """A measurement asked for one path and the library took another.

    Attributes:
        asked: the path asked for (one of :data:`PATHS`).
        taken: what was observed instead (a path name, or a description such as ``"nothing logged"``).
    """

    def __init__(self, asked: str, taken: str, detail: str = "") -> None:
        self.asked, self.taken = asked, taken
        self.detail = detail
        super().__init__(f"asked for path {asked!r}, but {taken!r} was taken" + (f": {detail}" if detail else ""))

    def __reduce__(self):  # a rank's exception travels to the launching process pickled
        return type(self), (self.asked, self.taken, self.detail)


def check_path(name: str) -> str:
    """``name`` if it is one of :data:`PATHS`, else ValueError listing them."""
    if name not in PATHS:
        raise ValueError(f"unknown path {name!r}; choose from {', '.join(PATHS)}")
    return name
