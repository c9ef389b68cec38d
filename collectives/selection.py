"""Which transport serves a call: an explicit fallback chain per (device, locality).

Selection may only depend on what every rank agrees on (op, dtype, device, topology, and a
size that has to match across ranks), so that ranks with a bad input still meet in the same
transport and get a clear ``ValueError`` there instead of waiting in different ones. For that
reason all_to_all, whose sizes differ by design, is never routed by size.

Host (CPU tensor) chains, first available wins. Where the numbers come from:
``benchmarks/results/cpu-shm-vs-mpi.txt`` (2 ranks on the 2-vCPU CI machine, one run interleaved
per size): shm was 1.3-3x faster than the mpi transport at every size up to 256 KiB for every
op and for all_reduce up to 2 MiB; MPICH's large-message path (one copy where shm makes two)
was faster for reduce_scatter and all_to_all from 2 MiB and all_gather at 16 MiB. shm still
serves those sizes: routing by size there would let ranks whose sizes wrongly differ wait in
different transports (a timeout instead of the ValueError that names the difference), and
all_to_all sizes differ by design. A single-copy shm path is the fix (see the issue notes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from transports.base import OpCode

# (device, single_node) -> transports in order of preference. A host transport serving CUDA
# tensors stages them through host memory (the communicator warns once when that happens).
# ``ipc`` is in no chain yet: it serves a call only when forced (transport="ipc", comm.using("ipc")).
# Emulated ipc (CPU tensors through Triton's interpreter) proves the kernels and is never fast; on
# GPUs, ipc joins the ("cuda", True) chain below per-op size thresholds once a GPU run has measured
# them against NCCL and a real P2P probe exists (issue 11; transports/ipc.py ONE_SHOT_MAX_BYTES).
FALLBACK_CHAINS: dict[tuple[str, bool], tuple[str, ...]] = {
    ("cpu", True): ("shm", "mpi"),
    ("cpu", False): ("mpi",),
    ("cuda", True): ("nccl", "shm", "mpi"),
    ("cuda", False): ("nccl", "mpi"),
}


@dataclass(frozen=True)
class Plan:
    """How one call will run: transport, its algorithm, and why.

    op: the collective's name; transport, algorithm: what serves it; nbytes: bytes of this rank's
    input; reason: why that transport; staged_through_host: device tensors copied via host memory.
    """

    op: str
    transport: str
    algorithm: str
    nbytes: int
    reason: str
    staged_through_host: bool = False

    def __str__(self) -> str:
        host = ", staged through host memory" if self.staged_through_host else ""
        return f"{self.op} of {self.nbytes} B -> {self.transport}/{self.algorithm} ({self.reason}{host})"


def candidate_chain(device: str, single_node: bool) -> tuple[str, ...]:
    """The transports that may serve tensors of ``device``, best first.

    Args:
        device: a torch device type ("cpu", "cuda", ...); others use the cpu chain (staged).
        single_node: whether every rank of the group runs on one node.
    Returns:
        Transport names in order of preference.
    """
    return FALLBACK_CHAINS.get((device, single_node), FALLBACK_CHAINS[("cpu", single_node)])


def choose_transport(opcode: OpCode, device: str, single_node: bool, available: Mapping[str, Any],
                     forced: str | None) -> tuple[str, str]:
    """The transport that serves one call, from what every rank agrees on (never from sizes).

    Args:
        opcode: the collective.
        device: device type of the call's tensors.
        single_node: whether every rank of the group runs on one node.
        available: transport name -> live transport of this communicator.
        forced: a transport every call must use (``transport=``/MOECOMM_TRANSPORT), or None.
    Returns:
        (transport name, reason for the choice). Raises ValueError if ``forced`` is not
        available, RuntimeError if no transport can serve ``device``.
    """
    if forced:
        if forced not in available:
            raise ValueError(
                f"transport {forced!r} was requested but is not available in this communicator "
                f"(available: {sorted(available)}); shm needs all ranks on one node, mpi needs an mpirun launch, "
                "ipc needs one node and CUDA (or MOECOMM_IPC_EMULATE=1 and triton for CPU tensors)")
        return forced, "forced by transport=/MOECOMM_TRANSPORT"
    chain = candidate_chain(device, single_node)
    for name in chain:
        if name in available:
            where = "one node" if single_node else "several nodes"
            return name, f"first available of {'>'.join(chain)} for {device} tensors on {where}"
    raise RuntimeError(
        f"no transport can serve {device} tensors here (available: {sorted(available)}); "
        "launch with mpirun for multi-node runs")
