"""Alpha-beta cost of the collectives, per algorithm x protocol, and the choice by minimum time.

``time = latency(algorithm, protocol) + max over links (bytes over that link / its bandwidth)``
for pipelined algorithms (a sum over phases for the non-pipelined ``hierarchical``).

Conventions follow nccl-tests and ``moecomm bench``: ``size`` is the nccl-tests size column
(all_reduce/broadcast: one rank's buffer; all_gather/reduce_scatter/all_to_all: the full
``n * count`` buffer), ``algbw = size / time``, ``busbw = algbw * bus_factor(op, n)``, GB/s = 1e9 B/s.
``n = nodes * gpus_per_node`` ranks, ``G`` GPUs per node, ``N`` nodes, ``S`` = size.

Bytes each link carries (derived per algorithm, one direction, per GPU for NVLink/PCIe and per
node for the network, whose bandwidth is the node's NICs together in the rail layout):

- ring (NCCL): all_reduce ``2(n-1)/n S`` on every link, all_gather/reduce_scatter ``(n-1)/n S``,
  broadcast (pipelined chain) ``S``; each ring crosses every node boundary once and NCCL spreads
  its channels over all NICs, so the network carries the same bytes per node.
- tree (NCCL double binary tree, all_reduce): the intra-node chain sends ``2S`` per GPU (up and
  down); across nodes every node is inner in one tree and leaf in the other: ``2S`` per node
  (``S`` with 2 nodes). Broadcast "tree" is a pipelined binary tree (NOT an NCCL algorithm: NCCL
  runs broadcast as a ring only), ``2S`` per inner rank.
- nvls (single node, NVSwitch multicast): all_reduce = ``multimem.ld_reduce`` of the own shard
  (each GPU's memory is read for every shard: ``S`` out, ``S/G`` in) + ``multimem.st`` of it
  (``S/G`` out, ``S`` in): ``S (G+1)/G`` each way at ``intra x nvls_efficiency``; all_gather /
  reduce_scatter ``S``. With NCCL's Hopper 0.85 this gives 8xH100 busbw 490 GB/s (measured 480)
  and with Blackwell's 0.74 8xB200 831 (measured 838) (shared ANCHORS.md).
- nvls_tree (multi-node all_reduce): nvls inside each node, every GPU runs the tree of its shard
  ``S/G`` over its own NICs: ``2S`` per node (``S`` with 2 nodes).
- one_shot / two_shot (our ipc kernels, transports/ipc.py; one node): one_shot reads the whole
  buffer of every peer (``(n-1) S`` per GPU), two_shot is reduce-scatter + all-gather through the
  buffers (``2(n-1)/n S``); both stage the input in the own buffer first (``2S`` of device memory).
  all_gather / reduce_scatter one_shot: ``(n-1)/n S``.
- hierarchical (not pipelined): intra-node reduce-scatter ``(G-1)/G S`` over NVLink, the shard's
  all_reduce over the rail ``2(N-1)/N S/G`` per GPU on its own NICs, intra-node all-gather.
- pairwise (all_to_all): ``(G-1)/n S`` to the GPUs of the node over NVLink, ``(N-1)G/n S`` to the
  other nodes over at most one NIC per GPU (NVIDIA/nccl-tests#267); so multi-node busbw is about
  ``N/(N-1) x`` the per-GPU NIC bandwidth, as NVIDIA states (NVIDIA/nccl-tests#130), times the
  send/recv efficiency :data:`P2P_EFFICIENCY`.

Latencies and protocol efficiencies are NCCL's (NVIDIA/nccl v2.30.7, ``src/graph/tuning.cc``,
``ncclTopoTuneModel`` / ``ncclTopoGetAlgoTime``), re-derived here: base + hops x hw latency per
link class, LL = half the bandwidth under a ceiling, LL128 = 0.92, Simple = 1.0.

Fitted constants (in-sample, each named where it is defined): :data:`P2P_EFFICIENCY` (three
single-node all_to_all points), the EFA latency scale (systems.EFA_LATENCY_SCALE, one 2-node point), the
ipc launch/peer costs (sglang's custom all-reduce). Everything else is NCCL's or a datasheet's.

Bus bandwidth and node count: busbw normalises by ``2(n-1)/n`` (all_reduce), so an algorithm whose
time does not grow with the node count (a tree's ``2S`` per node, NVLS tree's NVLink part on 2
nodes) predicts a *higher* busbw on more nodes, and so do latency-bound sizes of all_to_all, where
the factor ``(n-1)/n`` grows faster than the latency. Measured systems do the same (2x p5 reach
487 GB/s at 16 GiB against 480 on one node, aws-samples/awsome-distributed-training; "Tree is not
bandwidth optimal so the real bus bandwidth may be higher", NVIDIA/nccl-tests#274). What the model
guarantees, and the tests check: more nodes never predict a shorter time for the same per-rank
data, and never a higher busbw for the bandwidth-optimal algorithms (ring, hierarchical, and
pairwise once each peer's block is past LL's threshold).

Known misses (benchmarks/results/model-validation.md has the numbers):

- NCCL's per-channel bandwidth ceilings (perChMax*Bws) and channel counts are not modelled; they
  bind on B200 LL128 and on PCIe boxes, where the model is optimistic.
- NCCL's latencies are its *selection* model, not measured times: NVLS's 25 us keeps NCCL off
  NVLS for small sizes; nccl-tests small-message times also carry launch and host costs (8xA100
  32 KiB all_reduce: NCCL's model says ~16 us, stas00/ml-engineering measured 43.8 us).
- The ipc kernels' bandwidth is taken as the full NVLink figure; vLLM-style custom all-reduce
  kernels reach about half of it at 256 KiB (sgl-project/sglang#2904), and our transport also
  waits on the host after each launch: one_shot/two_shot predictions are optimistic until a GPU run
  calibrates them.
- PCIe boxes: a ring crossing the CPU socket link, and GPUs sharing a PCIe switch with a NIC, are
  not modelled.
- all_to_all: per-peer costs of NCCL's grouped send/recv beyond the network post overhead are
  not modelled; small-message all_to_all at many ranks is optimistic.
- EFA latency by generation is aws-ofi-nccl's per-platform figure (75 us p4d/p4de/p5, 35 us
  p5en/p6-b200) times one scale fitted on 2x p5 (systems.EFA_LATENCY_SCALE): an assumption that
  real latency keeps the ratio of the plugin's selection weights. Where the plugin sets
  NCCL_PROTO=simple (EFA without in-order 128-byte delivery: p4d/p4de) a System says so in
  ``network_protocols``; which platform runs Simple-only is read from aws-ofi-nccl's code and
  history, not from the measurements.
- LL over EFA carries far less than NCCL's LL ceiling: 2x p5 all_reduce grows from 69 us at 8 B
  to 135 us at 64 KiB (aws-samples/awsome-distributed-training), ~2 GB/s, where the model adds 3 us.
  Mid-size multi-node all_reduce (32 KiB - 256 MiB) on EFA is 15-45% optimistic for that reason
  and because pipeline start-up over a high-latency network costs more than NCCL's per-hop
  latencies say. 2-node NVLS tree reaches its plateau later than the model (437 GB/s measured at
  1 GiB on 2x p5, 505 predicted; 479 vs 523 at 8 GiB).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

from .segments import candidate_terms, segment_time
from .systems import NET_HOP_US, NVLINK_HOP_US, PCI_HOP_US, PROTOCOLS, System

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree", "one_shot", "two_shot", "hierarchical", "pairwise")
# What NCCL itself runs (nccl-tests measure these): compare published nccl-tests points with
# predict_collective(..., algorithms=NCCL_ALGORITHMS).
NCCL_ALGORITHMS = ("ring", "tree", "nvls", "nvls_tree", "pairwise")

# bytes per element; nccl-tests' -d names accepted as aliases (benchmarks/common.py DTYPE_ALIASES)
DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1,
               "int8": 1, "float8": 1}
DTYPE_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "bf16": "bfloat16",
                 "int": "int32", "int32_t": "int32", "int64_t": "int64", "uint8_t": "uint8", "fp8": "float8"}

_P = {"LL": 0, "LL128": 1, "Simple": 2}
# ---- NCCL v2.30.7 src/graph/tuning.cc constants -------------------------------------------------
# baseLatencies[algo][LL, LL128, Simple], us
BASE_LATENCY_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0),
                   "nvls_tree": (0.0, 0.0, 0.0)}
# hwLatencies[link class][algo][LL, LL128, Simple], us
HW_LATENCY_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0), "nvls_tree": (0.0, 0.0, 25.0)},
    "pcie": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "nvls": (0.0, 0.0, 0.0), "nvls_tree": (0.0, 0.0, 0.0)},
    "network": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0),
                "nvls_tree": (0.0, 0.0, 20.9)},
}
# each link class's table is shifted by Link.latency_us - its ring Simple entry: half per hop,
# all of it for Simple (NCCL's graph->latencyInter mechanism, systems.py)
_HOP_REFERENCE_US = {"nvlink": NVLINK_HOP_US, "pcie": PCI_HOP_US, "network": NET_HOP_US}
# llMaxBws: LL's bus-bandwidth ceiling, GB/s. One node: by architecture (Ampere, Hopper,
# Blackwell); several nodes: by CPU vendor and 2 / more nodes.
LL_MAX_BW_ONE_NODE = {1: 87.7, 2: 141.0, 3: 2 * 141.0}
LL_MAX_BW_MULTI_NODE = {("intel", 2): 39.0, ("intel", 3): 20.4, ("amd", 2): 22.5, ("amd", 3): 19.0}
RING_LL_FACTOR = 0.5        # "busBw * .5" for Ring/LL
LL128_FACTOR = 0.92         # "0.92 /*120.0/128.0*/" for Ring/LL128
TREE_ALLREDUCE_FACTOR = 0.92  # "busBw * .92" for Tree all_reduce
TREE_LL_FACTOR = 1.0 / 3.8    # Tree/LL
TREE_LL128_FACTOR_ONE_NODE = 7.0 / 9.0    # Tree/LL128, nNodes == 1
TREE_LL128_FACTOR_MULTI_NODE = 120.0 / 128.0
RING_PLATEAU_LATENCY_FACTOR = 1.4  # multi-node Ring/Simple all_reduce, sm80+ ("Plateau effect of ring")
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}  # getNetOverhead; x3 for Simple
# treeCorrectionFactor[protocol][log2(size/64)], 64 B .. 256 MiB, for Tree all_reduce
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}
# all_to_all (grouped send/recv) runs below the link rates the collectives reach: NVIDIA's GTC25
# S72583 slide "NCCL Tests Alltoall Bus Bandwidth, 8 GPUs" gives 210 (A100), 320 (H100), 640 (B200)
# GB/s against 240 / 370.8 / 721.8 for ring: 0.875, 0.863, 0.887. Send/recv moves each peer's data
# in its own chunks (NCCL_P2P_NVL_CHUNKSIZE / NCCL_P2P_NET_CHUNKSIZE) over fewer channels per peer
# than a ring has. In-sample: fitted to those three single-node points (their mean), applied to
# every link of all_to_all.
P2P_EFFICIENCY = (210 / 240.0 + 320 / 370.8 + 640 / 721.8) / 3
# NVIDIA/nccl v2.30.7 src/enqueue.cc: NCCL_P2P_LL_THRESHOLD 16384 B per peer (per channel); LL for
# send/recv only up to it (we take one channel: the conservative end).
P2P_LL_THRESHOLD_BYTES = 16384

# ---- our ipc kernels (transports/ipc.py; no GPU measurement of ours yet) ------------------------
# One launch + in-kernel barrier: sgl-project/sglang#2904 measured a single-launch custom all-reduce
# on H100 at 512 B: 3.7 / 4.8 / 5.9 us for 2 / 4 / 8 GPUs; launch + per-peer flag cost fitted to it
# (model: 3.7 / 4.3 / 5.5 us). In-sample for the ipc path, and from another implementation.
IPC_LAUNCH_US = 3.4
IPC_PER_PEER_US = 0.3
# vLLM's custom all-reduce needs full NVLink beyond 2 GPUs (vllm csrc/custom_all_reduce.cuh,
# shared ANCHORS.md): one_shot/two_shot candidates only then.


@dataclass(frozen=True)
class Candidate:
    """One algorithm x protocol the model considered.

    Attributes:
        algorithm: one of :data:`ALGORITHMS` (or ``transport/algorithm`` for a calibrated system).
        protocol: ``"LL"``, ``"LL128"``, ``"Simple"`` (``"fitted"`` for calibrated terms).
        time_us: predicted time, us.
        bottleneck: ``"latency"`` when the latency term dominates, else the slowest link:
            ``"nvlink"``, ``"pcie"``, ``"network"``, ``"memory"``, ``"host"`` (``"bandwidth"`` for fitted terms).
    """

    algorithm: str
    protocol: str
    time_us: float
    bottleneck: str


@dataclass(frozen=True)
class Prediction:
    """The model's answer for one op at one size (one row of ``moecomm predict``).

    Attributes:
        op, nodes, gpus_per_node: what was asked; ``size``: the nccl-tests size column, bytes;
        count: elements per rank as nccl-tests counts them; dtype: element type name;
        time_us: predicted time of the fastest candidate, us; algbw, busbw: GB/s (0 at size 0);
        algorithm, protocol, bottleneck: the fastest candidate's;
        candidates: every algorithm x protocol considered, fastest first (the runner-up is ``[1]``).
    """

    op: str
    nodes: int
    gpus_per_node: int
    size: int
    count: int
    dtype: str
    time_us: float
    algbw: float
    busbw: float
    algorithm: str
    protocol: str
    bottleneck: str
    candidates: tuple[Candidate, ...]

    def as_dict(self) -> dict[str, Any]:
        """A JSON row: every field, ``candidates`` as a list of dicts."""
        d = asdict(self)
        d["candidates"] = [asdict(c) for c in self.candidates]
        return d


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor: ``busbw = algbw * factor`` (src/*.cu, doc/PERFORMANCE.md).

    Args:
        op: a collective of :data:`OPS`, or ``"reduce"``.
        n: number of ranks.

    Returns:
        2(n-1)/n for all_reduce, (n-1)/n for all_gather/reduce_scatter/all_to_all, 1 for
        broadcast/reduce. Raises ValueError for any other op.
    """
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"no bus factor for {op!r}")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (nccl-tests' names accepted: ``float``, ``half``, ``bf16``...)."""
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(list(DTYPE_BYTES) + list(DTYPE_ALIASES))}")
    return DTYPE_BYTES[name]


