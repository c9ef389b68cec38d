"""The data model of one node's GPU and NIC topology: GPUs, NVLinks, NICs, NUMA nodes, and what connects them.

Plain frozen dataclasses, filled by :func:`~collectives.topology.detect.build_topology` and serialisable
to JSON (:meth:`GpuTopology.to_dict` / :meth:`GpuTopology.from_dict`). Matrix cells use the words of
``nvidia-smi topo -m``: X, NV#, PIX, PXB, PHB, NODE, SYS, and N/A for unknown. The text form lives in
:mod:`collectives.topology.render` (``render(topo)``, ``render_matrix(topo)``, ...), which reads this model;
the model does not import its renderer.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from .formats import cpulist_count, natural_key, normalize_bus_id

# PCI relations from nearest to farthest (see sysfs.pci_relation)
PCI_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")


@dataclass(frozen=True)
class NvLink:
    """One NVLink of a GPU: its number, whether it is up, and what is at the other end.

    ``remote``: "GPU", "NVSWITCH", "CPU" (an IBM NPU) or "UNKNOWN"; ``remote_bus_id``: the remote PCI
    bus id NVML gives (for NVSwitch links it names the switch, not a GPU), None when not reported.
    """

    link: int
    active: bool
    remote: str = "UNKNOWN"
    remote_bus_id: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU of this node.

    ``index`` is the NVML / nvidia-smi index (PCI bus order), which is not necessarily the CUDA ordinal
    (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER); ``cuda_device`` is the CUDA ordinal where the P2P probe
    mapped it, else None. ``cpu_affinity`` is the PCI device's ``local_cpulist`` (e.g. "0-55,112-167").
    ``pci_path``: host bridge then every PCI bridge down to the GPU, from sysfs (empty when unknown).
    """

    index: int
    pci_bus_id: str
    name: str
    uuid: str | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    nvlinks: tuple[NvLink, ...] = ()
    pci_path: tuple[str, ...] = ()
    cuda_device: int | None = None

    @property
    def active_nvlinks(self) -> int:
        """How many of its NVLinks are up."""
        return sum(1 for link in self.nvlinks if link.active)


@dataclass(frozen=True)
class NicInfo:
    """One network port: an RDMA device port (InfiniBand, or RoCE when its link layer is Ethernet) or a
    physical Ethernet interface without RDMA.

    ``state``: the RDMA port state (ACTIVE, DOWN, INIT, ARMED) or the interface's operstate (up, down,
    unknown). ``rate``: the kernel's own words ("400 Gb/sec (4X NDR)" for RDMA, "100000 Mb/s" for
    Ethernet); ``rate_gbps``: the same in Gb/s, None when the kernel does not know (link down, virtual NIC).
    """

    name: str
    kind: str
    state: str
    rate_gbps: float | None
    rate: str | None
    port: int | None = None
    physical_state: str | None = None
    netdevs: tuple[str, ...] = ()
    pci_bus_id: str | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    pci_path: tuple[str, ...] = ()

    @property
    def up(self) -> bool:
        """The port is ACTIVE (RDMA) or the interface is up (Ethernet)."""
        return self.state in ("ACTIVE", "up")

    @property
    def label(self) -> str:
        """``mlx5_0`` for port 1 of an RDMA device or for an interface, ``mlx4_0:2`` for port 2 (mlx5 devices
        have one port each; older dual-port ones show up once per port)."""
        return self.name if self.port in (None, 1) else f"{self.name}:{self.port}"


