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

One host route does go by size: across nodes, all_reduce, all_gather and reduce_scatter at or above
:data:`HIERARCHICAL_MIN_BYTES` go to the hierarchical transport (collectives/hierarchical.py). That is
safe because its first step is the flat transport's own signature exchange (the first step of the
flat call too), so ranks whose sizes wrongly differ still meet and raise the ValueError naming them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from transports.base import OpCode

# (device, single_node) -> transports in order of preference. A host transport serving CUDA
# tensors stages them through host memory (the communicator warns once when that happens).
# ``ipc`` is in no chain: emulated ipc (CPU tensors through Triton's interpreter) proves the kernels
# and is never fast, so CPU calls use it only when forced. On GPUs it would serve small calls by
# size (IPC_MAX_BYTES below, measured: 0, never), ahead of the chain. ``gloo`` (torch.distributed's,
# transports/gloo.py) is made only when the group spans nodes without MPI (torchrun across nodes) or when forced, so it
# ends the cross-node chains: where an mpiexec launch gives MPI, gloo is not made at all (it would
# open a connection between every two ranks for nothing).
FALLBACK_CHAINS: dict[tuple[str, bool], tuple[str, ...]] = {
    ("cpu", True): ("shm", "mpi"),
    ("cpu", False): ("mpi", "gloo"),
    ("cuda", True): ("nccl", "shm", "mpi"),
    ("cuda", False): ("nccl", "mpi", "gloo"),
}


# CUDA tensors on one node, when the ipc transport came up on every rank: these ops go to ipc up to
# these sizes (bytes of this rank's input), to the chain (NCCL) above; keyed by (op, GPU architecture
# or "any"), then world size. 0: ipc's host path per call made it slower than NCCL at every size
# measured, at any world size (benchmarks/results/gpu-nvidia-h100-80gb-hbm3-2026-11-23-notes.md;
# tests/test_ipc_selection.py re-derives the crossover from that run's sweep).
IPC_MAX_BYTES: dict[tuple[OpCode, str], dict[int, int]] = {
    (op, "any"): {n: 0 for n in range(2, 9)}
    for op in (OpCode.ALL_REDUCE, OpCode.ALL_GATHER, OpCode.REDUCE_SCATTER)
}


# Host tensors on several nodes with equal ranks (>1) per node: these ops go to the hierarchical
# transport (node reduce_scatter > rail collective > node all_gather) from this many bytes of this
# rank's input. Source: benchmarks/results/testbed-2x2-hierarchical.txt (2 nodes x 2 ranks, links
# shaped to ~1/10 of the intra-node bandwidth, flat = mpi): hierarchical was 1.4-3.9x faster from
# 64 KiB to 1 MiB and 0.96-1.42x above, for all three ops; 1 MiB is the smallest size both runs
# measured. Below it the flat transport keeps serving (one step fewer for latency-bound calls).
HIERARCHICAL_MIN_BYTES: dict[OpCode, int] = {
    OpCode.ALL_REDUCE: 1 << 20, OpCode.ALL_GATHER: 1 << 20, OpCode.REDUCE_SCATTER: 1 << 20,
}


class NoTransportError(RuntimeError):
    """No transport of the communicator serves the call's tensors: raised before any data moves."""

    in_step = True  # every rank raises it at the same point (collectives._shared.leaves_out_of_step)


def ipc_max_bytes(opcode: OpCode, world_size: int, arch: str = "any") -> int:
    """The largest call (bytes of one rank's input) that ipc serves for CUDA tensors; 0: never.

    Args:
        opcode: the collective; world_size: ranks in the group; arch: GPU architecture ("sm90", ...).
    """
    table = IPC_MAX_BYTES.get((opcode, arch)) or IPC_MAX_BYTES.get((opcode, "any")) or {}
    return table.get(world_size, 0)


