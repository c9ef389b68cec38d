"""GPU and NIC topology of one node, in the terms of ``nvidia-smi topo -m``.

What is known per local GPU: PCI bus id, NUMA node and local CPUs, NVLinks (per link, and as a bonded
count between each pair of GPUs, NVSwitch links included), P2P capability as NVML reports it and, where a
probe ran, as it actually worked; per NIC (InfiniBand and RoCE ports from ``/sys/class/infiniband``,
physical Ethernet interfaces from ``/sys/class/net``): kind, state, link rate, PCI bus id, NUMA node.
Between every two devices: the matrix cell nvidia-smi would print (X, NV#, PIX, PXB, PHB, NODE, SYS).

Sources, each optional, so that a machine without a GPU or without a driver still answers:

* NVML through ``pynvml`` (the ``nvidia-ml-py`` package, NVIDIA's own ctypes binding of libnvidia-ml):
  GPUs, NVLink state and remote end per link, P2P status, PCI common ancestor of two GPUs;
* ``nvidia-smi topo -m`` and ``nvidia-smi --query-gpu``, used when NVML is not importable, and by
  :func:`cross_check`;
* sysfs: the PCI path of every device (which bridges lie between two of them), ``numa_node`` and
  ``local_cpulist``, NIC ports and rates; NVIDIA GPUs are found there even without a driver;
* a probe for P2P as usable (:func:`probe_p2p`): ``torch.cuda.can_device_access_peer`` and a peer copy
  whose contents are checked; it needs CUDA and two GPUs, and is skipped (and marked as not run) otherwise.

Every parser takes a root directory, a text or an NVML-like object, so recorded fixtures drive the tests
(:func:`record` writes such a recording from a live machine; :func:`load_recording` reads one back).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

log = logging.getLogger("collectives.gpu_topology")

NVIDIA_VENDOR = "0x10de"
# NVML_NVLINK_MAX_LINKS in nvml.h as of CUDA 12 (Hopper and Blackwell have 18 links per GPU)
NVML_NVLINK_MAX_LINKS = 18
# NVML_P2P_CAPS_INDEX_*. Spelled out here because pynvml's NVML_P2P_CAPS_INDEX_READ is the tuple (0,)
# (a trailing comma in its source), which NVML rejects as an argument.
P2P_CAPS = {"read": 0, "write": 1, "nvlink": 2, "atomics": 3}
# nvmlGpuP2PStatus_t, abbreviated as `nvidia-smi topo -p2p` does
P2P_STATUS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DIS", 5: "NS", 6: "U"}
P2P_STATUS_TEXT = {0: "ok", 1: "chipset not supported", 2: "GPU not supported",
                   3: "IOH topology not supported", 4: "disabled by regkey", 5: "not supported", 6: "unknown"}
# nvmlIntNvLinkDeviceType_t
NVLINK_REMOTE = {0: "GPU", 1: "CPU", 2: "NVSWITCH", 255: "UNKNOWN"}
# nvmlGpuTopologyLevel_t -> matrix cell. INTERNAL (two GPUs on one board) sits behind the board's own bridge.
NVML_LEVEL = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
PCI_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_SMI_EXTRA_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")

_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_IB_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")
_ARPHRD_ETHER, _ARPHRD_INFINIBAND = 1, 32


# ----------------------------------------------------------------------------------------------- data

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
    ``p2p_*``: NVML P2P status codes as reported (0 = OK, see ``P2P_STATUS``), None when NVML was not asked.
    ``probed``: whether P2P worked when tried, None when not tried; ``probe``: what was tried.
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
    id: int
    cpulist: str

    @property
    def cpus(self) -> int:
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
    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def link(self, i: int, j: int) -> str:
        """Matrix cell between GPUs i and j: "X" for i == j, else e.g. "NV18" or "SYS"."""
        self._check_gpu(i), self._check_gpu(j)
        return "X" if i == j else self.peers[i][j].link

    def nvlink_count(self, i: int, j: int) -> int:
        """Bonded NVLinks between GPUs i != j (0 when they talk over PCIe only)."""
        self._check_gpu(i), self._check_gpu(j)
        return 0 if i == j else self.peers[i][j].nvlinks

    def p2p_usable(self, i: int, j: int) -> bool | None:
        """P2P from GPU i to GPU j: probed where the probe ran, else as NVML reports, None if unknown."""
        self._check_gpu(i), self._check_gpu(j)
        return True if i == j else self.peers[i][j].p2p_usable

    @property
    def nvlink_connected(self) -> bool:
        """Every pair of GPUs has at least one NVLink (trivially true for 0 or 1 GPU)."""
        return all(p.nvlinks > 0 for row in self.peers for p in row if p is not None)

    def gpu_by_bus_id(self, bus_id: str) -> GpuInfo:
        want = normalize_bus_id(bus_id)
        for g in self.gpus:
            if g.pci_bus_id == want:
                return g
        raise KeyError(f"no GPU with PCI bus id {want} on {self.hostname} (GPUs: "
                       f"{[g.pci_bus_id for g in self.gpus]})")

    def nics_for_gpu(self, i: int, *, up_only: bool = True) -> list[NicInfo]:
        """NICs ordered nearest first (PIX before PXB before ... SYS), then by name."""
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
    def from_dict(cls, d: dict) -> "GpuTopology":
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
        return json.dumps(self.to_dict(), **kwargs)

    # -- rendering
    def render_matrix(self) -> str:
        """The connection matrix laid out as ``nvidia-smi topo -m`` prints it (tab stops of 8 expanded),
        GPUs then NICs, with CPU and NUMA affinity per GPU, a legend and a NIC legend."""
        labels = [f"GPU{i}" for i in range(len(self.gpus))] + [f"NIC{n}" for n in range(len(self.nics))]
        rows = ["\t" + "\t".join(labels + (["CPU Affinity", "NUMA Affinity"] if self.gpus else []))]
        for i, g in enumerate(self.gpus):
            cells = [_smi_cell(self.link(i, j)) for j in range(len(self.gpus))] + list(self.gpu_nic[i])
            numa = "N/A" if g.numa_node is None else str(g.numa_node)
            rows.append("\t".join([f"GPU{i}"] + cells + [g.cpu_affinity or "N/A", numa]))
        for n in range(len(self.nics)):
            cells = [self.gpu_nic[i][n] for i in range(len(self.gpus))] + [_smi_cell(c) for c in self.nic_nic[n]]
            rows.append("\t".join([f"NIC{n}"] + cells))
        out = [r.expandtabs(8).rstrip() for r in rows]
        out += ["", "Legend:", "",
                "  X    = Self",
                "  NV#  = # bonded NVLinks (direct, or through NVSwitch)",
                "  PIX  = at most one PCIe bridge between them (one PCIe switch)",
                "  PXB  = several PCIe bridges, no PCIe host bridge",
                "  PHB  = through a PCIe host bridge (the CPU's root complex)",
                "  NODE = between PCIe host bridges within one NUMA node",
                "  SYS  = across NUMA nodes (the SMP interconnect, e.g. UPI or Infinity Fabric)",
                "  N/A  = unknown (no PCI path in sysfs)"]
        if self.nics:
            out += ["", "NIC Legend:", ""] + [f"  NIC{n}: {nic.label}" for n, nic in enumerate(self.nics)]
        return "\n".join(out)

    def render_gpus(self) -> str:
        if not self.gpus:
            looked = [s for s in self.sources if s != "probe"]
            return f"No NVIDIA GPU found (looked in: {', '.join(looked) or 'nothing readable'})."
        rows = [("GPU", "PCI bus id", "Name", "NUMA", "CPU affinity", "NVLinks")]
        for g in self.gpus:
            to_switch = sum(1 for link in g.nvlinks if link.active and link.remote == "NVSWITCH")
            nv = "none" if not g.nvlinks else f"{g.active_nvlinks}/{len(g.nvlinks)} up"
            if to_switch:
                nv += f", {to_switch} to NVSwitch"
            rows.append((f"GPU{g.index}", g.pci_bus_id, g.name, _opt(g.numa_node), g.cpu_affinity or "N/A", nv))
        return _table(rows)

    def render_p2p(self) -> str:
        """P2P read+write per GPU pair: OK / NS / CNS / GNS / TNS / DIS / U as NVML reports it, "?" when
        not reported; a trailing * marks a probed answer (OK* worked, NS* failed when tried)."""
        if len(self.gpus) < 2:
            return ""
        labels = [f"GPU{i}" for i in range(len(self.gpus))]
        rows = ["\t" + "\t".join(labels)]
        for i in range(len(self.gpus)):
            rows.append("\t".join([labels[i]] + [" X " if i == j else _p2p_cell(self.peers[i][j])
                                                 for j in range(len(self.gpus))]))
        probed = any(p is not None and p.probed is not None for row in self.peers for p in row)
        how = sorted({p.probe for row in self.peers for p in row if p is not None and p.probe})
        head = "P2P read/write (as NVML reports it" + (f"; * = probed: {', '.join(how)})" if probed else
                                                        "; not probed)")
        return "\n".join([head] + [r.expandtabs(8).rstrip() for r in rows])

    def render_nics(self) -> str:
        if not self.nics:
            return "No network interface with a PCI device found."
        rows = [("NIC", "Device", "Port", "Kind", "State", "Rate", "PCI bus id", "NUMA", "Netdev")]
        for n, nic in enumerate(self.nics):
            rate = nic.rate if nic.kind != "Ethernet" else (
                f"{nic.rate_gbps:g} Gb/s" if nic.rate_gbps is not None else "unknown")
            rows.append((f"NIC{n}", nic.name, _opt(nic.port, "-"), nic.kind, nic.state, rate or "unknown",
                         nic.pci_bus_id or "N/A", _opt(nic.numa_node), ",".join(nic.netdevs) or "-"))
        return _table(rows)

    def render_cpus(self) -> str:
        online = "unknown" if self.cpus_online is None else str(self.cpus_online)
        nodes = "; ".join(f"node{n.id}: {n.cpulist} ({n.cpus})" for n in self.numa_nodes) or "unknown"
        return f"CPUs online: {online}; NUMA nodes: {nodes}"

    def render(self) -> str:
        """Everything, as `moecomm topo` prints it."""
        head = f"Host {self.hostname}"
        if self.driver_version:
            head += f", NVIDIA driver {self.driver_version}"
        head += f"; sources: {', '.join(self.sources) or 'none'}"
        parts = [head, "", self.render_cpus(), "", self.render_gpus(), ""]
        if self.gpus or self.nics:
            parts += [self.render_matrix(), ""]
        p2p = self.render_p2p()
        if p2p:
            parts += [p2p, ""]
        parts += [self.render_nics()]
        if self.notes:
            parts += ["", "Notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.render()


def _smi_cell(c: str) -> str:
    return " X " if c == "X" else c


def _p2p_cell(p: PeerInfo) -> str:
    if p.probed is not None:
        return "OK*" if p.probed else "NS*"
    if p.p2p_read is None or p.p2p_write is None:
        return "?"
    if p.p2p_read == 0 and p.p2p_write == 0:
        return "OK"
    bad = p.p2p_read if p.p2p_read != 0 else p.p2p_write
    return P2P_STATUS.get(bad, "U")


def _opt(v: Any, none: str = "N/A") -> str:
    return none if v is None else str(v)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


# -------------------------------------------------------------------------------------------- helpers

def natural_key(s: str) -> list:
    """Sort key that puts mlx5_2 before mlx5_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def normalize_bus_id(bus_id: str | bytes) -> str:
    """PCI address as sysfs spells it: ``"00000000:1B:00.0"`` (NVML) -> ``"0000:1b:00.0"``."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    m = _BDF.match(bus_id.strip().rstrip("\x00"))
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (expected domain:bus:device.function, "
                         f"e.g. 0000:18:00.0)")
    dom, bus, dev, fn = m.groups()
    return f"{int(dom, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def cpulist_count(cpulist: str) -> int:
    """Number of CPUs in a kernel cpulist such as ``"0-55,112-167"``."""
    n = 0
    for part in cpulist.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        n += (int(hi) - int(lo) + 1) if hi else 1
    return n


def parse_ib_rate(text: str | None) -> float | None:
    """Gb/s from an RDMA port's ``rate`` file: ``"400 Gb/sec (4X NDR)"`` -> 400.0; None if unreadable."""
    if not text:
        return None
    m = _IB_RATE.match(text)
    return float(m.group(1)) if m else None


