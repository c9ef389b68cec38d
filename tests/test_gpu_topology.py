"""GPU topology: parsers on recorded / constructed sysfs, NVML and nvidia-smi fixtures (CPU only), the
`moecomm topo` command on this machine, and, where CUDA is available, detection against torch.cuda.

Fixtures (tests/fixtures/gpu_topology, see make_fixtures.py there): hgx_h100_8gpu and pcie_2gpu are
constructed in the kernel's / NVML's / nvidia-smi's formats; no_gpu_vm is a recording of a CPU-only VM.
"""

from __future__ import annotations

import dataclasses
import filecmp
import json
import os
import shutil
import sys

import pytest
import torch
from click.testing import CliRunner

from benchmarks.cli import main as cli_main
from collectives import topology as gt
from collectives.topology import render as gtr

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "gpu_topology")
HGX = os.path.join(FIX, "hgx_h100_8gpu")
PCIE = os.path.join(FIX, "pcie_2gpu")
VM = os.path.join(FIX, "no_gpu_vm")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
needs_2_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                  reason="needs two CUDA GPUs for a P2P pair")

HGX_GPU_BUS = ["0000:18:00.0", "0000:29:00.0", "0000:3a:00.0", "0000:4b:00.0",
               "0000:9a:00.0", "0000:ab:00.0", "0000:bc:00.0", "0000:cd:00.0"]
HGX_NIC_BUS = ["0000:19:00.0", "0000:2a:00.0", "0000:3b:00.0", "0000:4c:00.0",
               "0000:9b:00.0", "0000:ac:00.0", "0000:bd:00.0", "0000:ce:00.0"]
CPUS0, CPUS1 = "0-55,112-167", "56-111,168-223"


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _strip(t: gt.GpuTopology) -> gt.GpuTopology:
    return dataclasses.replace(t, sources=(), notes=())


# ------------------------------------------------------------------------------------- small parsers

@pytest.mark.parametrize("raw,want", [
    ("00000000:1B:00.0", "0000:1b:00.0"), (b"00000000:18:00.0\x00", "0000:18:00.0"),
    ("0000:ab:00.1", "0000:ab:00.1"), ("0001:02:1f.7", "0001:02:1f.7"), (" 00000000:C1:00.0\n", "0000:c1:00.0")])
def test_normalize_bus_id(raw, want):
    assert gt.normalize_bus_id(raw) == want


@pytest.mark.parametrize("raw", ["18:00.0", "0000:18:00", "0000:18:00.8", "GPU-1234", ""])
def test_normalize_bus_id_rejects(raw):
    with pytest.raises(ValueError, match="not a PCI bus id"):
        gt.normalize_bus_id(raw)


@pytest.mark.parametrize("raw,want", [("400 Gb/sec (4X NDR)", 400.0), ("2.5 Gb/sec (1X SDR)", 2.5),
                                      ("14 Gb/sec (1X FDR)", 14.0), ("200 Gb/sec (2X NDR)", 200.0),
                                      ("", None), (None, None), ("fast", None)])
def test_parse_ib_rate(raw, want):
    assert gt.parse_ib_rate(raw) == want


def test_parse_ib_state_and_net_speed_and_cpulist():
    assert [gt.parse_ib_state(s) for s in ("4: ACTIVE", "1: DOWN", "5: LinkUp", "3: Disabled", "ACTIVE", None)] == \
        ["ACTIVE", "DOWN", "LinkUp", "Disabled", "ACTIVE", None]
    assert [gt.parse_net_speed(s) for s in ("100000", "1000", "25000", "-1", "4294967295", "0", "x", None)] == \
        [100.0, 1.0, 25.0, None, None, None, None, None]
    assert [gt.cpulist_count(s) for s in ("0-55,112-167", "0", "0-1", "0,2,4-7", "3\n")] == [112, 1, 2, 6, 1]
    assert sorted(["mlx5_10", "mlx5_2", "mlx5_1", "eno1"], key=gt.natural_key) == ["eno1", "mlx5_1", "mlx5_2", "mlx5_10"]