# ---- the cost pieces ----------------------------------------------------------------------------
class _Fabric:
    """The numbers one prediction needs, derived once from the System and the shape."""

    def __init__(self, system: System, nodes: int, gpus: int) -> None:
        self.system, self.N, self.G, self.n = system, nodes, gpus, nodes * gpus
        self.intra_kind = system.intra.kind if system.intra.kind in ("nvlink", "pcie") else "pcie"
        self.intra_label = system.intra.kind  # "nvlink", "pcie" or "host"
        self.intra_bw = system.intra.bandwidth_gbps
        self.node_net_bw = system.nic_bandwidth_per_gpu() * gpus        # rail layout, all NICs
        self.gpu_net_bw = system.nic_bandwidth_per_gpu()                # one GPU's share (its rail)
        self.a2a_gpu_net_bw = system.all_to_all_nic_bandwidth_per_gpu()  # one NIC at most
        # NCCL's graph->latencyInter per hop (systems.py): half the link's excess over the reference
        self.intra_extra = (system.intra.latency_us - _HOP_REFERENCE_US[self.intra_kind]) / 2
        self.net_extra = (system.nic.latency_us - NET_HOP_US) / 2 if system.nic is not None else 0.0
        if nodes == 1:
            self.ll_max = LL_MAX_BW_ONE_NODE[system.compcap_index]
        else:
            self.ll_max = LL_MAX_BW_MULTI_NODE[(system.cpu_vendor, min(nodes, 3))]

    def hop(self, where: str, algorithm: str, protocol: str) -> float:
        """One hop's latency: NCCL's hwLatencies entry plus this link's extra (twice for Simple)."""
        kind, extra = ("network", self.net_extra) if where == "network" else (self.intra_kind, self.intra_extra)
        base = HW_LATENCY_US[kind][algorithm][_P[protocol]]
        return max(0.0, base + extra * (2 if protocol == "Simple" else 1))

    def ring_protocol_bw(self, bw: float, protocol: str) -> float:
        """A link's bandwidth under NCCL's ring protocol factors (LL: half, under the LL ceiling)."""
        if protocol == "LL":
            return min(self.ll_max, bw * RING_LL_FACTOR)
        if protocol == "LL128":
            return bw * LL128_FACTOR
        return bw


