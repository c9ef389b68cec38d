"""transports/nccl_paths.py: the environment that forces NCCL onto a path, and the verification from its log.

No NCCL runs here: the logs are tests/fixtures/nccl_logs/*.log, constructed from NCCL's format strings
(see the first line of each), and small inline logs for single formats.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from transports.nccl_paths import (
    DEBUG_SUBSYS, LOG_GLOB, Connection, NcclLog, nccl_env, parse_nccl_log, read_nccl_logs, taken_paths, verify_path)
from transports.paths import PATHS, PathMismatchError

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "nccl_logs"
PRE = "gpu-node1:4242:4300 [0] NCCL INFO "


def _fixture(name: str) -> NcclLog:
    return parse_nccl_log((FIXTURES / f"{name}.log").read_text())


def _log(*messages: str) -> NcclLog:
    """A log of these messages, each with NCCL's INFO prefix."""
    return parse_nccl_log("\n".join(PRE + m for m in messages))


def _mismatch(asked: str, log: NcclLog, **kw) -> PathMismatchError:
    with pytest.raises(PathMismatchError) as e:
        verify_path(asked, log, **kw)
    return e.value


# --- nccl_env --------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_env_logs_to_one_file_per_process(path, tmp_path):
    kw = {"hcas": ["mlx5_0:1"]} if path in ("ib", "roce") else {}
    env = nccl_env(path, str(tmp_path / "logs"), **kw)
    assert env["NCCL_DEBUG"] == "INFO"
    # the channel, NET/... Using and "Using network" lines are NCCL_INIT; "Pattern" lines NCCL_GRAPH only
    assert env["NCCL_DEBUG_SUBSYS"] == DEBUG_SUBSYS == "INIT,GRAPH"
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / "logs" / "nccl.%h.%p.log")
    assert (tmp_path / "logs").is_dir()  # NCCL falls back to stdout when it cannot open the file
    # NVLS and CollNet traffic would bypass the connections the log shows
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NCCL_COLLNET_ENABLE"] == "0"
    assert all(isinstance(v, str) for v in env.values())