def test_pci_relation_rules():
    sw = ("pci0000:15", "0000:15:01.0", "0000:16:00.0")  # root port, then a switch's upstream port
    gpu, nic = sw + ("0000:17:00.0", "0000:18:00.0"), sw + ("0000:17:01.0", "0000:19:00.0")
    chained = sw + ("0000:17:02.0", "0000:20:00.0", "0000:21:00.0", "0000:22:00.0")  # a second switch below
    behind_bridge = sw + ("0000:17:03.0", "0000:23:00.0", "0000:24:00.0")  # a PCIe-to-PCI bridge in between
    other_rp = ("pci0000:15", "0000:15:03.0", "0000:30:00.0")
    other_hb = ("pci0000:26", "0000:26:01.0", "0000:27:00.0")
    fn0, fn1 = ("pci0000:00", "0000:00:02.0", "0000:0c:00.0"), ("pci0000:00", "0000:00:02.0", "0000:0c:00.1")
    rel = gt.pci_relation
    assert rel(gpu, 0, gpu, 0) == "X"
    assert rel(gpu, 0, nic, 0) == rel(nic, 0, gpu, 0) == "PIX"
    assert rel(fn0, 0, fn1, 0) == "PIX"
    assert rel(gpu, 0, chained, 0) == rel(chained, 0, gpu, 0) == "PXB"
    assert rel(gpu, 0, behind_bridge, 0) == rel(behind_bridge, 0, nic, 0) == "PXB"
    assert rel(gpu, 0, other_rp, 0) == "PHB"
    assert rel(gpu, 0, other_hb, 0) == "NODE"
    assert rel(gpu, 0, other_hb, 1) == "SYS"
    assert rel(gpu, None, other_hb, None) == "NODE"  # no NUMA information: nothing says it crosses sockets
    assert rel((), 0, gpu, 0) == "N/A"


# ------------------------------------------------------------------------------------------- sysfs

def test_scan_pci_gpus_on_fixtures():
    gpus = gt.scan_pci_gpus(root=HGX)  # the four NVSwitches (NVIDIA, class 0x0680) are not GPUs
    assert [g.bus_id for g in gpus] == HGX_GPU_BUS
    assert [g.numa_node for g in gpus] == [0] * 4 + [1] * 4
    assert gpus[0].path == ("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0")
    assert (gpus[0].vendor, gpus[0].device, gpus[0].pci_class, gpus[0].cpu_affinity) == \
        ("0x10de", "0x2330", "0x030200", CPUS0)
    pcie = gt.scan_pci_gpus(root=PCIE)  # the BMC's ASPEED VGA is not NVIDIA
    assert [(g.bus_id, g.numa_node, g.device) for g in pcie] == [("0000:01:00.0", None, "0x26b9"),
                                                                 ("0000:02:00.0", None, "0x26b9")]
    assert gt.scan_pci_gpus(root=VM) == []
    assert gt.read_pci_device("0000:77:00.0", root=HGX) is None


def _nic_rows(nics):
    return [(n.label, n.kind, n.state, n.physical_state, n.rate_gbps, n.pci_bus_id, n.numa_node, n.netdevs)
            for n in nics]


def test_read_nics_hgx():
    nics = gt.read_nics(root=HGX)
    want = [(f"mlx5_{k}", "InfiniBand", "ACTIVE", "LinkUp", 400.0, HGX_NIC_BUS[k], k // 4,
             (f"ibp{int(HGX_NIC_BUS[k][5:7], 16)}s0",)) for k in range(8)]
    want += [("mlx5_8", "RoCE", "ACTIVE", "LinkUp", 100.0, "0000:0c:00.0", 0, ("ens12f0np0",)),
             ("mlx5_9", "RoCE", "DOWN", "Disabled", 40.0, "0000:0c:00.1", 0, ("ens12f1np1",)),
             ("eno1", "Ethernet", "up", None, 1.0, "0000:05:00.0", 0, ("eno1",))]
    assert _nic_rows(nics) == want  # ens12f*np* (RoCE netdevs), lo and docker0 (virtual) are not extra NICs
    assert nics[0].rate == "400 Gb/sec (4X NDR)" and nics[10].rate == "1000 Mb/s"
    assert [n.up for n in nics] == [True] * 9 + [False, True]
    assert nics[0].pci_path == ("pci0000:15", "0000:15:01.0", "0000:16:00.0", "0000:17:01.0", "0000:19:00.0")


def test_read_nics_pcie_and_vm():
    assert _nic_rows(gt.read_nics(root=PCIE)) == [
        ("enp5s0", "Ethernet", "up", None, 10.0, "0000:05:00.0", None, ("enp5s0",)),
        ("enp6s0", "Ethernet", "down", None, None, "0000:06:00.0", None, ("enp6s0",))]
    vm = gt.read_nics(root=VM)  # virtio: the netdev's device is virtio2, whose parent is the PCI function
    assert _nic_rows(vm) == [("eth0", "Ethernet", "up", None, None, "0000:00:03.0", None, ("eth0",))]
    assert vm[0].rate is None and vm[0].cpu_affinity == "0-1"


def test_read_numa_and_cpus():
    assert gt.read_numa_nodes(root=HGX) == (gt.NumaNode(0, CPUS0), gt.NumaNode(1, CPUS1))
    assert [n.cpus for n in gt.read_numa_nodes(root=HGX)] == [112, 112]
    assert gt.read_cpus_online(root=HGX) == 224
    assert gt.read_numa_nodes(root=VM) == (gt.NumaNode(0, "0-1"),) and gt.read_cpus_online(root=VM) == 2
    assert gt.read_numa_nodes(root=FIX) == () and gt.read_cpus_online(root=FIX) is None  # no sys/ there


