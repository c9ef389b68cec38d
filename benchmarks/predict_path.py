"""What ``moecomm predict`` predicts for: a named system (:func:`resolve_system`: a preset, a system file,
or one fitted to a run) or the system and algorithms of one path bytes take (:func:`path_model`, for
``moecomm predict --path P [--measured RUN.json]``; :data:`transports.paths.PATHS`).

The system of each path, and the algorithms of the transport that measured it (a run's
:func:`run_transport`; by default the one ``bench --path P`` forces, :data:`PATH_TRANSPORT`):

- ``nvlink``, ``pcie``: the intra link of ``--system``/``--system-file`` (whose intra link must be of
  that kind), NCCL's algorithms; ``cuda-ipc``: the same link, the ipc transport's one_shot/two_shot.
  These stay inside a node: a run on several nodes measured them within each node, so the model
  predicts one node of the run's ranks per node.
- ``ib``, ``roce``: the NIC of ``--system``/``--system-file``, NCCL's algorithms, >= 2 nodes (the
  model does not tell RoCE from InfiniBand: the NIC's numbers are what count).
- ``shm``: the host calibration the library ships (:data:`collectives.prediction.DEFAULT_HOST_MODEL`),
  or ``--system-file``/``--calibrate``, its fitted shm terms only (NCCL's SHM between GPUs: no model).
- ``socket``: a host system built from the link's numbers (``--link-rate``, ``--link-delay-ms``, or
  ``--testbed NAME``'s state): :func:`socket_system`; gloo's ring, pairwise for all_to_all (NCCL's
  algorithms for a GPU run that NCCL measured over sockets).

A calibrated system keeps only the fitted terms of the path's transport (:data:`PATH_TRANSPORT`).
Nothing numeric is computed here beyond the socket link's numbers. ``predict --path``
(benchmarks/predict_measured.py) puts the prediction beside a run with
:func:`benchmarks.report.predicted_beside`; ``report --predict`` names its system with
:func:`resolve_system`: both import this module, which imports neither.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import click

from transports.paths import NODE_LOCAL_PATHS

if TYPE_CHECKING:
    from collectives.model import System

LOCAL = "local"  # --system local: the machine a `moecomm bench --json` run was made on (--calibrate)


# ---- named systems ---------------------------------------------------------------------------------
def resolve_system(name: str | None, system_file: str | None, calibrate_run: str | None, *,
                   option: str = "--system") -> "System":
    """The machine to predict for, from the command line's three ways to name one.

    Args:
        name: a preset of :func:`collectives.model.list_systems`, or ``local`` (with ``calibrate_run``).
        system_file: a JSON description (:meth:`System.to_dict`), instead of ``name``.
        calibrate_run: a ``moecomm bench --json`` run to fit ``local`` from.
        option: the name of the option that holds ``name`` (``--system``; ``--predict`` in report).

    Returns:
        The system. Raises click.UsageError saying what to give instead for anything that does not
        name exactly one system.
    """
    from collectives import model
    from collectives.model.calibrate import calibrate

    if system_file and (name or calibrate_run):
        raise click.UsageError(f"--system-file describes the machine: give it without {option} and --calibrate")
    if system_file:
        try:
            return model.load_system_file(system_file)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise click.UsageError(f"--system-file {system_file}: not a system description ({e}); "
                                   "`moecomm predict --system dgx-h100 --save-system F.json` writes one to edit") from None
    if calibrate_run:
        if name not in (None, LOCAL):
            raise click.UsageError(f"--calibrate fits the machine a bench run was made on: use it with {option} "
                                   f"{LOCAL}, not {option} {name}")
        try:
            return calibrate(calibrate_run, name=LOCAL)
        except (OSError, ValueError, KeyError) as e:
            raise click.UsageError(f"--calibrate {calibrate_run}: cannot fit a system ({e}); give a run written "
                                   "by `moecomm bench --json`") from None
    names = ", ".join(s.name for s in model.list_systems())
    if name is None:
        raise click.UsageError(f"no system: give {option} NAME (one of {names}), {option} {LOCAL} --calibrate "
                               "RUN.json, or --system-file F.json")
    if name == LOCAL:
        raise click.UsageError(f"{option} {LOCAL} is fitted from a run of this machine: add --calibrate RUN.json "
                               "(written by `moecomm bench --json`)")
    try:
        return model.get_system(name)
    except (KeyError, ValueError):
        raise click.UsageError(f"unknown system {name!r} for {option}; one of {names}, {LOCAL} (with --calibrate), "
                               "or describe it in --system-file F.json") from None


def system_summary(system: "System") -> str:
    """Two ``#`` lines: the system's name and description, then its GPUs, links and NICs as the model uses them."""
    from collectives.model import PROTOCOLS

    nic = (f"network {system.nic_bandwidth_per_gpu():g} GB/s ({system.nics_per_node}x {system.nic.name} of "
           f"{system.nic.bandwidth_gbps:g} GB/s per node)" if system.nic else "no network (one node only)")
    if system.nic and system.network_protocols != PROTOCOLS:
        nic += f", across nodes NCCL protocol(s) {'/'.join(system.network_protocols)} only"
    return (f"# {system.name}: {system.description}\n# {system.gpus_per_node} GPUs (ranks) per node; per GPU: {system.intra.name} "
            f"{system.intra.bandwidth_gbps:g} GB/s, {nic}; NVLS {'yes' if system.nvls else 'no'}; GB/s = 1e9 B/s")


