"""Creating a communicator's transports, collectively.

One exchange first carries every rank's argument error (if any), the settings every rank must share,
and whether NCCL, ipc and gloo can come up there (their creation is collective, so only where every
rank can). Then the transports are created, and a second exchange drops any transport that did not
come up on every rank, so that no two ranks ever pick different transports for one call, except NCCL
on GPUs, whose failure is an error: dropping it would move every CUDA tensor through host memory.

Which transports are made: shm on one node, mpi under an MPI launch, NCCL and ipc where every rank
has them, and gloo (torch.distributed's, over the rendezvous's store) when the group spans nodes and
there is no MPI (torchrun across nodes), or when forced. A group that spans nodes with no transport
between them raises at creation, saying how to launch instead.
"""

from __future__ import annotations

import json
import logging

import torch

from transports import transport_class
from transports.base import CollectiveTimeoutError, GroupInfo, Transport
from transports.settings import agreed_items, check_settings_agree

from .topology import Topology

log = logging.getLogger("collectives")


class TransportCreationError(RuntimeError):
    """The transports cannot start as asked; every rank of the new group raises it together."""

    in_step = True  # a split that raises it leaves the parent usable (collectives._shared.leaves_out_of_step)


def create_transports(group: GroupInfo, topology: Topology, device: torch.device, forced: str | None,
                      local_error: Exception | None) -> dict[str, Transport]:
    """Every transport this group can use, the same names on every rank (collective over the group).

    Args:
        group: what the transports need to know (rank, rendezvous, settings, pids, ...).
        topology: where the ranks run (single node or not).
        device: this rank's device (cuda:N or cpu).
        forced: the transport every call must use, or None.
        local_error: this rank's error in the communicator's arguments, raised on every rank.
    Returns:
        name -> live transport. Raises ValueError/TypeError naming the rank whose arguments or
        settings were wrong (or differ), RuntimeError when NCCL failed on a machine with GPUs.
    """
    wanted = []
    if topology.single_node:
        wanted.append("shm")
    if group.mpi_comm is not None:
        wanted.append("mpi")
    from transports.gloo import gloo_usable
    from transports.ipc import ipc_available
    from transports.nccl import nccl_module

    # gloo opens a connection between every two ranks: only where nothing else crosses nodes, or forced
    gloo_wanted = forced == "gloo" or (not topology.single_node and group.mpi_comm is None)
    gloo_why_not = gloo_usable(group.rendezvous) if gloo_wanted else None

    # One exchange: this rank's argument error if any, the settings every rank must share, and
    # whether NCCL and ipc are there (their creation is collective, so only if every rank has them).
    mine = {"error": None if local_error is None else f"{type(local_error).__name__}: {local_error}",
            "settings": agreed_items(group.settings) if local_error is None else {},
            "nccl": local_error is None and device.type == "cuda" and nccl_module() is not None,
            "ipc": local_error is None and topology.single_node and ipc_available(group.settings),
            "gloo": local_error is None and gloo_wanted and gloo_why_not is None}
    facts = [json.loads(b) for b in group.rendezvous.allgather_bytes(json.dumps(mine, sort_keys=True).encode())]
    failed = [(group.global_ranks[r], f["error"]) for r, f in enumerate(facts) if f["error"]]
    if local_error is not None:
        raise local_error
    if failed:
        raise ValueError(f"rank(s) {[r for r, _ in failed]} could not create their communicator "
                         f"(rank {failed[0][0]}: {failed[0][1]}); every rank aborted the creation")
    check_settings_agree([f["settings"] for f in facts], group.global_ranks)
    made: dict[str, Transport] = {}
    if all(f["nccl"] for f in facts):
        wanted.append("nccl")
    if all(f.get("ipc") for f in facts):  # collective creation, like nccl: only where every rank can
        wanted.append("ipc")
    if all(f.get("gloo") for f in facts):
        wanted.append("gloo")
    errors: dict[str, str] = {}
    for name in wanted:
        try:
            made[name] = transport_class(name)(group)
        except Exception as e:  # noqa: BLE001 - reported below; peers drop it too
            errors[name] = f"{type(e).__name__}: {e}"
            log.warning("transport %s unavailable on rank %d: %s", name, group.global_ranks[group.rank], e)
    # A transport that failed on some rank (out of memory, a bad setting) must not be used by the
    # others: they would pick different transports for one call and wait for each other forever.
    mine = {"up": sorted(made), "errors": errors, "gpu": _gpu_identity(device)}
    try:
        reports = [json.loads(b) for b in group.rendezvous.allgather_bytes(json.dumps(mine, sort_keys=True).encode())]
    except BaseException as e:
        for t in made.values():
            t.close()
        if errors and isinstance(e, CollectiveTimeoutError):  # say what went wrong here first
            here = "; ".join(f"{name}: {why}" for name, why in sorted(errors.items()))
            raise CollectiveTimeoutError(f"{e} (before it, on this rank: {here})", e.missing_ranks) from e
        raise
    up = [set(r["up"]) for r in reports]
    nccl_failed = [(group.global_ranks[r], rep["errors"]["nccl"]) for r, rep in enumerate(reports)
                   if "nccl" in rep["errors"]]
    if nccl_failed and forced not in ("shm", "mpi", "ipc"):
        # There are GPUs (NCCL was wanted on every rank): dropping NCCL would move every CUDA
        # tensor through host memory, silently and slowly. Say why and what to do instead. A
        # communicator forced onto another transport asked for that path, so NCCL is dropped there.
        for t in made.values():
            t.close()
        raise TransportCreationError(_nccl_failure_message(nccl_failed, reports, group.global_ranks,
                                                 list(topology.node_ids)))
    for name in sorted(made):
        missing = [group.global_ranks[r] for r, names in enumerate(up) if name not in names]
        if missing:
            log.warning("transport %s is not used: it did not come up on rank(s) %s", name, missing)
            made.pop(name).close()
    if not topology.single_node and not forced and not {"mpi", "gloo"} & set(made):
        for t in made.values():
            t.close()
        raise TransportCreationError(_no_cross_node_message(topology, group, gloo_why_not, reports))
    return made


