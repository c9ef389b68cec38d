"""Detection: combine sysfs, NVML and nvidia-smi into one :class:`~collectives.topology.model.GpuTopology`.

:func:`build_topology` works on what the sources gave (live, recorded, or built by a test);
:func:`detect` asks this machine. Neither raises for a missing GPU, driver, NVML or nvidia-smi: what
could not be read is listed in the topology's ``notes``.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterable
from dataclasses import replace

from .formats import normalize_bus_id
from .model import PCI_LEVELS, GpuInfo, GpuTopology, NvLink, PeerInfo
from .nvml import NVLINK_REMOTE, NVML_LEVEL, read_nvml
from .probe import probe_p2p
from .smi import SMI_QUERY_ARGS, parse_nvidia_smi_query, parse_nvidia_smi_topo, run_nvidia_smi
from .sysfs import (PciDevice, pci_relation, read_cpus_online, read_numa_nodes, read_nics, read_pci_device,
                    scan_pci_gpus, sysfs_path)


def build_topology(*, root: str = "/", nvml: dict | None = None, smi_topo: str | None = None,
                   smi_query: str | None = None, hostname: str | None = None,
                   notes: Iterable[str] = ()) -> GpuTopology:
    """Combine the sources into one :class:`GpuTopology`.

    The GPU list comes from NVML, else nvidia-smi, else the NVIDIA devices on the PCI bus (sysfs).
    Cells between GPUs: NV# where NVLinks join them; otherwise NVML's common ancestor, else nvidia-smi's
    cell, else the PCI paths in sysfs. GPU-NIC cells: nvidia-smi's where it lists the NIC, else sysfs.

    Args:
        root: the directory holding ``sys/`` ("/" live, a recording or fixture in tests).
        nvml: an :func:`~collectives.topology.nvml.nvml_snapshot` dict, None without NVML.
        smi_topo: ``nvidia-smi topo -m`` output, used where NVML is absent.
        smi_query: ``nvidia-smi --query-gpu`` output (``SMI_QUERY_ARGS``), used where NVML is absent.
        hostname: the topology's host name; this machine's by default.
        notes: lines to start ``notes`` with (what the caller could not read).

    Returns:
        The topology; what disagreed or was left unused is added to its notes.
    """
    notes = list(notes)
    sources = ["sysfs"] if os.path.isdir(sysfs_path(root)) else []
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


def _bus_or_none(v: str | None) -> str | None:
    try:
        return None if v is None else normalize_bus_id(v)
    except ValueError:
        return None


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


def detect(*, root: str = "/", use_nvml: bool = True, use_nvidia_smi: bool = True, probe: bool = False,
           copy: bool = True) -> GpuTopology:
    """This node's topology. nvidia-smi is run only when NVML gave nothing.

    Args:
        root: the directory holding ``sys/``.
        use_nvml: ask NVML (pynvml) when installed.
        use_nvidia_smi: run nvidia-smi when NVML gave nothing.
        probe: run :func:`~collectives.topology.probe.probe_p2p` (creates a CUDA context on every visible
            GPU, so it is off by default).
        copy: with ``probe``, also do a checked peer copy per pair.

    Returns:
        The topology; never raises for a missing GPU, driver, NVML or nvidia-smi (see its ``notes``).
    """
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