def parse_ib_state(text: str | None) -> str | None:
    """``"4: ACTIVE"`` -> ``"ACTIVE"``; ``"5: LinkUp"`` -> ``"LinkUp"`` (the ``state``/``phys_state`` files)."""
    if text is None:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


def parse_net_speed(text: str | None) -> float | None:
    """Gb/s from ``/sys/class/net/<if>/speed`` (Mb/s); None for "-1" or (unsigned) 4294967295 = unknown."""
    if text is None:
        return None
    try:
        mbps = int(text.strip())
    except ValueError:
        return None
    return None if mbps <= 0 or mbps >= 0xFFFFFFFF else mbps / 1000.0


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):  # EINVAL: `speed` of a link that is down; ENOENT: not there
        return None


def _sys(root: str, *parts: str) -> str:
    return os.path.join(root, "sys", *parts)


# ------------------------------------------------------------------------------------------------ sysfs

@dataclass(frozen=True)
class PciDevice:
    """A PCI function as sysfs shows it. ``path``: host bridge ("pci0000:15") then each bridge, then itself."""

    bus_id: str
    path: tuple[str, ...]
    vendor: str | None
    device: str | None
    pci_class: str | None
    numa_node: int | None
    cpu_affinity: str | None


def _pci_path(real: str, root: str) -> tuple[str, ...]:
    """("pci0000:15", "0000:15:01.0", ..., "0000:18:00.0") from a resolved path under <root>/sys/devices;
    stops at the first non-PCI component (a virtio device, a netdev); () when not under a PCI host bridge."""
    rel = os.path.relpath(real, os.path.realpath(_sys(root, "devices")))
    parts = rel.split(os.sep)
    if rel.startswith("..") or not parts[0].startswith("pci"):
        return ()
    chain = [parts[0]]
    for p in parts[1:]:
        if not _BDF.match(p):
            break
        chain.append(normalize_bus_id(p))
    return tuple(chain) if len(chain) > 1 else ()


