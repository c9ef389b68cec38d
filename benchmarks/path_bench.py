"""``--path P`` of ``moecomm bench``, ``bench-moe`` and ``bench-p2p``: force one path, verify the one taken.

Call path (``moecomm bench --path socket,shm``):

* in the launching process: :func:`plan_launches` checks every path against :mod:`collectives.topology.paths`
  (a path that is not there: exit 2, one line), picks the transport under test (:func:`transport_for`) and
  groups the paths into launches: NCCL reads its variables once per process, so each NCCL path gets ranks
  of its own with :func:`transports.nccl_paths.nccl_env` in their environment; our transports share one;
* on the ranks, per path: :func:`path_comm` makes a communicator that can only take that path (a view of
  one transport; within each node for a node-local path on several nodes; a gloo communicator for
  ``socket`` on one node), the sweep runs on it, and :class:`Verifier` checks at its first row which path
  the bytes took: for NCCL from its own ``NCCL_DEBUG=INFO`` lines, for ours from the transport that ran
  the call. Every rank agrees on the verdict; a different path raises
  :class:`transports.paths.PathMismatchError` naming both. The row's ``path`` field is the verified path.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Sequence

import click
import torch

from transports.paths import NODE_LOCAL_PATHS, PATHS, PathMismatchError

# The transport that carries a path for each device. NCCL carries every path of CUDA tensors but cuda-ipc,
# which is our ipc transport (``--transport nccl`` measures NCCL's P2P/IPC instead).
_CPU_TRANSPORTS = {"shm": "shm", "socket": "gloo"}
_CUDA_TRANSPORTS = {"cuda-ipc": "ipc", **{p: "nccl" for p in PATHS if p != "cuda-ipc"}}
# what our own transports are, as paths (the verification of a row that did not go through NCCL)
OUR_PATHS = {"shm": "shm", "gloo": "socket", "ipc": "cuda-ipc"}


class PathUnavailable(click.ClickException):
    """A path this machine (or launch) does not have, or that cannot carry this device's tensors: exit 2."""

    exit_code = 2

    def show(self, file: Any = None) -> None:  # one line, no usage text
        click.echo(f"Error: {self.message}", err=True, file=file)


class PathFailed(click.ClickException):
    """The library took another path than the one asked for (:class:`PathMismatchError`): exit 1."""


def parse_paths(text: str | None) -> list[str]:
    """``"socket,shm"`` -> ``["socket", "shm"]``; ``"all"`` stays ``["all"]``; empty -> ``[]``.

    Raises click.BadParameter for a name that is not a path.
    """
    names = [t.strip() for t in (text or "").split(",") if t.strip()]
    if names == ["all"]:
        return names
    bad = [n for n in names if n not in PATHS]
    if bad:
        raise click.BadParameter(f"unknown path(s) {bad}; choose from {', '.join(PATHS)}, or all",
                                 param_hint="--path")
    return list(dict.fromkeys(names))


def transport_for(path: str, device: str, transport: str | None = None) -> str:
    """The transport that measures ``path`` for tensors on ``device`` ("cpu" or "cuda").

    Args:
        path: one of :data:`transports.paths.PATHS`.
        device: where the tensors live.
        transport: the user's ``--transport`` (None or "auto": the default for the path).

    Returns:
        "shm", "gloo", "ipc" or "nccl". Raises :class:`PathUnavailable` for a path this device's tensors
        cannot take, or a transport that cannot carry it.
    """
    table = _CUDA_TRANSPORTS if device.startswith("cuda") else _CPU_TRANSPORTS
    if path not in table:
        carried = ", ".join(table)
        raise PathUnavailable(f"path {path} does not carry {device} tensors (those take {carried}); "
                              f"{'use --device cuda on a machine with GPUs' if device == 'cpu' else ''}".rstrip("; "))
    default = table[path]
    if transport in (None, "auto", default):
        return default
    if device.startswith("cuda") and transport == "nccl":  # NCCL's own P2P/IPC, SHM, NET paths
        return "nccl"
    raise PathUnavailable(f"transport {transport} cannot be forced onto path {path} for {device} tensors "
                          f"({default} carries it)")


def available_paths(infos: Sequence[Any], device: str) -> list[str]:
    """``--path all``: every available path this device's tensors can take, in :data:`PATHS` order."""
    table = _CUDA_TRANSPORTS if device.startswith("cuda") else _CPU_TRANSPORTS
    return [i.path for i in infos if i.available and i.path in table]