# -------------------------------------------------------------------------------------------- NVML

class FakePynvml:
    """Answers like the pynvml module does, from per-GPU tables: strings as bytes, errors as NVMLError
    subclasses, NVLink calls past the last link raise, and NVML_P2P_CAPS_INDEX_READ is pynvml's (0,)."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801
        pass

    class NVMLError_InvalidArgument(NVMLError):  # noqa: N801
        pass

    NVML_P2P_CAPS_INDEX_READ = (0,)

    def __init__(self, gpus: list[dict], p2p, ancestor, driver="550.54.15", max_links=18):
        self.gpus, self.p2p_fn, self.ancestor_fn, self.driver, self.max_links = gpus, p2p, ancestor, driver, max_links

    def nvmlSystemGetDriverVersion(self):
        return self.driver.encode()

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetName(self, h):
        return self.gpus[h[1]]["name"].encode()

    def nvmlDeviceGetUUID(self, h):
        return self.gpus[h[1]]["uuid"]

    def nvmlDeviceGetPciInfo(self, h):
        return type("pci", (), {"busId": self.gpus[h[1]]["bus"].encode()})()

    def _link(self, h, link):
        links = self.gpus[h[1]]["links"]
        if link >= self.max_links:
            raise self.NVMLError_InvalidArgument()
        if links is None:
            raise self.NVMLError_NotSupported()
        return links.get(link)

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 0 if self._link(h, link) is None else 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return self._link(h, link)[0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return type("pci", (), {"busId": self._link(h, link)[1].encode() + b"\x00"})()

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        if not isinstance(index, int):
            raise TypeError("wrong type")
        return self.p2p_fn(a[1], b[1], index)

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestor_fn(a[1], b[1])


def _fake_hgx() -> FakePynvml:
    switches = ["00000000:1B:00.0"] * 5 + ["00000000:1C:00.0"] * 4 + ["00000000:1D:00.0"] * 4 + ["00000000:1E:00.0"] * 5
    snap = json.loads(_text(os.path.join(HGX, "nvml.json")))
    gpus = [{"name": "NVIDIA H100 80GB HBM3", "uuid": d["uuid"], "bus": "0000" + HGX_GPU_BUS[k].upper(),
             "links": {link: (2, switches[link]) for link in range(18)}} for k, d in enumerate(snap["devices"])]
    return FakePynvml(gpus, p2p=lambda a, b, idx: 0, ancestor=lambda a, b: 40 if a // 4 == b // 4 else 50)


def test_nvml_snapshot_of_pynvml_like_object_matches_recording():
    assert gt.nvml_snapshot(_fake_hgx()) == json.loads(_text(os.path.join(HGX, "nvml.json")))


def test_nvml_snapshot_pcie_without_nvlink():
    cns = {0: 1, 1: 1, 2: 5, 3: 1}
    gpus = [{"name": "NVIDIA L40S", "uuid": u, "bus": f"00000000:0{k + 1}:00.0", "links": None}
            for k, u in enumerate(d["uuid"] for d in json.loads(_text(os.path.join(PCIE, "nvml.json")))["devices"])]
    fake = FakePynvml(gpus, p2p=lambda a, b, idx: cns[idx], ancestor=lambda a, b: 30, driver="535.183.01")
    assert gt.nvml_snapshot(fake) == json.loads(_text(os.path.join(PCIE, "nvml.json")))


@pytest.mark.parametrize("fixture", [HGX, PCIE])
def test_nvml_replay_round_trip(fixture):
    snap = json.loads(_text(os.path.join(fixture, "nvml.json")))
    assert gt.nvml_snapshot(gt.NvmlReplay(snap)) == snap


def test_nvml_snapshot_tolerates_missing_functions():
    """An old pynvml without nvmlDeviceGetNvLinkRemoteDeviceType: links still counted by remote bus id."""
    fake = _fake_hgx()
    fake.nvmlDeviceGetNvLinkRemoteDeviceType = None  # getattr finds None: treated as absent
    snap = gt.nvml_snapshot(fake)
    assert all(e["remote_type"] is None for d in snap["devices"] for e in d["nvlinks"])
    t = gt.build_topology(root=HGX, nvml=snap, hostname="h")
    assert {t.link(i, j) for i in range(8) for j in range(8) if i != j} == {"NV18"}


def test_nvlink_counts_direct_switch_and_degraded():
    snap = json.loads(_text(os.path.join(HGX, "nvml.json")))
    for e in snap["devices"][3]["nvlinks"][:2]:
        e["active"] = False  # two links of GPU3 down: 16 to the switches
    t = gt.build_topology(root=HGX, nvml=snap, hostname="h")
    assert t.nvlink_count(3, 0) == t.nvlink_count(0, 3) == 16 and t.link(3, 7) == "NV16"
    assert t.nvlink_count(0, 1) == 18 and t.gpus[3].active_nvlinks == 16 and len(t.gpus[3].nvlinks) == 18
    assert t.peers[3][0].pci == "NODE" and t.peers[3][7].pci == "SYS"

    pc = json.loads(_text(os.path.join(PCIE, "nvml.json")))  # an NVLink bridge: 4 direct links
    pc["devices"][0]["nvlinks"] = [{"link": k, "active": True, "remote_type": 0, "remote_bus_id": "00000000:02:00.0"}
                                   for k in range(4)]
    pc["devices"][1]["nvlinks"] = [{"link": k, "active": True, "remote_type": 0, "remote_bus_id": "00000000:01:00.0"}
                                   for k in range(4)]
    t = gt.build_topology(root=PCIE, nvml=pc, hostname="h")
    assert (t.link(0, 1), t.nvlink_count(1, 0), t.peers[0][1].pci, t.peers[0][1].source) == ("NV4", 4, "PHB", "nvml")
    assert t.nvlink_connected


# -------------------------------------------------------------------------------------- nvidia-smi

def test_parse_nvidia_smi_topo_hgx():
    smi = gt.parse_nvidia_smi_topo(_text(os.path.join(HGX, "nvidia-smi-topo-m.txt")))
    assert smi.labels == tuple([f"GPU{k}" for k in range(8)] + [f"NIC{k}" for k in range(10)])
    assert smi.gpu_labels == [f"GPU{k}" for k in range(8)] and len(smi.nic_labels) == 10
    assert smi.nic_names == {f"NIC{k}": f"mlx5_{k}" for k in range(10)}
    assert smi.cells[("GPU0", "GPU0")] == "X" and smi.cells[("GPU0", "GPU5")] == "NV18"
    assert smi.cells[("GPU2", "NIC2")] == smi.cells[("NIC2", "GPU2")] == "PIX"
    assert smi.cells[("GPU1", "NIC3")] == "NODE" and smi.cells[("GPU5", "NIC8")] == "SYS"
    assert smi.cells[("NIC8", "NIC9")] == "PIX" and len(smi.cells) == 18 * 18
    assert smi.cpu_affinity == {f"GPU{k}": CPUS0 if k < 4 else CPUS1 for k in range(8)}
    assert smi.numa_affinity == {f"GPU{k}": k // 4 for k in range(8)}
    assert smi.gpu_numa_id == {f"GPU{k}": None for k in range(8)}


def test_parse_nvidia_smi_topo_variants():
    pc = gt.parse_nvidia_smi_topo(_text(os.path.join(PCIE, "nvidia-smi-topo-m.txt")))  # ANSI underline
    assert pc.labels == ("GPU0", "GPU1") and pc.cells[("GPU1", "GPU0")] == "PHB" and pc.nic_names == {}
    assert pc.numa_affinity == {"GPU0": None, "GPU1": None} and pc.cpu_affinity == {"GPU0": "0-31", "GPU1": "0-31"}
    old = gt.parse_nvidia_smi_topo(_text(os.path.join(FIX, "smi_old_driver.txt")))
    assert old.labels == ("GPU0", "GPU1", "mlx5_0") and old.nic_names == {"mlx5_0": "mlx5_0"}
    assert old.cells[("GPU0", "GPU1")] == "NV2" and old.cells[("mlx5_0", "GPU1")] == "PXB"
    assert old.cpu_affinity == {"GPU0": "0-19", "GPU1": "0-19"} and old.numa_affinity == {}
    # a copy pasted from a terminal: tabs became spaces
    text = _text(os.path.join(HGX, "nvidia-smi-topo-m.txt"))
    spaced = gt.parse_nvidia_smi_topo("\n".join(ln.expandtabs(8) for ln in text.splitlines()))
    assert spaced == gt.parse_nvidia_smi_topo(text)


def test_parse_nvidia_smi_errors():
    with pytest.raises(ValueError, match="no `nvidia-smi topo -m` header"):
        gt.parse_nvidia_smi_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    with pytest.raises(ValueError, match="row GPU1 has 1 cells for 2 columns"):
        gt.parse_nvidia_smi_topo("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\nGPU1\tNV4\n")
    with pytest.raises(ValueError, match=r"no row for \['GPU1'\]"):
        gt.parse_nvidia_smi_topo("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV4\t0-7\n")


def test_parse_nvidia_smi_query():
    rows = gt.parse_nvidia_smi_query(_text(os.path.join(HGX, "nvidia-smi-query-gpu.csv")))
    assert [r["index"] for r in rows] == list(range(8)) and [r["pci_bus_id"] for r in rows] == HGX_GPU_BUS
    assert {r["name"] for r in rows} == {"NVIDIA H100 80GB HBM3"} and rows[0]["uuid"].startswith("GPU-")
    assert gt.parse_nvidia_smi_query("1, 00000000:02:00.0, Some, Board, GPU-x\n0, 00000000:01:00.0, A, GPU-y\n") == [
        {"index": 0, "pci_bus_id": "0000:01:00.0", "name": "A", "uuid": "GPU-y"},
        {"index": 1, "pci_bus_id": "0000:02:00.0", "name": "Some, Board", "uuid": "GPU-x"}]


# ------------------------------------------------------------------------------------------ assembly

def test_build_hgx_from_nvml_and_sysfs():
    t = gt.load_recording(HGX)
    assert t.sources == ("sysfs", "nvml", "nvidia-smi") and t.notes == () and t.driver_version == "550.54.15"
    assert [g.pci_bus_id for g in t.gpus] == HGX_GPU_BUS and [g.index for g in t.gpus] == list(range(8))
    assert [(g.numa_node, g.cpu_affinity) for g in t.gpus] == [(0, CPUS0)] * 4 + [(1, CPUS1)] * 4
    assert t.gpus[0].nvlinks[17] == gt.NvLink(17, True, "NVSWITCH", "0000:1e:00.0")
    for i in range(8):
        for j in range(8):
            if i != j:
                p = t.peers[i][j]
                assert (p.link, p.nvlinks, p.source) == ("NV18", 18, "nvml")
                assert p.pci == ("NODE" if i // 4 == j // 4 else "SYS")
                assert (p.p2p_read, p.p2p_write, p.p2p_nvlink, p.p2p_atomics) == (0, 0, 0, 0)
                assert p.p2p_reported is True and p.probed is None and t.p2p_usable(i, j) is True
    assert t.link(2, 2) == "X" and t.nvlink_count(2, 2) == 0 and t.nvlink_connected
    assert t.gpu_nic[0] == ("PIX", "NODE", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS", "NODE", "NODE", "NODE")
    assert t.gpu_nic[6] == ("SYS",) * 4 + ("NODE", "NODE", "PIX", "NODE") + ("SYS",) * 3
    assert t.nic_nic[8] == ("NODE",) * 4 + ("SYS",) * 4 + ("X", "PIX", "PHB")
    assert [n.label for n in t.nics_for_gpu(5)] == ["mlx5_5", "mlx5_4", "mlx5_6", "mlx5_7", "eno1", "mlx5_0",
                                                   "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_8"]  # mlx5_9 is down
    assert t.gpu_by_bus_id("00000000:9A:00.0").index == 4
    with pytest.raises(KeyError, match="no GPU with PCI bus id 0000:01:00.0"):
        t.gpu_by_bus_id("0000:01:00.0")
    with pytest.raises(IndexError, match="GPU index 8 out of range: hgx_h100_8gpu has 8 GPU"):
        t.link(8, 0)


def test_build_pcie_2gpu():
    t = gt.load_recording(PCIE)
    assert [(g.pci_bus_id, g.name, g.numa_node, g.cpu_affinity, g.nvlinks) for g in t.gpus] == [
        ("0000:01:00.0", "NVIDIA L40S", None, "0-31", ()), ("0000:02:00.0", "NVIDIA L40S", None, "0-31", ())]
    p = t.peers[0][1]
    assert (p.link, p.nvlinks, p.pci, p.source, p.p2p_read, p.p2p_nvlink) == ("PHB", 0, "PHB", "nvml", 1, 5)
    assert p.p2p_reported is False and t.p2p_usable(1, 0) is False and not t.nvlink_connected
    assert t.gpu_nic == (("PHB", "PHB"), ("PHB", "PHB"))


def test_build_from_nvidia_smi_only_matches_nvml_path():
    """No NVML: GPUs from --query-gpu, NV# and PCI cells from topo -m; same matrix, P2P unknown."""
    smi = gt.build_topology(root=HGX, smi_topo=_text(os.path.join(HGX, "nvidia-smi-topo-m.txt")),
                            smi_query=_text(os.path.join(HGX, "nvidia-smi-query-gpu.csv")), hostname="hgx_h100_8gpu")
    nvml = gt.load_recording(HGX)
    assert smi.sources == ("sysfs", "nvidia-smi")
    assert gtr.render_matrix(smi) == gtr.render_matrix(nvml)
    assert [g.pci_bus_id for g in smi.gpus] == HGX_GPU_BUS and smi.gpus[0].nvlinks == ()
    assert (smi.peers[0][1].source, smi.peers[0][1].nvlinks, smi.peers[0][1].pci) == ("nvidia-smi", 18, "NODE")
    assert smi.p2p_usable(0, 1) is None and "?" in gtr.render_p2p(smi)
    # without --query-gpu the GPUs are matched to sysfs in bus order, which works when the counts agree
    noq = gt.build_topology(root=HGX, smi_topo=_text(os.path.join(HGX, "nvidia-smi-topo-m.txt")), hostname="x")
    assert gtr.render_matrix(noq) == gtr.render_matrix(nvml) and noq.gpus[0].name == "NVIDIA device 0x2330"
    bad = gt.build_topology(root=PCIE, smi_topo=_text(os.path.join(HGX, "nvidia-smi-topo-m.txt")), hostname="x")
    assert len(bad.gpus) == 2 and "nvidia-smi's matrix was not used" in bad.notes[0]