def test_env_debug_file_is_absolute_and_escapes_percent(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = nccl_env("shm", "run%1")
    # a rank may run in another folder, and NCCL reads "%1" as an unknown escape: "%%" is a literal %
    assert env["NCCL_DEBUG_FILE"] == os.path.join(str(tmp_path), "run%%1", "nccl.%h.%p.log")
    assert (tmp_path / "run%1").is_dir()


@pytest.mark.parametrize("path", ["nvlink", "pcie", "cuda-ipc"])
def test_env_p2p_paths(path, tmp_path):
    env = nccl_env(path, str(tmp_path))
    assert env["NCCL_P2P_DISABLE"] == "0" and env["NCCL_P2P_LEVEL"] == "SYS"
    assert env["NCCL_SHM_DISABLE"] == "1"
    # p2pCanConnect yields to the network when a NIC is faster than the GPU-GPU path
    assert env["NCCL_NET_DISABLE_INTRA"] == "1"
    assert "NCCL_NET" not in env and "NCCL_IB_HCA" not in env
    assert ("NCCL_MULTI_RANK_GPU_ENABLE" in env) == (path == "cuda-ipc")


def test_env_nvlink_and_pcie_are_the_same_request(tmp_path):
    # NCCL has no switch that takes PCIe over NVLink: the verification tells them apart
    assert nccl_env("nvlink", str(tmp_path)) == nccl_env("pcie", str(tmp_path))


def test_env_shm(tmp_path):
    env = nccl_env("shm", str(tmp_path))
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "0"
    assert env["NCCL_NET_DISABLE_INTRA"] == "1"  # shmCanConnect too yields to a faster NIC
    assert "NCCL_NET" not in env


def test_env_socket(tmp_path):
    env = nccl_env("socket", str(tmp_path), ifname="=eth0")
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "1"
    assert env["NCCL_NET"] == "Socket" and env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "=eth0"
    # on one node the network transport must not be refused, and each rank uses its own NIC
    assert env["NCCL_NET_DISABLE_INTRA"] == "0" and env["NCCL_PXN_DISABLE"] == "1"
    assert "NCCL_SOCKET_IFNAME" not in nccl_env("socket", str(tmp_path))


@pytest.mark.parametrize("path", ["ib", "roce"])
def test_env_ib_and_roce(path, tmp_path):
    kw = {"gid_index": 3} if path == "roce" else {}
    env = nccl_env(path, str(tmp_path), hcas=["mlx5_0:1", "mlx5_3:1"], **kw)
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "1"
    assert env["NCCL_NET"] == "IB" and env["NCCL_IB_DISABLE"] == "0"
    assert env["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_3:1"  # "=": exact names, not prefixes (mlx5_1 would match mlx5_10)
    assert env["NCCL_NET_DISABLE_INTRA"] == "0" and env["NCCL_PXN_DISABLE"] == "1"
    assert env.get("NCCL_IB_GID_INDEX") == ("3" if path == "roce" else None)
    # without hcas NCCL uses every port it finds; roce is then checked by the ports' link layer
    bare = nccl_env(path, str(tmp_path))
    assert "NCCL_IB_HCA" not in bare and "NCCL_IB_GID_INDEX" not in bare and bare["NCCL_NET"] == "IB"


@pytest.mark.parametrize("kw, error", [
    ({"path": "socket", "hcas": ["mlx5_0:1"]}, ValueError),
    ({"path": "shm", "hcas": ["mlx5_0:1"]}, ValueError),
    ({"path": "ib", "gid_index": 3}, ValueError),  # NCCL reads the GID index for Ethernet ports only
    ({"path": "roce", "gid_index": -1}, ValueError),
    ({"path": "ib", "hcas": "mlx5_0:1"}, TypeError),  # a string would be split into characters
    ({"path": "ib", "hcas": ["mlx5_0:1,mlx5_1:1"]}, ValueError),
    ({"path": "ib", "hcas": ["^mlx5_0"]}, ValueError),
    ({"path": "ib", "hcas": [""]}, ValueError),
    ({"path": "tcp"}, ValueError),
])
def test_env_rejects(kw, error, tmp_path):
    path = kw.pop("path")
    with pytest.raises(error):
        nccl_env(path, str(tmp_path), **kw)


# --- parsing ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, n, via, devices, graph_types, network, version", [
    ("p2p_nvlink", 20, "P2P/CUMEM/read", {"IB": {0: ("mlx5_0:1", "IB"), 1: ("mlx5_1:1", "IB")}}, ("NVL/PIX",), "IB",
     "2.30.7+cuda13.0"),
    ("cuda_ipc", 8, "P2P/CUMEM", {}, ("LOC/PIX",), "Socket", "2.30.7+cuda13.0"),
    ("shm", 8, "SHM/direct/direct", {}, ("SYS/PIX",), "Socket", "2.28.9+cuda12.9"),
    ("socket", 16, "NET/Socket/0", {"Socket": {0: ("eth0", "10.0.0.11<0>")}}, ("LOC/PHB",), "Socket",
     "2.30.7+cuda13.0"),
    ("ib", 64, "NET/IB/0/GDRDMA", {"IB": {i: (f"mlx5_{i}:1", "IB") for i in range(4)}}, ("LOC/PIX",), "IB",
     "2.30.7+cuda13.0"),
    ("roce", 16, "NET/IB/0/GDRDMA", {"IB": {0: ("mlx5_0:1", "RoCE"), 1: ("mlx5_1:1", "RoCE")}}, ("LOC/PIX",), "IB",
     "2.30.7+cuda13.0"),
])
def test_parse_fixtures(name, n, via, devices, graph_types, network, version):
    text = (FIXTURES / f"{name}.log").read_text()
    assert text.startswith("# Constructed from NCCL v")
    log = parse_nccl_log(text)
    assert len(log.connections) == n
    assert log.connections[0].via == via
    assert log.net_devices == devices
    assert log.graph_types == graph_types
    assert log.network == network and log.version == version


