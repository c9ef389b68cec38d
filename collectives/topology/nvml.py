"""NVML: what the driver says about GPUs, NVLinks, P2P and PCI ancestry, as a JSON-able snapshot.

:func:`read_nvml` asks the live driver through ``pynvml`` (the optional ``nvidia-ml-py`` package, NVIDIA's
ctypes binding of libnvidia-ml); :func:`nvml_snapshot` turns any NVML-like object into the dict that
``nvml.json`` recordings hold, and :class:`NvmlReplay` answers like NVML from such a dict.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# NVML_NVLINK_MAX_LINKS in nvml.h as of CUDA 12 (Hopper and Blackwell have 18 links per GPU)
NVML_NVLINK_MAX_LINKS = 18
# NVML_P2P_CAPS_INDEX_*. Spelled out here because pynvml's NVML_P2P_CAPS_INDEX_READ is the tuple (0,)
# (a trailing comma in its source), which NVML rejects as an argument.
P2P_CAPS = {"read": 0, "write": 1, "nvlink": 2, "atomics": 3}
# nvmlGpuP2PStatus_t, abbreviated as `nvidia-smi topo -p2p` does
P2P_STATUS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DIS", 5: "NS", 6: "U"}
P2P_STATUS_TEXT = {0: "ok", 1: "chipset not supported", 2: "GPU not supported",
                   3: "IOH topology not supported", 4: "disabled by regkey", 5: "not supported", 6: "unknown"}
# nvmlIntNvLinkDeviceType_t
NVLINK_REMOTE = {0: "GPU", 1: "CPU", 2: "NVSWITCH", 255: "UNKNOWN"}
# nvmlGpuTopologyLevel_t -> matrix cell. INTERNAL (two GPUs on one board) sits behind the board's own bridge.
NVML_LEVEL = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def _text(v: Any) -> str:
    return (v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)).rstrip("\x00")


def nvml_snapshot(nvml: Any) -> dict:
    """Every NVML answer this package uses, as a JSON-able dict (the format of ``nvml.json`` recordings).

    P2P statuses are asked for every ordered pair (they can be asymmetric); NVLinks for link
    0..NVML_NVLINK_MAX_LINKS-1 (a link that raises is absent, e.g. on PCIe-only GPUs). A function that is
    missing (an older pynvml or driver) or raises NVMLError is recorded as None.

    Args:
        nvml: the ``pynvml`` module after ``nvmlInit()``, or anything with the same functions
            (:class:`NvmlReplay`).

    Returns:
        ``{"format": 1, "driver_version", "devices": [...], "p2p": {"i,j": {...}}, "common_ancestor":
        {"i,j": level}}``; strings as NVML gives them (bus ids like "00000000:1B:00.0"),
        :func:`~collectives.topology.detect.build_topology` normalises them.
    """
    errors = tuple(e for e in (getattr(nvml, "NVMLError", None),) if isinstance(e, type)) or (Exception,)

    def ask(fn: str, *args: Any) -> Any:
        f = getattr(nvml, fn, None)
        if f is None:  # an older pynvml or driver without this function
            return None
        try:
            return f(*args)
        except errors as e:
            log.debug("NVML %s%s: %s", fn, args[1:], e)
            return None

    snap: dict = {"format": 1, "driver_version": None, "devices": [], "p2p": {}, "common_ancestor": {}}
    drv = ask("nvmlSystemGetDriverVersion")
    snap["driver_version"] = None if drv is None else _text(drv)
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    for i, h in enumerate(handles):
        uuid, name = ask("nvmlDeviceGetUUID", h), ask("nvmlDeviceGetName", h)
        dev = {"index": i, "name": "unknown" if name is None else _text(name),
               "uuid": None if uuid is None else _text(uuid),
               "pci_bus_id": _text(nvml.nvmlDeviceGetPciInfo(h).busId), "nvlinks": []}
        for link in range(NVML_NVLINK_MAX_LINKS):
            state = ask("nvmlDeviceGetNvLinkState", h, link)
            if state is None:
                continue
            entry: dict = {"link": link, "active": bool(state), "remote_type": None, "remote_bus_id": None}
            if state:
                entry["remote_type"] = ask("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
                pci = ask("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
                if pci is not None:
                    entry["remote_bus_id"] = _text(pci.busId)
            dev["nvlinks"].append(entry)
        snap["devices"].append(dev)
    for i, hi in enumerate(handles):
        for j, hj in enumerate(handles):
            if i == j:
                continue
            snap["p2p"][f"{i},{j}"] = {k: ask("nvmlDeviceGetP2PStatus", hi, hj, idx) for k, idx in P2P_CAPS.items()}
            if i < j:
                snap["common_ancestor"][f"{i},{j}"] = ask("nvmlDeviceGetTopologyCommonAncestor", hi, hj)
    return snap


class NvmlReplayError(Exception):
    """What :class:`NvmlReplay` raises where the recording has no answer (as NVML raises NotSupported)."""


@dataclass(frozen=True)
class _PciInfo:
    busId: str  # noqa: N815 (NVML's field name)


class NvmlReplay:
    """An NVML-like object answering from an :func:`nvml_snapshot` dict, so recordings replay exactly.

    Handles are GPU indices; the ``nvml*`` methods answer as pynvml's functions of the same names do.
    """

    NVMLError = NvmlReplayError

    def __init__(self, snapshot: dict):
        """Args:
            snapshot: a dict as :func:`nvml_snapshot` returns it.
        """
        self._s = snapshot
        self._links = [{e["link"]: e for e in d["nvlinks"]} for d in snapshot["devices"]]

    def _dev(self, h: int) -> dict:
        return self._s["devices"][h]

    def _link(self, h: int, link: int) -> dict:
        if link not in self._links[h]:
            raise NvmlReplayError(f"GPU {h} link {link}: not supported")
        return self._links[h][link]

    @staticmethod
    def _given(v: Any, what: str) -> Any:
        if v is None:
            raise NvmlReplayError(f"{what}: not recorded")
        return v

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._given(self._s.get("driver_version"), "driver version")

    def nvmlDeviceGetCount(self) -> int:
        return len(self._s["devices"])

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if not 0 <= i < len(self._s["devices"]):
            raise NvmlReplayError(f"no GPU {i}")
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._dev(h)["name"]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._given(self._dev(h).get("uuid"), "uuid")

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return _PciInfo(self._dev(h)["pci_bus_id"])

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        return int(self._link(h, link)["active"])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return self._given(self._link(h, link).get("remote_type"), "remote device type")

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return _PciInfo(self._given(self._link(h, link).get("remote_bus_id"), "remote PCI info"))

    def nvmlDeviceGetP2PStatus(self, h1: int, h2: int, index: int) -> int:
        if not isinstance(index, int):
            raise TypeError(f"P2P caps index must be an int, got {index!r}")
        name = {v: k for k, v in P2P_CAPS.items()}[index]
        return self._given(self._s["p2p"].get(f"{h1},{h2}", {}).get(name), f"P2P {name} {h1}->{h2}")

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: int, h2: int) -> int:
        key = f"{min(h1, h2)},{max(h1, h2)}"
        return self._given(self._s["common_ancestor"].get(key), f"common ancestor {key}")


def read_nvml() -> tuple[dict | None, str | None]:
    """Ask the live driver through pynvml.

    Returns:
        (snapshot, None) as :func:`nvml_snapshot` returns it, or (None, why not): pynvml not installed,
        no driver, or a query that failed.
    """
    try:
        import pynvml  # the nvidia-ml-py package; optional
    except ImportError:
        return None, "NVML not consulted: pynvml is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded: no driver on this machine
        return None, f"NVML not available: {e}"
    try:
        return nvml_snapshot(pynvml), None
    except Exception as e:
        return None, f"NVML query failed: {type(e).__name__}: {e}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