def _candidate(algorithm: str, protocol: str, latency: float, terms: Iterable[tuple[str, float, float]],
               *, sequential: bool = False) -> Candidate:
    """``latency + max`` (or ``sum`` if sequential) of ``bytes / bandwidth`` over ``(label, bytes, GB/s)``."""
    times = [(nbytes / (bw * 1e3), label) for label, nbytes, bw in terms if nbytes > 0]
    if not times:
        return Candidate(algorithm, protocol, latency, "latency")
    transfer = sum(t for t, _ in times) if sequential else max(t for t, _ in times)
    slowest = max(times)[1]
    return Candidate(algorithm, protocol, latency + transfer, "latency" if latency >= transfer else slowest)


def _ring(f: _Fabric, op: str, size: int, protocol: str) -> Candidate:
    """NCCL's ring (all_reduce, all_gather, reduce_scatter, broadcast as a pipelined chain)."""
    n, N, G = f.n, f.N, f.G
    base = BASE_LATENCY_US["ring"][_P[protocol]]
    if op == "broadcast":
        # tuning.cc: Broadcast/Reduce add nsteps (= nRanks) hw latencies of the ring (of the tree for Simple),
        # on the network's row as soon as there are several nodes
        where = "network" if N > 1 else "intra"
        latency = base + n * f.hop(where, "tree" if protocol == "Simple" else "ring", protocol)
        link_bytes = float(size)
    else:
        nsteps = 2 * (n - 1) if op == "all_reduce" else n - 1
        inter_steps = 0 if N == 1 else (2 * (N - 1) if op == "all_reduce" else N - 1)
        intra_lat = f.hop("intra", "ring", protocol)
        if N > 1:  # "Inter-node rings still have to launch nsteps * net overhead"
            overhead = NET_OVERHEAD_US[f.system.cpu_vendor] * (3 if protocol == "Simple" else 1)
            intra_lat = max(intra_lat, overhead)
        # with one GPU per node NCCL charges the tree's network latency
        inter_lat = f.hop("network", "tree" if G == 1 else "ring", protocol)
        latency = base + (nsteps - inter_steps) * intra_lat + inter_steps * inter_lat
        if N > 1 and protocol == "Simple" and op == "all_reduce":
            latency *= RING_PLATEAU_LATENCY_FACTOR
        link_bytes = size * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)
    terms = []
    if G > 1:
        terms.append((f.intra_label, link_bytes, f.ring_protocol_bw(f.intra_bw, protocol)))
    if N > 1:
        terms.append(("network", link_bytes, f.ring_protocol_bw(f.node_net_bw, protocol)))
    return _candidate("ring", protocol, latency, terms)


