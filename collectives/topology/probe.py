"""P2P as actually usable: tried between every pair of CUDA devices with torch.cuda, not only as reported.

Creates a CUDA context on every visible GPU, so it runs only when asked (``moecomm topo --probe``,
``detect(probe=True)``); without CUDA or with fewer than two devices it adds a note and changes nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .model import GpuTopology

# probe(cuda_a, cuda_b) -> (P2P from a to b worked, what was tried)
ProbeFn = Callable[[int, int], tuple[bool, str]]


def probe_p2p(topo: GpuTopology, *, copy: bool = True, probe: ProbeFn | None = None,
              cuda_devices: dict[int, int] | None = None) -> GpuTopology:
    """A copy of ``topo`` whose peers carry ``probed``/``probe`` where the probe could run.

    Default: torch.cuda, on the CUDA devices of this process (mapped to topology GPUs by PCI bus id);
    per ordered pair ``can_device_access_peer`` and, with ``copy``, a 1 MiB peer copy of random bytes
    checked on the host.

    Args:
        topo: the topology to annotate.
        copy: also do the checked peer copy, not only ask CUDA.
        probe: replaces the torch probe (tests, other frameworks).
        cuda_devices: topology GPU index -> CUDA ordinal; replaces the mapping by bus id.

    Returns:
        The annotated copy, with "probe" among its sources and ``cuda_device`` set on mapped GPUs; or
        ``topo`` plus a note saying why nothing was probed.
    """
    if probe is None or cuda_devices is None:
        try:
            import torch
        except ImportError:
            return _note(topo, "P2P not probed: torch is not importable")
        if not torch.cuda.is_available():
            return _note(topo, "P2P not probed: CUDA is not available to torch")
        if cuda_devices is None:
            cuda_devices, unmapped = _map_cuda_devices(topo, torch)
            if unmapped:
                topo = _note(topo, f"CUDA device(s) {unmapped} could not be matched to a topology GPU by bus id")
        if probe is None:
            probe = lambda a, b: _torch_probe(torch, a, b, copy)  # noqa: E731
    gpus = list(topo.gpus)
    for gi, dev in cuda_devices.items():
        gpus[gi] = replace(gpus[gi], cuda_device=dev)
    if len(cuda_devices) < 2:
        return replace(topo, gpus=tuple(gpus), notes=topo.notes + (
            f"P2P not probed: {len(cuda_devices)} CUDA device(s) visible, a pair is needed",))
    peers = [list(r) for r in topo.peers]
    for i, a in cuda_devices.items():
        for j, b in cuda_devices.items():
            if i != j:
                ok, how = probe(a, b)
                peers[i][j] = replace(peers[i][j], probed=bool(ok), probe=how)
    sources = topo.sources + (() if "probe" in topo.sources else ("probe",))
    return replace(topo, gpus=tuple(gpus), peers=tuple(tuple(r) for r in peers), sources=sources)


def _note(topo: GpuTopology, note: str) -> GpuTopology:
    return replace(topo, notes=topo.notes + (note,))


def _map_cuda_devices(topo: GpuTopology, torch: Any) -> tuple[dict[int, int], list[int]]:
    """topology GPU index -> CUDA ordinal, by PCI bus id (torch >= 2.x exposes pci_domain/bus/device_id)."""
    out, unmapped = {}, []
    for d in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(d)
        try:
            bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            out[topo.gpus.index(topo.gpu_by_bus_id(bus))] = d
        except (AttributeError, KeyError):
            unmapped.append(d)
    return out, unmapped


def _torch_probe(torch: Any, a: int, b: int, copy: bool) -> tuple[bool, str]:
    if not torch.cuda.can_device_access_peer(a, b):
        return False, "can_device_access_peer"
    if not copy:
        return True, "can_device_access_peer"
    gen = torch.Generator().manual_seed(1000 * a + b)
    host = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)
    src = host.to(f"cuda:{a}")
    dst = torch.empty_like(src, device=f"cuda:{b}")
    dst.copy_(src)  # device-to-device: peer access when the driver allows it
    torch.cuda.synchronize(b)
    return bool(torch.equal(dst.cpu(), host)), "can_device_access_peer+checked copy"
