"""Where the ranks of a communicator run: nodes, local ranks, the CPUs each may use, and this node's GPUs.

Each rank contributes :func:`local_facts`; the communicator allgathers them and builds one
:class:`Topology` per rank from the list (:meth:`Topology.from_facts`).
"""

from __future__ import annotations

import functools
import json
import os
import socket
from dataclasses import dataclass, field


def node_identity() -> str:
    """Hostname plus the kernel boot id: two containers with one hostname on different machines differ."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def local_facts() -> bytes:
    """This rank's contribution to the topology exchange."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return json.dumps({"host": socket.gethostname(), "node": node_identity(), "pid": os.getpid(),
                       "cpus": cpus}).encode()


@dataclass(frozen=True)
class Topology:
    """Placement of the ranks of one communicator.

    ``hosts[r]``/``nodes_of[r]``: hostname and node identity of rank r; ``pids[r]`` its process id;
    ``nodes``: the ranks of each node, nodes in order of their lowest rank.
    """

    rank: int
    size: int
    hosts: tuple[str, ...]
    node_ids: tuple[str, ...]
    pids: tuple[int, ...]
    cpus_per_rank: tuple[int, ...]
    launch: str
    nodes: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self):
        order: dict[str, list[int]] = {}
        for r, node in enumerate(self.node_ids):
            order.setdefault(node, []).append(r)
        object.__setattr__(self, "nodes", tuple(tuple(v) for v in order.values()))

    @classmethod
    def from_facts(cls, rank: int, facts: list[bytes], launch: str) -> "Topology":
        d = [json.loads(f) for f in facts]
        return cls(rank, len(d), tuple(x["host"] for x in d), tuple(x["node"] for x in d),
                   tuple(x["pid"] for x in d), tuple(x["cpus"] for x in d), launch)

    def subset(self, ranks: list[int], new_rank: int) -> "Topology":
        return Topology(new_rank, len(ranks), tuple(self.hosts[r] for r in ranks),
                        tuple(self.node_ids[r] for r in ranks), tuple(self.pids[r] for r in ranks),
                        tuple(self.cpus_per_rank[r] for r in ranks), self.launch)

    @functools.cached_property
    def gpus(self):
        """This node's GPUs, NVLinks, P2P capability, NUMA nodes and NICs (:class:`GpuTopology`).

        Detected on first use (NVML, else nvidia-smi, else sysfs; ~ms, no CUDA context) and cached.
        Empty ``gpus`` list on a machine without NVIDIA GPUs.
        """
        from .detect import detect

        return detect()

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's node."""
        me = self.node_ids[self.rank]
        return tuple(r for r in range(self.size) if self.node_ids[r] == me)

    @property
    def local_rank(self) -> int:
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_ranks)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def single_node(self) -> bool:
        return self.num_nodes == 1

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this node than CPUs they may run on."""
        return self.local_size > self.cpus_per_rank[self.rank]

    def __str__(self) -> str:
        lines = [f"{self.size} rank(s) on {self.num_nodes} node(s), launched by {self.launch}"]
        for ranks in self.nodes:
            lines.append(f"  {self.hosts[ranks[0]]}: ranks {list(ranks)}, {self.cpus_per_rank[ranks[0]]} CPU(s)")
        return "\n".join(lines)