def test_build_from_nvidia_smi_without_sysfs(tmp_path):
    """A container without /sys/bus/pci: NUMA and CPU affinity come from nvidia-smi's columns."""
    t = gt.build_topology(root=str(tmp_path), smi_topo=_text(os.path.join(HGX, "nvidia-smi-topo-m.txt")),
                          smi_query=_text(os.path.join(HGX, "nvidia-smi-query-gpu.csv")), hostname="x")
    assert t.sources == ("nvidia-smi",) and t.nics == () and t.numa_nodes == () and t.cpus_online is None
    assert [(g.numa_node, g.cpu_affinity, g.pci_path) for g in t.gpus] == [(0, CPUS0, ())] * 4 + [(1, CPUS1, ())] * 4
    assert (t.link(0, 7), t.peers[0][7].pci) == ("NV18", None)


def test_build_from_sysfs_only():
    t = gt.build_topology(root=HGX, hostname="x")  # no driver: GPUs from the PCI bus, no NVLink known
    assert t.sources == ("sysfs",) and [g.pci_bus_id for g in t.gpus] == HGX_GPU_BUS
    assert [t.link(0, j) for j in range(1, 8)] == ["NODE"] * 3 + ["SYS"] * 4
    assert t.peers[0][1].source == "sysfs" and t.p2p_usable(0, 1) is None
    assert t.gpu_nic == gt.load_recording(HGX).gpu_nic  # sysfs alone reproduces nvidia-smi's GPU-NIC cells


