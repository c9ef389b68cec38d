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

from .detect import detect
from .formats import format_cpulist, parse_cpulist
from .model import GpuTopology


def node_identity() -> str:
    """The identity of this process's node: processes with the same one can share memory.

    Hostname, kernel boot id (new at every boot of every machine) and the device number of the
    ``/dev/shm`` file system, which POSIX shared memory lives in. Ranks on different machines differ even
    when their containers share a hostname; containers or network-namespace "nodes" of one machine differ
    when they have their own hostname or their own /dev/shm (the multi-node testbed's nodes have both:
    benchmarks/testbed.py), so the shm transport is never picked between processes that cannot share a
    segment. The hostname stays in as well: machines restored from one VM snapshot share a boot id; ranks
    that could share memory but carry different hostnames are merely treated as two nodes (correct, slower).

    Returns:
        ``<hostname>/<boot id>/shm:<device of /dev/shm in hex>`` (``shm:-`` where there is no /dev/shm).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        shm = f"{os.stat('/dev/shm').st_dev:x}"
    except OSError:
        shm = "-"
    return f"{socket.gethostname()}/{boot}/shm:{shm}"


def local_facts() -> bytes:
    """This rank's contribution to the topology exchange.

    Returns:
        JSON: ``host``, ``node`` (:func:`node_identity`), ``pid``, ``cpus`` (how many CPUs this process may
        run on) and ``cpulist`` (which, as a kernel cpulist; its affinity, e.g. a pinning by mpiexec).
    """
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return json.dumps({"host": socket.gethostname(), "node": node_identity(), "pid": os.getpid(),
                       "cpus": len(cpus), "cpulist": format_cpulist(cpus)}).encode()


@dataclass(frozen=True)
class Topology:
    """Placement of the ranks of one communicator.

    ``hosts[r]``/``node_ids[r]``: hostname and node identity of rank r; ``pids[r]`` its process id;
    ``cpus_per_rank[r]``/``cpu_lists[r]``: how many CPUs it may run on and which (a kernel cpulist; ()
    when not known: then CPUs 0..cpus-1 are assumed); ``launch``: how the job was started;
    ``nodes``: the ranks of each node, nodes in order of their lowest rank. ``job``: the topology of all
    ranks of the job when this one is a sub-communicator's (None for the job's own).
    """

    rank: int
    size: int
    hosts: tuple[str, ...]
    node_ids: tuple[str, ...]
    pids: tuple[int, ...]
    cpus_per_rank: tuple[int, ...]
    launch: str
    cpu_lists: tuple[str, ...] = ()
    job: Topology | None = field(default=None, repr=False, compare=False)
    nodes: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self):
        order: dict[str, list[int]] = {}
        for r, node in enumerate(self.node_ids):
            order.setdefault(node, []).append(r)
        object.__setattr__(self, "nodes", tuple(tuple(v) for v in order.values()))

    @classmethod
    def from_facts(cls, rank: int, facts: list[bytes], launch: str) -> Topology:
        """The topology of a job from every rank's :func:`local_facts`.

        Args:
            rank: this process's rank.
            facts: ``local_facts()`` of rank 0, 1, ... in order.
            launch: how the job was started (e.g. "self", "mpiexec", "torchrun").

        Returns:
            This rank's view of the job.
        """
        d = [json.loads(f) for f in facts]
        return cls(rank, len(d), tuple(x["host"] for x in d), tuple(x["node"] for x in d),
                   tuple(x["pid"] for x in d), tuple(x["cpus"] for x in d), launch,
                   tuple(x["cpulist"] for x in d))

    def subset(self, ranks: list[int], new_rank: int) -> Topology:
        """The topology of a sub-communicator.

        Args:
            ranks: its members, as ranks of this communicator, in their new order.
            new_rank: this process's rank in it.

        Returns:
            Its view; ``job`` keeps the whole job's, which :attr:`oversubscribed` and :attr:`gpus` use.
        """
        def pick(values: tuple) -> tuple:
            return tuple(values[r] for r in ranks) if values else ()

        return Topology(new_rank, len(ranks), pick(self.hosts), pick(self.node_ids), pick(self.pids),
                        pick(self.cpus_per_rank), self.launch, pick(self.cpu_lists), job=self.job or self)

    @functools.cached_property
    def gpus(self) -> GpuTopology:
        """This node's GPUs, NVLinks, P2P capability, NUMA nodes and NICs.

        Detected on first use (NVML, else nvidia-smi, else sysfs; ~ms, no CUDA context) and cached, once
        for a job and its sub-communicators. Empty ``gpus`` list on a machine without NVIDIA GPUs.
        """
        return self.job.gpus if self.job is not None else detect()

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's node."""
        me = self.node_ids[self.rank]
        return tuple(r for r in range(self.size) if self.node_ids[r] == me)

    @property
    def local_rank(self) -> int:
        """This rank's position among the ranks on its node."""
        return self.local_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        """How many ranks run on this rank's node."""
        return len(self.local_ranks)

    @property
    def num_nodes(self) -> int:
        """How many nodes the ranks run on."""
        return len(self.nodes)

    @property
    def single_node(self) -> bool:
        """All ranks run on one node."""
        return self.num_nodes == 1

    def cpu_set(self, rank: int) -> frozenset[int]:
        """The CPUs a rank may run on.

        Args:
            rank: a rank of this communicator.

        Returns:
            Its affinity; CPUs 0..cpus_per_rank[rank]-1 when ``cpu_lists`` is not known.
        """
        if self.cpu_lists:
            return parse_cpulist(self.cpu_lists[rank])
        return frozenset(range(self.cpus_per_rank[rank]))

    @functools.cached_property
    def oversubscribed(self) -> bool:
        """More ranks on this node than CPUs for each to run on at once: some rank will wait for a CPU.

        Counts every rank of the job on this node (a sub-communicator's ranks share the node with the
        ranks outside it) and the CPUs each may run on: ranks pinned to distinct cores are not
        oversubscribed, two ranks pinned to one core are, however many other cores there are. The one
        definition; transports get it as ``GroupInfo.oversubscribed``.
        """
        job = self.job or self
        me = job.node_ids[job.rank]
        return not _each_gets_a_cpu([job.cpu_set(r) for r in range(job.size) if job.node_ids[r] == me])

    def __str__(self) -> str:
        lines = [f"{self.size} rank(s) on {self.num_nodes} node(s), launched by {self.launch}"]
        for ranks in self.nodes:
            lines.append(f"  {self.hosts[ranks[0]]}: ranks {list(ranks)}, {self.cpus_per_rank[ranks[0]]} CPU(s)")
        return "\n".join(lines)


def _each_gets_a_cpu(cpu_sets: list[frozenset[int]]) -> bool:
    """Whether every rank can have a CPU of its own from its set at the same time (a bipartite matching of
    ranks to CPUs, by augmenting paths; a free CPU is taken first, so unpinned ranks cost one pass)."""
    if len(cpu_sets) > len(frozenset().union(*cpu_sets)):
        return False
    owner: dict[int, int] = {}

    def place(rank: int, seen: set[int]) -> bool:
        free = next((c for c in cpu_sets[rank] if c not in owner), None)
        if free is not None:
            owner[free] = rank
            return True
        for c in cpu_sets[rank]:
            if c not in seen:
                seen.add(c)
                if place(owner[c], seen):
                    owner[c] = rank
                    return True
        return False

    return all(place(r, set()) for r in range(len(cpu_sets)))
