"""Path discovery (collectives/topology/paths.py) and ``moecomm paths`` on the topology fixtures and this machine.

Fixtures (tests/fixtures/gpu_topology, see make_fixtures.py): hgx_h100_8gpu (8 H100 on NVSwitch, mlx5_0..7
InfiniBand NDR, mlx5_8 RoCE up with a RoCE v2 IPv4 GID at index 3, mlx5_9 RoCE down, nvidia_peermem, default
route via eno1), pcie_2gpu (2 L40S, P2P "chipset not supported", no RDMA), no_gpu_vm (a CPU-only VM).
Variants that break one rule at a time are built from them (copies, or the topology with fields replaced).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
from click.testing import CliRunner

import collectives.topology as gt
from benchmarks.cli import main as cli_main
from benchmarks.paths_cli import unavailable_message
from collectives.topology.paths import PathInfo, combine_paths, discover_paths, path_info
from transports.paths import PATHS

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "gpu_topology")
HGX, PCIE, VM = (os.path.join(FIX, n) for n in ("hgx_h100_8gpu", "pcie_2gpu", "no_gpu_vm"))
HGX_RDMA = os.path.join("sys", "devices", "pci0000:00", "0000:00:02.0")  # the RoCE card's functions


def _rows(root: str, topo: gt.GpuTopology | None = None, **kw) -> dict[str, PathInfo]:
    rows = discover_paths(topo if topo is not None else gt.load_recording(root), root=root, **kw)
    assert [r.path for r in rows] == list(PATHS)
    return {r.path: r for r in rows}


def _available(rows: dict[str, PathInfo]) -> dict[str, bool]:
    return {p: r.available for p, r in rows.items()}


def _copy(src: str, tmp_path, name: str = "node") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(src, dst, symlinks=True)
    return dst


# --------------------------------------------------------------------------------------------- fixtures

def test_hgx():
    r = _rows(HGX)
    assert _available(r) == {"nvlink": True, "pcie": False, "cuda-ipc": True, "shm": True, "ib": True,
                             "roce": True, "socket": True}
    assert "8 GPUs" in r["nvlink"].reason and "NV18" in r["nvlink"].reason
    assert r["nvlink"].devices == ("8 GPUs, every pair NV18",)
    assert r["pcie"].reason == "every GPU pair has NVLink: NCCL's P2P goes over NVLink, not PCIe"
    assert r["cuda-ipc"].devices == tuple(f"cuda:{k}" for k in range(8))  # a recording: the topology's GPUs
    # the RoCE ports of the Ethernet card are not InfiniBand, and mlx5_9 (down) is not used
    assert r["ib"].devices == tuple(f"mlx5_{k}:1" for k in range(8)) and r["ib"].gdr is True
    assert "8 ports at 400 Gb/s" in r["ib"].reason and "nvidia_peermem loaded" in r["ib"].reason
    assert r["ib"].gid_index is None
    assert r["roce"].devices == ("mlx5_8:1",) and r["roce"].gdr is True
    # index 1 is RoCE v2 too, but link-local (fe80::): NCCL wants the IPv4-mapped one
    assert r["roce"].gid_index == 3 and "NCCL_IB_GID_INDEX=3" in r["roce"].reason
    assert "100 Gb/s over ens12f0np0" in r["roce"].reason
    sock = r["socket"]
    assert sock.devices[0] == "eno1" and "TCP over eno1 (the default route)" in sock.reason
    assert "ens12f0np0" in sock.devices and "ibp25s0" in sock.devices  # the RoCE netdev and IPoIB are up
    assert not {"lo", "docker0", "ens12f1np1"} & set(sock.devices)  # loopback, a bridge, a port that is down
    assert "lo between ranks on one node" in sock.reason
    assert r["shm"].reason == "POSIX shared memory in /dev/shm"


def test_pcie_2gpu():
    r = _rows(PCIE)
    assert _available(r) == {"nvlink": False, "pcie": False, "cuda-ipc": True, "shm": True, "ib": False,
                             "roce": False, "socket": True}
    assert r["nvlink"].reason == "no NVLink between the 2 GPUs (PCIe only)"
    assert "GPU0-GPU1" in r["pcie"].reason and "(PHB)" in r["pcie"].reason
    assert "chipset not supported" in r["pcie"].reason  # NVML's status text for code 1 (CNS)
    assert r["ib"].reason == "no RDMA device: /sys/class/infiniband does not exist"
    assert r["roce"].reason.startswith("no RDMA device") and "rdma_rxe" not in r["roce"].reason
    assert "netdev enp5s0" in r["roce"].reason  # the soft RoCE hint names the default route's interface
    assert r["ib"].gdr is None and r["roce"].gid_index is None
    # enp6s0 is down, veth3f2a1b0 a container's end of a pair
    assert r["socket"].devices == ("enp5s0",) and "TCP over enp5s0 (the default route)" in r["socket"].reason


def test_no_gpu_vm():
    r = _rows(VM)
    assert _available(r) == {"nvlink": False, "pcie": False, "cuda-ipc": False, "shm": True, "ib": False,
                             "roce": False, "socket": True}
    for p in ("nvlink", "pcie"):
        assert r[p].reason == "no NVIDIA GPU found (looked in: sysfs)"
    assert r["cuda-ipc"].reason.startswith("no CUDA GPU")
    assert r["ib"].reason.startswith("no RDMA device") and r["roce"].reason.startswith("no RDMA device")
    assert r["socket"].devices == ("eth0",)  # ifb0 and ifb1 are down
    assert r["socket"].reason == "TCP over eth0 (the default route); lo between ranks on one node"


# ------------------------------------------------------------------------------- one rule at a time

def test_rdma_kinds_and_states():
    t = gt.load_recording(HGX)
    roce_only = replace(t, nics=tuple(n for n in t.nics if n.kind != "InfiniBand"))
    r = _rows(HGX, roce_only)
    assert not r["ib"].available and r["roce"].available
    assert r["ib"].reason == "no InfiniBand port: the RDMA ports (mlx5_8, mlx5_9) are RoCE"
    ib_only = replace(t, nics=tuple(n for n in t.nics if n.kind != "RoCE"))
    r = _rows(HGX, ib_only)
    assert r["ib"].available and r["roce"].reason.startswith("no RoCE port: the RDMA ports (mlx5_0, ")
    down = replace(t, nics=tuple(replace(n, state="DOWN") if n.name in ("mlx5_0", "mlx5_8") else
                                 replace(n, state="INIT") if n.kind == "InfiniBand" else n for n in t.nics))
    r = _rows(HGX, down)
    assert not r["ib"].available and not r["roce"].available
    assert r["ib"].reason.startswith("InfiniBand port(s) down: mlx5_0 (DOWN), mlx5_1 (INIT)")
    assert r["roce"].reason == "RoCE port(s) down: mlx5_8 (DOWN), mlx5_9 (DOWN)"
    one_up = replace(t, nics=tuple(replace(n, state="DOWN") if n.name not in ("mlx5_3", "mlx5_8") else n
                                   for n in t.nics))
    assert _rows(HGX, one_up)["ib"].devices == ("mlx5_3:1",)


def test_empty_infiniband_class_gid_and_gdr(tmp_path):
    root = _copy(HGX, tmp_path)
    types = os.path.join(root, HGX_RDMA, "0000:0c:00.0", "infiniband", "mlx5_8", "ports", "1", "gid_attrs", "types")
    os.remove(os.path.join(types, "3"))  # left: RoCE v2 at 1 (link-local only)
    shutil.rmtree(os.path.join(root, "sys", "module", "nvidia_peermem"))
    r = _rows(root)
    assert r["roce"].available and r["roce"].gid_index is None and "no RoCE v2 GID with an IPv4" in r["roce"].reason
    assert r["ib"].gdr is False and r["roce"].gdr is False and "no nvidia_peermem" in r["ib"].reason
    shutil.rmtree(os.path.join(root, "sys", "module"))
    assert _rows(root)["ib"].gdr is None  # not known: nothing to say about modules
    # no GPU: no GPUDirect, whatever the modules
    t = gt.load_recording(HGX)
    assert _rows(HGX, replace(t, gpus=(), peers=(), gpu_nic=()))["ib"].gdr is False

    empty = _copy(VM, tmp_path, "vm")
    os.makedirs(os.path.join(empty, "sys", "class", "infiniband"))
    assert _rows(empty)["ib"].reason == "no RDMA device: /sys/class/infiniband is empty"


def test_pcie_and_nvlink_rules():
    t = gt.load_recording(PCIE)
    probed = gt.probe_p2p(t, probe=lambda a, b: (True, "fake copy"), cuda_devices={0: 0, 1: 1})
    r = _rows(PCIE, probed)  # a probe that worked outranks NVML's "not supported"
    assert r["pcie"].available and r["pcie"].devices == ("GPU0-GPU1",) and "PHB" in r["pcie"].reason
    failed = gt.probe_p2p(t, probe=lambda a, b: (a != 1, "fake copy"), cuda_devices={0: 0, 1: 1})
    assert "the P2P probe failed (fake copy)" in _rows(PCIE, failed)["pcie"].reason
    unknown = replace(t, peers=tuple(tuple(None if p is None else replace(p, p2p_read=None, p2p_write=None)
                                           for p in row) for row in t.peers))
    r = _rows(PCIE, unknown)
    assert r["pcie"].available and "not confirmed" in r["pcie"].reason

    one = replace(t, gpus=t.gpus[:1], peers=((None,),), gpu_nic=t.gpu_nic[:1])
    r = _rows(PCIE, one)
    assert r["nvlink"].reason == r["pcie"].reason == "one GPU: no peer"
    assert r["cuda-ipc"].available and r["cuda-ipc"].devices == ("cuda:0",)  # two ranks may share it

    h = gt.load_recording(HGX)
    # NVLink only between GPU0 and GPU1: nvlink available for that pair, pcie for the rest
    peers = tuple(tuple(None if p is None else p if {i, j} == {0, 1} else replace(p, nvlinks=0, link=p.pci)
                        for j, p in enumerate(row)) for i, row in enumerate(h.peers))
    r = _rows(HGX, replace(h, peers=peers))
    assert r["nvlink"].available and r["nvlink"].devices == ("GPU0-GPU1 NV18",)
    assert "1 of the 28 GPU pairs" in r["nvlink"].reason
    assert r["pcie"].available and len(r["pcie"].devices) == 27 and "GPU0-GPU1" not in r["pcie"].devices


def test_cuda_ipc_arguments():
    assert not _rows(HGX, cuda_devices=0)["cuda-ipc"].available
    r = _rows(HGX, cuda_devices=2, ipc_why_not="triton not installed")["cuda-ipc"]
    assert not r.available and r.reason == "the ipc transport is not available: triton not installed"
    assert _rows(VM, cuda_devices=1)["cuda-ipc"].available  # the caller's count wins over the topology's


def test_shm_and_socket_variants(tmp_path):
    root = _copy(VM, tmp_path)
    os.remove(os.path.join(root, "proc", "net", "route"))
    shutil.rmtree(os.path.join(root, "dev"))
    r = _rows(root)
    assert not r["shm"].available and r["shm"].reason == "no /dev/shm"
    assert r["socket"].reason.startswith("TCP over eth0 (no default route found)")
    with open(os.path.join(root, "sys", "devices", "pci0000:00", "0000:00:03.0", "virtio2", "net", "eth0",
                           "operstate"), "w") as f:
        f.write("down\n")
    r = _rows(root)
    assert r["socket"].available and r["socket"].reason == "TCP over lo only: ranks on one node"
    assert r["socket"].devices == ("lo",)


# --------------------------------------------------------------------------------------- combine

def test_combine_paths():
    hgx, pcie = discover_paths(gt.load_recording(HGX), root=HGX), discover_paths(gt.load_recording(PCIE), root=PCIE)
    c = {r.path: r for r in combine_paths({"a": hgx, "b": pcie})}
    assert [r.path for r in combine_paths({"a": hgx, "b": pcie})] == list(PATHS)
    assert _available(c) == {"nvlink": False, "pcie": False, "cuda-ipc": True, "shm": True, "ib": False,
                             "roce": False, "socket": True}
    assert c["ib"].reason == "not on b (no RDMA device: /sys/class/infiniband does not exist)"
    assert c["nvlink"].reason == "not on b (no NVLink between the 2 GPUs (PCIe only))"
    assert c["pcie"].reason.startswith("a: every GPU pair has NVLink") and "; b: P2P over PCIe" in c["pcie"].reason
    assert c["shm"].reason == "within each node only (2 nodes): POSIX shared memory in /dev/shm"
    assert c["socket"].reason.startswith("between the 2 nodes: a: TCP over eno1")
    assert "eno1" in c["socket"].devices and "enp5s0" in c["socket"].devices
    assert c["ib"].gdr is None  # b does not say

    same = {r.path: r for r in combine_paths({"a": hgx, "b": hgx})}
    assert same["ib"].available and same["ib"].reason.startswith("between the 2 nodes: 8 ports at 400 Gb/s")
    assert same["roce"].gid_index == 3 and same["ib"].gdr is True
    assert same["nvlink"].reason.startswith("within each node only (2 nodes): NVLink")
    none = {r.path: r for r in combine_paths({"a": pcie, "b": pcie, "c": pcie})}
    assert none["ib"].reason == "all 3 hosts: no RDMA device: /sys/class/infiniband does not exist"
    # socket on a host with lo alone does not reach the other nodes
    lo_only = [replace(r, devices=("lo",), reason="TCP over lo only: ranks on one node") if r.path == "socket" else r
               for r in hgx]
    assert not path_info(combine_paths({"a": hgx, "b": lo_only}), "socket").available
    assert combine_paths({"a": pcie}) == pcie


def test_path_info_and_rows():
    rows = discover_paths(gt.load_recording(VM), root=VM)
    assert path_info(rows, "shm").available
    with pytest.raises(ValueError, match="unknown path 'tcp'"):
        path_info(rows, "tcp")
    with pytest.raises(KeyError):
        path_info(rows[:2], "socket")
    r = path_info(rows, "roce")
    assert unavailable_message(r) == f"path roce is not available here: {r.reason}"
    assert all(PathInfo.from_dict(json.loads(json.dumps(x.to_dict()))) == x for x in rows)


# --------------------------------------------------------------------------------------- the command

def test_cli_json_from_recording():
    res = CliRunner().invoke(cli_main, ["paths", "--from", HGX, "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    assert got == [r.to_dict() for r in discover_paths(gt.load_recording(HGX), root=HGX)]
    roce = got[PATHS.index("roce")]
    assert roce["available"] is True and roce["devices"] == ["mlx5_8:1"] and roce["gid_index"] == 3
    table = CliRunner().invoke(cli_main, ["paths", "--from", PCIE])
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].split() == ["#path", "available", "devices", "reason"]
    assert lines[PATHS.index("pcie") + 1].split()[:3] == ["pcie", "no", "-"]
    assert lines[PATHS.index("socket") + 1].split()[:3] == ["socket", "yes", "enp5s0"]
    bad = CliRunner().invoke(cli_main, ["paths", "--from", os.path.join(FIX, "expected")])
    assert bad.exit_code == 2 and "holds no recording" in bad.output


def test_cli_on_this_machine(monkeypatch):
    monkeypatch.setenv("MOECOMM_LAUNCH", "single")  # even inside mpiexec/torchrun: this process alone
    res = CliRunner().invoke(cli_main, ["paths", "--json"])
    assert res.exit_code == 0, res.output
    rows = {d["path"]: d for d in json.loads(res.output)}
    assert list(rows) == list(PATHS) and all(d["reason"] for d in rows.values())
    assert rows["shm"]["available"] == os.path.isdir("/dev/shm") and rows["socket"]["available"]
    t = gt.detect(probe=False)
    if not t.gpus:
        assert rows["nvlink"]["reason"].startswith("no NVIDIA GPU found")
        assert rows["pcie"]["reason"].startswith("no NVIDIA GPU found")
    import torch

    if torch.cuda.device_count() == 0:
        assert rows["cuda-ipc"] == {**rows["cuda-ipc"], "available": False,
                                    "reason": "no CUDA GPU (torch.cuda.is_available() is False)"}
    if not any(n.kind in ("InfiniBand", "RoCE") for n in t.nics):
        assert not rows["ib"]["available"] and rows["ib"]["reason"].startswith("no RDMA device")
        assert not rows["roce"]["available"] and rows["roce"]["reason"].startswith("no RDMA device")
    table = CliRunner().invoke(cli_main, ["paths"])
    assert table.exit_code == 0
    assert [line.split()[0] for line in table.output.splitlines()[1:]] == list(PATHS)