def test_nvml_missing_a_pci_gpu_is_noted():
    snap = json.loads(_text(os.path.join(HGX, "nvml.json")))
    del snap["devices"][7]
    snap["p2p"] = {k: v for k, v in snap["p2p"].items() if "7" not in k}
    t = gt.build_topology(root=HGX, nvml=snap, hostname="x")
    assert len(t.gpus) == 7
    assert t.notes == (("NVIDIA PCI device(s) ['0000:cd:00.0'] are not among the GPUs the driver reports "
                        "(driver not bound, or hidden from this container)"),)


def test_cross_check():
    t = gt.load_recording(HGX)
    text = _text(os.path.join(HGX, "nvidia-smi-topo-m.txt"))
    assert gt.cross_check(t, text) == []
    assert gt.cross_check(gt.load_recording(PCIE), _text(os.path.join(PCIE, "nvidia-smi-topo-m.txt"))) == []
    lines = text.splitlines()
    lines[2] = lines[2].replace("NODE", "SYS", 1)  # GPU1-NIC0
    lines[3] = lines[3].replace("0-55,112-167\t0", "0-55,112-167\t1")  # GPU2's NUMA affinity
    assert gt.cross_check(t, "\n".join(lines)) == ["GPU1-NIC0: NODE here, SYS in nvidia-smi",
                                                   "GPU2 NUMA affinity: 0 here, 1 in nvidia-smi"]
    assert gt.cross_check(gt.load_recording(PCIE), text)[0] == "GPU count: 2 here, 8 in nvidia-smi"


