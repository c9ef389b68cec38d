"""Machines the performance model knows: links, systems, the six presets and system files.

A :class:`System` is one node type (all nodes alike) and its fabric: the GPU<->GPU link inside a
node (:attr:`System.intra`, NVLink through NVSwitch or PCIe, per GPU, one direction) and the
network card (:attr:`System.nic`, one card) with :attr:`System.nics_per_node` of them laid out
rail-optimised (NIC i serves GPU i; with more NICs than GPUs each GPU owns several, with fewer,
several GPUs share one). Units: GB/s = 1e9 B/s one direction, microseconds.

Bandwidths are *usable* figures, the ones NCCL's own model uses where it has one (NVLink: links per
GPU x the per-link constant of NVIDIA/nccl v2.30.7 ``src/graph/topo.h``, which already folds in
protocol overhead: 18 x 20.6 = 370.8 GB/s on H100 against a 450 GB/s line rate) and measured
per-NIC throughput where one is published (shared ANCHORS.md). Every preset number carries its
source in :attr:`System.sources` and in a comment.

Latencies: :attr:`Link.latency_us` is the link's per-hop latency for NCCL's ring Simple protocol
(NVIDIA/nccl v2.30.7 ``src/graph/tuning.cc`` hwLatencies: NVLink 3.4, PCI 5.7, NET 14.0 us). The
rest of NCCL's per-algorithm/per-protocol table of that link class is used as is, shifted the way
NCCL shifts it for a network plugin that reports a latency (``graph->latencyInter``: added once per
hop, twice for Simple, whose receive also waits for a flush): a link with ``latency_us = L`` adds
``(L - reference) / 2`` per hop, ``L - reference`` for Simple. InfiniBand reports no latency
(src/transport/net_ib/init.cc, "Not set"), so the presets' IB, NVLink and PCIe links carry exactly
NCCL's reference values; EFA carries more (see EFA_200G).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

# NCCL v2.30.7 src/graph/tuning.cc, hwLatencies[NCCL_HW_*][NCCL_ALGO_RING][NCCL_PROTO_SIMPLE]:
# the per-hop ring Simple latency of each link class (see the module docstring).
NVLINK_HOP_US = 3.4
PCI_HOP_US = 5.7
NET_HOP_US = 14.0

ARCHES = ("sm80", "sm86", "sm89", "sm90", "sm100", "host")
CPU_VENDORS = ("intel", "amd")
PROTOCOLS = ("LL", "LL128", "Simple")  # NCCL's, in its order (NCCL_PROTO names)


@dataclass(frozen=True)
class Link:
    """One kind of link.

    Attributes:
        name: ``"nvlink3"``, ``"nvlink4"``, ``"nvlink5"``, ``"pcie-gen4"``, ``"hdr-200g"``,
            ``"ndr-400g"``, ``"efa-200g"``, ``"shm"``... A name starting with ``nvlink`` makes
            the link NVLink for the model, ``pcie`` PCIe; anything else is host memory.
        bandwidth_gbps: usable GB/s (1e9 B/s), one direction, per GPU (per NIC for a NIC).
        latency_us: per-hop latency of NCCL's ring Simple protocol over this link, us (NCCL's
            reference for the link class plus twice a network plugin's reported latency).
    """

    name: str
    bandwidth_gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Link.name must be a non-empty string, got {self.name!r}")
        for attr in ("bandwidth_gbps", "latency_us"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"Link {self.name!r}: {attr} must be a finite number, got {value!r}")
        if self.bandwidth_gbps <= 0:
            raise ValueError(f"Link {self.name!r}: bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")
        if self.latency_us < 0:
            raise ValueError(f"Link {self.name!r}: latency_us must be >= 0, got {self.latency_us}")

    @property
    def kind(self) -> str:
        """``"nvlink"``, ``"pcie"``, ``"network"`` or ``"host"``: the class NCCL's tables know it by."""
        lowered = self.name.lower()
        if lowered.startswith("nvlink"):
            return "nvlink"
        if lowered.startswith("pcie"):
            return "pcie"
        if lowered.startswith("shm") or lowered.startswith("host"):
            return "host"
        return "network"

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "bandwidth_gbps", "latency_us"}``."""
        return {"name": self.name, "bandwidth_gbps": self.bandwidth_gbps, "latency_us": self.latency_us}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Link":
        """Inverse of :meth:`to_dict`; a missing or unknown key raises ValueError naming it."""
        _check_keys(d, {"name", "bandwidth_gbps", "latency_us"}, set(), "link")
        return cls(name=d["name"], bandwidth_gbps=float(d["bandwidth_gbps"]), latency_us=float(d["latency_us"]))


@dataclass(frozen=True)
class System:
    """One node type and its fabric (every node alike).

    Attributes:
        name: preset or file name (``"dgx-h100"``).
        description: one line for ``moecomm predict --list-systems``.
        gpus_per_node: GPUs (ranks) per node.
        arch: ``"sm80"``, ``"sm86"``, ``"sm89"``, ``"sm90"``, ``"sm100"`` or ``"host"``; picks
            NCCL's per-architecture constants (sm8x -> Ampere, sm90 -> Hopper, sm100 -> Blackwell).
        intra: GPU<->GPU link inside a node, per GPU (NVLink through NVSwitch, or PCIe).
        nic: one network card; None for a machine that is only ever one node.
        nics_per_node: NICs per node, rail-optimised.
        nvls: NVLink SHARP (NVSwitch multicast and in-switch reduction) available.
        nvls_efficiency: NCCL's NVLS efficiency factor (tuning.cc ``nvlsEfficiency``); 0 without NVLS.
        memory_gbps: device memory bandwidth, GB/s (staging copies of the ipc kernels); 0 = unknown.
        cpu_vendor: ``"intel"`` or ``"amd"``: NCCL's multi-node LL ceiling and network post overhead
            depend on it (tuning.cc ``llMaxBws``, ``getNetOverhead``).
        network_protocols: the NCCL protocols a job of several nodes may use (default all three).
            ``("Simple",)`` where the network plugin sets ``NCCL_PROTO=simple`` for the job, as
            aws-ofi-nccl does on EFA without in-order 128-byte delivery (p4d/p4de).
        sources: field name -> where its number comes from.
        calibration: fitted alpha-beta terms (from :func:`collectives.model.calibrate`): op -> list of
            ``{"algorithm", "ranks", "alpha_us", "beta_us_per_byte"[, "protocol", "min_bytes",
            "max_bytes"]}``; when non-empty, :func:`~collectives.model.predict_collective` uses these
            terms instead of the analytical model. Treat as read-only.
    """

    name: str
    description: str
    gpus_per_node: int
    arch: str
    intra: Link
    nic: Link | None
    nics_per_node: int
    nvls: bool
    nvls_efficiency: float = 0.0
    memory_gbps: float = 0.0
    cpu_vendor: str = "intel"
    network_protocols: tuple[str, ...] = PROTOCOLS
    sources: Mapping[str, str] = field(default_factory=dict, hash=False)
    calibration: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        where = f"system {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"System.name must be a non-empty string, got {self.name!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"{where}: gpus_per_node must be an integer >= 1, got {self.gpus_per_node!r}")
        if self.arch not in ARCHES:
            raise ValueError(f"{where}: arch must be one of {', '.join(ARCHES)}, got {self.arch!r}")
        if not isinstance(self.intra, Link):
            raise ValueError(f"{where}: intra must be a Link, got {type(self.intra).__name__}")
        if self.nic is not None and not isinstance(self.nic, Link):
            raise ValueError(f"{where}: nic must be a Link or None, got {type(self.nic).__name__}")
        if isinstance(self.nics_per_node, bool) or not isinstance(self.nics_per_node, int) or self.nics_per_node < 0:
            raise ValueError(f"{where}: nics_per_node must be an integer >= 0, got {self.nics_per_node!r}")
        if (self.nic is None) != (self.nics_per_node == 0):
            raise ValueError(f"{where}: give both nic and nics_per_node >= 1, or nic=None and nics_per_node=0 "
                             f"(got nic={self.nic!r}, nics_per_node={self.nics_per_node})")
        if self.nvls and not 0 < self.nvls_efficiency <= 1:
            raise ValueError(f"{where}: nvls=True needs 0 < nvls_efficiency <= 1, got {self.nvls_efficiency}")
        if self.memory_gbps < 0:
            raise ValueError(f"{where}: memory_gbps must be >= 0, got {self.memory_gbps}")
        if self.cpu_vendor not in CPU_VENDORS:
            raise ValueError(f"{where}: cpu_vendor must be one of {', '.join(CPU_VENDORS)}, got {self.cpu_vendor!r}")
        if (not isinstance(self.network_protocols, tuple) or not self.network_protocols
                or not set(self.network_protocols) <= set(PROTOCOLS)):
            raise ValueError(f"{where}: network_protocols must be a non-empty tuple of {', '.join(PROTOCOLS)}, "
                             f"got {self.network_protocols!r}")
        if not isinstance(self.calibration, Mapping):
            raise ValueError(f"{where}: calibration must be a mapping op -> list of terms")

    # ---- derived figures --------------------------------------------------------------------
    def nic_bandwidth_per_gpu(self) -> float:
        """GB/s of network one GPU drives when every GPU of the node sends at once (rail layout).

        Returns:
            ``nic.bandwidth_gbps * nics_per_node / gpus_per_node`` (p5en: 2 x 200G EFA per GPU;
            a PCIe box with 4 NICs for 8 GPUs: half a NIC), 0.0 without a NIC.
        """
        if self.nic is None:
            return 0.0
        return self.nic.bandwidth_gbps * self.nics_per_node / self.gpus_per_node

    @property
    def network_is_efa(self) -> bool:
        """Whether the node's NICs are AWS EFA (a Link named ``efa...``): no GPU-initiated RDMA (IBGDA)."""
        return self.nic is not None and self.nic.name.startswith("efa")

    def nic_bandwidth_per_node(self) -> float:
        """GB/s of all the node's NICs together (0.0 without a NIC)."""
        return self.nic.bandwidth_gbps * self.nics_per_node if self.nic is not None else 0.0

    def all_to_all_nic_bandwidth_per_gpu(self) -> float:
        """GB/s of network one GPU drives in all_to_all: at most ONE NIC per GPU.

        NCCL's point-to-point operations use one NIC per GPU, so all_to_all cannot aggregate the
        second 200G EFA card of a p5en GPU (NVIDIA/nccl-tests#267).

        Returns:
            ``nic.bandwidth_gbps * min(1, nics_per_node / gpus_per_node)``, 0.0 without a NIC.
        """
        if self.nic is None:
            return 0.0
        return self.nic.bandwidth_gbps * min(1.0, self.nics_per_node / self.gpus_per_node)

    @property
    def compcap_index(self) -> int:
        """NCCL's architecture row: 1 Ampere (sm8x and host), 2 Hopper, 3 Blackwell (tuning.cc)."""
        return {"sm90": 2, "sm100": 3}.get(self.arch, 1)

    # ---- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict; :meth:`from_dict` gives an equal System back."""
        d: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Link):
                value = value.to_dict()
            elif isinstance(value, Mapping):
                value = json.loads(json.dumps(dict(value)))  # a deep, plain copy
            elif isinstance(value, tuple):
                value = list(value)
            d[f.name] = value
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "System":
        """A System from :meth:`to_dict`'s form (or a hand-written system file).

        Required keys: name, description, gpus_per_node, arch, intra, nic, nics_per_node, nvls;
        the others default. A missing or unknown key, or a bad value, raises ValueError naming it.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"a system description must be a JSON object, got {type(d).__name__}")
        required = {"name", "description", "gpus_per_node", "arch", "intra", "nic", "nics_per_node", "nvls"}
        optional = {f.name for f in fields(cls)} - required
        _check_keys(d, required, optional, "system")
        kwargs = dict(d)
        kwargs["intra"] = Link.from_dict(d["intra"])
        kwargs["nic"] = Link.from_dict(d["nic"]) if d["nic"] is not None else None
        kwargs["nvls"] = bool(d["nvls"])
        if "network_protocols" in d:
            protocols = d["network_protocols"]
            if isinstance(protocols, str) or not isinstance(protocols, (list, tuple)):
                raise ValueError(f"network_protocols must be a list of {', '.join(PROTOCOLS)}, got {protocols!r}")
            kwargs["network_protocols"] = tuple(protocols)
        kwargs["sources"] = dict(d.get("sources", {}))
        kwargs["calibration"] = dict(d.get("calibration", {}))
        return cls(**kwargs)


def _check_keys(d: Mapping[str, Any], required: set[str], optional: set[str], what: str) -> None:
    if not isinstance(d, Mapping):
        raise ValueError(f"a {what} must be a JSON object, got {type(d).__name__}")
    missing = sorted(required - set(d))
    unknown = sorted(set(d) - required - optional)
    if missing:
        raise ValueError(f"{what} description lacks {', '.join(missing)} (needs {', '.join(sorted(required))})")
    if unknown:
        raise ValueError(f"{what} description has unknown key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(required | optional))}")


# ---- links of the presets -------------------------------------------------------------------
# NVLink: links per GPU x NCCL's per-link constant (NVIDIA/nccl v2.30.7 src/graph/topo.h
# SM80_NVLINK_BW 20.0, SM90_NVLINK_BW 20.6, SM100_NVLINK_BW 40.1 GB/s); link counts from NVIDIA's
# datasheets (A100 12 NVLink3 links = 600 GB/s bidirectional, H100/H200 18 NVLink4 = 900,
# B200 18 NVLink5 = 1,800). Latency: NCCL's NVLink reference.
NVLINK3 = Link("nvlink3", 12 * 20.0, NVLINK_HOP_US)
NVLINK4 = Link("nvlink4", 18 * 20.6, NVLINK_HOP_US)
NVLINK5 = Link("nvlink5", 18 * 40.1, NVLINK_HOP_US)
# H800 SXM: NVLink4 with 8 links instead of 18 (NVIDIA H800 SXM spec: 400 GB/s bidirectional);
# 8 x 20.6 = 164.8, and DeepEP (deepseek-ai/DeepEP README) measures "~160 GB/s" on it.
NVLINK4_H800 = Link("nvlink4-h800", 8 * 20.6, NVLINK_HOP_US)
# PCIe Gen4 x16: 24 GB/s in NCCL's model (shared ANCHORS.md: PCIe Gen4 x16 = 24 in NCCL's model,
# ~25 GB/s measured). Latency: NCCL's PCI reference.
PCIE_GEN4 = Link("pcie-gen4", 24.0, PCI_HOP_US)
# HDR 200G InfiniBand: ~24 GB/s measured per NIC (NVIDIA/nccl#412, shared ANCHORS.md). Latency:
# NCCL's NET reference (IB reports no extra latency, src/transport/net_ib/init.cc).
HDR_200G = Link("hdr-200g", 24.0, NET_HOP_US)
# NDR 400G InfiniBand: 46-48 GB/s measured per NIC (NVIDIA/nccl-tests#290, shared ANCHORS.md): 47.
NDR_400G = Link("ndr-400g", 47.0, NET_HOP_US)
# EFA. Bandwidth (200G, p5en): no per-NIC measurement at hand; 200 Gb/s = 25 GB/s line rate x 0.94,
# the measured/line ratio of NDR (47/50): an assumption.
# Latency: aws-ofi-nccl reports a per-platform network latency to NCCL (aws/aws-ofi-nccl
# src/platform-aws.cpp, platform table `.latency`: 75 us on p4d/p4de and p5/p5e, 35 us on p5en and
# p6-b200, the latter set "based on empirical search", aws-ofi-nccl 2496e7de), which NCCL adds per
# network hop as graph->latencyInter (NVIDIA/nccl src/graph/search.cc, tuning.cc). Taken literally
# it makes 2x p5 8-byte all_reduce 175 us (69 measured): it is a selection weight. The model keeps
# its ratio between platforms and FITS one scale on one published point,
# 2x p5.48xlarge all_reduce of 8 B = 69.12 us (aws-samples/awsome-distributed-training
# micro-benchmarks/nccl-tests/README.md), which NCCL runs as tree/LL (p5's EFA reports in-order
# 128-byte writes, aws-ofi-nccl ece41f0c): 6.8 + 2 x (7 x 0.6 + (5.0 + x)) = 69.12 -> x = 21.96 us per
# hop for LL (twice that for Simple) = 0.293 x p5's 75 us. In-sample for that point; every other
# EFA point stays out of sample. (Until this per-platform ratio the model used p5's x for every EFA
# generation, which over-predicted 2x p6-b200 by 37%; the ratio was adopted after seeing that miss.)
EFA_P5_PLUGIN_LATENCY_US = 75.0     # aws-ofi-nccl platform table: p4d, p4de, p5/p5e
EFA_P5EN_PLUGIN_LATENCY_US = 35.0   # aws-ofi-nccl platform table: p5en, p6-b200
EFA_EXTRA_HOP_US = (69.12 - 6.8 - 2 * (7 * 0.6 + 5.0)) / 2   # fitted on 2x p5 (see above)
EFA_LATENCY_SCALE = EFA_EXTRA_HOP_US / EFA_P5_PLUGIN_LATENCY_US


def efa_latency_us(plugin_latency_us: float) -> float:
    """Link.latency_us of an EFA card whose aws-ofi-nccl platform entry reports ``plugin_latency_us``.

    NCCL's NET reference plus twice the per-hop extra (the Simple protocol pays it twice), the extra
    being the plugin's figure times :data:`EFA_LATENCY_SCALE` (fitted on 2x p5, see above).
    """
    if isinstance(plugin_latency_us, bool) or not isinstance(plugin_latency_us, (int, float)) or plugin_latency_us < 0:
        raise ValueError(f"plugin_latency_us must be a number >= 0, got {plugin_latency_us!r}")
    return NET_HOP_US + 2 * EFA_LATENCY_SCALE * plugin_latency_us


EFA_200G = Link("efa-200g", 25.0 * 47.0 / 50.0, efa_latency_us(EFA_P5EN_PLUGIN_LATENCY_US))
# 200G Ethernet/IB card on the PCIe box: same usable rate as HDR 200G (NVIDIA/nccl#412), IB latency.
ETH_200G = Link("cx-200g", 24.0, NET_HOP_US)

_NCCL_NVLINK = "NVIDIA/nccl v2.30.7 src/graph/topo.h per-link NVLink bandwidth x links per GPU (NVIDIA datasheet)"
_NCCL_NVLS = "NVIDIA/nccl v2.30.7 src/graph/tuning.cc nvlsEfficiency"
_HBM = "vendor datasheet HBM bandwidth (shared ANCHORS.md: A100 80G 2.0, H100 SXM 3.35, H200 4.8, B200 8.0 TB/s)"

_PRESETS: tuple[System, ...] = (
    System(
        name="dgx-a100", description="8x A100 SXM 80G, NVLink3 (12 links) via NVSwitch, 8x HDR 200G IB",
        gpus_per_node=8, arch="sm80", intra=NVLINK3, nic=HDR_200G, nics_per_node=8, nvls=False,
        memory_gbps=2000.0,   # A100 80G HBM2e ~2.0 TB/s (NVIDIA datasheet)
        cpu_vendor="amd",     # DGX A100: 2x AMD EPYC 7742 (NVIDIA DGX A100 user guide)
        sources={"intra": _NCCL_NVLINK + ": 12 x 20.0", "nic": "HDR ~24 GB/s per NIC measured, NVIDIA/nccl#412",
                 "nics_per_node": "DGX A100 datasheet: 8x ConnectX-6 200Gb/s compute NICs",
                 "memory_gbps": _HBM, "cpu_vendor": "DGX A100 user guide: 2x AMD EPYC 7742"}),
    System(
        name="dgx-h100", description="8x H100 SXM, NVLink4 (18 links) via NVSwitch with NVLS, 8x NDR 400G IB",
        gpus_per_node=8, arch="sm90", intra=NVLINK4, nic=NDR_400G, nics_per_node=8, nvls=True,
        nvls_efficiency=0.85,  # tuning.cc nvlsEfficiency[Hopper]
        memory_gbps=3350.0,    # H100 SXM HBM3 3.35 TB/s (NVIDIA datasheet)
        cpu_vendor="intel",    # DGX H100: 2x Intel Xeon Platinum 8480C (NVIDIA DGX H100 user guide)
        sources={"intra": _NCCL_NVLINK + ": 18 x 20.6", "nic": "NDR 46-48 GB/s per NIC measured, NVIDIA/nccl-tests#290",
                 "nics_per_node": "DGX H100 datasheet: 8x ConnectX-7 400Gb/s (OSFP) compute NICs",
                 "nvls_efficiency": _NCCL_NVLS + "[Hopper] = 0.85", "memory_gbps": _HBM,
                 "cpu_vendor": "DGX H100 user guide: 2x Intel Xeon Platinum 8480C"}),
    System(
        name="dgx-h200", description="8x H200 SXM, NVLink4 (18 links) via NVSwitch with NVLS, 8x NDR 400G IB",
        gpus_per_node=8, arch="sm90", intra=NVLINK4, nic=NDR_400G, nics_per_node=8, nvls=True,
        nvls_efficiency=0.85,  # tuning.cc nvlsEfficiency[Hopper]
        memory_gbps=4800.0,    # H200 HBM3e 4.8 TB/s (NVIDIA datasheet)
        cpu_vendor="intel",    # DGX H200: 2x Intel Xeon Platinum 8480C (same board as DGX H100)
        sources={"intra": _NCCL_NVLINK + ": 18 x 20.6 (same NVLink4/NVSwitch fabric as H100)",
                 "nic": "NDR 46-48 GB/s per NIC measured, NVIDIA/nccl-tests#290",
                 "nics_per_node": "DGX H200 datasheet: 8x ConnectX-7 400Gb/s compute NICs",
                 "nvls_efficiency": _NCCL_NVLS + "[Hopper] = 0.85", "memory_gbps": _HBM,
                 "cpu_vendor": "DGX H200 datasheet: 2x Intel Xeon Platinum 8480C"}),
    System(
        name="b200-8", description="8x B200, NVLink5 (18 links) via NVSwitch with NVLS, 8x 400G (CX-7)",
        gpus_per_node=8, arch="sm100", intra=NVLINK5, nic=NDR_400G, nics_per_node=8, nvls=True,
        nvls_efficiency=0.74,  # tuning.cc nvlsEfficiency[Blackwell]
        memory_gbps=8000.0,    # B200 HBM3e 8.0 TB/s (NVIDIA datasheet)
        cpu_vendor="intel",    # DGX B200: 2x Intel Xeon Platinum 8570 (NVIDIA DGX B200 datasheet)
        sources={"intra": _NCCL_NVLINK + ": 18 x 40.1", "nic": "400G NDR 46-48 GB/s per NIC measured, NVIDIA/nccl-tests#290",
                 "nics_per_node": "DGX B200 datasheet: 8x ConnectX-7 400Gb/s compute NICs",
                 "nvls_efficiency": _NCCL_NVLS + "[Blackwell] = 0.74", "memory_gbps": _HBM,
                 "cpu_vendor": "DGX B200 datasheet: 2x Intel Xeon Platinum 8570"}),
    System(
        name="p5en", description="AWS p5en.48xlarge: 8x H200, NVLink4 via NVSwitch with NVLS, 16x 200G EFA (2 per GPU)",
        gpus_per_node=8, arch="sm90", intra=NVLINK4, nic=EFA_200G, nics_per_node=16, nvls=True,
        nvls_efficiency=0.85,  # tuning.cc nvlsEfficiency[Hopper]
        memory_gbps=4800.0,    # H200 HBM3e 4.8 TB/s (NVIDIA datasheet)
        cpu_vendor="intel",    # p5en: 4th gen Intel Xeon Scalable (Sapphire Rapids), AWS instance page
        sources={"intra": _NCCL_NVLINK + ": 18 x 20.6",
                 "nic": "200 Gb/s EFA = 25 GB/s line x 0.94 (NDR measured/line ratio, nccl-tests#290): assumed; "
                        "latency: aws-ofi-nccl's p5en figure (35 us) x a scale fitted on 2x p5 (systems.EFA_200G)",
                 "nics_per_node": "AWS p5en: 3200 Gbps EFAv3 as 16x 200G (shared ANCHORS.md)",
                 "nvls_efficiency": _NCCL_NVLS + "[Hopper] = 0.85", "memory_gbps": _HBM,
                 "cpu_vendor": "AWS p5en instance page: Intel Sapphire Rapids"}),
    System(
        name="h800-8", description="8x H800 SXM (NVLink4 with 8 links) via NVSwitch with NVLS, 8x NDR 400G IB",
        gpus_per_node=8, arch="sm90", intra=NVLINK4_H800, nic=NDR_400G, nics_per_node=8, nvls=True,
        nvls_efficiency=0.85,  # tuning.cc nvlsEfficiency[Hopper]
        memory_gbps=3350.0,    # H800 SXM HBM3 3.35 TB/s, as H100 SXM (NVIDIA datasheet)
        cpu_vendor="intel",    # assumed: HGX H800 boards ship in Intel Sapphire Rapids hosts like DGX H100
        sources={"intra": _NCCL_NVLINK + ": 8 x 20.6 (H800: 400 GB/s bidirectional NVLink; DeepEP README "
                          "measures ~160 GB/s)",
                 "nic": "NDR 46-48 GB/s per NIC measured, NVIDIA/nccl-tests#290 (DeepEP: CX7 400 Gb/s, ~50 GB/s max)",
                 "nics_per_node": "DeepEP README test machine: one CX7 400G NIC per GPU",
                 "nvls_efficiency": _NCCL_NVLS + "[Hopper] = 0.85", "memory_gbps": _HBM,
                 "cpu_vendor": "assumption"}),
    System(
        name="pcie-l40s-8",
        description="8x L40S on PCIe Gen4 x16 (no NVLink), 4x 200G NICs (one per 2 GPUs); assumed layout",
        gpus_per_node=8, arch="sm89", intra=PCIE_GEN4, nic=ETH_200G, nics_per_node=4, nvls=False,
        memory_gbps=864.0,     # L40S GDDR6 864 GB/s (NVIDIA L40S datasheet)
        cpu_vendor="intel",    # assumed: an Intel dual-socket host
        sources={"intra": "PCIe Gen4 x16 = 24 GB/s in NCCL's model (shared ANCHORS.md); L40S has no NVLink "
                          "(NVIDIA L40S datasheet). Assumes every GPU pair reaches 24 GB/s through PCIe "
                          "switches; a ring crossing the CPU socket link is slower (not modelled)",
                 "nic": "200G card ~24 GB/s usable as HDR (NVIDIA/nccl#412)",
                 "nics_per_node": "assumption: 4 NICs for 8 GPUs, as in NVIDIA's L40S OVX reference servers",
                 "memory_gbps": "NVIDIA L40S datasheet: 864 GB/s GDDR6", "cpu_vendor": "assumption"}),
)

_BY_NAME = {s.name: s for s in _PRESETS}


def list_systems() -> list[System]:
    """The built-in presets: dgx-a100, dgx-h100, dgx-h200, b200-8, p5en, h800-8, pcie-l40s-8."""
    return list(_PRESETS)


def get_system(name: str) -> System:
    """A preset by name.

    Args:
        name: one of :func:`list_systems`' names.

    Returns:
        The System. An unknown name raises ValueError listing the known ones.
    """
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        known = ", ".join(_BY_NAME)
        raise ValueError(f"unknown system {name!r}; known systems: {known} "
                         f"(or describe your machine in a JSON system file)") from None


def read_json_file(path: str | Path, what: str) -> Any:
    """The parsed JSON of a file; an unreadable file or bad JSON raises ValueError naming ``what`` and the path."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON: {exc}") from exc


def load_system_file(path: str | Path) -> System:
    """A System from a JSON file in :meth:`System.to_dict`'s form.

    Args:
        path: the file.

    Returns:
        The System. An unreadable file, bad JSON or a bad description raises ValueError naming the file.
    """
    path = Path(path)
    data = read_json_file(path, "system file")
    try:
        return System.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"system file {path}: {exc}") from exc