def _numa(text: str | None) -> int | None:
    try:
        n = int(text) if text is not None else -1
    except ValueError:
        return None
    return None if n < 0 else n  # the kernel writes -1 when the firmware gave no proximity information


def read_pci_device(bus_id: str, *, root: str = "/") -> PciDevice | None:
    """The PCI function ``bus_id`` from ``<root>/sys/bus/pci/devices``; None when sysfs does not list it."""
    bus_id = normalize_bus_id(bus_id)
    link = _sys(root, "bus", "pci", "devices", bus_id)
    if not os.path.isdir(link):
        return None
    return _pci_device_at(os.path.realpath(link), root)


def _pci_device_at(real: str, root: str) -> PciDevice | None:
    path = _pci_path(real, root)
    if not path:
        return None
    d = os.path.join(os.path.realpath(_sys(root, "devices")), *path)
    return PciDevice(bus_id=path[-1], path=path, vendor=_read(os.path.join(d, "vendor")),
                     device=_read(os.path.join(d, "device")), pci_class=_read(os.path.join(d, "class")),
                     numa_node=_numa(_read(os.path.join(d, "numa_node"))),
                     cpu_affinity=_read(os.path.join(d, "local_cpulist")))


def _pci_device_of(device_link: str, root: str) -> PciDevice | None:
    """The PCI function behind a ``device`` symlink (of a netdev or an RDMA device), walking up from a
    virtio device to its PCI function; None for virtual devices (no such link)."""
    if not os.path.exists(device_link):
        return None
    real = os.path.realpath(device_link)
    path = _pci_path(real, root)
    if not path:
        return None
    return _pci_device_at(os.path.join(os.path.realpath(_sys(root, "devices")), *path), root)


def scan_pci_gpus(*, root: str = "/") -> list[PciDevice]:
    """NVIDIA display/3D controllers (class 0x03xxxx, vendor 0x10de) in PCI bus order; this finds GPUs
    without a driver or NVML (NVSwitches are bridges, class 0x0680, and audio functions 0x0403: skipped)."""
    base = _sys(root, "bus", "pci", "devices")
    if not os.path.isdir(base):
        return []
    out = []
    for name in sorted(os.listdir(base)):
        if not _BDF.match(name):
            continue
        dev = read_pci_device(name, root=root)
        if dev and dev.vendor == NVIDIA_VENDOR and (dev.pci_class or "").startswith("0x03"):
            out.append(dev)
    return out


def pci_relation(a: tuple[str, ...], a_numa: int | None, b: tuple[str, ...], b_numa: int | None) -> str:
    """Matrix cell between two PCI devices from their sysfs paths (see :class:`PciDevice`).

    Different host bridges: NODE on one NUMA node, else SYS. One host bridge, paths parting right below it
    (different root ports): PHB. Parting below a bridge: PIX when each side then passes at most one more
    bridge (two ports of one PCIe switch, or two functions of one card), else PXB (switches in a chain).
    """
    if not a or not b:
        return "N/A"
    if a == b:
        return "X"
    if a[0] != b[0]:
        return "NODE" if a_numa == b_numa else "SYS"
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    if k == 1:
        return "PHB"
    return "PIX" if len(a[k:-1]) <= 1 and len(b[k:-1]) <= 1 else "PXB"


def read_numa_nodes(*, root: str = "/") -> tuple[NumaNode, ...]:
    base = _sys(root, "devices", "system", "node")
    if not os.path.isdir(base):
        return ()
    out = []
    for name in sorted(os.listdir(base), key=natural_key):
        m = re.fullmatch(r"node(\d+)", name)
        cpulist = _read(os.path.join(base, name, "cpulist")) if m else None
        if m and cpulist is not None:
            out.append(NumaNode(int(m.group(1)), cpulist))
    return tuple(out)


def read_cpus_online(*, root: str = "/") -> int | None:
    text = _read(_sys(root, "devices", "system", "cpu", "online"))
    try:
        return cpulist_count(text) if text else None
    except ValueError:
        return None


def read_infiniband(*, root: str = "/") -> list[NicInfo]:
    """One :class:`NicInfo` per port of each device in ``/sys/class/infiniband`` (kind InfiniBand, or
    RoCE when the port's link layer is Ethernet), with the netdevs of its PCI function."""
    base = _sys(root, "class", "infiniband")
    if not os.path.isdir(base):
        return []
    nics = []
    for dev in sorted(os.listdir(base), key=natural_key):
        ddir = os.path.join(base, dev)
        pci = _pci_device_of(os.path.join(ddir, "device"), root)
        netdir = os.path.join(ddir, "device", "net")
        fn_netdevs = sorted(os.listdir(netdir)) if os.path.isdir(netdir) else []
        pdir = os.path.join(ddir, "ports")
        ports = sorted(int(p) for p in os.listdir(pdir) if p.isdigit()) if os.path.isdir(pdir) else []
        for port in ports:
            pp = os.path.join(pdir, str(port))
            layer = _read(os.path.join(pp, "link_layer")) or "InfiniBand"
            kind = {"InfiniBand": "InfiniBand", "Ethernet": "RoCE"}.get(layer, layer)
            # RoCE: the port's GID table names its netdev; otherwise (IPoIB) the PCI function's netdevs
            ndev = _read(os.path.join(pp, "gid_attrs", "ndevs", "0"))
            netdevs = (ndev,) if ndev else tuple(fn_netdevs) if len(ports) == 1 else ()
            rate = _read(os.path.join(pp, "rate"))
            nics.append(NicInfo(
                name=dev, port=port, kind=kind, state=parse_ib_state(_read(os.path.join(pp, "state"))) or "unknown",
                physical_state=parse_ib_state(_read(os.path.join(pp, "phys_state"))),
                rate=rate, rate_gbps=parse_ib_rate(rate), netdevs=netdevs,
                pci_bus_id=pci.bus_id if pci else None, numa_node=pci.numa_node if pci else None,
                cpu_affinity=pci.cpu_affinity if pci else None, pci_path=pci.path if pci else ()))
    return nics