@dataclass(frozen=True)
class PeerInfo:
    """What connects GPU i to GPU j (i != j).

    ``link``: the matrix cell ("NV18", "PIX", "PXB", "PHB", "NODE", "SYS", "N/A"); ``nvlinks``: bonded
    NVLinks, direct or through NVSwitch; ``pci``: the PCI relation alone (None when unknown);
    ``source``: where ``link`` came from ("nvml", "nvidia-smi", "sysfs").
    ``p2p_*``: NVML P2P status codes as reported (0 = OK, see ``nvml.P2P_STATUS``), None when NVML was not
    asked. ``probed``: whether P2P worked when tried, None when not tried; ``probe``: what was tried.
    """

    link: str
    nvlinks: int = 0
    pci: str | None = None
    source: str = "sysfs"
    p2p_read: int | None = None
    p2p_write: int | None = None
    p2p_nvlink: int | None = None
    p2p_atomics: int | None = None
    probed: bool | None = None
    probe: str | None = None

    @property
    def p2p_reported(self) -> bool | None:
        """NVML says P2P reads and writes are supported (None: NVML was not asked)."""
        if self.p2p_read is None or self.p2p_write is None:
            return None
        return self.p2p_read == 0 and self.p2p_write == 0

    @property
    def p2p_usable(self) -> bool | None:
        """The probe's answer where it ran, else NVML's report, else None."""
        return self.probed if self.probed is not None else self.p2p_reported


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its number and its CPUs as a kernel cpulist ("0-55,112-167")."""

    id: int
    cpulist: str

    @property
    def cpus(self) -> int:
        """How many CPUs it has."""
        return cpulist_count(self.cpulist)


@dataclass(frozen=True)
class GpuTopology:
    """GPUs and NICs of one node and how they connect.

    ``peers[i][j]``: :class:`PeerInfo` for GPUs i != j, None on the diagonal. ``gpu_nic[g][n]`` and
    ``nic_nic[a][b]``: matrix cells ("X" on the diagonal). ``sources``: what was read ("sysfs", "nvml",
    "nvidia-smi", "probe"); ``notes``: what could not be read or disagreed, one line each.
    """

    hostname: str
    gpus: tuple[GpuInfo, ...] = ()
    nics: tuple[NicInfo, ...] = ()
    peers: tuple[tuple[PeerInfo | None, ...], ...] = ()
    gpu_nic: tuple[tuple[str, ...], ...] = ()
    nic_nic: tuple[tuple[str, ...], ...] = ()
    numa_nodes: tuple[NumaNode, ...] = ()
    cpus_online: int | None = None
    driver_version: str | None = None
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    # -- queries
    def link(self, i: int, j: int) -> str:
        """Matrix cell between two GPUs.

        Args:
            i, j: GPU positions in ``gpus``.

        Returns:
            "X" for i == j, else e.g. "NV18" or "SYS".
        """
        self._check_gpu(i), self._check_gpu(j)
        return "X" if i == j else self.peers[i][j].link

    def nvlink_count(self, i: int, j: int) -> int:
        """Bonded NVLinks between two GPUs.

        Args:
            i, j: GPU positions in ``gpus``.

        Returns:
            The count, direct or through NVSwitch; 0 for i == j or when they talk over PCIe only.
        """
        self._check_gpu(i), self._check_gpu(j)
        return 0 if i == j else self.peers[i][j].nvlinks

    def p2p_usable(self, i: int, j: int) -> bool | None:
        """P2P from GPU i to GPU j.

        Args:
            i, j: GPU positions in ``gpus``.

        Returns:
            The probe's answer where it ran, else NVML's report, None when neither is known.
        """
        self._check_gpu(i), self._check_gpu(j)
        return True if i == j else self.peers[i][j].p2p_usable

    @property
    def nvlink_connected(self) -> bool:
        """Every pair of GPUs has at least one NVLink (trivially true for 0 or 1 GPU)."""
        return all(p.nvlinks > 0 for row in self.peers for p in row if p is not None)

    def gpu_by_bus_id(self, bus_id: str) -> GpuInfo:
        """The GPU at a PCI address.

        Args:
            bus_id: in any spelling :func:`~collectives.topology.formats.normalize_bus_id` accepts.

        Returns:
            Its :class:`GpuInfo`.

        Raises:
            KeyError: no GPU of this node has that address.
        """
        want = normalize_bus_id(bus_id)
        for g in self.gpus:
            if g.pci_bus_id == want:
                return g
        raise KeyError(f"no GPU with PCI bus id {want} on {self.hostname} (GPUs: "
                       f"{[g.pci_bus_id for g in self.gpus]})")

    def nics_for_gpu(self, i: int, *, up_only: bool = True) -> list[NicInfo]:
        """The NICs a GPU would use, nearest first (PIX before PXB before ... SYS), then by name.

        Args:
            i: GPU position in ``gpus``.
            up_only: leave out ports that are down.

        Returns:
            The NICs in that order.
        """
        self._check_gpu(i)
        order = {lvl: k for k, lvl in enumerate(PCI_LEVELS + ("N/A",))}
        idx = [n for n in range(len(self.nics)) if self.nics[n].up or not up_only]
        idx.sort(key=lambda n: (order.get(self.gpu_nic[i][n], len(order)), natural_key(self.nics[n].label)))
        return [self.nics[n] for n in idx]

    def _check_gpu(self, i: int) -> None:
        if not 0 <= i < len(self.gpus):
            raise IndexError(f"GPU index {i} out of range: {self.hostname} has {len(self.gpus)} GPU(s)")

    # -- serialisation
    def to_dict(self) -> dict:
        """Plain JSON-able dict; :meth:`from_dict` inverts it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GpuTopology:
        """Inverse of :meth:`to_dict`.

        Args:
            d: a dict as :meth:`to_dict` returns it (e.g. read back from ``moecomm topo --json``).

        Returns:
            The topology, equal to the one that was written.
        """
        gpus = tuple(GpuInfo(**{**g, "nvlinks": tuple(NvLink(**link) for link in g["nvlinks"]),
                                "pci_path": tuple(g["pci_path"])}) for g in d["gpus"])
        nics = tuple(NicInfo(**{**n, "netdevs": tuple(n["netdevs"]), "pci_path": tuple(n["pci_path"])})
                     for n in d["nics"])
        peers = tuple(tuple(None if p is None else PeerInfo(**p) for p in row) for row in d["peers"])
        return cls(hostname=d["hostname"], gpus=gpus, nics=nics, peers=peers,
                   gpu_nic=tuple(tuple(r) for r in d["gpu_nic"]), nic_nic=tuple(tuple(r) for r in d["nic_nic"]),
                   numa_nodes=tuple(NumaNode(**x) for x in d["numa_nodes"]), cpus_online=d["cpus_online"],
                   driver_version=d["driver_version"], sources=tuple(d["sources"]), notes=tuple(d["notes"]))

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as JSON; ``kwargs`` go to :func:`json.dumps` (e.g. ``indent=1``)."""
        return json.dumps(self.to_dict(), **kwargs)
