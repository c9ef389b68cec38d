"""Force NCCL onto one path between ranks, and verify from NCCL's own log which path it took.

:func:`nccl_env` gives the environment that steers NCCL's transport selection towards a path of
:data:`transports.paths.PATHS` and makes every process write NCCL's INFO log into a file;
:func:`read_nccl_logs` / :func:`parse_nccl_log` read back what NCCL logged, and :func:`verify_path`
says whether every connection took the path asked for (else :class:`PathMismatchError` naming both).

The forcing is a request, the log is the evidence: NCCL picks the first transport whose ``canConnect``
accepts a pair of ranks, in the order P2P, SHM, NET (``ncclTransports[]``, src/transport.cc), and its
choice also depends on the topology. So a measurement must verify before it reports a path.

The log formats were read in NCCL's source (github.com/NVIDIA/nccl), v2.30.7 unless said otherwise;
each regex below quotes the format string it matches. Older formats that differ are accepted too
(back to v2.18).
"""

from __future__ import annotations

import glob
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from .paths import PathMismatchError, check_path

__all__ = ["Connection", "NcclLog", "nccl_env", "parse_nccl_log", "read_nccl_logs", "taken_paths", "verify_path",
           "DEBUG_SUBSYS", "LOG_GLOB"]

# The subsystems of the lines the parser reads (NCCL v2.30.7, files under src/; a line is printed when its
# flags & NCCL_DEBUG_SUBSYS is non-zero, debug.cc:272): the "Channel ... via" lines are INFO(NCCL_INIT |
# NCCL_P2P / NCCL_SHM / NCCL_NET) (transport/p2p.cc:416, transport/shm.cc:116, transport/net.cc:324),
# "NET/IB : Using" and "NET/Socket : Using" are INFO(NCCL_INIT | NCCL_NET) (transport/net_ib/init.cc:513,
# transport/net_socket.cc:77), "Using network" is INFO(NCCL_INIT) (init.cc:486), "Pattern ..." is
# INFO(NCCL_GRAPH) only (graph/search.cc:1319), and "NCCL version" is INFO(NCCL_ALL) (init.cc:702), printed
# whatever the mask. INIT covers all but the graph lines.
DEBUG_SUBSYS = "INIT,GRAPH"
# the files NCCL_DEBUG_FILE=<log_dir>/nccl.%h.%p.log makes, one a process (%h host, %p pid: debug.cc:215-218)
LOG_GLOB = "nccl.*.log"

_P2P_PATHS = ("nvlink", "pcie", "cuda-ipc")
_NET_PATHS = ("socket", "ib", "roce")