def local_paths() -> list[Any]:
    """This machine's paths (:func:`benchmarks.paths_cli.local_paths`)."""
    from .paths_cli import local_paths as here

    return here()


def check_available(paths: Sequence[str], infos: Sequence[Any]) -> None:
    """Raise :class:`PathUnavailable` (exit 2, one line with the reason) for the first path not available."""
    from .paths_cli import unavailable_message
    from collectives.topology.paths import path_info

    for p in paths:
        info = path_info(infos, p)
        if not info.available:
            raise PathUnavailable(unavailable_message(info))


@dataclass
class Launch:
    """One set of ranks: the paths it measures, and the environment its ranks need (NCCL's)."""

    paths: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None


def plan_launches(paths: Sequence[str], device: str, transport: str | None, infos: Sequence[Any], *,
                  external: bool) -> list[Launch]:
    """The launches that measure ``paths``: one for every path our transports carry, one per NCCL path.

    Args:
        paths: the paths asked for (already checked available).
        device: "cpu" or "cuda"; transport: the user's ``--transport``.
        infos: the paths of this machine or launch (for the NCCL HCAs, GID index and interface).
        external: ranks started by mpirun/torchrun: this process is a rank and can take one NCCL
            environment only.

    Returns:
        The launches, ours first. Raises :class:`PathUnavailable` for several NCCL paths under an
        external launcher.
    """
    from collectives.topology.paths import path_info

    ours = [p for p in paths if transport_for(p, device, transport) != "nccl"]
    nccl = [p for p in paths if p not in ours]
    if external and len(nccl) > 1:
        raise PathUnavailable(f"NCCL reads its environment once per process: under mpirun/torchrun give one "
                              f"NCCL path per run (asked {', '.join(nccl)})")
    out = [Launch(ours)] if ours else []
    for p in nccl:
        from transports.nccl_paths import nccl_env

        info = path_info(infos, p)
        sock = path_info(infos, "socket")
        log_dir = tempfile.mkdtemp(prefix=f"moecomm-nccl-{p}-")
        env = nccl_env(p, log_dir, hcas=info.devices if p in ("ib", "roce") else (), gid_index=info.gid_index,
                       ifname=sock.devices[0] if p == "socket" and sock.devices else None)
        out.append(Launch([p], env, log_dir))
    return out


# ---- on the ranks ----------------------------------------------------------------------------------
def agreed_paths(comm) -> list[Any]:
    """The launch's paths: every host's view of itself, combined (collective)."""
    from collectives.topology.paths import combine_paths

    from .paths_cli import paths_by_host

    return combine_paths(paths_by_host(comm, local_paths()))


def path_comm(comm, path: str, transport: str) -> tuple[Any, Any | None]:
    """A communicator whose calls can only take ``path`` through ``transport`` (collective).

    Returns:
        (communicator, owned): ``owned`` is a sub-communicator to close afterwards, or None for a view.
        A node-local path on several nodes runs within each node (each node's ranks measure it among
        themselves, at the same time); ``socket`` on one node gets a communicator forced onto gloo.
    """
    topo = comm.topology
    owned = None
    base = comm
    if path in NODE_LOCAL_PATHS and not topo.single_node:
        node = next(i for i, ranks in enumerate(topo.nodes) if comm.rank in ranks)
        owned = base = comm.split(color=node)
    if transport not in base.transports:
        if transport != "gloo":
            raise PathUnavailable(f"transport {transport} (path {path}) did not come up here "
                                  f"(available: {sorted(base.transports)})")
        try:
            made = base.split(0, options={"transport": "gloo"})
        except ValueError as e:  # every rank: gloo needs a torch store (torchrun, or ranks moecomm launched)
            raise PathUnavailable(f"path socket is measured through gloo, which cannot start here ({e}); under "
                                  "mpiexec use torchrun or self-launched ranks") from None
        if owned is not None:
            owned.close()
        owned = base = made
    return base.using(transport), owned


def interface_bytes() -> dict[str, int]:
    """Bytes each network interface of this process's network namespace has sent (/proc/net/dev)."""
    out = {}
    try:
        with open("/proc/net/dev") as f:
            for line in f.readlines()[2:]:
                name, _, rest = line.partition(":")
                cols = rest.split()
                if len(cols) >= 9:
                    out[name.strip()] = int(cols[8])
    except OSError:
        pass
    return out