def _tree_all_reduce(f: _Fabric, size: int, protocol: str) -> Candidate:
    """NCCL's tree all_reduce: intra-node chain, double binary tree across nodes."""
    N, G = f.N, f.G
    factor = TREE_ALLREDUCE_FACTOR
    if protocol == "LL":
        factor *= TREE_LL_FACTOR
    elif protocol == "LL128":
        factor *= TREE_LL128_FACTOR_ONE_NODE if N == 1 else TREE_LL128_FACTOR_MULTI_NODE
    factor *= _tree_correction(protocol, size)

    def bw(raw: float) -> float:
        eff = raw * factor
        return min(eff, f.ll_max) if protocol == "LL" else eff

    terms = []
    if G > 1:
        terms.append((f.intra_label, 2.0 * size, bw(f.intra_bw)))
    if N > 1:
        terms.append(("network", (1.0 if N == 2 else 2.0) * size, bw(f.node_net_bw)))
    latency = BASE_LATENCY_US["tree"][_P[protocol]] + 2 * (
        (G - 1) * f.hop("intra", "tree", protocol) + _log2i(N) * f.hop("network", "tree", protocol))
    return _candidate("tree", protocol, latency, terms)


def _tree_correction(protocol: str, size: int) -> float:
    """NCCL's treeCorrectionFactor ("Trees are not perfectly sticking to the model for medium sizes").

    NCCL (ncclTopoGetAlgoTime) applies the table stepwise per power of two from 64 B and 1.0 from
    512 MiB; a step up in the factor would make a larger size predict a shorter time, so we
    interpolate linearly in log2(size) between the table's points (64 B * 2^i), with 1.0 at 2^23 * 64 B.
    """
    table = TREE_CORRECTION[protocol]
    x = math.log2(size / 64) if size > 0 else -1.0
    if x <= 0:
        return table[0]
    if x >= len(table) - 1:
        return 1.0
    i = int(x)
    upper = table[i + 1] if i + 1 < len(table) - 1 else 1.0
    return table[i] + (upper - table[i]) * (x - i)


