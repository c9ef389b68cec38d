"""Path discovery: which of the paths bytes can take between two ranks (:data:`transports.paths.PATHS`) a
node offers, what each would use, and why a path is missing.

One :class:`PathInfo` per path, from a :class:`~collectives.topology.model.GpuTopology` and the directory
holding ``sys/``, ``dev/`` and ``proc/`` ("/" live, a recording or fixture otherwise). The rules:

* nvlink: two or more GPUs and a pair joined by NVLink (``peers[i][j].nvlinks > 0``).
* pcie: a GPU pair without NVLink whose P2P is not known to fail (``PeerInfo.p2p_usable`` is not False);
  where every pair has NVLink, NCCL's P2P goes over NVLink and pcie is reported unavailable.
* cuda-ipc: a CUDA device (one is enough: two ranks may share it) and the ipc transport (the caller's
  ``ipc_why_not``).
* shm: ``/dev/shm`` is a directory (and writable, live).
* ib / roce: an ACTIVE RDMA port whose link layer is InfiniBand / Ethernet. ``gdr``: the nvidia_peermem or
  nv_peer_mem module is loaded (``sys/module``; None when that directory is missing, False without a GPU).
  ``gid_index`` (roce): the first GID of type "RoCE v2" holding an IPv4-mapped address.
* socket: a non-loopback interface that is up (operstate up, or unknown with carrier; docker*, veth* and
  virbr* left out), the default route's (``proc/net/route``) first; lo alone serves ranks on one node.

:func:`combine_paths` merges the rows of several hosts: a path is available where every host has it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from transports.paths import NODE_LOCAL_PATHS, PATHS, check_path

from .formats import natural_key
from .model import GpuTopology, NicInfo
from .nvml import P2P_STATUS_TEXT
from .sysfs import read_sysfs_file, sysfs_path

log = logging.getLogger(__name__)

_RDMA_KINDS = {"ib": "InfiniBand", "roce": "RoCE"}
_PEERMEM = ("nvidia_peermem", "nv_peer_mem")
_SKIP_IF = ("docker", "veth", "virbr")  # container and VM bridges: not a way to another node


@dataclass(frozen=True)
class PathInfo:
    """Whether one path is available on a node.

    Attributes:
        path: one of :data:`transports.paths.PATHS`.
        available: whether the node offers it.
        reason: one line: why not, or what it is.
        devices: what it would use: RDMA ports as "mlx5_0:1" (NCCL_IB_HCA's spelling), interfaces ("eth0"),
            GPU pairs ("GPU0-GPU1"), CUDA devices ("cuda:0"), "/dev/shm".
        gdr: ib/roce: GPUDirect RDMA possible (nvidia_peermem or nv_peer_mem loaded); None when unknown.
        gid_index: roce: the RoCE v2 GID index for NCCL_IB_GID_INDEX; None when none was found.
    """

    path: str
    available: bool
    reason: str
    devices: tuple[str, ...] = ()
    gdr: bool | None = None
    gid_index: int | None = None

    def to_dict(self) -> dict:
        """Plain JSON-able dict (devices as a list)."""
        d = asdict(self)
        d["devices"] = list(self.devices)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> PathInfo:
        """Inverse of :meth:`to_dict`."""
        return cls(path=d["path"], available=d["available"], reason=d["reason"], devices=tuple(d.get("devices", ())),
                   gdr=d.get("gdr"), gid_index=d.get("gid_index"))


def discover_paths(topo: GpuTopology, *, root: str = "/", cuda_devices: int | None = None,
                   ipc_why_not: str | None = None) -> list[PathInfo]:
    """One row per path of :data:`~transports.paths.PATHS`, in that order.

    Args:
        topo: the node's topology (``detect()`` live, ``load_recording(root)`` for a recording).
        root: the directory holding ``sys/``, ``dev/shm`` and ``proc/net/route``.
        cuda_devices: CUDA devices visible to this process; None: ``torch.cuda.device_count()`` when
            ``root`` is "/", else the topology's GPU count.
        ipc_why_not: why the ipc transport cannot be created here, None when it can.

    Returns:
        The rows.
    """
    live = os.path.realpath(root) == "/"
    if cuda_devices is None:
        cuda_devices = _cuda_device_count() if live else len(topo.gpus)
    rdma = [n for n in topo.nics if n.kind != "Ethernet"]  # RDMA ports (read_infiniband), any link layer
    gdr = _gdr(root) if topo.gpus else False
    default_if = _default_route(root)
    rows = [_nvlink(topo), _pcie(topo), _cuda_ipc(topo, cuda_devices, ipc_why_not, live), _shm(root, live),
            _rdma("ib", rdma, root, gdr, default_if), _rdma("roce", rdma, root, gdr, default_if),
            _socket(root, default_if)]
    assert tuple(r.path for r in rows) == PATHS
    return rows


def path_info(paths: Sequence[PathInfo], name: str) -> PathInfo:
    """The row of one path.

    Args:
        paths: rows as :func:`discover_paths` returns them.
        name: one of :data:`~transports.paths.PATHS`.

    Returns:
        Its row.

    Raises:
        ValueError: ``name`` is not a path; KeyError: ``paths`` has no row for it.
    """
    check_path(name)
    for p in paths:
        if p.path == name:
            return p
    raise KeyError(f"no row for path {name!r} (rows: {[p.path for p in paths]})")


def combine_paths(per_host: Mapping[str, Sequence[PathInfo]]) -> list[PathInfo]:
    """The paths of a launch over several hosts.

    A path is available where every host has it; the reason of one that is not names the hosts that lack
    it. Available node-local paths (nvlink, pcie, cuda-ipc, shm) say they serve ranks within each node
    only; socket, ib and roce are what crosses nodes (socket on a host with only lo does not).

    Args:
        per_host: each host's rows, by host name.

    Returns:
        One row per path; one host's rows unchanged.
    """
    hosts = list(per_host)
    if len(hosts) == 1:
        return list(per_host[hosts[0]])
    out = []
    for name in PATHS:
        infos = {h: path_info(per_host[h], name) for h in hosts}
        lacking: dict[str, list[str]] = {}
        for h, i in infos.items():
            if not i.available or (name == "socket" and i.devices == ("lo",)):
                lacking.setdefault(i.reason, []).append(h)
        scope = (f"within each node only ({len(hosts)} nodes)" if name in NODE_LOCAL_PATHS
                 else f"between the {len(hosts)} nodes")
        devices = tuple(dict.fromkeys(d for i in infos.values() for d in i.devices))
        gdrs = {i.gdr for i in infos.values()}
        gdr = False if False in gdrs else True if gdrs == {True} else None
        gids = {i.gid_index for i in infos.values()}
        gid = gids.pop() if len(gids) == 1 else None
        if lacking:
            if sum(len(hs) for hs in lacking.values()) < len(hosts):
                why = "; ".join(f"not on {', '.join(hs)} ({r})" for r, hs in lacking.items())
            elif len(lacking) == 1:
                why = f"all {len(hosts)} hosts: {next(iter(lacking))}"
            else:
                why = "; ".join(f"{', '.join(hs)}: {r}" for r, hs in lacking.items())
            out.append(PathInfo(name, False, why, devices, gdr, gid))
            continue
        reasons = list(dict.fromkeys(i.reason for i in infos.values()))
        reason = reasons[0] if len(reasons) == 1 else f"{hosts[0]}: {reasons[0]} (other hosts differ)"
        if len(gids) > 1 and name == "roce":
            reason += "; the RoCE v2 GID index differs between hosts: set NCCL_IB_GID_INDEX per host"
        out.append(PathInfo(name, True, f"{scope}: {reason}", devices, gdr, gid))
    return out


# ----------------------------------------------------------------------------------------- GPU paths

def _no_gpu(topo: GpuTopology) -> str:
    looked = [s for s in topo.sources if s != "probe"]
    return f"no NVIDIA GPU found (looked in: {', '.join(looked) or 'nothing readable'})"


def _pairs(topo: GpuTopology) -> list[tuple[int, int]]:
    n = len(topo.gpus)
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def _nv(topo: GpuTopology, i: int, j: int) -> int:
    return max(topo.nvlink_count(i, j), topo.nvlink_count(j, i))


def _pair_name(topo: GpuTopology, i: int, j: int) -> str:
    return f"GPU{topo.gpus[i].index}-GPU{topo.gpus[j].index}"


def _nvlink(topo: GpuTopology) -> PathInfo:
    n = len(topo.gpus)
    if n < 2:
        return PathInfo("nvlink", False, _no_gpu(topo) if n == 0 else "one GPU: no peer")
    pairs = _pairs(topo)
    joined = [(i, j, _nv(topo, i, j)) for i, j in pairs if _nv(topo, i, j) > 0]
    if not joined:
        return PathInfo("nvlink", False, f"no NVLink between the {n} GPUs (PCIe only)")
    counts = sorted({c for _, _, c in joined})
    each = f"NV{counts[0]}" if len(counts) == 1 else f"NV{counts[0]}-NV{counts[-1]}"
    if len(joined) == len(pairs):
        return PathInfo("nvlink", True, f"NVLink between every pair of the {n} GPUs ({each})",
                        (f"{n} GPUs, every pair {each}",))
    return PathInfo("nvlink", True, f"NVLink between {len(joined)} of the {len(pairs)} GPU pairs ({each}); "
                    "the others over PCIe", tuple(f"{_pair_name(topo, i, j)} NV{c}" for i, j, c in joined))


def _p2p_failure(topo: GpuTopology, i: int, j: int) -> str:
    """Why P2P between GPU i and j is known not to work: the probe's result, else NVML's status (as
    ``PeerInfo.p2p_usable`` ranks them)."""
    peers = (topo.peers[i][j], topo.peers[j][i])
    for p in peers:
        if p.probed is False:
            return f"the P2P probe failed ({p.probe or 'no detail'})"
    for p in peers:
        if p.probed is None and p.p2p_reported is False:
            code = p.p2p_read if p.p2p_read != 0 else p.p2p_write
            return f"NVML reports P2P {P2P_STATUS_TEXT.get(code, f'status {code}')}"
    return "P2P unusable"


def _pcie(topo: GpuTopology) -> PathInfo:
    n = len(topo.gpus)
    if n < 2:
        return PathInfo("pcie", False, _no_gpu(topo) if n == 0 else "one GPU: no peer")
    plain = [(i, j) for i, j in _pairs(topo) if _nv(topo, i, j) == 0]
    if not plain:
        return PathInfo("pcie", False, "every GPU pair has NVLink: NCCL's P2P goes over NVLink, not PCIe")
    ok = [(i, j) for i, j in plain if topo.p2p_usable(i, j) is not False and topo.p2p_usable(j, i) is not False]
    if not ok:
        i, j = plain[0]
        more = f" (and {len(plain) - 1} more pair(s))" if len(plain) > 1 else ""
        return PathInfo("pcie", False, f"P2P over PCIe not supported between {_pair_name(topo, i, j)} "
                        f"({topo.peers[i][j].pci or 'N/A'}): {_p2p_failure(topo, i, j)}{more}")
    known = all(topo.p2p_usable(i, j) for i, j in ok)
    rel = sorted({topo.peers[i][j].pci or "N/A" for i, j in ok})
    return PathInfo("pcie", True, f"GPU P2P over PCIe ({', '.join(rel)}) between {len(ok)} GPU pair(s); "
                    + ("P2P reported usable" if known else "P2P not confirmed (no NVML report or probe)"),
                    tuple(_pair_name(topo, i, j) for i, j in ok))


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001 - no torch or a broken CUDA install both mean: no CUDA device
        log.info("paths: torch.cuda.device_count() failed: %s", e)
        return 0


def _cuda_ipc(topo: GpuTopology, cuda_devices: int, ipc_why_not: str | None, live: bool) -> PathInfo:
    if cuda_devices <= 0:
        why = " (torch.cuda.is_available() is False)" if live else f": {_no_gpu(topo)}"
        return PathInfo("cuda-ipc", False, f"no CUDA GPU{why}")
    if ipc_why_not:
        return PathInfo("cuda-ipc", False, f"the ipc transport is not available: {ipc_why_not}")
    return PathInfo("cuda-ipc", True, f"CUDA IPC between ranks' GPU memory ({cuda_devices} CUDA device(s); "
                    "two ranks on one GPU can use it too)", tuple(f"cuda:{k}" for k in range(cuda_devices)))


# --------------------------------------------------------------------------------------- host memory

def _shm(root: str, live: bool) -> PathInfo:
    d = os.path.join(root, "dev", "shm")
    if not os.path.isdir(d):
        return PathInfo("shm", False, "no /dev/shm")
    if not live:
        return PathInfo("shm", True, "POSIX shared memory in /dev/shm", ("/dev/shm",))
    if not os.access(d, os.W_OK | os.X_OK):
        return PathInfo("shm", False, "/dev/shm is not writable by this user")
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    # Docker's default /dev/shm is 64 MiB: enough to start, too small for large messages
    small = "; small: docker run --shm-size or --ipc=host" if free < 1 << 30 else ""
    return PathInfo("shm", True, f"POSIX shared memory in /dev/shm ({free / (1 << 30):.1f} GiB free{small})",
                    ("/dev/shm",))


# ----------------------------------------------------------------------------------------------- RDMA

def _gdr(root: str) -> bool | None:
    mods = sysfs_path(root, "module")
    if not os.path.isdir(mods):
        return None
    return any(os.path.isdir(os.path.join(mods, m)) for m in _PEERMEM)


def _roce_v2_gid_index(root: str, nic: NicInfo) -> int | None:
    """The first GID index of the port whose type is "RoCE v2" and whose GID is an IPv4-mapped address
    (::ffff:a.b.c.d): NCCL's default address family is IPv4."""
    port = sysfs_path(root, "class", "infiniband", nic.name, "ports", str(nic.port or 1))
    types = os.path.join(port, "gid_attrs", "types")
    if not os.path.isdir(types):
        return None
    for k in sorted((int(x) for x in os.listdir(types) if x.isdigit())):
        # unused entries are unreadable (EINVAL): read_sysfs_file gives None
        if read_sysfs_file(os.path.join(types, str(k))) != "RoCE v2":
            continue
        gid = (read_sysfs_file(os.path.join(port, "gids", str(k))) or "").replace(":", "").lower()
        if len(gid) == 32 and gid[:20] == "0" * 20 and gid[20:24] == "ffff" and gid[24:] != "0" * 8:
            return k
    return None


def _rates(nics: Sequence[NicInfo]) -> str:
    by: dict[str, int] = {}
    for n in nics:
        key = f"{n.rate_gbps:g} Gb/s" if n.rate_gbps is not None else "an unknown rate"
        by[key] = by.get(key, 0) + 1
    return ", ".join(f"{c} port{'s' if c > 1 else ''} at {r}" for r, c in by.items())


def _rdma(path: str, rdma: Sequence[NicInfo], root: str, gdr: bool | None, default_if: str | None) -> PathInfo:
    kind = _RDMA_KINDS[path]
    if not rdma:
        base = sysfs_path(root, "class", "infiniband")
        why = f"no RDMA device: /sys/class/infiniband {'is empty' if os.path.isdir(base) else 'does not exist'}"
        if path == "roce":  # a soft RoCE device lets NCCL's IB transport run over any Ethernet port
            why += f" (soft RoCE: rdma link add rxe0 type rxe netdev {default_if or 'eth0'})"
        return PathInfo(path, False, why)
    mine = [n for n in rdma if n.kind == kind]
    if not mine:
        names = ", ".join(dict.fromkeys(n.name for n in rdma))
        kinds = ", ".join(dict.fromkeys(n.kind for n in rdma))
        return PathInfo(path, False, f"no {kind} port: the RDMA ports ({names}) are {kinds}")
    up = [n for n in mine if n.state == "ACTIVE"]
    if not up:
        return PathInfo(path, False, f"{kind} port(s) down: " + ", ".join(f"{n.label} ({n.state})" for n in mine))
    parts = [_rates(up)]
    gid = None
    if path == "roce":
        netdevs = [d for n in up for d in n.netdevs]
        if netdevs:
            parts[0] += f" over {', '.join(netdevs)}"
        found = {n.label: _roce_v2_gid_index(root, n) for n in up}
        gid = next((g for g in found.values() if g is not None), None)
        if gid is None:
            parts.append("no RoCE v2 GID with an IPv4 address (give the netdev an IPv4 address)")
        elif len(set(found.values())) == 1:
            parts.append(f"RoCE v2 GID index {gid} (NCCL_IB_GID_INDEX={gid})")
        else:
            parts.append("RoCE v2 GID index per port: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    if gdr is not None:
        parts.append("GPUDirect RDMA: " + ("nvidia_peermem loaded" if gdr else
                                           "no nvidia_peermem module (DMA-BUF may still allow it)"))
    return PathInfo(path, True, "; ".join(parts), tuple(f"{n.name}:{n.port or 1}" for n in up), gdr, gid)


# --------------------------------------------------------------------------------------------- socket

def _default_route(root: str) -> str | None:
    """The interface of the first default route (Destination 00000000) in ``proc/net/route``."""
    try:
        with open(os.path.join(root, "proc", "net", "route")) as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 1 and fields[1] == "00000000":
            return fields[0]
    return None


def _up_interfaces(root: str) -> tuple[list[str], bool]:
    """Non-loopback interfaces that are up, naturally sorted, and whether lo exists."""
    base = sysfs_path(root, "class", "net")
    names = sorted(os.listdir(base), key=natural_key) if os.path.isdir(base) else []
    up = []
    for name in names:
        if name == "lo" or name.startswith(_SKIP_IF):
            continue
        d = os.path.join(base, name)
        state = read_sysfs_file(os.path.join(d, "operstate"))
        # tunnels and some virtual NICs report "unknown" while working; carrier says whether they are
        if state == "up" or (state == "unknown" and read_sysfs_file(os.path.join(d, "carrier")) == "1"):
            up.append(name)
    return up, "lo" in names


def _socket(root: str, default_if: str | None) -> PathInfo:
    up, lo = _up_interfaces(root)
    if not up:
        if lo:
            return PathInfo("socket", True, "TCP over lo only: ranks on one node", ("lo",))
        return PathInfo("socket", False, "no network interface up under /sys/class/net")
    if default_if in up:
        up.remove(default_if)
        up.insert(0, default_if)
        what = f"TCP over {default_if} (the default route)"
    else:
        what = f"TCP over {', '.join(up)} (no default route found)"
    if len(up) > 1 and default_if == up[0]:
        rest = up[1:]
        what += f"; also up: {', '.join(rest)}" if len(rest) <= 3 else f"; {len(rest)} other interfaces up"
    if lo:
        what += "; lo between ranks on one node"
    return PathInfo("socket", True, what, tuple(up))