def taken_path(path: str, transport: str, ran: str, log_dir: str | None) -> tuple[str, str]:
    """(the path taken, how it was seen) on this rank, for a call that ran on transport ``ran``.

    Our transports are their path (:data:`OUR_PATHS`); NCCL's is read from its log in ``log_dir``.
    """
    if ran != transport:
        return f"transport {ran}", f"the call ran on {ran}, not {transport}"
    if ran != "nccl":
        return OUR_PATHS.get(ran, ran), f"{ran} transport"
    from transports.nccl_paths import read_nccl_logs, verify_path

    try:
        return verify_path(path, read_nccl_logs(log_dir or "")), f"NCCL's log in {log_dir}"
    except PathMismatchError as e:
        return e.taken, e.detail


def agree_on_path(comm, path: str, taken: tuple[str, str], what: str) -> str:
    """Every rank's (taken, detail), compared (collective): ``path`` when all took it, else
    :class:`PathMismatchError` on every rank naming the first rank that did not and what it took."""
    from .ranks import allgather_text

    verdicts = [json.loads(t) for t in allgather_text(comm, json.dumps(list(taken)))]
    wrong = [(r, t, d) for r, (t, d) in enumerate(verdicts) if t != path]
    if wrong:
        r, t, d = wrong[0]
        raise PathMismatchError(path, t, f"rank {r} ({what}): {d}")
    return path


class Verifier:
    """Checks, at a path's first row, which path the row's bytes took; stamps every row with it.

    Collective over ``comm`` (every rank's row callback runs at the same point of the sweep).

    Args:
        comm: the communicator the sweep aggregates over.
        path: the path asked for; transport: the transport under test.
        log_dir: where NCCL writes its log (``transport == "nccl"``).
    """

    def __init__(self, comm, path: str, transport: str, log_dir: str | None = None) -> None:
        self.comm, self.path, self.transport, self.log_dir = comm, path, transport, log_dir
        self.verified: str | None = None

    def __call__(self, row: Any) -> None:
        if self.verified is None:
            ran = row.algorithm.split(":", 1)[0]  # MoecommPeer with show_transport: "transport:algorithm"
            taken = taken_path(self.path, self.transport, ran, self.log_dir)
            self.verified = agree_on_path(self.comm, self.path, taken, f"{row.op} of {row.size} B")
        row.path = self.verified


def nccl_log_dir() -> str | None:
    """The directory NCCL logs into in this rank (set by :func:`plan_launches`' environment), or None."""
    return os.path.dirname(os.environ.get("NCCL_DEBUG_FILE", "")) or None


@dataclass
class SinglePath:
    """``--path`` of a command that measures one path per run (bench-moe, bench-p2p)."""

    path: str
    transport: str
    launch: Launch


def single_path(path: str, device: str, transport: str | None) -> SinglePath:
    """Check one ``--path`` of bench-moe / bench-p2p: available (else exit 2), its transport, NCCL's environment."""
    names = parse_paths(path)
    if len(names) != 1 or names == ["all"]:
        raise click.BadParameter("this command measures one path per run", param_hint="--path")
    infos = local_paths()
    if not external_launch():
        check_available(names, infos)
    chosen = transport_for(names[0], device, transport)
    launch = plan_launches(names, device, transport, infos, external=external_launch())[0]
    return SinglePath(names[0], chosen, launch)


def traffic_note(path: str, before: dict[str, int], after: dict[str, int]) -> str:
    """One line: the interfaces that carried this rank's bytes during a path's sweep, most first."""
    moved = sorted(((after.get(k, 0) - v, k) for k, v in before.items() if after.get(k, 0) > v), reverse=True)
    if not moved:
        return f"{path}: no interface of this rank's network namespace sent anything"
    return f"{path}: rank 0 sent " + ", ".join(f"{b / 1e6:.1f} MB over {k}" for b, k in moved[:3])


def resolve_device(requested: str) -> str:
    """``--device``: auto is cuda where torch sees a GPU (the ranks check that each has one), else cpu."""
    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def external_launch() -> bool:
    """This process is one rank of a job started by mpirun/torchrun."""
    import collectives

    return collectives.detect_launch() in ("mpi", "torchrun")


def cleanup(launches: Sequence[Launch]) -> None:
    """Remove the NCCL log directories of ``launches`` (a failed run keeps them: its error names them)."""
    import shutil

    for launch in launches:
        if launch.log_dir:
            shutil.rmtree(launch.log_dir, ignore_errors=True)