def _tree_broadcast(f: _Fabric, size: int, protocol: str) -> Candidate:
    """A pipelined binary-tree broadcast (not NCCL's: NCCL broadcasts over a ring only)."""
    N, G = f.N, f.G
    terms = []
    if G > 1:
        terms.append((f.intra_label, 2.0 * size, f.ring_protocol_bw(f.intra_bw, protocol)))
    if N > 1:
        terms.append(("network", (1.0 if N == 2 else 2.0) * size, f.ring_protocol_bw(f.node_net_bw, protocol)))
    latency = BASE_LATENCY_US["tree"][_P[protocol]] + (
        math.ceil(math.log2(G)) * f.hop("intra", "tree", protocol)
        + math.ceil(math.log2(N)) * f.hop("network", "tree", protocol))
    return _candidate("tree", protocol, latency, terms)


def _nvls(f: _Fabric, op: str, size: int) -> Candidate:
    """NVLink SHARP on one node (Simple only, as NCCL)."""
    G = f.G
    nvls_bw = f.intra_bw * f.system.nvls_efficiency
    link_bytes = size * (G + 1) / G if op == "all_reduce" else float(size)
    # tuning.cc: NVLS latency = its NVLink hw latency alone (base 0)
    return _candidate("nvls", "Simple", f.hop("intra", "nvls", "Simple"), [("nvlink", link_bytes, nvls_bw)])