def nccl_env(path: str, log_dir: str, *, hcas: Sequence[str] = (), gid_index: int | None = None,
             ifname: str | None = None) -> dict[str, str]:
    """The environment variables that steer NCCL onto ``path`` and make it log what it chose.

    Every process of the job needs them before NCCL initializes. Each writes its log to
    ``<log_dir>/nccl.<host>.<pid>.log`` (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,GRAPH); read them back
    with :func:`read_nccl_logs` after at least one NCCL call (NCCL connects lazily) and check them with
    :func:`verify_path`. ``log_dir`` is made absolute and created here: NCCL does not expand ``~`` and,
    when it cannot open the file, logs to stdout without a word (src/debug.cc).

    NVLS and CollNet are off for every path (NCCL_NVLS_ENABLE=0, NCCL_COLLNET_ENABLE=0): their traffic
    bypasses the P2P/SHM/NET connections that the log shows.

    * ``nvlink``, ``pcie``, ``cuda-ipc``: P2P on at any distance (NCCL_P2P_DISABLE=0,
      NCCL_P2P_LEVEL=SYS), SHM off, and the network refused inside a node (NCCL_NET_DISABLE_INTRA=1:
      p2pCanConnect otherwise yields to NET when a NIC is faster than the GPU-GPU path,
      ncclTopoCheckNet in src/graph/paths.cc). NCCL has no switch that takes PCIe over NVLink: P2P
      goes over whatever links the two GPUs, so ``nvlink`` and ``pcie`` get the same variables and
      :func:`verify_path` tells them apart by the GPUs' link. ``cuda-ipc`` also sets
      NCCL_MULTI_RANK_GPU_ENABLE=1 so that two ranks may share one GPU (NCCL >= 2.30.3; older NCCL
      refuses with "Duplicate GPU detected"); ranks of one process use direct pointers, not CUDA IPC.
    * ``shm``: P2P off (NCCL_P2P_DISABLE=1), SHM on, NCCL_NET_DISABLE_INTRA=1 (shmCanConnect too yields
      to a faster NIC). NCCL_P2P_DISABLE=1 means P2P level LOC (ncclGetLevel, graph/paths.cc), which
      still lets two ranks on one GPU use P2P: the verification catches that.
    * ``socket``: P2P and SHM off, NCCL_NET=Socket, NCCL_IB_DISABLE=1.
    * ``ib``, ``roce``: P2P and SHM off, NCCL_NET=IB, NCCL_IB_DISABLE=0, NCCL_IB_HCA="=" + the
      ``hcas`` (exact names, e.g. "mlx5_0:1") when given, NCCL_IB_GID_INDEX=``gid_index`` (roce only:
      NCCL reads it for Ethernet ports alone, ncclIbGetGidIndex in net_ib/connect.cc). NCCL_IB_HCA
      cannot select by link layer, so ``roce`` without ``hcas`` is allowed (right on a machine whose
      ports are all RoCE) and :func:`verify_path` checks each device's link layer; name the RoCE ports
      on a machine that has both.

    The three network paths also set NCCL_NET_DISABLE_INTRA=0 and NCCL_PXN_DISABLE=1 (each rank sends
    through its own NIC, not through a peer GPU's). They work between ranks of one node because, with
    P2P and SHM both refused, ncclTopoComputePaths marks the peer GPU PATH_NET and ncclTopoTrimSystem
    drops it from the local topology (graph/paths.cc); net's canConnect (transport/net.cc) then finds
    no GPU-GPU path to compare with the NIC (ncclTopoCheckNet returns early) and accepts, so the ranks
    connect through the network transport as if on two nodes.

    Args:
        path: one of :data:`transports.paths.PATHS`.
        log_dir: the folder for the per-process log files.
        hcas: IB/RoCE ports for ``ib`` / ``roce`` ("mlx5_0:1" or "mlx5_0").
        gid_index: the RoCE GID index (``roce`` only); NCCL picks one when None.
        ifname: NCCL_SOCKET_IFNAME for any path (bootstrap, the IB out-of-band socket, the socket
            transport); NCCL's syntax: prefixes, "=" for an exact name, "^" to exclude.

    Returns:
        Variable name -> value, to merge over the ranks' environment.

    Raises:
        ValueError: an unknown path, ``hcas`` for a path other than ib/roce, ``gid_index`` for a path
            other than roce, or a malformed port name.
        TypeError: ``hcas`` given as one string rather than a sequence of names.
    """
    check_path(path)
    if isinstance(hcas, str):
        raise TypeError(f"hcas is a sequence of port names, e.g. [{hcas!r}], not a string")
    hcas = tuple(hcas)
    if hcas and path not in ("ib", "roce"):
        raise ValueError(f"hcas select IB/RoCE ports; path {path!r} uses none")
    if gid_index is not None and path != "roce":
        raise ValueError(f"gid_index applies to RoCE ports only (NCCL ignores it on InfiniBand); path is {path!r}")
    if gid_index is not None and (isinstance(gid_index, bool) or not isinstance(gid_index, int) or gid_index < 0):
        raise ValueError(f"gid_index must be an int >= 0, not {gid_index!r}")
    for hca in hcas:
        # NCCL_IB_HCA is a comma-separated list whose first character may be ^ or = (net_ib/init.cc:320)
        if not hca or any(c in hca for c in ", \t") or hca[0] in "^=":
            raise ValueError(f"bad port name {hca!r}: give a device or device:port, e.g. 'mlx5_0:1'")

    log_dir = os.path.abspath(os.path.expanduser(log_dir))
    os.makedirs(log_dir, exist_ok=True)
    env = {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": DEBUG_SUBSYS,
        # a literal % in the folder must not be read as NCCL's %h / %p (debug.cc: "%%" is one %)
        "NCCL_DEBUG_FILE": os.path.join(log_dir.replace("%", "%%"), "nccl.%h.%p.log"),
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_COLLNET_ENABLE": "0",
    }
    if ifname:
        env["NCCL_SOCKET_IFNAME"] = ifname
    if path in _P2P_PATHS:
        env.update(NCCL_P2P_DISABLE="0", NCCL_P2P_LEVEL="SYS", NCCL_SHM_DISABLE="1", NCCL_NET_DISABLE_INTRA="1")
        if path == "cuda-ipc":
            env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    elif path == "shm":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="0", NCCL_NET_DISABLE_INTRA="1")
    else:
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_NET_DISABLE_INTRA="0", NCCL_PXN_DISABLE="1")
        if path == "socket":
            env.update(NCCL_NET="Socket", NCCL_IB_DISABLE="1")
        else:
            env.update(NCCL_NET="IB", NCCL_IB_DISABLE="0")
            if hcas:
                env["NCCL_IB_HCA"] = "=" + ",".join(hcas)
            if gid_index is not None:
                env["NCCL_IB_GID_INDEX"] = str(gid_index)
    return env