def check_gpus_per_node(system: "System", gpus_per_node: int | None, *, option: str = "--gpus-per-node") -> None:
    """A usage error of ``option`` when ``gpus_per_node`` ranks do not fit one node of ``system``."""
    if gpus_per_node is not None and gpus_per_node > system.gpus_per_node:
        raise click.BadParameter(f"{gpus_per_node} is more than the {system.gpus_per_node} GPUs per node of "
                                 f"{system.name}; give at most {system.gpus_per_node}, or describe another machine "
                                 "with --system-file", param_hint=option)


# ---- the socket path's link ------------------------------------------------------------------------
# What tc counts: a qdisc (tbf, netem) charges the bytes of the packet it sees, from the Ethernet header on,
# per segment for a GSO packet (the kernel's qdisc_pkt_len_init adds every segment's headers): no preamble,
# FCS or inter-frame gap. A full TCP segment over a 1500-byte MTU carries 1500 - 20 (IPv4) - 20 (TCP)
# - 12 (the timestamp option Linux sends by default) = 1448 bytes of payload, in 1500 + 14 (Ethernet
# header) = 1514 bytes the qdisc counts. So the payload rate of a link shaped to RATE bit/s is
# RATE / 8 x 1448 / 1514 B/s (1 gbit: 0.1196 GB/s). Not counted: the ACKs of the opposite direction's
# data (66 B per one or two segments), which a ring, sending both ways at once, puts on every link too.
TCP_MSS_BYTES = 1500 - 20 - 20 - 12
TC_FRAME_BYTES = 1500 + 14
TCP_PAYLOAD_PER_TC_BYTE = TCP_MSS_BYTES / TC_FRAME_BYTES
# `moecomm testbed` puts netem's delay on every node's link in both directions (out of a node and into
# it: benchmarks/testbed.py Testbed._shape), so a packet from one node to another is delayed twice.
NETEM_DELAYS_PER_HOP = 2
# The TCP stack's share of a hop (send and receive path, wake-up): an assumption, not a fit. A Python
# ping-pong over loopback on the 2-vCPU dev machine took ~110 us per round trip, interpreter and
# scheduler included, so at most ~55 us one way there; gloo's C++ path skips the interpreter. It only matters
# below ~1 MiB, where the hops' latency is comparable with the transfer.
TCP_STACK_US = 25.0
# Within a node gloo's hops go over loopback TCP, not the shaped link: an assumed rate. A Python
# sendall/recv_into pair moved 1.3-2.1 GB/s over loopback on the 2-vCPU dev machine (64 MiB). Whenever
# the shaped link is the slower, the prediction at >= 1 MiB does not depend on this number (the model
# takes the slowest link of a pipelined ring).
LOOPBACK_TCP_GBPS = 2.0
# gloo (torch's ProcessGroupGloo): ring all_reduce / all_gather (and the ring the model has for
# reduce_scatter and broadcast), all_to_all as direct sends to every peer (the model's pairwise);
# no LL protocols: Simple only.
GLOO_ALGORITHMS = ("ring", "pairwise")
GLOO_PROTOCOLS = ("Simple",)

NCCL_PATHS = ("nvlink", "pcie", "ib", "roce")
# the transport that `bench --path P` forces: its name prefixes a calibrated system's fitted terms
PATH_TRANSPORT = {**{p: "nccl" for p in NCCL_PATHS}, "cuda-ipc": "ipc", "shm": "shm", "socket": "gloo"}
IPC_ALGORITHMS = ("one_shot", "two_shot")
# the options that describe the socket path's link
LINK_OPTIONS = {"link_rate": "--link-rate", "link_delay_ms": "--link-delay-ms", "testbed": "--testbed"}


