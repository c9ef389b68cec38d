"""Recording and replay of what topology detection reads, as fixtures for tests and for bug reports.

A recording is a directory: the sysfs files that are read, under ``sys/`` with the kernel's symlinks kept
(relative), plus ``nvml.json`` (an NVML snapshot) and the nvidia-smi outputs where they were available.
:func:`record` writes one from a live machine (``moecomm topo --record``); :func:`load_recording` builds
the topology from one (``moecomm topo --from``), exactly as :func:`~collectives.topology.detect.detect`
would have on that machine.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from .detect import build_topology
from .model import GpuTopology
from .nvml import read_nvml
from .smi import SMI_QUERY_ARGS, run_nvidia_smi
from .sysfs import PCI_FILES, pci_path, read_numa_nodes, read_sysfs_file, scan_pci_gpus, sysfs_path

log = logging.getLogger(__name__)

RECORD_FILES = {"nvml": "nvml.json", "smi_topo": "nvidia-smi-topo-m.txt", "smi_query": "nvidia-smi-query-gpu.csv"}


def load_recording(path: str, *, hostname: str | None = None) -> GpuTopology:
    """:func:`build_topology` over a recording.

    Args:
        path: the recording: ``path/sys`` plus, where present, ``nvml.json``, ``nvidia-smi-topo-m.txt`` and
            ``nvidia-smi-query-gpu.csv``.
        hostname: the topology's host name; the directory's name by default.

    Returns:
        The topology as it was on the recorded machine.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or holds none of those.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no recording directory {path!r}")
    texts = {k: _read_whole(os.path.join(path, f)) for k, f in RECORD_FILES.items()}
    if not os.path.isdir(sysfs_path(path)) and not any(texts.values()):
        raise FileNotFoundError(f"{path!r} holds no recording: none of sys/, {', '.join(RECORD_FILES.values())} "
                                "(`moecomm topo --record DIR` writes one)")
    nvml = json.loads(texts["nvml"]) if texts["nvml"] else None
    return build_topology(root=path, nvml=nvml, smi_topo=texts["smi_topo"], smi_query=texts["smi_query"],
                          hostname=hostname if hostname is not None else os.path.basename(os.path.abspath(path)))


def _read_whole(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def record(dest: str, *, root: str = "/", nvml: bool = True, nvidia_smi: bool = True) -> list[str]:
    """Copy what detection reads into a recording directory (a fixture for the tests, or a bug report).

    Records the sysfs files of the GPUs, NICs and every PCI bridge above them (symlinks kept relative),
    NUMA nodes and online CPUs, the NVML snapshot and the nvidia-smi outputs. MAC and IP addresses are not
    copied.

    Args:
        dest: the directory to write (created where missing).
        root: the directory holding the ``sys/`` to record ("/" live).
        nvml: record the NVML snapshot when NVML answers.
        nvidia_smi: record nvidia-smi's outputs when it is on PATH.

    Returns:
        The files and links written, relative to ``dest``.

    Raises:
        OSError: ``dest`` cannot be written.
    """
    written: list[str] = []
    real_root = os.path.realpath(sysfs_path(root, "devices"))

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
        text = read_sysfs_file(src)
        if text is not None:
            put(rel, text)

    def pci_chain(path: tuple[str, ...]) -> str:
        """Record every function on the path; returns the device directory relative to dest."""
        for k in range(1, len(path)):
            rel = os.path.join("sys", "devices", *path[:k + 1])
            for f in PCI_FILES:
                copy(os.path.join(real_root, *path[:k + 1], f), os.path.join(rel, f))
            link(os.path.join("sys", "bus", "pci", "devices", path[k]), rel)
        return os.path.join("sys", "devices", *path)

    os.makedirs(dest, exist_ok=True)  # fail here, before anything is read, when dest cannot be written
    for g in scan_pci_gpus(root=root):
        pci_chain(g.path)
    # class entries are links into the device tree (devices/<pci path>/net/eth0, devices/virtual/net/lo,
    # devices/<pci path>/infiniband/mlx5_0); they are recorded the same way, with their `device` links
    for kind in ("infiniband", "net"):
        base = sysfs_path(root, "class", kind)
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
                path = pci_path(real, root)
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
    online = read_sysfs_file(sysfs_path(root, "devices", "system", "cpu", "online"))
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