def read_ethernet(*, root: str = "/", skip_pci: Iterable[str] = (), skip_names: Iterable[str] = ()
                  ) -> list[NicInfo]:
    """Physical Ethernet interfaces of ``/sys/class/net`` (type 1 with a ``device`` link): virtual ones
    (lo, bridges, veth, bonds) have no device; those of an RDMA function (``skip_pci``) are its netdevs."""
    base = _sys(root, "class", "net")
    if not os.path.isdir(base):
        return []
    skip_pci, skip_names = set(skip_pci), set(skip_names)
    nics = []
    for name in sorted(os.listdir(base), key=natural_key):
        d = os.path.join(base, name)
        if name in skip_names or _read(os.path.join(d, "type")) != str(_ARPHRD_ETHER):
            continue
        pci = _pci_device_of(os.path.join(d, "device"), root)
        if pci is None or pci.bus_id in skip_pci:
            continue
        speed = _read(os.path.join(d, "speed"))
        gbps = parse_net_speed(speed)
        nics.append(NicInfo(name=name, kind="Ethernet", state=_read(os.path.join(d, "operstate")) or "unknown",
                            rate=f"{speed} Mb/s" if gbps is not None else None, rate_gbps=gbps, netdevs=(name,),
                            pci_bus_id=pci.bus_id, numa_node=pci.numa_node, cpu_affinity=pci.cpu_affinity,
                            pci_path=pci.path))
    return nics


def read_nics(*, root: str = "/") -> list[NicInfo]:
    """RDMA ports (by device name, naturally sorted), then physical Ethernet interfaces without RDMA."""
    rdma = read_infiniband(root=root)
    eth = read_ethernet(root=root, skip_pci=[n.pci_bus_id for n in rdma if n.pci_bus_id],
                        skip_names=[d for n in rdma for d in n.netdevs])
    return rdma + eth


# ------------------------------------------------------------------------------------------------- NVML

def _text(v: Any) -> str:
    return (v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)).rstrip("\x00")


def _bus_or_none(v: str | None) -> str | None:
    try:
        return None if v is None else normalize_bus_id(v)
    except ValueError:
        return None


