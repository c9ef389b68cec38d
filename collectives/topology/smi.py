"""nvidia-smi: run it, parse ``nvidia-smi topo -m`` and ``--query-gpu``, and compare a topology with its matrix.

Used where NVML is not importable, and by :func:`cross_check` (``moecomm topo --cross-check``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .formats import normalize_bus_id, or_na

if TYPE_CHECKING:
    from .model import GpuTopology

SMI_QUERY_ARGS = ("--query-gpu=index,pci.bus_id,name,uuid", "--format=csv,noheader")
_SMI_EXTRA_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


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
        """The GPU columns, "GPU0", "GPU1", ..."""
        return [lab for lab in self.labels if re.fullmatch(r"GPU\d+", lab)]

    @property
    def nic_labels(self) -> list[str]:
        """The NIC columns."""
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
    (the underlined header nvidia-smi writes) are dropped; tabs turned into spaces are accepted.

    Args:
        text: the command's output.

    Returns:
        The parsed matrix.

    Raises:
        ValueError: no header, a row with too few cells, or a column without a row.
    """
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
    """Parse ``nvidia-smi --query-gpu=index,pci.bus_id,name,uuid --format=csv,noheader`` (``SMI_QUERY_ARGS``).

    Args:
        text: the command's output; lines that are not GPU rows are skipped.

    Returns:
        One ``{"index": int, "pci_bus_id": str (normalised), "name": str, "uuid": str}`` per GPU, by index.
    """
    out = []
    for ln in text.splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        out.append({"index": int(parts[0]), "pci_bus_id": normalize_bus_id(parts[1]),
                    "name": ", ".join(parts[2:-1]), "uuid": parts[-1]})
    return sorted(out, key=lambda d: d["index"])


def run_nvidia_smi(*args: str, timeout: float = 30.0) -> tuple[str | None, str | None]:
    """Run nvidia-smi from PATH.

    Args:
        args: its arguments, e.g. ``"topo", "-m"`` or ``*SMI_QUERY_ARGS``.
        timeout: seconds before it is given up on.

    Returns:
        (stdout, None), or (None, why not): not on PATH, failed to start, timed out, or a non-zero exit.
    """
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


def cross_check(topo: GpuTopology, smi_topo: str) -> list[str]:
    """Where a topology and an ``nvidia-smi topo -m`` output disagree: cells, CPU and NUMA affinity.

    Args:
        topo: the topology to check.
        smi_topo: nvidia-smi's output; its GPUs are matched by index, its NICs by RDMA device name.

    Returns:
        One line per difference; [] when they agree.

    Raises:
        ValueError: ``smi_topo`` cannot be parsed (see :func:`parse_nvidia_smi_topo`).
    """
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
            out.append(f"{lab} NUMA affinity: {or_na(g.numa_node)} here, {or_na(smi.numa_affinity[lab])} in nvidia-smi")
        if lab in smi.cpu_affinity and smi.cpu_affinity[lab] != g.cpu_affinity:
            out.append(f"{lab} CPU affinity: {g.cpu_affinity} here, {smi.cpu_affinity[lab]} in nvidia-smi")
    return out