@dataclass(frozen=True)
class Plan:
    """How one call will run: transport, its algorithm, and why.

    op: the collective's name; transport, algorithm: what serves it; nbytes: bytes of this rank's
    input; reason: why that transport; staged_through_host: device tensors copied via host memory;
    predicted_us, runner_up, runner_up_us: the performance model's time for this plan and for the
    best other plan of this communicator (``transport/algorithm``), filled in by ``comm.plan()``
    (None where the model has nothing for the call; see :mod:`collectives.prediction`).
    """

    op: str
    transport: str
    algorithm: str
    nbytes: int
    reason: str
    staged_through_host: bool = False
    predicted_us: float | None = None
    runner_up: str | None = None
    runner_up_us: float | None = None

    def __str__(self) -> str:
        host = ", staged through host memory" if self.staged_through_host else ""
        text = f"{self.op} of {self.nbytes} B -> {self.transport}/{self.algorithm} ({self.reason}{host})"
        if self.predicted_us is not None:
            text += f"; predicted {self.predicted_us:.1f} us"
            if self.runner_up is not None and self.runner_up_us is not None:
                text += f", runner-up {self.runner_up} {self.runner_up_us:.1f} us"
        return text


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
                     forced: str | None, *, nbytes: int | None = None, arch: str = "any") -> tuple[str, str]:
    """The transport that serves one call, from what every rank agrees on.

    Host tensors are never routed by size (see the module docstring). CUDA tensors on one node go
    to ipc up to :func:`ipc_max_bytes`: ranks whose sizes wrongly differ may then sit in different
    transports, and both ipc and nccl compare call signatures over the rendezvous on the first call
    of each signature, so they still meet there and raise the ValueError that names the difference.

    Args:
        opcode: the collective.
        device: device type of the call's tensors.
        single_node: whether every rank of the group runs on one node.
        available: transport name -> live transport of this communicator.
        forced: a transport every call must use (``transport=``/MOECOMM_TRANSPORT), or None.
        nbytes: bytes of this rank's input (None: not routed by size).
        arch: GPU architecture for the size table.
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
        if device != "cpu" or "cpu" in available[forced].devices:
            return forced, "forced by transport=/MOECOMM_TRANSPORT"
        # A GPU transport forced for the device tensors cannot take host tensors (such as the count
        # exchanges of MoE's layout and of agreement checks): they go to the host chain below.
        forced_note = f"; {forced!r} is forced but moves only {'/'.join(available[forced].devices)} tensors"
    else:
        forced_note = ""
    hier = available.get("hierarchical")
    hier_min = HIERARCHICAL_MIN_BYTES.get(opcode)
    if device == "cpu" and not single_node and hier is not None and hier_min is not None and nbytes is not None \
            and nbytes >= hier_min:
        return "hierarchical", (f"host tensors on {hier.num_nodes} nodes x {hier.local_size} ranks, {nbytes} B >= "
                                f"{hier_min} B (selection.HIERARCHICAL_MIN_BYTES){forced_note}")
    ipc = available.get("ipc")
    if device == "cuda" and single_node and nbytes is not None and ipc is not None and device in ipc.devices:
        limit = ipc_max_bytes(opcode, ipc.size, arch)
        if nbytes <= limit:
            return "ipc", f"cuda tensors on one node, {nbytes} B <= {limit} B (selection.IPC_MAX_BYTES)"
    chain = candidate_chain(device, single_node)
    for name in chain:
        if name in available:
            where = "one node" if single_node else "several nodes"
            reason = f"first available of {'>'.join(chain)} for {device} tensors on {where}"
            if device == "cpu" and not single_node and hier_min is not None and nbytes is not None:
                reason += (f"; not hierarchical: {nbytes} B < {hier_min} B (selection.HIERARCHICAL_MIN_BYTES)"
                           if hier is not None else "; not hierarchical: needs equal ranks (>1) on every node")
            return name, reason + forced_note
    raise NoTransportError(
        f"no transport can serve {device} tensors here (available: {sorted(available)}); "
        "launch with mpiexec (mpi) or torchrun (gloo: torch.distributed with gloo) for multi-node runs")