@dataclass(frozen=True)
class Connection:
    """One "Channel XX/Y : a[da] -> b[db] [send|receive] via KIND/..." line.

    Attributes:
        channel: the channel number.
        src, dst: the sending and the receiving rank.
        via: the text after "via ", e.g. "P2P/CUMEM/read", "SHM/direct/direct", "NET/IB/0/GDRDMA".
    """

    channel: int
    src: int
    dst: int
    via: str


@dataclass(frozen=True)
class NcclLog:
    """What NCCL logged about its connections, from one or several ranks' logs.

    Attributes:
        connections: every connection line, in log order (NET connections are logged by both ends,
            "[send]" and "[receive]"; P2P and SHM ones by the sender only).
        net_devices: "IB" / "Socket" -> device index -> (device, link layer) for IB ("IB", "RoCE",
            "UNSPECIFIED") or (interface, address) for sockets. An index that two logs name
            differently keeps both, joined by "|".
        graph_types: the distinct "intra/inter" path types of the topology graphs, e.g. "NVL/PIX".
        network: the network NCCL used ("IB", "Socket"), first one logged.
        version: e.g. "2.30.7+cuda13.0", first one logged.
    """

    connections: tuple[Connection, ...] = ()
    net_devices: dict[str, dict[int, tuple[str, str]]] = field(default_factory=dict)
    graph_types: tuple[str, ...] = ()
    network: str | None = None
    version: str | None = None


# --- the log's formats ---------------------------------------------------------------------------
# file:line under src/ of NCCL v2.30.7 unless another version is named
# Each line is "<host>:<pid>:<tid> [<cudaDev>] NCCL INFO <message>" (debug.cc:330 "%s:%d:%d ", debug.cc:354
# "[%d] NCCL INFO %s\n"), with a "[%F %T] " time stamp first only if NCCL_DEBUG_TIMESTAMP_LEVELS asks.
_INFO = "NCCL INFO "