def nvml_snapshot(nvml: Any) -> dict:
    """Every NVML answer this module uses, as a JSON-able dict (the format of ``nvml.json`` recordings);
    strings as NVML gives them (bus ids like "00000000:1B:00.0"), :func:`build_topology` normalises.

    ``nvml``: the ``pynvml`` module after ``nvmlInit()``, or anything with the same functions
    (:class:`NvmlReplay`). P2P statuses are asked for every ordered pair (they can be asymmetric);
    NVLinks for link 0..NVML_NVLINK_MAX_LINKS-1 (a link that raises is absent, e.g. on PCIe-only GPUs).
    """
    errors = tuple(e for e in (getattr(nvml, "NVMLError", None),) if isinstance(e, type)) or (Exception,)

    def ask(fn: str, *args: Any) -> Any:
        f = getattr(nvml, fn, None)
        if f is None:  # an older pynvml or driver without this function
            return None
        try:
            return f(*args)
        except errors as e:
            log.debug("NVML %s%s: %s", fn, args[1:], e)
            return None

    snap: dict = {"format": 1, "driver_version": None, "devices": [], "p2p": {}, "common_ancestor": {}}
    drv = ask("nvmlSystemGetDriverVersion")
    snap["driver_version"] = None if drv is None else _text(drv)
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    for i, h in enumerate(handles):
        uuid, name = ask("nvmlDeviceGetUUID", h), ask("nvmlDeviceGetName", h)
        dev = {"index": i, "name": "unknown" if name is None else _text(name),
               "uuid": None if uuid is None else _text(uuid),
               "pci_bus_id": _text(nvml.nvmlDeviceGetPciInfo(h).busId), "nvlinks": []}
        for link in range(NVML_NVLINK_MAX_LINKS):
            state = ask("nvmlDeviceGetNvLinkState", h, link)
            if state is None:
                continue
            entry: dict = {"link": link, "active": bool(state), "remote_type": None, "remote_bus_id": None}
            if state:
                entry["remote_type"] = ask("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
                pci = ask("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
                if pci is not None:
                    entry["remote_bus_id"] = _text(pci.busId)
            dev["nvlinks"].append(entry)
        snap["devices"].append(dev)
    for i, hi in enumerate(handles):
        for j, hj in enumerate(handles):
            if i == j:
                continue
            snap["p2p"][f"{i},{j}"] = {k: ask("nvmlDeviceGetP2PStatus", hi, hj, idx) for k, idx in P2P_CAPS.items()}
            if i < j:
                snap["common_ancestor"][f"{i},{j}"] = ask("nvmlDeviceGetTopologyCommonAncestor", hi, hj)
    return snap


class NvmlReplayError(Exception):
    """What :class:`NvmlReplay` raises where the recording has no answer (as NVML raises NotSupported)."""


class NvmlReplay:
    """An NVML-like object answering from an :func:`nvml_snapshot` dict, so recordings replay exactly."""

    NVMLError = NvmlReplayError

    def __init__(self, snapshot: dict):
        self._s = snapshot
        self._links = [{e["link"]: e for e in d["nvlinks"]} for d in snapshot["devices"]]

    def _dev(self, h: int) -> dict:
        return self._s["devices"][h]

    def _link(self, h: int, link: int) -> dict:
        if link not in self._links[h]:
            raise NvmlReplayError(f"GPU {h} link {link}: not supported")
        return self._links[h][link]

    @staticmethod
    def _given(v: Any, what: str) -> Any:
        if v is None:
            raise NvmlReplayError(f"{what}: not recorded")
        return v

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._given(self._s.get("driver_version"), "driver version")

    def nvmlDeviceGetCount(self) -> int:
        return len(self._s["devices"])

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < len(self._s["devices"]):
            raise NvmlReplayError(f"no GPU {i}")
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._dev(h)["name"]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._given(self._dev(h).get("uuid"), "uuid")

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return _PciInfo(self._dev(h)["pci_bus_id"])

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        return int(self._link(h, link)["active"])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return self._given(self._link(h, link).get("remote_type"), "remote device type")

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return _PciInfo(self._given(self._link(h, link).get("remote_bus_id"), "remote PCI info"))

    def nvmlDeviceGetP2PStatus(self, h1: int, h2: int, index: int) -> int:
        if not isinstance(index, int):
            raise TypeError(f"P2P caps index must be an int, got {index!r}")
        name = {v: k for k, v in P2P_CAPS.items()}[index]
        return self._given(self._s["p2p"].get(f"{h1},{h2}", {}).get(name), f"P2P {name} {h1}->{h2}")

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: int, h2: int) -> int:
        key = f"{min(h1, h2)},{max(h1, h2)}"
        return self._given(self._s["common_ancestor"].get(key), f"common ancestor {key}")


@dataclass(frozen=True)
class _PciInfo:
    busId: str  # noqa: N815 (NVML's field name)


def read_nvml() -> tuple[dict | None, str | None]:
    """(snapshot, None) from the live driver through pynvml, or (None, why not)."""
    try:
        import pynvml  # the nvidia-ml-py package; optional
    except ImportError:
        return None, "NVML not consulted: pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded: no driver on this machine
        return None, f"NVML not available: {e}"
    try:
        return nvml_snapshot(pynvml), None
    except Exception as e:
        return None, f"NVML query failed: {type(e).__name__}: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# ------------------------------------------------------------------------------------------ nvidia-smi

@dataclass(frozen=True)
class SmiTopo:
    """``nvidia-smi topo -m`` parsed. ``labels``: the device columns ("GPU0", "NIC0", or an RDMA device name
    in old drivers' output); ``cells[(row, col)]``: the cell, "X" on the diagonal; ``nic_names``: column
    label -> RDMA device; per GPU label: ``cpu_affinity``, ``numa_affinity`` and ``gpu_numa_id`` (None for N/A)."""

    labels: tuple[str, ...]
    cells: dict[tuple[str, str], str]
    nic_names: dict[str, str]
    cpu_affinity: dict[str, str | None]
    numa_affinity: dict[str, int | None]
    gpu_numa_id: dict[str, int | None]

    @property
    def gpu_labels(self) -> list[str]:
        return [lab for lab in self.labels if re.fullmatch(r"GPU\d+", lab)]

    @property
    def nic_labels(self) -> list[str]:
        return [lab for lab in self.labels if not re.fullmatch(r"GPU\d+", lab)]


def _smi_split(line: str) -> list[str]:
    # nvidia-smi separates with tabs; copies pasted from a terminal have runs of spaces instead
    return [t.strip() for t in line.split("\t")] if "\t" in line else re.split(r"\s{2,}", line.strip())


def _na_int(v: str | None) -> int | None:
    return int(v) if v is not None and v.strip().isdigit() else None


def _is_smi_header(toks: list[str]) -> bool:
    # the header has GPU0 followed by another column name; GPU0's own row has GPU0 followed by its "X"
    toks = [t for t in toks if t]
    return "GPU0" in toks and toks.index("GPU0") + 1 < len(toks) and toks[toks.index("GPU0") + 1] != "X"


def parse_nvidia_smi_topo(text: str) -> SmiTopo:
    """Parse ``nvidia-smi topo -m``: the header of device columns (then CPU Affinity, NUMA Affinity and, in
    newer drivers, GPU NUMA ID), one row per GPU and NIC, the legend, and the NIC legend. ANSI escapes
    (the underlined header nvidia-smi writes) are dropped."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    hi = next((k for k, ln in enumerate(lines) if _is_smi_header(_smi_split(ln))), None)
    if hi is None:
        raise ValueError("no `nvidia-smi topo -m` header (a line of GPU0 GPU1 ... columns) in the text; "
                         f"first line: {lines[0] if lines else ''!r}")
    head = [t for t in _smi_split(lines[hi]) if t]
    ncol = next((k for k, t in enumerate(head) if t in _SMI_EXTRA_COLUMNS), len(head))
    labels, extras = tuple(head[:ncol]), head[ncol:]
    cells: dict[tuple[str, str], str] = {}
    cpu_aff: dict[str, str | None] = {}
    numa_aff: dict[str, int | None] = {}
    gpu_numa: dict[str, int | None] = {}
    for ln in lines[hi + 1:]:
        if ln.strip().startswith("Legend"):
            break
        toks = _smi_split(ln)
        if not toks or toks[0] not in labels:
            continue
        row, vals = toks[0], toks[1:]
        if len(vals) < len(labels):
            raise ValueError(f"`nvidia-smi topo -m` row {row} has {len(vals)} cells for {len(labels)} columns: {ln!r}")
        for col, v in zip(labels, vals):
            cells[(row, col)] = v or "X"
        rest = dict(zip(extras, [v for v in vals[len(labels):] if v]))
        if "CPU Affinity" in rest:
            cpu_aff[row] = None if rest["CPU Affinity"] == "N/A" else rest["CPU Affinity"]
        if "NUMA Affinity" in rest:
            numa_aff[row] = _na_int(rest["NUMA Affinity"])
        if "GPU NUMA ID" in rest:
            gpu_numa[row] = _na_int(rest["GPU NUMA ID"])
    nic_names = {}
    for ln in lines:
        m = re.fullmatch(r"\s*(NIC\d+):\s*(\S+)\s*", ln)
        if m:
            nic_names[m.group(1)] = m.group(2)
    for lab in labels:  # old drivers name the NIC columns by device
        if not re.fullmatch(r"(GPU|NIC)\d+", lab):
            nic_names.setdefault(lab, lab)
    missing = [lab for lab in labels if (lab, lab) not in cells]
    if missing:
        raise ValueError(f"`nvidia-smi topo -m` text has no row for {missing}")
    return SmiTopo(labels, cells, nic_names, cpu_aff, numa_aff, gpu_numa)


def parse_nvidia_smi_query(text: str) -> list[dict]:
    """Parse ``nvidia-smi --query-gpu=index,pci.bus_id,name,uuid --format=csv,noheader``."""
    out = []
    for ln in text.splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        out.append({"index": int(parts[0]), "pci_bus_id": normalize_bus_id(parts[1]),
                    "name": ", ".join(parts[2:-1]), "uuid": parts[-1]})
    return sorted(out, key=lambda d: d["index"])


SMI_QUERY_ARGS = ("--query-gpu=index,pci.bus_id,name,uuid", "--format=csv,noheader")


def run_nvidia_smi(*args: str, timeout: float = 30.0) -> tuple[str | None, str | None]:
    """(stdout, None) or (None, why not)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found on PATH"
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi {' '.join(args)}: {e}"
    if r.returncode != 0:
        return None, f"nvidia-smi {' '.join(args)} exited {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}"
    return r.stdout, None


# ------------------------------------------------------------------------------------------- assembly

def build_topology(*, root: str = "/", nvml: dict | None = None, smi_topo: str | None = None,
                   smi_query: str | None = None, hostname: str | None = None,
                   notes: Iterable[str] = ()) -> GpuTopology:
    """Combine the sources into one :class:`GpuTopology`.

    root: the directory holding ``sys/`` (``"/"`` live, a fixture in tests). nvml: an :func:`nvml_snapshot`
    dict. smi_topo / smi_query: ``nvidia-smi topo -m`` / ``--query-gpu`` outputs, used where NVML is absent.
    The GPU list comes from NVML, else nvidia-smi, else the NVIDIA devices on the PCI bus (sysfs).
    Cells between GPUs: NV# where NVLinks join them; otherwise NVML's common ancestor, else nvidia-smi's
    cell, else the PCI paths in sysfs. GPU-NIC cells: nvidia-smi's where it lists the NIC, else sysfs.
    """
    notes = list(notes)
    sources = ["sysfs"] if os.path.isdir(_sys(root)) else []
    smi = parse_nvidia_smi_topo(smi_topo) if smi_topo else None
    query = parse_nvidia_smi_query(smi_query) if smi_query else []
    pci_gpus = scan_pci_gpus(root=root)
    gpus: list[GpuInfo] = []
    if nvml is not None:
        sources.append("nvml")
        for d in nvml["devices"]:
            links = tuple(NvLink(e["link"], e["active"], NVLINK_REMOTE.get(e["remote_type"], "UNKNOWN"),
                                 _bus_or_none(e["remote_bus_id"])) for e in d["nvlinks"])
            gpus.append(GpuInfo(index=d["index"], pci_bus_id=normalize_bus_id(d["pci_bus_id"]), name=d["name"],
                                uuid=d["uuid"], nvlinks=links))
    elif query:
        sources.append("nvidia-smi")
        gpus = [GpuInfo(index=q["index"], pci_bus_id=q["pci_bus_id"], name=q["name"], uuid=q["uuid"]) for q in query]
    elif smi is not None and len(smi.gpu_labels) == len(pci_gpus):
        # nvidia-smi numbers GPUs in PCI bus order, as sysfs lists them
        sources.append("nvidia-smi")
        gpus = [GpuInfo(index=k, pci_bus_id=p.bus_id, name=_pci_name(p)) for k, p in enumerate(pci_gpus)]
    else:
        if smi is not None:
            notes.append(f"nvidia-smi topo -m lists {len(smi.gpu_labels)} GPU(s) but sysfs has {len(pci_gpus)} "
                         "NVIDIA PCI display device(s) and there is no --query-gpu output to match them; "
                         "nvidia-smi's matrix was not used")
            smi = None
        gpus = [GpuInfo(index=k, pci_bus_id=p.bus_id, name=_pci_name(p)) for k, p in enumerate(pci_gpus)]
    if smi is not None and "nvidia-smi" not in sources:
        sources.append("nvidia-smi")

    # sysfs facts per GPU: PCI path, NUMA node, local CPUs (nvidia-smi's affinity columns as a fallback)
    known = {g.pci_bus_id for g in gpus}
    extra = [p.bus_id for p in pci_gpus if p.bus_id not in known]
    if extra and (nvml is not None or query):
        notes.append(f"NVIDIA PCI device(s) {extra} are not among the GPUs the driver reports "
                     "(driver not bound, or hidden from this container)")
    for k, g in enumerate(gpus):
        p = read_pci_device(g.pci_bus_id, root=root)
        lab = f"GPU{g.index}"
        numa = p.numa_node if p else None
        cpus = p.cpu_affinity if p else None
        if smi is not None:
            numa = numa if numa is not None else smi.numa_affinity.get(lab)
            cpus = cpus or smi.cpu_affinity.get(lab)
        gpus[k] = replace(g, numa_node=numa, cpu_affinity=cpus, pci_path=p.path if p else ())

    nics = read_nics(root=root)
    n = len(gpus)
    nv = _nvlink_matrix(gpus)
    peers: list[list[PeerInfo | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            pci, source = None, "sysfs"
            if nvml is not None:
                level = nvml["common_ancestor"].get(f"{min(i, j)},{max(i, j)}")
                if level is not None and level in NVML_LEVEL:
                    pci, source = NVML_LEVEL[level], "nvml"
            smi_cell = smi.cells.get((f"GPU{gpus[i].index}", f"GPU{gpus[j].index}")) if smi is not None else None
            if pci is None and smi_cell in PCI_LEVELS:
                pci, source = smi_cell, "nvidia-smi"
            if pci is None and gpus[i].pci_path and gpus[j].pci_path:
                pci = pci_relation(gpus[i].pci_path, gpus[i].numa_node, gpus[j].pci_path, gpus[j].numa_node)
                source = "sysfs"
            count = nv[i][j]
            if nvml is None and smi_cell and smi_cell.startswith("NV"):
                count, source = int(smi_cell[2:]), "nvidia-smi"
            p2p = nvml["p2p"].get(f"{i},{j}", {}) if nvml is not None else {}
            peers[i][j] = PeerInfo(link=f"NV{count}" if count else (pci or "N/A"), nvlinks=count, pci=pci,
                                   source="nvml" if count and nvml is not None else source,
                                   p2p_read=p2p.get("read"), p2p_write=p2p.get("write"),
                                   p2p_nvlink=p2p.get("nvlink"), p2p_atomics=p2p.get("atomics"))

    smi_nic = {name: lab for lab, name in smi.nic_names.items()} if smi is not None else {}
    gpu_nic = []
    for g in gpus:
        row = []
        for nic in nics:
            cell = smi.cells.get((f"GPU{g.index}", smi_nic[nic.name])) if nic.name in smi_nic else None
            row.append(cell or pci_relation(g.pci_path, g.numa_node, nic.pci_path, nic.numa_node))
        gpu_nic.append(tuple(row))
    nic_nic = tuple(tuple(pci_relation(a.pci_path, a.numa_node, b.pci_path, b.numa_node) if a is not b else "X"
                          for b in nics) for a in nics)
    return GpuTopology(hostname=hostname if hostname is not None else socket.gethostname(), gpus=tuple(gpus),
                       nics=tuple(nics), peers=tuple(tuple(r) for r in peers), gpu_nic=tuple(gpu_nic),
                       nic_nic=nic_nic, numa_nodes=read_numa_nodes(root=root),
                       cpus_online=read_cpus_online(root=root),
                       driver_version=nvml.get("driver_version") if nvml is not None else None,
                       sources=tuple(sources), notes=tuple(notes))


def _pci_name(p: PciDevice) -> str:
    return f"NVIDIA device {p.device or 'unknown'}"


def _nvlink_matrix(gpus: list[GpuInfo]) -> list[list[int]]:
    """Bonded NVLinks between GPU pairs: direct GPU-GPU links, plus for two GPUs on NVSwitches the smaller
    of their switch link counts (every switch reaches every GPU, as on HGX boards). A link whose remote type
    NVML did not give counts as direct when its remote bus id is a local GPU, else as a switch link."""
    idx = {g.pci_bus_id: k for k, g in enumerate(gpus)}
    n = len(gpus)
    direct = [[0] * n for _ in range(n)]
    switch = [0] * n
    for i, g in enumerate(gpus):
        for link in g.nvlinks:
            if not link.active:
                continue
            if link.remote == "GPU" or (link.remote == "UNKNOWN" and link.remote_bus_id in idx):
                j = idx.get(link.remote_bus_id)
                if j is not None and j != i:
                    direct[i][j] += 1
            elif link.remote == "NVSWITCH" or (link.remote == "UNKNOWN" and link.remote_bus_id is not None):
                switch[i] += 1
    return [[0 if i == j else direct[i][j] + min(switch[i], switch[j]) for j in range(n)] for i in range(n)]


# ---------------------------------------------------------------------------------------------- probe

ProbeFn = Callable[[int, int], tuple[bool, str]]


def probe_p2p(topo: GpuTopology, *, copy: bool = True, probe: ProbeFn | None = None,
              cuda_devices: dict[int, int] | None = None) -> GpuTopology:
    """P2P as actually usable: a copy of ``topo`` whose peers carry ``probed``/``probe`` where it could run.

    Default: torch.cuda, on the CUDA devices of this process (mapped to topology GPUs by PCI bus id);
    per ordered pair ``can_device_access_peer`` and, with ``copy``, a 1 MiB peer copy of random bytes checked
    on the host. Without CUDA or with fewer than two mapped devices nothing is probed and a note says why.
    probe(a, b) -> (usable, what was tried) and cuda_devices (topology GPU index -> CUDA ordinal) replace
    the torch parts (tests, other frameworks).
    """
    if probe is None or cuda_devices is None:
        try:
            import torch
        except ImportError:
            return _note(topo, "P2P not probed: torch is not importable")
        if not torch.cuda.is_available():
            return _note(topo, "P2P not probed: CUDA is not available to torch")
        if cuda_devices is None:
            cuda_devices, unmapped = _map_cuda_devices(topo, torch)
            if unmapped:
                topo = _note(topo, f"CUDA device(s) {unmapped} could not be matched to a topology GPU by bus id")
        if probe is None:
            probe = lambda a, b: _torch_probe(torch, a, b, copy)  # noqa: E731
    gpus = list(topo.gpus)
    for gi, dev in cuda_devices.items():
        gpus[gi] = replace(gpus[gi], cuda_device=dev)
    if len(cuda_devices) < 2:
        return replace(topo, gpus=tuple(gpus), notes=topo.notes + (
            f"P2P not probed: {len(cuda_devices)} CUDA device(s) visible, a pair is needed",))
    peers = [list(r) for r in topo.peers]
    for i, a in cuda_devices.items():
        for j, b in cuda_devices.items():
            if i != j:
                ok, how = probe(a, b)
                peers[i][j] = replace(peers[i][j], probed=bool(ok), probe=how)
    sources = topo.sources + (() if "probe" in topo.sources else ("probe",))
    return replace(topo, gpus=tuple(gpus), peers=tuple(tuple(r) for r in peers), sources=sources)


def _note(topo: GpuTopology, note: str) -> GpuTopology:
    return replace(topo, notes=topo.notes + (note,))


def _map_cuda_devices(topo: GpuTopology, torch: Any) -> tuple[dict[int, int], list[int]]:
    """topology GPU index -> CUDA ordinal, by PCI bus id (torch >= 2.x exposes pci_domain/bus/device_id)."""
    out, unmapped = {}, []
    for d in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(d)
        try:
            bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            out[topo.gpus.index(topo.gpu_by_bus_id(bus))] = d
        except (AttributeError, KeyError):
            unmapped.append(d)
    return out, unmapped


def _torch_probe(torch: Any, a: int, b: int, copy: bool) -> tuple[bool, str]:
    if not torch.cuda.can_device_access_peer(a, b):
        return False, "can_device_access_peer"
    if not copy:
        return True, "can_device_access_peer"
    gen = torch.Generator().manual_seed(1000 * a + b)
    host = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)
    src = host.to(f"cuda:{a}")
    dst = torch.empty_like(src, device=f"cuda:{b}")
    dst.copy_(src)  # device-to-device: peer access when the driver allows it
    torch.cuda.synchronize(b)
    return bool(torch.equal(dst.cpu(), host)), "can_device_access_peer+checked copy"


# ------------------------------------------------------------------------------------- entry points

def detect(*, root: str = "/", use_nvml: bool = True, use_nvidia_smi: bool = True, probe: bool = False,
           copy: bool = True) -> GpuTopology:
    """This node's topology. Never raises for a missing GPU, driver, NVML or nvidia-smi: what could not be
    read is listed in ``notes``. nvidia-smi is run only when NVML gave nothing. probe: run
    :func:`probe_p2p` (creates a CUDA context on every visible GPU, so it is off by default)."""
    notes: list[str] = []
    snap = None
    if use_nvml:
        snap, why = read_nvml()
        if why:
            notes.append(why)
    smi_topo = smi_query = None
    if snap is None and use_nvidia_smi and shutil.which("nvidia-smi"):
        smi_query, why = run_nvidia_smi(*SMI_QUERY_ARGS)
        if why:
            notes.append(why)
        if smi_query is not None:
            smi_topo, why = run_nvidia_smi("topo", "-m")
            if why:
                notes.append(why)
    topo = build_topology(root=root, nvml=snap, smi_topo=smi_topo, smi_query=smi_query, notes=notes)
    return probe_p2p(topo, copy=copy) if probe and topo.gpus else topo


def cross_check(topo: GpuTopology, smi_topo: str) -> list[str]:
    """Where ``topo`` and an ``nvidia-smi topo -m`` output disagree, one line each (GPUs by index, NICs by
    RDMA device name; cells, CPU affinity and NUMA affinity). [] when they agree."""
    smi = parse_nvidia_smi_topo(smi_topo)
    out = []
    if len(smi.gpu_labels) != len(topo.gpus):
        out.append(f"GPU count: {len(topo.gpus)} here, {len(smi.gpu_labels)} in nvidia-smi")
    ours: dict[str, str] = {f"GPU{g.index}": f"GPU{g.index}" for g in topo.gpus}
    nic_label = {nic.name: f"NIC{k}" for k, nic in enumerate(topo.nics)}
    for lab, name in smi.nic_names.items():
        if name in nic_label:
            ours[lab] = nic_label[name]
        else:
            out.append(f"{lab} ({name}) of nvidia-smi is not among the NICs found here")
    gpu_pos = {f"GPU{g.index}": k for k, g in enumerate(topo.gpus)}
    nic_pos = {f"NIC{k}": k for k in range(len(topo.nics))}

    def cell(a: str, b: str) -> str:
        if a == b:
            return "X"
        if a in gpu_pos and b in gpu_pos:
            return topo.link(gpu_pos[a], gpu_pos[b])
        if a in gpu_pos:
            return topo.gpu_nic[gpu_pos[a]][nic_pos[b]]
        if b in gpu_pos:
            return topo.gpu_nic[gpu_pos[b]][nic_pos[a]]
        return topo.nic_nic[nic_pos[a]][nic_pos[b]]

    for (r, c), v in sorted(smi.cells.items()):
        if r in ours and c in ours and cell(ours[r], ours[c]) != v:
            out.append(f"{r}-{c}: {cell(ours[r], ours[c])} here, {v} in nvidia-smi")
    for lab, k in gpu_pos.items():
        g = topo.gpus[k]
        if lab in smi.numa_affinity and smi.numa_affinity[lab] != g.numa_node:
            out.append(f"{lab} NUMA affinity: {_opt(g.numa_node)} here, {_opt(smi.numa_affinity[lab])} in nvidia-smi")
        if lab in smi.cpu_affinity and smi.cpu_affinity[lab] != g.cpu_affinity:
            out.append(f"{lab} CPU affinity: {g.cpu_affinity} here, {smi.cpu_affinity[lab]} in nvidia-smi")
    return out


# -------------------------------------------------------------------------------------- recordings

RECORD_FILES = {"nvml": "nvml.json", "smi_topo": "nvidia-smi-topo-m.txt", "smi_query": "nvidia-smi-query-gpu.csv"}
_PCI_FILES = ("vendor", "device", "class", "numa_node", "local_cpulist")


def load_recording(path: str, *, hostname: str | None = None) -> GpuTopology:
    """:func:`build_topology` over a recording: ``path/sys`` plus, where present, ``nvml.json``,
    ``nvidia-smi-topo-m.txt`` and ``nvidia-smi-query-gpu.csv``. hostname defaults to the directory name."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no recording directory {path!r}")
    texts = {k: _read_raw(os.path.join(path, f)) for k, f in RECORD_FILES.items()}
    nvml = json.loads(texts["nvml"]) if texts["nvml"] else None
    return build_topology(root=path, nvml=nvml, smi_topo=texts["smi_topo"], smi_query=texts["smi_query"],
                          hostname=hostname if hostname is not None else os.path.basename(os.path.abspath(path)))


def _read_raw(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def record(dest: str, *, root: str = "/", nvml: bool = True, nvidia_smi: bool = True) -> list[str]:
    """Copy what this module reads into ``dest`` (a fixture for the tests, or a bug report): the sysfs files
    of the GPUs, NICs and every PCI bridge above them (symlinks kept relative), NUMA nodes, the NVML
    snapshot and nvidia-smi outputs. Returns the files written. MAC and IP addresses are not copied."""
    written: list[str] = []
    real_root = os.path.realpath(_sys(root, "devices"))

    def put(rel: str, text: str) -> None:
        p = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        written.append(rel)

    def link(rel: str, target_rel: str) -> None:
        p = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        os.makedirs(os.path.join(dest, target_rel), exist_ok=True)  # links in sysfs point at directories
        if not os.path.lexists(p):
            os.symlink(os.path.relpath(os.path.join(dest, target_rel), os.path.dirname(p)), p)
            written.append(rel)

    def copy(src: str, rel: str) -> None:
        text = _read(src)
        if text is not None:
            put(rel, text)

    def pci_chain(path: tuple[str, ...]) -> str:
        """Record every function on the path; returns the device directory relative to dest."""
        for k in range(1, len(path)):
            rel = os.path.join("sys", "devices", *path[:k + 1])
            for f in _PCI_FILES:
                copy(os.path.join(real_root, *path[:k + 1], f), os.path.join(rel, f))
            link(os.path.join("sys", "bus", "pci", "devices", path[k]), rel)
        return os.path.join("sys", "devices", *path)

    for g in scan_pci_gpus(root=root):
        pci_chain(g.path)
    # class entries are links into the device tree (devices/<pci path>/net/eth0, devices/virtual/net/lo,
    # devices/<pci path>/infiniband/mlx5_0); they are recorded the same way, with their `device` links
    for kind in ("infiniband", "net"):
        base = _sys(root, "class", kind)
        for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            d = os.path.join(base, name)
            rel_real = os.path.relpath(os.path.realpath(d), real_root)
            rel = (os.path.join("sys", "devices", rel_real) if not rel_real.startswith("..")
                   else os.path.join("sys", "class", kind, name))
            if rel != os.path.join("sys", "class", kind, name):
                link(os.path.join("sys", "class", kind, name), rel)
            dev = os.path.join(d, "device")
            if os.path.exists(dev):
                real = os.path.realpath(dev)
                path = _pci_path(real, root)
                if path:
                    pci_chain(path)
                    link(os.path.join(rel, "device"), os.path.join("sys", "devices", os.path.relpath(real, real_root)))
            if kind == "net":
                files = ["type", "operstate", "speed"]
            else:
                ports = os.path.join(d, "ports")
                files = [os.path.join("ports", port, f) for port in
                         (sorted(os.listdir(ports)) if os.path.isdir(ports) else [])
                         for f in ("rate", "state", "phys_state", "link_layer", os.path.join("gid_attrs", "ndevs", "0"))]
            for f in files:
                copy(os.path.join(d, f), os.path.join(rel, f))
    for node in read_numa_nodes(root=root):
        put(os.path.join("sys", "devices", "system", "node", f"node{node.id}", "cpulist"), node.cpulist)
    online = _read(_sys(root, "devices", "system", "cpu", "online"))
    if online:
        put(os.path.join("sys", "devices", "system", "cpu", "online"), online)
    if nvml:
        snap, why = read_nvml()
        if snap is not None:
            put(RECORD_FILES["nvml"], json.dumps(snap, indent=1))
        else:
            log.info("record: %s", why)
    if nvidia_smi and shutil.which("nvidia-smi"):
        for key, args in (("smi_topo", ("topo", "-m")), ("smi_query", SMI_QUERY_ARGS)):
            text, why = run_nvidia_smi(*args)
            if text is not None:
                put(RECORD_FILES[key], text)
            else:
                log.info("record: %s", why)
    return written
