"""The notations every source of topology shares: PCI bus ids, kernel cpulists, "N/A", natural sort order."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def is_bus_id(text: str) -> bool:
    """Whether ``text`` is a PCI address (domain:bus:device.function, in sysfs' or NVML's spelling).

    Args:
        text: a candidate, e.g. a directory name under ``/sys/bus/pci/devices``.

    Returns:
        True for ``"0000:18:00.0"`` or ``"00000000:1B:00.0"``, False for ``"pci0000:15"`` or ``"net"``.
    """
    return _BDF.match(text) is not None


def normalize_bus_id(bus_id: str | bytes) -> str:
    """PCI address as sysfs spells it: ``"00000000:1B:00.0"`` (NVML) -> ``"0000:1b:00.0"``.

    Args:
        bus_id: a PCI address as NVML, nvidia-smi or sysfs gives it; bytes and a trailing NUL are accepted.

    Returns:
        The address with a 4-digit domain and lower-case hex digits.

    Raises:
        ValueError: ``bus_id`` is not domain:bus:device.function.
    """
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    m = _BDF.match(bus_id.strip().rstrip("\x00"))
    if m is None:
        raise ValueError(f"not a PCI bus id: {bus_id!r} (expected domain:bus:device.function, "
                         f"e.g. 0000:18:00.0)")
    dom, bus, dev, fn = m.groups()
    return f"{int(dom, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def parse_cpulist(cpulist: str) -> frozenset[int]:
    """The CPUs of a kernel cpulist such as ``"0-55,112-167"`` (``local_cpulist``, ``cpu/online``).

    Args:
        cpulist: comma-separated CPU numbers and inclusive ranges; "" is the empty set.

    Returns:
        The CPU numbers.

    Raises:
        ValueError: a part is not a number or a range of numbers.
    """
    cpus: set[int] = set()
    for part in cpulist.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi) + 1) if hi else (int(lo),))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """A kernel cpulist for a set of CPUs: ``{0, 1, 2, 5}`` -> ``"0-2,5"`` (inverse of :func:`parse_cpulist`).

    Args:
        cpus: CPU numbers, in any order.

    Returns:
        Consecutive numbers as ranges, in increasing order; "" for no CPU.
    """
    parts: list[str] = []
    ordered = sorted(set(cpus))
    start = 0
    for k in range(1, len(ordered) + 1):
        if k == len(ordered) or ordered[k] != ordered[k - 1] + 1:
            lo, hi = ordered[start], ordered[k - 1]
            parts.append(str(lo) if lo == hi else f"{lo}-{hi}")
            start = k
    return ",".join(parts)


def cpulist_count(cpulist: str) -> int:
    """Number of CPUs in a kernel cpulist such as ``"0-55,112-167"`` (112).

    Args:
        cpulist: see :func:`parse_cpulist`.

    Returns:
        How many distinct CPUs it names.
    """
    return len(parse_cpulist(cpulist))


def natural_key(s: str) -> list:
    """Sort key that puts mlx5_2 before mlx5_10.

    Args:
        s: a device or interface name.

    Returns:
        Its runs of digits as ints and the text between them as str, for ``sorted(..., key=natural_key)``.
    """
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def or_na(value: Any, none: str = "N/A") -> str:
    """``str(value)``, or nvidia-smi's "N/A" (or ``none``) for None.

    Args:
        value: anything; None means unknown.
        none: what to write for None.

    Returns:
        The text of a table cell.
    """
    return none if value is None else str(value)