# transport/p2p.cc:416 "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/direct pointer%s"
# transport/p2p.cc:423 "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/%s%s%s"  (CUMEM or MNNVL, "/read", "/CE")
# transport/p2p.cc:429 "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/IPC%s%s"
# transport/p2p.cc:437 "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/indirect/%d[%d]%s"
# transport/shm.cc:116 "Channel %02d : %d[%d] -> %d[%d] via SHM/direct"  (no connection index;
#   v2.18.3-v2.30.4 transport/shm.cc: "Channel %02d : %d[%d] -> %d[%d] via SHM/%s/%s", "direct" or "CE" each)
# transport/net.cc:324 "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s"  ("/GDRDMA", "(PCI)", "/Shared")
# transport/net.cc:328 "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d(%d)%s%s%s"  (through proxy rank, PXN)
# transport/net.cc:377 "Channel %02d/%d : %d[%d] -> %d[%d] [receive] via NET/%s/%d%s%s%s"
# The ring dump "Channel %02d/%02d :" + ranks (graph/rings.cc:48) has no "->" and does not match.
_CHANNEL = re.compile(r"Channel (\d+)(?:/\d+)? : (\d+)\[\w+\] -> (\d+)\[\w+\](?: \[(?:send|receive)\])? via (.+?)\s*$")
# transport/net_ib/init.cc:513 "NET/IB : Using%s %s; OOB %s:%s", the list built by init.cc:494 " [%d]%s:%d"
# (device:port), an optional rail ":%d" or plane "::%d", then init.cc:504 "/%s" with NCCL_IB_LLSTR
# (transport/net_ib/common.h:118: "IB", "RoCE" or "UNSPECIFIED"); the " [RO]" flag and the OOB part follow.
_IB_USING = re.compile(r"NET/IB : Using(.*)$")
# v2.21.5 transport/net_ib.cc:521-532 listed a merged device as " [%d]={" "[%d] %s:%d/%s" ", " ... "}"
_IB_DEVICE = re.compile(r"\[(\d+)\](?:=\{([^}]*)\}|([^\s\[\]{}/]+)/(\w+))")
_IB_MERGED_PART = re.compile(r"\[\d+\] ?([^\s,\[\]/]+)/(\w+)")
# transport/net_socket.cc:73 " [%d]%s:%s" (interface, ncclSocketToString = "%s<%s>", misc/socket.cc:170),
# transport/net_socket.cc:77 "NET/Socket : Using%s"
_SOCKET_USING = re.compile(r"NET/Socket : Using(.*)$")
_SOCKET_DEVICE = re.compile(r"\[(\d+)\]([^:\s]+):(\S+)")
# graph/search.cc:1319 "Pattern %d, crossNic %d, nChannels %d, bw %f/%f, type %s/%s, sameChannels %d"
# (typeIntra/typeInter, names from graph/topo.cc:34 topoPathTypeStr: LOC NVL NVB C2C PIX PXB P2C PXN PHB SYS NET DIS)
_PATTERN = re.compile(r"Pattern \d+, crossNic \d+, nChannels \d+, bw [\d.]+/[\d.]+, type (\w+)/(\w+), sameChannels \d+")
# init.cc:486 "Using network %s"
_NETWORK = re.compile(r"Using network (\S+)")
# init.cc:694-702 "NCCL version " STR(NCCL_MAJOR) "." STR(NCCL_MINOR) "." STR(NCCL_PATCH) NCCL_SUFFIX "+cuda" ...
_VERSION = re.compile(r"NCCL version (\S+)")


def _add_device(table: dict[int, tuple[str, str]], index: int, entry: tuple[str, str]) -> None:
    """Record device ``index``; a different entry for the same index (another host's log) is kept alongside."""
    old = table.get(index)
    if old is None or old == entry:
        table[index] = entry
    elif entry[0] not in old[0].split("|") or entry[1] not in old[1].split("|"):
        table[index] = (f"{old[0]}|{entry[0]}", f"{old[1]}|{entry[1]}")


def parse_nccl_log(text: str) -> NcclLog:
    """Read NCCL's INFO log text: one rank's, or several ranks' concatenated.

    Lines whose first non-blank character is "#" are comments; lines that match no known format are
    skipped. The "<host>:<pid>:<tid> [<dev>] NCCL INFO " prefix may be there or not.

    Args:
        text: the log text.

    Returns:
        The connections, network devices, graph types, network and version logged.
    """
    connections: list[Connection] = []
    devices: dict[str, dict[int, tuple[str, str]]] = {}
    graph_types: dict[str, None] = {}  # an ordered set
    network = version = None
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        at = line.find(_INFO)
        msg = line[at + len(_INFO):] if at >= 0 else line.strip()
        if m := _CHANNEL.match(msg):
            connections.append(Connection(int(m[1]), int(m[2]), int(m[3]), m[4]))
        elif m := _IB_USING.match(msg):
            table = devices.setdefault("IB", {})
            for d in _IB_DEVICE.finditer(m[1]):
                if d[2] is not None:
                    parts = _IB_MERGED_PART.findall(d[2])
                    links = sorted({ll for _, ll in parts})
                    _add_device(table, int(d[1]), ("+".join(n for n, _ in parts), "+".join(links)))
                else:
                    _add_device(table, int(d[1]), (d[3], d[4]))
        elif m := _SOCKET_USING.match(msg):
            table = devices.setdefault("Socket", {})
            for d in _SOCKET_DEVICE.finditer(m[1]):
                _add_device(table, int(d[1]), (d[2], d[3]))
        elif m := _PATTERN.match(msg):
            graph_types[f"{m[1]}/{m[2]}"] = None
        elif m := _NETWORK.match(msg):
            network = network or m[1]
        elif m := _VERSION.match(msg):
            version = version or m[1]
    return NcclLog(tuple(connections), devices, tuple(graph_types), network, version)