def _nvls_tree(f: _Fabric, size: int) -> Candidate:
    """NCCL's NVLS tree all_reduce across nodes: NVLS inside, each GPU's shard over its rail's tree."""
    G, N = f.G, f.N
    # the inter-node part is a pipelined tree like NCCL's Tree: its 0.92 (tuning.cc) applies
    terms = [("nvlink", size * (G + 1) / G, f.intra_bw * f.system.nvls_efficiency),
             ("network", (1.0 if N == 2 else 2.0) * size, f.node_net_bw * TREE_ALLREDUCE_FACTOR)]
    latency = f.hop("intra", "nvls_tree", "Simple") + 2 * _log2i(N) * f.hop("network", "nvls_tree", "Simple")
    return _candidate("nvls_tree", "Simple", latency, terms)


def _ipc(f: _Fabric, op: str, size: int, algorithm: str) -> Candidate:
    """Our ipc kernels on one node: stage into the own buffer, barrier, read the peers."""
    n = f.n
    # two_shot meets the peers once more (between its reduce-scatter and all-gather halves)
    latency = IPC_LAUNCH_US + IPC_PER_PEER_US * (n - 1) * (1 if algorithm == "one_shot" else 2)
    if op == "all_reduce":
        peer_bytes = (n - 1) * size if algorithm == "one_shot" else 2 * (n - 1) / n * size
    else:  # all_gather / reduce_scatter: every rank pulls its blocks once
        peer_bytes = (n - 1) / n * size
    terms = [(f.intra_label, peer_bytes, f.intra_bw)]
    if f.system.memory_gbps > 0:  # staging copy: read + write of the input, before the peers read it
        staged = size if op != "all_gather" else size / n
        terms.append(("memory", 2.0 * staged, f.system.memory_gbps))
    return _candidate(algorithm, "Simple", latency, terms, sequential=True)


def _hierarchical(f: _Fabric, op: str, size: int, protocol: str) -> Candidate:
    """Intra-node reduce-scatter -> inter-node collective of the shard on the rail -> intra-node all-gather."""
    N, G = f.N, f.G
    base = BASE_LATENCY_US["ring"][_P[protocol]]
    intra_hop, net_hop = f.hop("intra", "ring", protocol), f.hop("network", "ring", protocol)
    intra_bw = f.ring_protocol_bw(f.intra_bw, protocol)
    rail_bw = f.ring_protocol_bw(f.gpu_net_bw, protocol)
    if op == "all_reduce":
        latency = 3 * base + 2 * (G - 1) * intra_hop + 2 * (N - 1) * net_hop
        terms = [(f.intra_label, size * (G - 1) / G, intra_bw),                    # reduce-scatter
                 ("network", size * 2 * (N - 1) / N / G, rail_bw),                 # all_reduce of S/G
                 (f.intra_label, size * (G - 1) / G, intra_bw)]                    # all-gather
    else:  # all_gather: rail all-gather of the own block, then intra-node; reduce_scatter mirrored
        latency = 2 * base + (G - 1) * intra_hop + (N - 1) * net_hop
        terms = [("network", size * (N - 1) / f.n, rail_bw), (f.intra_label, size * (G - 1) / G, intra_bw)]
    return _candidate("hierarchical", protocol, latency, terms, sequential=True)


def _pairwise(f: _Fabric, size: int, protocol: str) -> Candidate:
    """all_to_all as concurrent send/recv with every peer (NCCL's grouped p2p).

    Latency: one launch and one hop of each link class, plus NCCL's network post overhead
    (tuning.cc getNetOverhead: 1 us on Intel, 2 us on AMD hosts; x3 for Simple) for every remote
    peer, whose sends the proxy posts one by one.
    """
    n, N, G = f.n, f.N, f.G
    latency = BASE_LATENCY_US["ring"][_P[protocol]] + f.hop("intra", "ring", protocol)
    terms = [(f.intra_label, size * (G - 1) / n, f.ring_protocol_bw(f.intra_bw * P2P_EFFICIENCY, protocol))]
    if N > 1:
        post = NET_OVERHEAD_US[f.system.cpu_vendor] * (3 if protocol == "Simple" else 1)
        latency += f.hop("network", "ring", protocol) + (n - G) * post
        terms.append(("network", size * (N - 1) * G / n,
                      f.ring_protocol_bw(f.a2a_gpu_net_bw * P2P_EFFICIENCY, protocol)))
    return _candidate("pairwise", protocol, latency, terms)