@dataclasses.dataclass(frozen=True)
class PathModel:
    """What one path is predicted with.

    Attributes:
        path: one of :data:`PATHS`; transport: the one that measures it; system: the machine;
        algorithms, protocols: the ones the transport runs (None: all the model has); lines: ``#``
        lines saying so; notes: caveats; testbed_nodes: the node count of ``--testbed``'s state (None
        without it).
    """

    path: str
    transport: str
    system: "System"
    algorithms: tuple[str, ...] | None
    protocols: tuple[str, ...] | None
    lines: tuple[str, ...]
    notes: tuple[str, ...] = ()
    testbed_nodes: int | None = None

    def model_shape(self, nodes: int, ranks: int) -> tuple[int, int]:
        """(nodes, ranks) to predict a run of ``ranks`` on ``nodes`` with: one node for a node-local path."""
        return (1, ranks // nodes) if self.path in NODE_LOCAL_PATHS else (nodes, ranks)

    def op_notes(self, ops: Sequence[str], nodes: int, ranks_per_node: int) -> list[str]:
        """Caveats of ``ops`` on ``nodes`` x ``ranks_per_node``: a socket path that never leaves the node,
        and where gloo moves other bytes than the model's algorithm."""
        notes = [f"on one node the socket path stays on loopback TCP: the prediction is the assumed loopback rate "
                 f"({LOOPBACK_TCP_GBPS:g} GB/s), not the link's"] if self.path == "socket" and nodes == 1 else []
        return notes + (gloo_notes(ops, nodes, ranks_per_node) if self.transport == "gloo" else [])


def socket_system(rate_bps: float, delay_ms: float, ranks_per_node: int) -> "System":
    """A host system whose nodes talk TCP over one link shaped to ``rate_bps`` with netem's ``delay_ms``.

    Args:
        rate_bps: the link's rate as tc shapes it, bit/s; delay_ms: the one-way delay netem adds on
            each node's link (``moecomm testbed --delay-ms``); ranks_per_node: ranks (``gpus_per_node``).

    Returns:
        The System: NIC = the TCP payload rate (:data:`TCP_PAYLOAD_PER_TC_BYTE`), one per node, hop
        latency ``NETEM_DELAYS_PER_HOP x delay + TCP_STACK_US``; intra = loopback TCP
        (:data:`LOOPBACK_TCP_GBPS`); Simple protocol only across nodes.
    """
    from collectives.model import Link, System

    payload_gbps = rate_bps / 8 * TCP_PAYLOAD_PER_TC_BYTE / 1e9
    hop_us = NETEM_DELAYS_PER_HOP * delay_ms * 1e3 + TCP_STACK_US
    rate = f"{rate_bps / 1e6:g}mbit"
    return System(
        name=f"socket-{rate}" + (f"-{delay_ms:g}ms" if delay_ms else ""),
        description=f"TCP over a link shaped to {rate} with {delay_ms:g} ms netem delay per node link; "
                    f"loopback TCP within a node",
        gpus_per_node=ranks_per_node, arch="host", intra=Link("host-loopback-tcp", LOOPBACK_TCP_GBPS, TCP_STACK_US),
        nic=Link(f"tcp-{rate}", payload_gbps, hop_us), nics_per_node=1, nvls=False,
        network_protocols=GLOO_PROTOCOLS,
        sources={"nic": f"{rate} x {TCP_MSS_BYTES}/{TC_FRAME_BYTES} (TCP payload per byte tc counts); latency "
                        f"{NETEM_DELAYS_PER_HOP} x {delay_ms:g} ms netem + {TCP_STACK_US:g} us TCP stack (assumed)",
                 "intra": f"loopback TCP, assumed {LOOPBACK_TCP_GBPS:g} GB/s (benchmarks/predict_path.py)"})


def testbed_link(name: str) -> tuple[int, float, int]:
    """(rate bit/s, delay ms, nodes) of testbed ``name``'s state (:func:`benchmarks.testbed_state.testbeds`).

    Raises click.BadParameter of ``--testbed`` for a bad name, a testbed that is not up, or one whose
    links are not rate-limited.
    """
    from . import testbed_state
    from .testbed import check_name

    try:
        check_name(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--testbed") from None
    state = next((s for s in testbed_state.testbeds() if s.get("tag") == name), None)
    if state is None:
        raise click.BadParameter(f"no testbed {name!r} is up (`moecomm testbed status` lists them); give the link's "
                                 "numbers with --link-rate RATE [--link-delay-ms D]", param_hint="--testbed")
    if not state.get("rate_bps"):
        raise click.BadParameter(f"testbed {name!r} does not limit its links' rate, and the model needs one: give "
                                 "--link-rate RATE [--link-delay-ms D] instead", param_hint="--testbed")
    return int(state["rate_bps"]), float(state.get("delay_ms") or 0.0), len(state.get("nodes") or [])


def _socket_link(params: Mapping[str, Any]) -> tuple[int, float, str, int | None]:
    """(rate bit/s, delay ms, where they come from, the testbed's nodes) of ``--path socket``."""
    from .testbed import check_delay, parse_rate

    name = params["testbed"]
    if name is not None:
        if params["link_rate"] is not None or params["link_delay_ms"] is not None:
            raise click.UsageError("--testbed gives the link's rate and delay: drop --link-rate/--link-delay-ms, "
                                   "or --testbed")
        rate_bps, delay_ms, nodes = testbed_link(name)
        return rate_bps, delay_ms, f"testbed {name}", nodes
    if params["link_rate"] is None:
        raise click.UsageError("--path socket needs the link's numbers: --link-rate RATE (tc notation: 1gbit, "
                               "800mbit) [--link-delay-ms D], or --testbed NAME")
    try:
        rate_bps = parse_rate(params["link_rate"])
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--link-rate") from None
    try:
        delay_ms = check_delay(params["link_delay_ms"] or 0.0)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--link-delay-ms") from None
    return rate_bps, delay_ms, "--link-rate", None


def _only_transport(system: "System", transport: str) -> "System":
    """A calibrated ``system`` with the fitted terms of ``transport`` alone (usage error when it has none)."""
    kept = {op: [t for t in terms if str(t["algorithm"]).split("/", 1)[0] == transport]
            for op, terms in system.calibration.items()}
    kept = {op: terms for op, terms in kept.items() if terms}
    if not kept:
        fitted = sorted({str(t["algorithm"]) for terms in system.calibration.values() for t in terms})
        raise click.UsageError(f"{system.name} has no fitted term of the {transport} transport (it has "
                               f"{', '.join(fitted)}); calibrate from a run that measured {transport}")
    return dataclasses.replace(system, calibration=kept)


def path_model(ctx: click.Context, path: str, *, ranks_per_node: int | None,
               transport: str | None = None) -> PathModel:
    """The system, algorithms and protocols to predict ``path`` with (see the module docstring).

    Args:
        ctx: the command's context (``--system``, ``--system-file``, ``--calibrate``, the link options).
        path: one of :data:`PATHS`; ranks_per_node: the run's ranks per node (None: the system's; 1 for socket).
        transport: the transport that measured the path (a run's :func:`run_transport`; None: the one
            ``bench --path`` forces for host tensors, or NCCL's for GPU paths: :data:`PATH_TRANSPORT`).

    Returns:
        The :class:`PathModel`. Raises a click usage error for a system that does not have the path.
    """
    p = ctx.params
    transport = transport or PATH_TRANSPORT[path]
    given = [flag for name, flag in LINK_OPTIONS.items() if p[name] is not None]
    if path != "socket" and given:
        raise click.UsageError(f"{', '.join(given)} {verb(given, 'describes', 'describe')} the socket path's "
                               f"link; --path {path} takes --system/--system-file"
                               + (" (or the shipped host calibration)" if path == "shm" else ""))
    named = [flag for name, flag in (("system_name", "--system"), ("system_file", "--system-file"),
                                     ("calibrate_run", "--calibrate")) if p[name] is not None]
    if path == "shm":
        if transport != "shm":
            raise click.UsageError(f"path shm was measured by {transport} (GPU tensors through host memory): the "
                                   "model has no such path; it predicts moecomm's shm transport for host tensors")
        return _shm_model(p, named, ranks_per_node)
    if path == "socket":
        if named:
            raise click.UsageError(f"--path socket builds its system from the link's numbers (--link-rate, "
                                   f"--link-delay-ms or --testbed): drop {', '.join(named)}")
        rate_bps, delay_ms, source, testbed_nodes = _socket_link(p)
        system = socket_system(rate_bps, delay_ms, ranks_per_node or 1)
        what = (f"link {rate_bps / 1e6:g} Mbit/s ({source}) -> TCP payload {system.nic.bandwidth_gbps:.4f} GB/s "
                f"(x {TCP_MSS_BYTES}/{TC_FRAME_BYTES}), {system.nic.latency_us:g} us per hop ({NETEM_DELAYS_PER_HOP} "
                f"x {delay_ms:g} ms netem + {TCP_STACK_US:g} us TCP, assumed); within a node loopback TCP, assumed "
                f"{LOOPBACK_TCP_GBPS:g} GB/s")
        notes = (f"the link's TCP payload rate is not below the assumed loopback rate ({LOOPBACK_TCP_GBPS:g} GB/s): "
                 "intra-node hops may bound the prediction",) if system.nic.bandwidth_gbps >= LOOPBACK_TCP_GBPS else ()
    else:
        system, notes, testbed_nodes = _gpu_path_system(p, path, ranks_per_node), (), None
        what = (f"{system.intra.name} ({system.intra.bandwidth_gbps:g} GB/s per GPU), within one node"
                if path in ("nvlink", "pcie", "cuda-ipc") else
                f"{system.nics_per_node}x {system.nic.name} ({system.nic.bandwidth_gbps:g} GB/s each) per node"
                + (", as InfiniBand (the model does not tell RoCE from it)" if path == "roce" else ""))
    if system.calibration:
        system, (algorithms, protocols) = _only_transport(system, transport), (None, None)
        who = f"the fitted {transport} terms"
    else:
        algorithms, protocols = _transport_algorithms(transport)
        who = f"{transport}: {', '.join(algorithms)}" + (f" ({'/'.join(protocols)})" if protocols else "")
    return PathModel(path, transport, system, algorithms, protocols, (f"# path {path}: {what}; {who}",), notes,
                     testbed_nodes)


def _transport_algorithms(transport: str) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """(algorithms, protocols) of the model that ``transport`` runs (gloo, nccl, ipc)."""
    from collectives.model import NCCL_ALGORITHMS

    table = {"gloo": (GLOO_ALGORITHMS, GLOO_PROTOCOLS), "nccl": (tuple(NCCL_ALGORITHMS), None),
             "ipc": (IPC_ALGORITHMS, None)}
    if transport not in table:
        raise click.UsageError(f"the model has no algorithms of the {transport} transport over this path (it knows "
                               f"{', '.join(table)})")
    return table[transport]


def _gpu_path_system(p: Mapping[str, Any], path: str, ranks_per_node: int | None) -> "System":
    """``--system``/``--system-file``/``--calibrate`` for an NVLink, PCIe, CUDA IPC or network path: one whose
    intra link (nvlink, pcie, cuda-ipc) or NIC (ib, roce) is that path, and whose nodes hold the ranks."""
    system = resolve_system(p["system_name"], p["system_file"], p["calibrate_run"])
    if path in ("nvlink", "pcie", "cuda-ipc"):
        want = {"nvlink": ("nvlink",), "pcie": ("pcie",), "cuda-ipc": ("nvlink", "pcie")}[path]
        if system.intra.kind not in want:
            raise click.UsageError(f"{system.name}'s GPUs talk over {system.intra.name} ({system.intra.kind}), not "
                                   f"{'/'.join(want)}: give a system whose intra link is {'/'.join(want)} "
                                   "(--list-systems), or --system-file")
    elif system.nic is None:
        raise click.UsageError(f"{system.name} has no NIC: --path {path} needs a system with one (--list-systems)")
    check_gpus_per_node(system, ranks_per_node, option="the run's ranks per node" if p["measured"] else
                        "--gpus-per-node")
    return system


def run_transport(run: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], path: str) -> str | None:
    """The transport that measured ``path`` in a run: its env's ``paths`` (``bench --path``), else the
    transport all its rows name in ``algorithm`` (``"gloo:allreduce"``), else None (the path's default)."""
    said = (run.get("env", {}).get("paths") or {}).get(path, {})
    if isinstance(said, Mapping) and said.get("transport"):
        return str(said["transport"])
    named = {a.partition(":")[0] if ":" in a else None for a in (str(r.get("algorithm", "")) for r in rows)}
    return named.pop() if len(named) == 1 else None


def _shm_model(p: Mapping[str, Any], named: Sequence[str], ranks_per_node: int | None) -> PathModel:
    """``--path shm``: the shipped host calibration (or ``--system-file``/``--calibrate``), its shm terms."""
    from collectives.prediction import DEFAULT_HOST_MODEL, at_ranks, host_model

    if p["system_name"] not in (None, LOCAL):
        raise click.UsageError(f"--path shm predicts from a calibrated host model (default: the shipped "
                               f"{DEFAULT_HOST_MODEL.name}; or --system-file, --system {LOCAL} --calibrate RUN.json), "
                               f"not from the GPU system {p['system_name']}")
    if named:
        system, source = resolve_system(p["system_name"], p["system_file"], p["calibrate_run"]), ", ".join(named)
    else:
        try:
            system, source = host_model({}), f"shipped {DEFAULT_HOST_MODEL.name}"
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    if not system.calibration:  # a described host machine: the analytical model's choice
        check_gpus_per_node(system, ranks_per_node)
        return PathModel("shm", "shm", system, None, None, (f"# path shm: {system.intra.name} of {system.name} "
                                                            f"({source}), the model's algorithms",))
    system = at_ranks(_only_transport(system, "shm"), ranks_per_node or system.gpus_per_node)
    fitted = sorted({str(t["algorithm"]) for terms in system.calibration.values() for t in terms})
    return PathModel("shm", "shm", system, None, None, (f"# path shm: the fitted shm terms of {system.name} "
                                                        f"({source}): {', '.join(fitted)}",))


def check_nodes(path: str, nodes: Sequence[int], where: str, *, sweep: bool) -> None:
    """A usage error when ``path`` cannot be predicted on these node counts.

    Args:
        path: the path; nodes: the node counts; where: what gave them, for the message
            (``"run.json ran on 1 node(s)"``); sweep: they are ``--nodes`` (a prediction alone).
    """
    if path in ("ib", "roce") and min(nodes) < 2:
        raise click.UsageError(f"--path {path} is the model's NET path, between nodes: it needs >= 2 nodes, and "
                               f"{where}")
    if sweep and path in NODE_LOCAL_PATHS and max(nodes) > 1:
        raise click.UsageError(f"--path {path} stays inside a node (a run on several nodes measures it within each): "
                               "give --nodes 1")


def gloo_notes(ops: Sequence[str], nodes: int, ranks_per_node: int) -> list[str]:
    """Where gloo moves other bytes than the model's algorithm for ``ops`` on ``nodes`` x ``ranks_per_node``."""
    from collectives.model.collective import P2P_EFFICIENCY

    notes = []
    if "all_to_all" in ops:
        notes.append(f"all_to_all: the model's pairwise runs at NCCL's send/recv efficiency {P2P_EFFICIENCY:.3f} "
                     "(collectives.model.collective.P2P_EFFICIENCY, fitted on NVLink): gloo filling the link reads "
                     f"as ratio {1 / P2P_EFFICIENCY:.2f}")
    n, g = nodes * ranks_per_node, ranks_per_node
    if "reduce_scatter" in ops and nodes > 1 and g > 1:
        notes.append(f"reduce_scatter: moecomm's gloo transport sends it as one alltoall (transports/gloo.py), "
                     f"{g * (n - g) / n:.3g} x the buffer out of each node where the model's ring sends "
                     f"{(n - 1) / n:.3g} x: "
                     f"gloo filling the link reads as ratio {(n - 1) / (g * (n - g)):.2f}")
    return notes


def path_rows(rows: Sequence[Mapping[str, Any]], path: str, name: str) -> tuple[list[Mapping[str, Any]], str]:
    """The rows of a run taken over ``path``, and the field they were matched by.

    Rows carry the verified ``path`` since ``bench --path``; in an older run (no row has one) the rows
    whose ``transport`` is ``path`` count. Raises click.UsageError naming what the run has when none match.
    """
    key = "path" if any(r.get("path") for r in rows) else "transport"
    picked = [r for r in rows if r.get(key) == path]
    if not picked:
        have = ", ".join(sorted({str(r.get(key)) for r in rows if r.get(key)})) or "none"
        older = " (a run from before `bench --path`: rows are matched by transport)" if key == "transport" else ""
        raise click.UsageError(f"{name} has no row of path {path}: its rows' {key}s are {have}{older}")
    return picked, key


def verb(names: Sequence[str], one: str, several: str) -> str:
    """``one`` for a single name, else ``several`` (``"--x goes"``, ``"--x, --y go"``)."""
    return one if len(names) == 1 else several