def test_parse_connection_fields_from_several_ranks():
    log = _fixture("ib")
    # rank 0's log: its ring send and the receive from rank 3, each end of a NET connection logs a line
    assert log.connections[:2] == (Connection(0, 0, 1, "NET/IB/0/GDRDMA"), Connection(0, 3, 0, "NET/IB/0/GDRDMA"))
    # four ranks' logs concatenated; the tree's connections (0 <-> 2) are there besides the ring's
    assert {c.src for c in log.connections} == {0, 1, 2, 3}
    assert Connection(3, 0, 2, "NET/IB/0/GDRDMA") in log.connections
    assert Connection(3, 0, 2, "NET/IB/2/GDRDMA") in log.connections  # rank 2 receives on its own NIC
    # channels of the send/recv connections (connection index 1) are read too
    p2p = _fixture("p2p_nvlink")
    assert [c.channel for c in p2p.connections if c.src == 0] == [*range(8), 0, 1]


def test_parse_every_source_format():
    log = _log(
        "Channel 00/0 : 0[0] -> 1[1] via P2P/direct pointer/read",  # p2p.cc:416
        "Channel 01/1 : 0[0] -> 1[1] via P2P/IPC/read/CE",  # p2p.cc:429
        "Channel 02/0 : 0[0] -> 1[1] via P2P/MNNVL/read",  # p2p.cc:423
        "Channel 03/0 : 0[0] -> 3[3] via P2P/indirect/1[1]/read",  # p2p.cc:437
        "Channel 04 : 0[0] -> 1[1] via SHM/direct",  # shm.cc:116 (v2.30.7: no connection index)
        "Channel 05/0 : 0[0] -> 1[1] [send] via NET/IB/1(3)/GDRDMA(PCI)/Shared",  # net.cc:328, through rank 3
        "Channel 06/0 : 1[1] -> 0[0] [receive] via NET/Socket/2",  # net.cc:377
        "Channel 07/0 : 0[1c000] -> 1[1d000] via P2P/IPC",  # an old busId in the brackets
    )
    assert [(c.channel, c.src, c.dst) for c in log.connections] == [
        (0, 0, 1), (1, 0, 1), (2, 0, 1), (3, 0, 3), (4, 0, 1), (5, 0, 1), (6, 1, 0), (7, 0, 1)]
    assert [c.via for c in log.connections] == [
        "P2P/direct pointer/read", "P2P/IPC/read/CE", "P2P/MNNVL/read", "P2P/indirect/1[1]/read", "SHM/direct",
        "NET/IB/1(3)/GDRDMA(PCI)/Shared", "NET/Socket/2", "P2P/IPC"]
    # the device of a connection through a proxy rank ("1(3)") is device 1
    pxn = _log("NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE",
               "Channel 05/0 : 0[0] -> 1[1] [send] via NET/IB/1(3)/GDRDMA(PCI)/Shared")
    assert taken_paths(pxn) == {"roce": 1}


def test_parse_skips_comments_and_lines_that_are_no_connection():
    text = "\n".join([
        "# " + PRE + "Channel 00/0 : 0[0] -> 1[1] via SHM/direct",  # a line commented out
        "   # NET/IB : Using [0]mlx5_9:1/RoCE",
        PRE + "Channel 00/02 : 0 1",  # the ring dump (graph/rings.cc:48)
        "gpu-node1:4242:4300 [0] 0.123 p2pRecvSetup:501 NCCL TRACE Ring 00 : 0[0] <- 1[1] via P2P/CUMEM",
        "gpu-node1:4242:4300 [0] transport.cc:40 NCCL WARN No transport found for rank 0[1b000] -> rank 1[43000]",
        PRE + "Connected all rings, use ring PXN 0 GDR 1",
        "[2026-05-17 10:00:00] " + PRE + "Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM",  # a time stamp first
        "Channel 02/0 : 1[1] -> 0[0] via P2P/CUMEM",  # the message alone, no prefix
    ])
    log = parse_nccl_log(text)
    assert log.connections == (Connection(1, 0, 1, "P2P/CUMEM"), Connection(2, 1, 0, "P2P/CUMEM"))
    assert log.net_devices == {}