def _log2i(x: int) -> int:
    return x.bit_length() - 1


def _analytical_candidates(f: _Fabric, op: str, size: int) -> list[Candidate]:
    s = f.system
    out: list[Candidate] = []
    if f.n == 1:  # one rank: a local copy (read + write) after one launch
        mem = s.memory_gbps or s.intra.bandwidth_gbps
        return [_candidate("local", "Simple", BASE_LATENCY_US["ring"][_P["Simple"]], [("memory", 2.0 * size, mem)])]
    # several nodes: what the network plugin leaves NCCL (NCCL_PROTO=simple on EFA without ordering)
    allowed = PROTOCOLS if f.N == 1 else s.network_protocols
    if op == "all_to_all":
        per_peer = size / f.n
        protocols = ("LL", "Simple") if per_peer <= P2P_LL_THRESHOLD_BYTES else ("Simple",)
        return [_pairwise(f, size, p) for p in protocols if p in allowed]
    for p in allowed:
        out.append(_ring(f, op, size, p))
        if op == "all_reduce":
            out.append(_tree_all_reduce(f, size, p))
        if op == "broadcast":
            out.append(_tree_broadcast(f, size, p))
        if op in ("all_reduce", "all_gather", "reduce_scatter") and f.N > 1 and f.G > 1:
            out.append(_hierarchical(f, op, size, p))
    nvlink = s.intra.kind == "nvlink"
    if s.nvls and nvlink and f.G > 1:
        if f.N == 1 and op in ("all_reduce", "all_gather", "reduce_scatter"):
            out.append(_nvls(f, op, size))
        if f.N > 1 and op == "all_reduce":
            out.append(_nvls_tree(f, size))
    if f.N == 1 and s.arch != "host" and (nvlink or f.n == 2) and op in ("all_reduce", "all_gather", "reduce_scatter"):
        out.append(_ipc(f, op, size, "one_shot"))
        if op == "all_reduce":
            out.append(_ipc(f, op, size, "two_shot"))
    return out


def _calibrated_candidates(system: System, op: str, size: int, n: int) -> list[Candidate]:
    """The fitted terms for ``op`` on ``n`` ranks that may predict ``size``, one per algorithm.

    A fit holds over the sizes it was fitted on (``min_bytes`` .. ``max_bytes``); which algorithms
    compete at a size outside some of their spans, with which term, is :func:`candidate_terms`' rule (per
    transport: those whose span holds it, the chord across a gap where the transport changed path,
    else the nearest). An algorithm fitted piecewise (several terms, collectives.model.calibrate)
    predicts with :func:`~collectives.model.segments.fitted_segment` (through ``candidate_terms``); a
    size in the gap between two of its segments is inside its span, so the algorithm stays in the
    running. Negative fitted coefficients count as 0.
    """
    terms = [t for t in system.calibration.get(op, ()) if int(t.get("ranks", -1)) == n]
    if not terms:
        fitted = sorted({(o, int(t.get("ranks", -1))) for o, ts in system.calibration.items() for t in ts})
        raise ValueError(f"system {system.name!r} is calibrated, but not for {op} on {n} ranks; "
                         f"fitted (op, ranks): {fitted}. Calibrate from a run with that op and rank count.")
    by_algorithm: dict[str, list[Mapping[str, Any]]] = {}
    for t in terms:
        by_algorithm.setdefault(str(t["algorithm"]), []).append(t)
    out = []
    for name, t in candidate_terms(by_algorithm, size):
        alpha = max(0.0, float(t["alpha_us"]))
        out.append(Candidate(name, str(t.get("protocol", "fitted")), segment_time(t, size),
                             "latency" if alpha >= segment_time(t, size) - alpha else "bandwidth"))
    return out