# ------------------------------------------------------------------------------------ render, probe

@pytest.mark.parametrize("name", ["hgx_h100_8gpu", "pcie_2gpu", "no_gpu_vm"])
def test_render_matches_expected_text(name):
    got = gtr.render(gt.load_recording(os.path.join(FIX, name))).splitlines()
    want = _text(os.path.join(FIX, "expected", f"{name}.txt")).splitlines()
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"line {k + 1} of expected/{name}.txt"
    assert len(got) == len(want)


def test_render_matrix_rows_line_up_with_nvidia_smi():
    """Our GPU rows are nvidia-smi's rows with tabs expanded, plus the column of eno1 (no RDMA, so not in
    nvidia-smi's list) and without GPU NUMA ID (known only to newer NVML)."""
    ours = gtr.render_matrix(gt.load_recording(HGX)).splitlines()
    smi = _text(os.path.join(HGX, "nvidia-smi-topo-m.txt")).splitlines()
    for k in range(8):
        cells = smi[k + 1].split("\t")  # label, 8 GPUs, 10 NICs, CPU Affinity, NUMA Affinity, "", GPU NUMA ID
        eno1 = "NODE" if k < 4 else "SYS"
        assert ours[k + 1] == "\t".join(cells[:19] + [eno1] + cells[19:21]).expandtabs(8)