def test_parse_net_device_lists():
    log = _log(
        # v2.30.7 net_ib/init.cc: device:port, a rail (":%d") or a plane ("::%d"), the link layer, [RO], OOB
        "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1:2/RoCE [2]mlx5_2:1::0/UNSPECIFIED [RO]; OOB eth0:10.0.0.1<0>",
        "NET/Socket : Using [0]eth0:10.0.0.1<0> [1]ib0:fe80::1%ib0<0>",
    )
    assert log.net_devices == {
        "IB": {0: ("mlx5_0:1", "IB"), 1: ("mlx5_1:1:2", "RoCE"), 2: ("mlx5_2:1::0", "UNSPECIFIED")},
        "Socket": {0: ("eth0", "10.0.0.1<0>"), 1: ("ib0", "fe80::1%ib0<0>")}}
    # v2.21's merged devices: " [%d]={[%d] %s:%d/%s, ...}"
    old = _log("NET/IB : Using [0]={[0] mlx5_0:1/IB, [1] mlx5_1:1/IB} [1]mlx5_2:1/RoCE ; OOB ib0:10.0.0.1<0>")
    assert old.net_devices == {"IB": {0: ("mlx5_0:1+mlx5_1:1", "IB"), 1: ("mlx5_2:1", "RoCE")}}


def test_parse_keeps_the_first_network_and_version():
    log = _log("NCCL version 2.30.7+cuda13.0", "Using network IB", "NCCL version 2.29.7+cuda12.9",
               "Using network Socket")
    assert (log.network, log.version) == ("IB", "2.30.7+cuda13.0")


def test_parse_keeps_both_when_logs_disagree_on_a_device():
    log = parse_nccl_log("\n".join([
        "hostA:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [RO]; OOB ib0:10.0.0.1<0>",
        "hostB:2:2 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE [RO]; OOB eth0:10.0.0.2<0>",
        "hostA:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0",
    ]))
    assert log.net_devices["IB"][0] == ("mlx5_0:1|mlx5_0:1", "IB|RoCE")
    e = _mismatch("ib", log)
    assert "link layer 'IB|RoCE'" in str(e)


# --- verification ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, path", [
    ("p2p_nvlink", "nvlink"), ("cuda_ipc", "cuda-ipc"), ("shm", "shm"), ("socket", "socket"), ("ib", "ib"),
    ("roce", "roce")])
def test_verify_the_path_taken(name, path):
    assert verify_path(path, _fixture(name)) == path


@pytest.mark.parametrize("name, asked, taken", [
    ("shm", "socket", "shm"), ("socket", "shm", "socket"), ("ib", "socket", "ib"), ("p2p_nvlink", "shm", "nvlink"),
    ("p2p_nvlink", "pcie", "nvlink"), ("shm", "nvlink", "shm"), ("socket", "ib", "socket")])
def test_verify_a_wrong_path_names_both(name, asked, taken):
    e = _mismatch(asked, _fixture(name))
    assert (e.asked, e.taken) == (asked, taken)
    assert repr(asked) in str(e) and repr(taken) in str(e)
    n = len(_fixture(name).connections)
    assert f"{n} took {taken}" in str(e)  # with the count and an example of the line
    assert _fixture(name).connections[0].via in str(e)


def test_roce_and_ib_told_apart_by_the_link_layer():
    assert verify_path("ib", _fixture("ib")) == "ib"
    assert verify_path("roce", _fixture("roce")) == "roce"
    e = _mismatch("roce", _fixture("ib"))
    assert (e.asked, e.taken) == ("roce", "ib")
    e = _mismatch("ib", _fixture("roce"))
    assert (e.asked, e.taken) == ("ib", "roce")
    # the same connection lines, and only the device list differs
    conn = "Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/1/GDRDMA"
    assert taken_paths(_log("NET/IB : Using [0]mlx5_0:1/RoCE [1]mlx5_1:1/IB", conn)) == {"ib": 1}
    assert taken_paths(_log("NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE", conn)) == {"roce": 1}


