"""sysfs parsing: PCI devices and the bridges between them, NVIDIA GPUs on the PCI bus, NICs, NUMA nodes.

Every reader takes ``root``, the directory that holds ``sys/`` ("/" on a live machine, a recording or a
test fixture otherwise), and returns what it could read: a file that is missing or unreadable is None,
never an exception. NVIDIA GPUs are found here even without a driver.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .formats import cpulist_count, is_bus_id, natural_key, normalize_bus_id
from .model import NicInfo, NumaNode

NVIDIA_VENDOR = "0x10de"
# The files of a PCI function that are read (and recorded, see recording.record)
PCI_FILES = ("vendor", "device", "class", "numa_node", "local_cpulist")
_IB_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")
_ARPHRD_ETHER = 1  # the `type` of an Ethernet interface in /sys/class/net


def sysfs_path(root: str, *parts: str) -> str:
    """``<root>/sys/<parts...>``.

    Args:
        root: the directory holding ``sys/``.
        parts: path components below ``sys/``.

    Returns:
        The joined path.
    """
    return os.path.join(root, "sys", *parts)


def read_sysfs_file(path: str) -> str | None:
    """A sysfs file's contents without surrounding whitespace.

    Args:
        path: the file.

    Returns:
        The text, or None when it is missing or unreadable (EINVAL: ``speed`` of a link that is down).
    """
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def parse_ib_rate(text: str | None) -> float | None:
    """Gb/s from an RDMA port's ``rate`` file: ``"400 Gb/sec (4X NDR)"`` -> 400.0.

    Args:
        text: the file's contents, None when unreadable.

    Returns:
        The rate, or None when it is not given in Gb/sec.
    """
    if not text:
        return None
    m = _IB_RATE.match(text)
    return float(m.group(1)) if m else None


def parse_ib_state(text: str | None) -> str | None:
    """The state word of an RDMA port's ``state``/``phys_state`` file: ``"4: ACTIVE"`` -> ``"ACTIVE"``.

    Args:
        text: the file's contents, None when unreadable.

    Returns:
        The word after the code (the whole text when there is no code), None for None.
    """
    if text is None:
        return None
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


def parse_net_speed(text: str | None) -> float | None:
    """Gb/s from ``/sys/class/net/<if>/speed`` (which is in Mb/s).

    Args:
        text: the file's contents, None when unreadable.

    Returns:
        The speed, or None for "-1" or (unsigned) 4294967295, the kernel's "unknown".
    """
    if text is None:
        return None
    try:
        mbps = int(text.strip())
    except ValueError:
        return None
    return None if mbps <= 0 or mbps >= 0xFFFFFFFF else mbps / 1000.0


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


def pci_path(real: str, root: str) -> tuple[str, ...]:
    """The PCI chain of a device directory: ("pci0000:15", "0000:15:01.0", ..., "0000:18:00.0").

    Args:
        real: a resolved path under ``<root>/sys/devices``.
        root: the directory holding ``sys/``.

    Returns:
        The host bridge then every PCI function down to the last one on the path (the walk stops at the
        first non-PCI component, a virtio device or a netdev); () when not under a PCI host bridge.
    """
    rel = os.path.relpath(real, os.path.realpath(sysfs_path(root, "devices")))
    parts = rel.split(os.sep)
    if rel.startswith("..") or not parts[0].startswith("pci"):
        return ()
    chain = [parts[0]]
    for p in parts[1:]:
        if not is_bus_id(p):
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
    """One PCI function from ``<root>/sys/bus/pci/devices``.

    Args:
        bus_id: its PCI address, in any spelling :func:`normalize_bus_id` accepts.
        root: the directory holding ``sys/``.

    Returns:
        The device, or None when sysfs does not list it.
    """
    link = sysfs_path(root, "bus", "pci", "devices", normalize_bus_id(bus_id))
    if not os.path.isdir(link):
        return None
    return _pci_device_at(os.path.realpath(link), root)


def _pci_device_at(real: str, root: str) -> PciDevice | None:
    """The last PCI function on the resolved path ``real`` (walking up from a virtio device or a netdev)."""
    path = pci_path(real, root)
    if not path:
        return None
    d = os.path.join(os.path.realpath(sysfs_path(root, "devices")), *path)
    vendor, device, pci_class, numa, cpus = (read_sysfs_file(os.path.join(d, f)) for f in PCI_FILES)
    return PciDevice(bus_id=path[-1], path=path, vendor=vendor, device=device, pci_class=pci_class,
                     numa_node=_numa(numa), cpu_affinity=cpus)


def _pci_device_of(device_link: str, root: str) -> PciDevice | None:
    """The PCI function behind a ``device`` symlink (of a netdev or an RDMA device); None for virtual
    devices (no such link)."""
    if not os.path.exists(device_link):
        return None
    return _pci_device_at(os.path.realpath(device_link), root)


def scan_pci_gpus(*, root: str = "/") -> list[PciDevice]:
    """NVIDIA display/3D controllers (class 0x03xxxx, vendor 0x10de) on the PCI bus.

    NVSwitches (bridges, class 0x0680) and the GPUs' audio functions (0x0403) are not GPUs.

    Args:
        root: the directory holding ``sys/``.

    Returns:
        The GPUs in PCI bus order (nvidia-smi's order); [] without sysfs.
    """
    base = sysfs_path(root, "bus", "pci", "devices")
    if not os.path.isdir(base):
        return []
    out = []
    for name in sorted(os.listdir(base)):
        if not is_bus_id(name):
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

    Args:
        a, b: the two devices' PCI paths (() when unknown).
        a_numa, b_numa: their NUMA nodes (None when unknown: then nothing says they are on two sockets).

    Returns:
        "X", "PIX", "PXB", "PHB", "NODE", "SYS", or "N/A" when a path is unknown.
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
    """The NUMA nodes of ``<root>/sys/devices/system/node``.

    Args:
        root: the directory holding ``sys/``.

    Returns:
        One :class:`NumaNode` per node with a readable cpulist, by node number; () without sysfs.
    """
    base = sysfs_path(root, "devices", "system", "node")
    if not os.path.isdir(base):
        return ()
    out = []
    for name in sorted(os.listdir(base), key=natural_key):
        m = re.fullmatch(r"node(\d+)", name)
        cpulist = read_sysfs_file(os.path.join(base, name, "cpulist")) if m else None
        if m and cpulist is not None:
            out.append(NumaNode(int(m.group(1)), cpulist))
    return tuple(out)


def read_cpus_online(*, root: str = "/") -> int | None:
    """How many CPUs ``<root>/sys/devices/system/cpu/online`` lists.

    Args:
        root: the directory holding ``sys/``.

    Returns:
        The count, or None when the file is missing or unreadable.
    """
    text = read_sysfs_file(sysfs_path(root, "devices", "system", "cpu", "online"))
    try:
        return cpulist_count(text) if text else None
    except ValueError:
        return None


def read_infiniband(*, root: str = "/") -> list[NicInfo]:
    """The ports of the RDMA devices in ``/sys/class/infiniband``.

    Args:
        root: the directory holding ``sys/``.

    Returns:
        One :class:`NicInfo` per port (kind InfiniBand, or RoCE when the port's link layer is Ethernet),
        with the netdevs of its PCI function; devices naturally sorted by name.
    """
    base = sysfs_path(root, "class", "infiniband")
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
            layer = read_sysfs_file(os.path.join(pp, "link_layer")) or "InfiniBand"
            kind = {"InfiniBand": "InfiniBand", "Ethernet": "RoCE"}.get(layer, layer)
            # RoCE: the port's GID table names its netdev; otherwise (IPoIB) the PCI function's netdevs
            ndev = read_sysfs_file(os.path.join(pp, "gid_attrs", "ndevs", "0"))
            netdevs = (ndev,) if ndev else tuple(fn_netdevs) if len(ports) == 1 else ()
            rate = read_sysfs_file(os.path.join(pp, "rate"))
            nics.append(NicInfo(
                name=dev, port=port, kind=kind,
                state=parse_ib_state(read_sysfs_file(os.path.join(pp, "state"))) or "unknown",
                physical_state=parse_ib_state(read_sysfs_file(os.path.join(pp, "phys_state"))),
                rate=rate, rate_gbps=parse_ib_rate(rate), netdevs=netdevs,
                pci_bus_id=pci.bus_id if pci else None, numa_node=pci.numa_node if pci else None,
                cpu_affinity=pci.cpu_affinity if pci else None, pci_path=pci.path if pci else ()))
    return nics


def read_ethernet(*, root: str = "/", skip_pci: Iterable[str] = (), skip_names: Iterable[str] = ()
                  ) -> list[NicInfo]:
    """The physical Ethernet interfaces of ``/sys/class/net``: type 1 with a ``device`` link (virtual ones,
    lo, bridges, veth, bonds, have none).

    Args:
        root: the directory holding ``sys/``.
        skip_pci: PCI addresses to leave out (RDMA functions: their interfaces are their netdevs).
        skip_names: interface names to leave out.

    Returns:
        One :class:`NicInfo` per interface, naturally sorted by name.
    """
    base = sysfs_path(root, "class", "net")
    if not os.path.isdir(base):
        return []
    skip_pci, skip_names = set(skip_pci), set(skip_names)
    nics = []
    for name in sorted(os.listdir(base), key=natural_key):
        d = os.path.join(base, name)
        if name in skip_names or read_sysfs_file(os.path.join(d, "type")) != str(_ARPHRD_ETHER):
            continue
        pci = _pci_device_of(os.path.join(d, "device"), root)
        if pci is None or pci.bus_id in skip_pci:
            continue
        speed = read_sysfs_file(os.path.join(d, "speed"))
        gbps = parse_net_speed(speed)
        nics.append(NicInfo(name=name, kind="Ethernet", state=read_sysfs_file(os.path.join(d, "operstate")) or
                            "unknown", rate=f"{speed} Mb/s" if gbps is not None else None, rate_gbps=gbps,
                            netdevs=(name,), pci_bus_id=pci.bus_id, numa_node=pci.numa_node,
                            cpu_affinity=pci.cpu_affinity, pci_path=pci.path))
    return nics


def read_nics(*, root: str = "/") -> list[NicInfo]:
    """Every NIC of the node.

    Args:
        root: the directory holding ``sys/``.

    Returns:
        RDMA ports (by device name, naturally sorted), then physical Ethernet interfaces without RDMA.
    """
    rdma = read_infiniband(root=root)
    eth = read_ethernet(root=root, skip_pci=[n.pci_bus_id for n in rdma if n.pci_bus_id],
                        skip_names=[d for n in rdma for d in n.netdevs])
    return rdma + eth