def test_probe_marks_probed_pairs():
    t = gt.load_recording(HGX)
    tried = []

    def probe(a, b):
        tried.append((a, b))
        return (a, b) != (12, 15), "fake copy"

    p = gt.probe_p2p(t, probe=probe, cuda_devices={k: 10 + k for k in range(8)})
    assert len(tried) == 56 and "probe" in p.sources
    assert p.peers[2][5].probed is False and p.peers[2][5].p2p_reported is True and p.p2p_usable(2, 5) is False
    assert p.p2p_usable(5, 2) is True and p.peers[0][1].probe == "fake copy"
    assert [g.cuda_device for g in p.gpus] == list(range(10, 18))
    grid = gtr.render_p2p(p).splitlines()
    assert grid[0] == "P2P read/write (as NVML reports it; * = probed: fake copy)"
    assert grid[4].split() == ["GPU2", "OK*", "OK*", "X", "OK*", "OK*", "NS*", "OK*", "OK*"]
    one = gt.probe_p2p(t, probe=probe, cuda_devices={3: 0})
    assert one.notes[-1] == "P2P not probed: 1 CUDA device(s) visible, a pair is needed" and one.gpus[3].cuda_device == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_probe_without_cuda_is_a_note():
    t = gt.probe_p2p(gt.load_recording(HGX))
    assert t.notes[-1] == "P2P not probed: CUDA is not available to torch" and t.peers[0][1].probed is None


def test_to_dict_round_trip():
    for t in (gt.load_recording(HGX), gt.load_recording(PCIE), gt.load_recording(VM),
              gt.probe_p2p(gt.load_recording(HGX), probe=lambda a, b: (a < b, "x"), cuda_devices={0: 0, 1: 1})):
        d = json.loads(t.to_json())
        assert gt.GpuTopology.from_dict(d) == t


# ----------------------------------------------------------------------------------- record, detect

def _tree(root):
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            out[rel] = ("link", os.readlink(p)) if os.path.islink(p) else ("dir",) if os.path.isdir(p) else \
                ("file", _text(p))
    return out


def test_make_fixtures_reproduces_committed_fixtures(tmp_path):
    sys.path.insert(0, FIX)
    try:
        import make_fixtures
    finally:
        sys.path.remove(FIX)
    make_fixtures.main(str(tmp_path))
    for name in ("hgx_h100_8gpu", "pcie_2gpu"):
        assert _tree(tmp_path / name) == _tree(os.path.join(FIX, name)), name
    assert filecmp.cmp(tmp_path / "smi_old_driver.txt", os.path.join(FIX, "smi_old_driver.txt"), shallow=False)


@pytest.mark.parametrize("fixture", [HGX, PCIE, VM])
def test_record_round_trip_on_fixtures(tmp_path, fixture):
    gt.record(str(tmp_path), root=fixture, nvml=False, nvidia_smi=False)
    if os.path.exists(os.path.join(fixture, "nvml.json")):
        shutil.copy(os.path.join(fixture, "nvml.json"), tmp_path)
    a = gt.load_recording(fixture)
    b = gt.load_recording(str(tmp_path), hostname=a.hostname)
    assert _strip(a) == _strip(b)


def test_detect_on_this_machine(tmp_path):
    t = gt.detect(probe=False)
    assert "sysfs" in t.sources or not os.path.isdir("/sys")
    if "nvml" not in t.sources and "nvidia-smi" not in t.sources:
        assert [g.pci_bus_id for g in t.gpus] == [p.bus_id for p in gt.scan_pci_gpus()]
    for nic in t.nics:
        assert os.path.isdir(f"/sys/class/{'net' if nic.kind == 'Ethernet' else 'infiniband'}/{nic.name}")
    assert len(t.gpu_nic) == len(t.gpus) and all(len(r) == len(t.nics) for r in t.gpu_nic)
    gt.record(str(tmp_path), nvml=False, nvidia_smi=False)
    live = gt.detect(use_nvml=False, use_nvidia_smi=False)
    assert _strip(gt.load_recording(str(tmp_path), hostname=live.hostname)) == _strip(live)
    assert "pynvml" not in sys.modules or "nvml" in t.sources or any("NVML" in n for n in t.notes)