def predict_collective(system: System, op: str, size: int, *, nodes: int = 1, gpus_per_node: int | None = None,
                       dtype: str = "float32", algorithms: Iterable[str] | None = None,
                       protocols: Iterable[str] | None = None) -> Prediction:
    """Predicted time and bandwidth of one collective: the fastest algorithm x protocol.

    Args:
        system: the machine (:func:`~collectives.model.get_system`, a system file, or calibrated).
        op: one of :data:`OPS`.
        size: the nccl-tests size column in bytes (all_reduce/broadcast: one rank's buffer; the
            others: the full ``n * count`` buffer), >= 0. Size 0 predicts the latency alone
            (algbw = busbw = 0).
        nodes: number of nodes, >= 1 (> 1 needs a system with a NIC).
        gpus_per_node: GPUs (ranks) used per node, 1 .. ``system.gpus_per_node`` (default: all).
        dtype: element type (for ``count`` only: the model is per byte).
        algorithms: consider only these (e.g. :data:`NCCL_ALGORITHMS` to compare with nccl-tests).
        protocols: consider only these of :data:`PROTOCOLS`, as ``NCCL_PROTO`` does (e.g.
            ``["Simple"]``); not for a calibrated system, whose terms are per algorithm.

    Returns:
        A :class:`Prediction`; ``candidates`` holds every algorithm x protocol considered, fastest
        first. Bad input raises ValueError saying what to pass instead.
    """
    if not isinstance(system, System):
        raise ValueError(f"system must be a System (collectives.model.get_system(name) or load_system_file(path)), "
                         f"got {type(system).__name__}")
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; pass one of {', '.join(OPS)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be an integer number of bytes >= 0, got {size!r}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    gpus = system.gpus_per_node if gpus_per_node is None else gpus_per_node
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= system.gpus_per_node:
        raise ValueError(f"gpus_per_node must be an integer in 1..{system.gpus_per_node} for system "
                         f"{system.name!r}, got {gpus_per_node!r}")
    if nodes > 1 and system.nic is None:
        raise ValueError(f"system {system.name!r} has no NIC: it is a single-node machine; pass nodes=1 "
                         f"or a system with a nic")
    item = dtype_bytes(dtype)
    n = nodes * gpus
    count = size // item if op in ("all_reduce", "broadcast") else size // item // n
    if system.calibration:
        if nodes != 1:
            raise ValueError(f"system {system.name!r} is calibrated from one node; pass nodes=1")
        candidates = _calibrated_candidates(system, op, size, n)
    else:
        candidates = _analytical_candidates(_Fabric(system, nodes, gpus), op, size)
        if not candidates:
            raise ValueError(f"system {system.name!r} allows only {'/'.join(system.network_protocols)} across nodes, "
                             f"and no {op} algorithm of the model runs it at {size} B; add Simple to its "
                             "network_protocols")
    if algorithms is not None:
        wanted = set(algorithms)
        unknown = wanted - set(ALGORITHMS) - {c.algorithm for c in candidates}
        if unknown:
            raise ValueError(f"unknown algorithm(s) {sorted(unknown)}; known: {', '.join(ALGORITHMS)}")
        candidates = [c for c in candidates if c.algorithm in wanted]
        if not candidates:
            raise ValueError(f"none of the algorithms {sorted(wanted)} applies to {op} on {nodes} node(s) of "
                             f"{system.name!r}; drop the algorithms filter to see the candidates")
    if protocols is not None:
        wanted = set(protocols)
        unknown = wanted - set(PROTOCOLS)
        if unknown or not wanted:
            raise ValueError(f"unknown protocol(s) {sorted(unknown)}; give some of {', '.join(PROTOCOLS)}")
        if system.calibration:
            raise ValueError(f"system {system.name!r} is calibrated: its fitted terms are per algorithm, not per NCCL "
                             "protocol; drop the protocols filter")
        candidates = [c for c in candidates if c.protocol in wanted]
        if not candidates:
            raise ValueError(f"no candidate for {op} on {nodes} node(s) of {system.name!r} runs {sorted(wanted)}"
                             f"{' among the algorithms asked for' if algorithms is not None else ''}; "
                             "drop the protocols filter to see the candidates")
    candidates.sort(key=lambda c: (c.time_us, c.algorithm, c.protocol))
    best = candidates[0]
    algbw = size / (best.time_us * 1e3) if size > 0 and best.time_us > 0 else 0.0
    busbw = algbw * bus_factor(op, n)
    return Prediction(op=op, nodes=nodes, gpus_per_node=gpus, size=size, count=count, dtype=DTYPE_ALIASES.get(dtype, dtype),
                      time_us=best.time_us, algbw=algbw, busbw=busbw, algorithm=best.algorithm,
                      protocol=best.protocol, bottleneck=best.bottleneck, candidates=tuple(candidates))