def _no_cross_node_message(topology: Topology, group: GroupInfo, gloo_why_not: str | None,
                           reports: list[dict]) -> str:
    """Why no transport links the nodes of this group, and what to do."""
    nodes = [topology.hosts[ranks[0]] for ranks in topology.nodes]
    gloo_errors = [(group.global_ranks[r], rep["errors"]["gloo"]) for r, rep in enumerate(reports)
                   if "gloo" in rep.get("errors", {})]
    gloo = (f"gloo failed on rank(s) {[r for r, _ in gloo_errors]} ({gloo_errors[0][1]})" if gloo_errors
            else f"gloo cannot start ({gloo_why_not})" if gloo_why_not else "gloo did not come up on every rank")
    return (f"the ranks run on {len(nodes)} nodes ({', '.join(nodes)}) and no transport moves host tensors "
            f"between nodes: mpi needs a launch by mpiexec/mpirun with mpi4py installed, and {gloo}. To fix: "
            "launch with mpiexec (pip install mpi4py, plus an MPI such as the mpich wheel), or under torchrun "
            "use a torch build with gloo (torch.distributed.is_gloo_available()) and make sure every node can "
            "reach the others on the address that reaches MASTER_ADDR (or set GLOO_SOCKET_IFNAME); "
            "every rank aborted the creation.")


def _gpu_identity(device: torch.device) -> str | None:
    """The physical GPU behind ``device`` (its UUID where torch knows it), to find ranks sharing one."""
    if device.type != "cuda":
        return None
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except Exception:  # noqa: BLE001 - older torch, or a driver error: the index is the best we have
        return str(device)


def _nccl_failure_message(failed: list[tuple[int, str]], reports: list[dict], ranks: list[int],
                          nodes: list[str]) -> str:
    """What went wrong creating NCCL, which ranks share a GPU, and what to do."""
    from transports.nccl import nccl_version

    by_gpu: dict[tuple[str, str], list[int]] = {}
    for r, rep in enumerate(reports):
        if rep.get("gpu") is not None:
            by_gpu.setdefault((nodes[r] if r < len(nodes) else "", rep["gpu"]), []).append(ranks[r])
    shared = [group for group in by_gpu.values() if len(group) > 1]
    version = nccl_version()
    have = f"this process has NCCL {'.'.join(map(str, version))}" if version else "NCCL's version is unknown"
    why = (f"{'; '.join(f'ranks {g} share a GPU' for g in shared)}, which NCCL refuses ('Duplicate GPU "
           f"detected') unless NCCL_MULTI_RANK_GPU_ENABLE=1 is set on every rank (NCCL >= 2.30; {have}). "
           if shared else "")
    return (f"NCCL could not start on rank(s) {[r for r, _ in failed]} (rank {failed[0][0]}: {failed[0][1]}); "
            f"every rank aborted the creation. {why}To fix: give each rank its own GPU (device= of "
            "collectives.init/launch; the default is cuda:local_rank), or, for ranks that must share a GPU, set "
            "NCCL_MULTI_RANK_GPU_ENABLE=1 with NCCL >= 2.30. To run without NCCL, pass transport='ipc' (our "
            "kernels over CUDA IPC, one node), 'shm' or 'mpi' (CUDA tensors are then copied through host "
            "memory) or device='cpu'.")