# --------------------------------------------------------------------------------------- the command

def test_moecomm_topo_on_this_machine():
    r = CliRunner().invoke(cli_main, ["topo", "--no-probe"])
    assert r.exit_code == 0, r.output
    t = gt.detect()
    assert gtr.render_cpus(t) in r.output
    for nic in t.nics:
        assert nic.name in r.output
    if not t.gpus:
        assert "No NVIDIA GPU found" in r.output
    j = CliRunner().invoke(cli_main, ["topo", "--json", "--no-probe"])
    assert j.exit_code == 0, j.output
    d = json.loads(j.output)
    assert len(d["gpus"]) == len(t.gpus) and [n["name"] for n in d["nics"]] == [n.name for n in t.nics]


def test_moecomm_topo_from_recording_and_cross_check(tmp_path):
    r = CliRunner().invoke(cli_main, ["topo", "--from", HGX, "--cross-check"])
    assert r.exit_code == 0, r.output
    assert r.output == _text(os.path.join(FIX, "expected", "hgx_h100_8gpu.txt")) + \
        "\nCross-check with nvidia-smi topo -m: agrees\n"
    shutil.copytree(PCIE, tmp_path / "p", symlinks=True)
    with open(tmp_path / "p" / "nvidia-smi-topo-m.txt", "w") as f:
        f.write(_text(os.path.join(PCIE, "nvidia-smi-topo-m.txt")).replace("PHB", "PIX"))
    bad = CliRunner().invoke(cli_main, ["topo", "--from", str(tmp_path / "p"), "--cross-check", "--json"])
    assert bad.exit_code == 1
    assert json.loads(bad.output)["cross_check"]["differences"] == ["GPU0-GPU1: PHB here, PIX in nvidia-smi",
                                                                    "GPU1-GPU0: PHB here, PIX in nvidia-smi"]
    none = CliRunner().invoke(cli_main, ["topo", "--from", VM, "--cross-check"])
    assert none.exit_code == 1 and "Cross-check with nvidia-smi topo -m: not done: no " in none.output


def test_moecomm_topo_record(tmp_path):
    r = CliRunner().invoke(cli_main, ["topo", "--record", str(tmp_path / "rec"), "--no-probe", "--json"])
    assert r.exit_code == 0, r.output
    assert os.path.isdir(tmp_path / "rec" / "sys")


def test_moecomm_topo_usage_errors(tmp_path):
    """A --record directory that cannot be written, and a --from directory that is missing or holds no
    recording, are usage errors: exit 2 and one "Error:" line naming the option, no traceback, no output
    of an empty topology."""
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "empty").mkdir()
    cases = [["--record", str(tmp_path / "a_file" / "rec"), "--no-probe"],
             ["--from", str(tmp_path / "empty")],
             ["--from", str(tmp_path / "missing")]]
    failures = []
    for args in cases:
        r = CliRunner().invoke(cli_main, ["topo", *args])
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        if r.exit_code != 2 or len(errors) != 1 or args[0] not in errors[0] or "Host " in r.output:
            failures.append(f"topo {' '.join(args)}: exit {r.exit_code}, exception {r.exception!r}, "
                            f"output {r.output!r}")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------------------------ on a GPU

@needs_cuda
def test_detect_finds_every_cuda_device():
    t = gt.detect(probe=True)
    assert len(t.gpus) >= torch.cuda.device_count()
    mapped = {g.cuda_device for g in t.gpus if g.cuda_device is not None}
    assert mapped == set(range(torch.cuda.device_count())), (t.notes, [g.pci_bus_id for g in t.gpus])
    for g in t.gpus:
        if g.cuda_device is not None:
            assert torch.cuda.get_device_properties(g.cuda_device).name in g.name or "nvml" not in t.sources


@needs_2_gpus
def test_probe_on_real_gpus():
    t = gt.detect(probe=True)
    pairs = [(i, j) for i, g in enumerate(t.gpus) for j, h in enumerate(t.gpus)
             if i != j and g.cuda_device is not None and h.cuda_device is not None]
    assert pairs and all(t.peers[i][j].probed is not None for i, j in pairs)
    for i, j in pairs:
        assert t.peers[i][j].probed == torch.cuda.can_device_access_peer(t.gpus[i].cuda_device, t.gpus[j].cuda_device) \
            or t.peers[i][j].probed is False  # can-access but failed copy counts as not usable


def test_communicator_topology_exposes_gpu_topology():
    import collectives

    with collectives.init() as comm:
        topo = comm.topology.gpus
        assert isinstance(topo, gt.GpuTopology)
        assert comm.topology.gpus is topo  # detected once, cached
        if torch.cuda.is_available():
            assert len(topo.gpus) == torch.cuda.device_count()
