"""Text rendering of a :class:`~collectives.topology.model.GpuTopology`, as ``moecomm topo`` prints it.

The matrix is laid out as ``nvidia-smi topo -m`` lays it out (tab stops of 8 expanded), so the two can be
compared line by line; the GPU, NIC and P2P tables are moecomm's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .formats import or_na
from .nvml import P2P_STATUS

if TYPE_CHECKING:
    from .model import GpuTopology, PeerInfo

LEGEND = ["Legend:", "",
          "  X    = Self",
          "  NV#  = # bonded NVLinks (direct, or through NVSwitch)",
          "  PIX  = at most one PCIe bridge between them (one PCIe switch)",
          "  PXB  = several PCIe bridges, no PCIe host bridge",
          "  PHB  = through a PCIe host bridge (the CPU's root complex)",
          "  NODE = between PCIe host bridges within one NUMA node",
          "  SYS  = across NUMA nodes (the SMP interconnect, e.g. UPI or Infinity Fabric)",
          "  N/A  = unknown (no PCI path in sysfs)"]


def render_matrix(topo: GpuTopology) -> str:
    """The connection matrix laid out as ``nvidia-smi topo -m`` prints it.

    Args:
        topo: the topology.

    Returns:
        GPU rows then NIC rows (tab stops of 8 expanded), with CPU and NUMA affinity per GPU, then a
        legend and a NIC legend; several lines.
    """
    labels = [f"GPU{i}" for i in range(len(topo.gpus))] + [f"NIC{n}" for n in range(len(topo.nics))]
    rows = ["\t" + "\t".join(labels + (["CPU Affinity", "NUMA Affinity"] if topo.gpus else []))]
    for i, g in enumerate(topo.gpus):
        cells = [_smi_cell(topo.link(i, j)) for j in range(len(topo.gpus))] + list(topo.gpu_nic[i])
        rows.append("\t".join([f"GPU{i}"] + cells + [g.cpu_affinity or "N/A", or_na(g.numa_node)]))
    for n in range(len(topo.nics)):
        cells = [topo.gpu_nic[i][n] for i in range(len(topo.gpus))] + [_smi_cell(c) for c in topo.nic_nic[n]]
        rows.append("\t".join([f"NIC{n}"] + cells))
    out = [r.expandtabs(8).rstrip() for r in rows] + [""] + LEGEND
    if topo.nics:
        out += ["", "NIC Legend:", ""] + [f"  NIC{n}: {nic.label}" for n, nic in enumerate(topo.nics)]
    return "\n".join(out)


def render_gpus(topo: GpuTopology) -> str:
    """One row per GPU: index, PCI bus id, name, NUMA node, CPU affinity, NVLinks up (and to NVSwitch).

    Args:
        topo: the topology.

    Returns:
        A table, or one line saying no GPU was found and where it was looked for.
    """
    if not topo.gpus:
        looked = [s for s in topo.sources if s != "probe"]
        return f"No NVIDIA GPU found (looked in: {', '.join(looked) or 'nothing readable'})."
    rows = [("GPU", "PCI bus id", "Name", "NUMA", "CPU affinity", "NVLinks")]
    for g in topo.gpus:
        to_switch = sum(1 for link in g.nvlinks if link.active and link.remote == "NVSWITCH")
        nv = "none" if not g.nvlinks else f"{g.active_nvlinks}/{len(g.nvlinks)} up"
        if to_switch:
            nv += f", {to_switch} to NVSwitch"
        rows.append((f"GPU{g.index}", g.pci_bus_id, g.name, or_na(g.numa_node), g.cpu_affinity or "N/A", nv))
    return _table(rows)


def render_p2p(topo: GpuTopology) -> str:
    """P2P read+write per GPU pair: OK / NS / CNS / GNS / TNS / DIS / U as NVML reports it, "?" when not
    reported; a trailing * marks a probed answer (OK* worked, NS* failed when tried).

    Args:
        topo: the topology.

    Returns:
        A heading and a matrix; "" for fewer than two GPUs.
    """
    if len(topo.gpus) < 2:
        return ""
    labels = [f"GPU{i}" for i in range(len(topo.gpus))]
    rows = ["\t" + "\t".join(labels)]
    for i in range(len(topo.gpus)):
        rows.append("\t".join([labels[i]] + [" X " if i == j else _p2p_cell(topo.peers[i][j])
                                             for j in range(len(topo.gpus))]))
    probed = any(p is not None and p.probed is not None for row in topo.peers for p in row)
    how = sorted({p.probe for row in topo.peers for p in row if p is not None and p.probe})
    head = "P2P read/write (as NVML reports it" + (f"; * = probed: {', '.join(how)})" if probed else
                                                    "; not probed)")
    return "\n".join([head] + [r.expandtabs(8).rstrip() for r in rows])


def render_nics(topo: GpuTopology) -> str:
    """One row per NIC: device, port, kind, state, rate, PCI bus id, NUMA node, netdevs.

    Args:
        topo: the topology.

    Returns:
        A table, or one line saying there is no NIC with a PCI device.
    """
    if not topo.nics:
        return "No network interface with a PCI device found."
    rows = [("NIC", "Device", "Port", "Kind", "State", "Rate", "PCI bus id", "NUMA", "Netdev")]
    for n, nic in enumerate(topo.nics):
        rate = nic.rate if nic.kind != "Ethernet" else (
            f"{nic.rate_gbps:g} Gb/s" if nic.rate_gbps is not None else "unknown")
        rows.append((f"NIC{n}", nic.name, or_na(nic.port, "-"), nic.kind, nic.state, rate or "unknown",
                     nic.pci_bus_id or "N/A", or_na(nic.numa_node), ",".join(nic.netdevs) or "-"))
    return _table(rows)


def render_cpus(topo: GpuTopology) -> str:
    """CPUs online and the NUMA nodes with their cpulists.

    Args:
        topo: the topology.

    Returns:
        One line, e.g. ``CPUs online: 224; NUMA nodes: node0: 0-55,112-167 (112); ...``.
    """
    nodes = "; ".join(f"node{n.id}: {n.cpulist} ({n.cpus})" for n in topo.numa_nodes) or "unknown"
    return f"CPUs online: {or_na(topo.cpus_online, 'unknown')}; NUMA nodes: {nodes}"


def render(topo: GpuTopology) -> str:
    """Everything, as ``moecomm topo`` prints it: host and sources, CPUs, GPUs, matrix, P2P, NICs, notes.

    Args:
        topo: the topology.

    Returns:
        Several lines, separated by blank lines between the parts.
    """
    head = f"Host {topo.hostname}"
    if topo.driver_version:
        head += f", NVIDIA driver {topo.driver_version}"
    head += f"; sources: {', '.join(topo.sources) or 'none'}"
    parts = [head, "", render_cpus(topo), "", render_gpus(topo), ""]
    if topo.gpus or topo.nics:
        parts += [render_matrix(topo), ""]
    p2p = render_p2p(topo)
    if p2p:
        parts += [p2p, ""]
    parts += [render_nics(topo)]
    if topo.notes:
        parts += ["", "Notes:"] + [f"  - {n}" for n in topo.notes]
    return "\n".join(parts)


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


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)
