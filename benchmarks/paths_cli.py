"""``moecomm paths``: which paths between ranks (nvlink, pcie, cuda-ipc, shm, ib, roce, socket) this node or
this launch offers, what each would use, and why a path is missing (rules: collectives/topology/paths.py)."""

from __future__ import annotations

import json
import socket

import click

from collectives.topology.paths import PathInfo

# how many ranks an external launcher started: torchrun's, then the MPI launchers' variables
def unavailable_message(info: PathInfo) -> str:
    """One line for a path that cannot be measured here: ``path roce is not available here: <reason>``."""
    return f"path {info.path} is not available here: {info.reason}"


def _ipc_why_not() -> str | None:
    """The ipc transport's own answer, emulation off: cuda-ipc is CUDA's path (emulation moves CPU tensors)."""
    from transports.ipc import ipc_why_not

    return ipc_why_not({"ipc_emulate": False})  # the one setting it reads


def local_paths() -> list[PathInfo]:
    """This node's rows, as this process sees them (its CUDA devices, its ipc transport)."""
    from collectives.topology import detect
    from collectives.topology.paths import discover_paths

    return discover_paths(detect(probe=False), ipc_why_not=_ipc_why_not())


def paths_by_host(comm, rows: list[PathInfo]) -> dict[str, list[PathInfo]]:
    """Every rank's rows by host name (collective over ``comm``; the same on every rank). The first rank of
    each host speaks for it: ranks of one host differ only in their CUDA devices."""
    from .ranks import allgather_text

    mine = json.dumps({"host": socket.gethostname(), "rows": [r.to_dict() for r in rows]})
    per_host: dict[str, list[PathInfo]] = {}
    for text in allgather_text(comm, mine):
        d = json.loads(text)
        per_host.setdefault(d["host"], [PathInfo.from_dict(x) for x in d["rows"]])
    return per_host


def _gather(rows: list[PathInfo]) -> dict[str, list[PathInfo]] | None:
    """Every rank's rows by host name, on rank 0 (None elsewhere), over a CPU communicator: NCCL need not
    work for this (it may be what is being diagnosed)."""
    import collectives

    comm = collectives.init(device="cpu")
    try:
        per_host = paths_by_host(comm, rows)
        rank = comm.rank
    finally:
        comm.close()
    return per_host if rank == 0 else None


def _compact(devices: tuple[str, ...]) -> str:
    if not devices:
        return "-"
    return ", ".join(devices) if len(devices) <= 3 else f"{devices[0]} .. {devices[-1]} ({len(devices)})"


def render_paths(rows: list[PathInfo]) -> list[str]:
    """The table of ``moecomm paths``: path, available, devices, reason."""
    from .table import Column, Table

    cells = [(r.path, "yes" if r.available else "no", _compact(r.devices), r.reason) for r in rows]
    widths = [max(len(c[k]) for c in cells) for k in range(3)]
    table = Table([Column("path", widths[0], align="<"), Column("available", widths[1], align="<", gap=2),
                   Column("devices", widths[2], align="<", gap=2), Column("reason", align="<", gap=2)])
    return table.header() + [table.line(*c) for c in cells]


@click.command("paths")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of rows instead of a table.")
@click.option("--from", "recording", type=click.Path(exists=True, file_okay=False),
              help="Show a recording (a directory written by `moecomm topo --record`, or a test fixture) "
                   "instead of this node.")
def paths(as_json: bool, recording: str | None) -> None:
    """Which paths between ranks are available: nvlink, pcie, cuda-ipc, shm, ib, roce, socket; with the
    devices each would use (NCCL_IB_HCA ports, interfaces, GPU pairs) and why a path is missing.

    Under mpirun/torchrun with several ranks, every rank looks at its node and rank 0 prints the paths of
    the whole launch (available where every host has it). Exit status 0; 1 when the ranks could not
    exchange their rows; 2 for a --from directory that holds no recording.
    """
    from collectives.topology.paths import combine_paths, discover_paths

    hosts = 1
    if recording:
        from collectives.topology import load_recording

        try:
            topo = load_recording(recording)
        except FileNotFoundError as e:
            raise click.BadParameter(str(e), param_hint="'--from'") from None
        rows = discover_paths(topo, root=recording)
    else:
        import collectives

        rows = local_paths()
        if collectives.detect_launch() != "single":  # every rank of the launch looks at its node
            try:
                per_host = _gather(rows)
            except (RuntimeError, OSError) as e:  # no mpi4py under mpirun, an unreachable store, a timeout
                raise click.ClickException(f"cannot gather the paths of the launch's ranks: {e}") from None
            if per_host is None:
                return  # not rank 0
            rows, hosts = combine_paths(per_host), len(per_host)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=1))
        return
    if hosts > 1:
        click.echo(f"# {hosts} hosts")
    for line in render_paths(rows):
        click.echo(line)