def test_ib_device_with_unknown_link_layer_is_named():
    conn = "Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/4/GDRDMA"
    e = _mismatch("roce", _log("NET/IB : Using [0]mlx5_0:1/RoCE", conn))  # device 4 not listed (a merged vNIC)
    assert "NET/IB device 4" in str(e) and "unknown" in str(e) and e.taken.startswith("ib or roce")
    e = _mismatch("ib", _log("NET/IB : Using [0]mlx5_0:1/UNSPECIFIED", conn.replace("IB/4", "IB/0")))
    assert "'UNSPECIFIED'" in str(e)


def test_nvlink_and_pcie_from_the_graph_type_or_the_gpu_link():
    p2p = "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM"
    pattern = "Pattern 4, crossNic 0, nChannels 2, bw 24.000000/24.000000, type {}/PIX, sameChannels 1"
    for intra, path in [("NVL", "nvlink"), ("NVB", "nvlink"), ("PIX", "pcie"), ("PXB", "pcie"), ("PHB", "pcie"),
                        ("SYS", "pcie")]:
        assert verify_path(path, _log(pattern.format(intra), p2p)) == path
    # the topology matrix cell wins over the graph: NVLink GPUs ("NV18") and PCIe ones
    log = _fixture("p2p_nvlink")
    assert verify_path("nvlink", log, gpu_link="NV18") == "nvlink"
    for cell in ("PIX", "PXB", "PHB", "NODE", "SYS"):
        assert verify_path("pcie", log, gpu_link=cell) == "pcie"
    e = _mismatch("nvlink", log, gpu_link="PHB")
    assert e.taken == "pcie" and "no switch that takes PCIe over NVLink" in str(e)


def test_p2p_without_a_graph_or_gpu_link_is_undecided():
    e = _mismatch("nvlink", _log("Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read"))
    assert e.taken.startswith("nvlink or pcie") and "gpu_link" in str(e)
    e = _mismatch("pcie", _fixture("p2p_nvlink"), gpu_link="N/A")
    assert "'N/A'" in str(e)


def test_same_gpu_is_neither_nvlink_nor_pcie():
    log = _fixture("cuda_ipc")  # graph type LOC: two ranks on one GPU
    e = _mismatch("nvlink", log)
    assert e.taken.startswith("same GPU") and "LOC" in str(e)
    e = _mismatch("shm", log, gpu_link="X")
    assert e.taken.startswith("same GPU") and "NCCL_P2P_DISABLE=1" in str(e)


def test_cuda_ipc_is_p2p_through_imported_handles():
    graph = "Pattern 4, crossNic 0, nChannels 1, bw 40.000000/40.000000, type NVL/PIX, sameChannels 1"
    for mode in ("IPC/read", "CUMEM/read", "CUMEM", "MNNVL"):
        log = _log(graph, f"Channel 00/0 : 0[0] -> 1[1] via P2P/{mode}")
        assert verify_path("cuda-ipc", log) == "cuda-ipc"
    # cross-process cuMem over NVLink is CUDA IPC when that is asked, and NVLink otherwise
    assert taken_paths(_fixture("p2p_nvlink"), asked="cuda-ipc") == {"cuda-ipc": 20}
    assert taken_paths(_fixture("p2p_nvlink")) == {"nvlink": 20}
    # multi-node NVLink is NVLink whatever the local matrix says
    mnnvl = _log("Channel 00/0 : 0[0] -> 4[0] via P2P/MNNVL/read")
    assert taken_paths(mnnvl, gpu_link="SYS") == {"nvlink": 1}
    # ranks of one process share pointers: no IPC
    e = _mismatch("cuda-ipc", _log(graph, "Channel 00/0 : 0[0] -> 1[1] via P2P/direct pointer/read"))
    assert e.taken == "nvlink" and "one process per rank" in str(e)


