"""Topology: where the ranks of a communicator run, and the GPUs and NICs of a node and how they connect.

The node's topology is told in the terms of ``nvidia-smi topo -m``. Per local GPU: PCI bus id, NUMA node
and local CPUs, NVLinks (per link, and as a bonded count between each pair of GPUs, NVSwitch links
included), P2P capability as NVML reports it and, where a probe ran, as it actually worked. Per NIC
(InfiniBand and RoCE ports, physical Ethernet interfaces): kind, state, link rate, PCI bus id, NUMA node.
Between every two devices: the matrix cell nvidia-smi would print (X, NV#, PIX, PXB, PHB, NODE, SYS).

Each source is optional, so a machine without a GPU or a driver still answers. Modules, one job each:

* :mod:`.placement`: ranks, nodes and CPUs of a communicator (:class:`Topology`, ``comm.topology``);
  ``comm.topology.gpus`` is this node's :class:`GpuTopology`;
* :mod:`.model`: the data model (:class:`GpuTopology` and its parts); :mod:`.render`: its text form;
* :mod:`.formats`: notations every source shares (PCI bus ids, cpulists);
* :mod:`.sysfs`: the PCI path of every device, NUMA nodes, NIC ports and rates; NVIDIA GPUs are found
  there even without a driver;
* :mod:`.nvml`: NVML through ``pynvml`` (the optional ``nvidia-ml-py`` package);
* :mod:`.smi`: ``nvidia-smi topo -m`` and ``--query-gpu``, used when NVML is not importable, and
  :func:`cross_check`;
* :mod:`.detect`: combining the sources (:func:`build_topology`, :func:`detect`); :mod:`.probe`: P2P as
  usable (:func:`probe_p2p`, needs CUDA and two GPUs);
* :mod:`.recording`: :func:`record` writes what detection reads into a directory, :func:`load_recording`
  reads one back; recorded fixtures drive the tests.
"""

from .detect import build_topology, detect
from .formats import cpulist_count, format_cpulist, is_bus_id, natural_key, normalize_bus_id, parse_cpulist
from .model import PCI_LEVELS, GpuInfo, GpuTopology, NicInfo, NumaNode, NvLink, PeerInfo
from .nvml import (NVLINK_REMOTE, NVML_LEVEL, NVML_NVLINK_MAX_LINKS, P2P_CAPS, P2P_STATUS, P2P_STATUS_TEXT,
                   NvmlReplay, NvmlReplayError, nvml_snapshot, read_nvml)
from .placement import Topology, local_facts, node_identity
from .probe import ProbeFn, probe_p2p
from .recording import RECORD_FILES, load_recording, record
from .smi import SMI_QUERY_ARGS, SmiTopo, cross_check, parse_nvidia_smi_query, parse_nvidia_smi_topo, run_nvidia_smi
from .sysfs import (NVIDIA_VENDOR, PciDevice, parse_ib_rate, parse_ib_state, parse_net_speed, pci_relation,
                    read_cpus_online, read_ethernet, read_infiniband, read_nics, read_numa_nodes, read_pci_device,
                    scan_pci_gpus)

__all__ = [
    # ranks and nodes
    "Topology", "local_facts", "node_identity",
    # data model
    "GpuTopology", "GpuInfo", "NicInfo", "NumaNode", "NvLink", "PeerInfo", "PCI_LEVELS",
    # notations
    "cpulist_count", "format_cpulist", "is_bus_id", "natural_key", "normalize_bus_id", "parse_cpulist",
    # sysfs
    "NVIDIA_VENDOR", "PciDevice", "parse_ib_rate", "parse_ib_state", "parse_net_speed", "pci_relation",
    "read_cpus_online", "read_ethernet", "read_infiniband", "read_nics", "read_numa_nodes", "read_pci_device",
    "scan_pci_gpus",
    # NVML
    "NVLINK_REMOTE", "NVML_LEVEL", "NVML_NVLINK_MAX_LINKS", "P2P_CAPS", "P2P_STATUS", "P2P_STATUS_TEXT",
    "NvmlReplay", "NvmlReplayError", "nvml_snapshot", "read_nvml",
    # nvidia-smi
    "SMI_QUERY_ARGS", "SmiTopo", "cross_check", "parse_nvidia_smi_query", "parse_nvidia_smi_topo", "run_nvidia_smi",
    # detection, probe, recordings
    "build_topology", "detect", "ProbeFn", "probe_p2p", "RECORD_FILES", "load_recording", "record",
]