def read_nccl_logs(log_dir: str) -> NcclLog:
    """Every ``nccl.*.log`` file in ``log_dir`` (one per process, see :func:`nccl_env`), parsed as one log.

    No file there (or no such folder) reads as an empty log, which :func:`verify_path` reports as a
    mismatch ("nothing logged"), as it does any other failure to verify: a caller that agrees on a
    verdict across ranks gets one from every rank rather than an exception from some.
    """
    files = sorted(glob.glob(os.path.join(glob.escape(log_dir), LOG_GLOB)))
    texts = []
    for name in files:
        with open(name, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return parse_nccl_log("\n".join(texts))


# --- from connections to paths -------------------------------------------------------------------
# P2P modes whose buffers are cuMem / CUDA IPC handles imported from another process (p2p.cc:423-429,
# p2pMap: a peer of another pid imports through ncclP2pImportShareableBuffer); MNNVL is cuMem with fabric
# handles. "direct pointer" is a peer in the same process; "indirect" goes through a third GPU.
_IPC_MODES = ("IPC", "CUMEM", "MNNVL")
# graph types (topo.cc:34) and `moecomm topo` matrix cells ("NV18", "PIX", ... "X") -> path
_NVLINK_TYPES = ("NVL", "NVB")  # NVB: NVLink through an intermediate GPU
_PCIE_TYPES = ("PIX", "PXB", "PHB", "NODE", "SYS")
_SAME_GPU = "same GPU"


def _link_of(cell: str, what: str) -> str:
    """nvlink / pcie / a description, for a graph type or a topology matrix cell named ``what``."""
    if re.fullmatch(r"NV\d+", cell) or cell in _NVLINK_TYPES:
        return "nvlink"
    if cell in _PCIE_TYPES:
        return "pcie"
    if cell in ("LOC", "X"):
        # two ranks on one GPU: P2P inside the GPU's memory, over neither NVLink nor PCIe
        return f"{_SAME_GPU} ({what} {cell}: P2P within one GPU)"
    return f"GPU P2P of unknown link ({what} {cell!r})"


def _p2p_link(log: NcclLog, gpu_link: str | None) -> str:
    """What a P2P connection ran over: from ``gpu_link``, else from the graphs' intra-node type."""
    if gpu_link is not None:
        return _link_of(gpu_link.strip(), "GPU link")
    intra = sorted({t.split("/")[0] for t in log.graph_types})
    if not intra:
        return "nvlink or pcie (no graph 'Pattern' line logged and no gpu_link given)"
    links = {_link_of(t, "graph type") for t in intra}
    if len(links) > 1:
        return f"nvlink or pcie (graph types disagree: {', '.join(intra)}; give gpu_link)"
    return links.pop()


def _net_path(log: NcclLog, net: str, index: int) -> str:
    """socket / ib / roce / a description, for a connection via NET/<net>/<index>."""
    if net == "Socket":
        return "socket"
    if net != "IB":
        return f"network {net!r}"
    device = log.net_devices.get("IB", {}).get(index)
    if device is None:
        return f"ib or roce (NET/IB device {index} is in no 'NET/IB : Using' line, link layer unknown)"
    name, link = device
    if link == "IB":
        return "ib"
    if link == "RoCE":
        return "roce"
    return f"ib or roce (NET/IB device {index} {name} has link layer {link!r})"


def _path_of(conn: Connection, log: NcclLog, gpu_link: str | None, ipc: bool) -> str:
    """The path one connection took: a name of PATHS, or a description of what is known."""
    parts = conn.via.split("/")
    kind = parts[0]
    if kind == "SHM":
        return "shm"
    if kind == "NET" and len(parts) > 2 and (m := re.match(r"\d+", parts[2])):
        return _net_path(log, parts[1], int(m[0]))
    if kind == "P2P" and len(parts) > 1:
        mode = parts[1]
        if ipc and mode in _IPC_MODES:
            return "cuda-ipc"
        if mode == "MNNVL":  # multi-node NVLink: NVLink whatever the local matrix says
            return "nvlink"
        return _p2p_link(log, gpu_link)
    return f"unknown transport ({conn.via})"


def taken_paths(log: NcclLog, *, gpu_link: str | None = None, asked: str | None = None) -> dict[str, int]:
    """Path -> how many logged connections took it, in order of first appearance.

    SHM/... is shm; NET/Socket/... socket; NET/IB/<i>/... ib or roce by the link layer of device i in
    ``log.net_devices["IB"]``; P2P/... nvlink or pcie by ``gpu_link`` (the `moecomm topo` matrix cell
    between the ranks' GPUs, e.g. "NV18" or "PHB"), else by the graphs' intra-node type (NVL/NVB or
    PIX/PXB/PHB/SYS). When ``asked`` is "cuda-ipc", P2P connections through imported handles
    (P2P/IPC, P2P/CUMEM, P2P/MNNVL) count as cuda-ipc. What cannot be told is a description (not a
    path name) saying why, e.g. "same GPU (graph type LOC: ...)" or "ib or roce (... unknown)".

    Args:
        log: the parsed log.
        gpu_link: the GPU-GPU matrix cell; overrides the graph types.
        asked: the path asked for, when it is "cuda-ipc".

    Returns:
        Path name or description -> number of connection lines.
    """
    ipc = asked == "cuda-ipc"
    return dict(Counter(_path_of(c, log, gpu_link, ipc) for c in log.connections))


def _hints(asked: str, taken: dict[str, int], log: NcclLog) -> list[str]:
    """What to do about a mismatch, for the cases with a known cause."""
    hints = []
    if asked in ("nvlink", "pcie") and {"nvlink", "pcie"} - {asked} <= set(taken):
        hints.append("NCCL has no switch that takes PCIe over NVLink: P2P uses the link between the two GPUs, "
                     f"so run {asked} on GPUs linked by {'NVLink' if asked == 'nvlink' else 'PCIe only'}")
    if asked == "cuda-ipc" and any(c.via.startswith("P2P/direct pointer") for c in log.connections):
        hints.append("'P2P/direct pointer' connects ranks of one process; CUDA IPC needs one process per rank")
    if asked != "cuda-ipc" and any(p.startswith(_SAME_GPU) for p in taken):
        hints.append("ranks sharing one GPU connect through P2P even with NCCL_P2P_DISABLE=1 (it means P2P "
                     "level LOC): give each rank its own GPU")
    return hints


def verify_path(asked: str, log: NcclLog, *, gpu_link: str | None = None) -> str:
    """Check that every connection NCCL logged took path ``asked``.

    Args:
        asked: one of :data:`transports.paths.PATHS`.
        log: the parsed log of the run (:func:`read_nccl_logs`).
        gpu_link: the `moecomm topo` matrix cell between the ranks' GPUs, for P2P connections.

    Returns:
        ``asked``, verified.

    Raises:
        PathMismatchError: no connection was logged, or some took another path (or one that cannot
            be told); the message names every path taken, with counts and an example of each.
        ValueError: ``asked`` is not a path name.
    """
    check_path(asked)
    if not log.connections:
        if log.version is None and not log.graph_types and not log.net_devices:
            why = ("no NCCL INFO line at all: give every rank nccl_env()'s variables before NCCL initializes, "
                   f"and read the {LOG_GLOB} files of its log_dir (NCCL logs to stdout when it cannot open them)")
        else:
            why = ("NCCL connects lazily: make a call before verifying; no 'Channel ... via' line was logged "
                   "(the first collective, or send/recv, between the ranks connects them; the lines are "
                   "logged under NCCL_DEBUG_SUBSYS=INIT)")
        raise PathMismatchError(asked, "nothing logged", why)
    taken = taken_paths(log, gpu_link=gpu_link, asked=asked)
    if set(taken) == {asked}:
        return asked
    examples: dict[str, str] = {}
    for c in log.connections:
        examples.setdefault(_path_of(c, log, gpu_link, asked == "cuda-ipc"), c.via)
    counts = ", ".join(f"{n} took {p} (e.g. {examples[p]!r})" for p, n in taken.items())
    about = [f"network {log.network}"] if log.network else []
    about += [f"NCCL {log.version}"] if log.version else []
    detail = f"of {sum(taken.values())} connections logged, {counts}"
    detail += f" [{', '.join(about)}]" if about else ""
    detail += "".join(f"; {h}" for h in _hints(asked, taken, log))
    raise PathMismatchError(asked, ", ".join(taken), detail)