def test_nothing_connected():
    # initialized, but no call made: NCCL connects at the first call (NCCL_RUNTIME_CONNECT=1)
    text = (FIXTURES / "p2p_nvlink.log").read_text()
    init_only = "\n".join(line for line in text.splitlines() if " via " not in line)
    e = _mismatch("nvlink", parse_nccl_log(init_only))
    assert (e.asked, e.taken) == ("nvlink", "nothing logged")
    assert "NCCL connects lazily: make a call before verifying" in str(e)
    # no NCCL line at all: the variables did not reach NCCL
    e = _mismatch("shm", parse_nccl_log("some other program's output\n"))
    assert e.taken == "nothing logged" and "nccl_env()" in str(e)


def test_mixed_paths_are_all_named_with_counts():
    text = "\n".join((FIXTURES / name).read_text() for name in ("p2p_nvlink.log", "shm.log"))
    log = parse_nccl_log(text)
    # two graphs, NVL and SYS: which one the P2P connections ran on is the GPU link's to say
    assert taken_paths(log) == {"nvlink or pcie (graph types disagree: NVL, SYS; give gpu_link)": 20, "shm": 8}
    assert taken_paths(log, gpu_link="NV18") == {"nvlink": 20, "shm": 8}
    e = _mismatch("nvlink", log, gpu_link="NV18")
    assert e.taken == "nvlink, shm"
    assert re.search(r"of 28 connections logged, 20 took nvlink \(e\.g\. 'P2P/CUMEM/read'\), "
                     r"8 took shm \(e\.g\. 'SHM/direct/direct'\)", str(e))
    e = _mismatch("socket", parse_nccl_log("\n".join((FIXTURES / n).read_text() for n in ("socket.log", "ib.log"))))
    assert e.taken == "socket, ib" and "16 took socket" in str(e) and "64 took ib" in str(e)


def test_verify_rejects_an_unknown_path():
    with pytest.raises(ValueError):
        verify_path("tcp", _fixture("socket"))


# --- reading a folder of logs ----------------------------------------------------------------------

def test_read_nccl_logs_merges_every_rank_file(tmp_path):
    text = (FIXTURES / "ib.log").read_text()
    env = nccl_env("ib", str(tmp_path), hcas=["mlx5_0:1"])
    by_pid: dict[str, list[str]] = {}
    for line in text.splitlines():
        # each file then ends with a connection line, which a file run into the next would garble
        if not line.startswith("#") and "Connected all" not in line:
            by_pid.setdefault(line.split(":")[1], []).append(line)
    assert len(by_pid) == 4
    for pid, lines in by_pid.items():
        # the names NCCL makes of NCCL_DEBUG_FILE (%h hostname, %p pid)
        name = env["NCCL_DEBUG_FILE"].replace("%h", "gpu-node1").replace("%p", pid)
        Path(name).write_text("\n".join(lines))  # no final newline: the files must not run together
    (tmp_path / "other.txt").write_text(PRE + "Channel 00/0 : 0[0] -> 1[1] via SHM/direct\n")
    assert sorted(p.name for p in tmp_path.glob(LOG_GLOB)) == [f"nccl.gpu-node1.{p}.log" for p in sorted(by_pid)]
    log = read_nccl_logs(str(tmp_path))
    assert sorted(log.connections, key=repr) == sorted(parse_nccl_log(text).connections, key=repr)
    assert log.net_devices == parse_nccl_log(text).net_devices
    assert verify_path("ib", log) == "ib"


def test_read_nccl_logs_without_files(tmp_path):
    # every failure to verify is a PathMismatchError, so that ranks agreeing on a verdict all get one
    (tmp_path / "nccl.txt").write_text((FIXTURES / "shm.log").read_text())  # not a NCCL_DEBUG_FILE name
    for folder in (tmp_path, tmp_path / "missing"):
        log = read_nccl_logs(str(folder))
        assert log == NcclLog()
        e = _mismatch("shm", log)
        assert e.taken == "nothing logged" and "nccl_env()" in str(e) and LOG_GLOB in str(e)
