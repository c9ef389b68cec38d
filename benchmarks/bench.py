"""``moecomm bench``: the nccl-tests-style sweep, optionally with every peer side by side."""

from __future__ import annotations

import sys
from typing import Any, Callable

import click

from transports.paths import PATHS, PathMismatchError
from transports.settings import TRANSPORT_CHOICES

from . import sweep as sw
from .common import ALL_OPS, DTYPES, OPS, REDOPS, format_size, parse_dtypes, parse_ops, parse_redops, sweep_sizes
from .options import BYTES, COUNT, FIGURE, NONNEGATIVE, SECONDS, comma_list
from .peers import EXTERNAL
from .ranks import on_ranks
from .table import SWEEP, format_row, summary

DEFAULT_JSON = "moecomm-bench.json"
DEFAULT_PLOT = "moecomm-bench.png"


def _bench_rank(comm, opts: dict[str, Any]) -> dict[str, Any]:
    """Body of `moecomm bench` on one rank (collective); rank 0 prints as rows arrive.

    Returns {"rows": [Row dicts], "notes": [...], "meta": {...}}; rows are the same on every rank (with
    ``--path``, a node-local path on several nodes: each node's own).
    """
    from .peers import bench_device, build_peers
    from .report import memcpy_table, ratio_table

    device = bench_device(comm, opts["device"])
    lead = comm.rank == 0
    path_meta: dict[str, Any] = {}
    if opts.get("paths"):
        sweeps, notes = _path_sweeps(comm, opts, device, path_meta)
    else:
        try:
            peers, notes = build_peers(comm, transports=opts["transports"], compare=opts["compare"],
                                       peers=opts["peers"], device=device, timeout=opts["timeout"],
                                       memcpy=opts["memcpy"])
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        sweeps = [_Sweep(peers, comm)]

    def out(text: str = "") -> None:
        if lead:
            click.echo(text)

    rows: list[sw.Row] = []
    printed_notes: list[str] = []
    try:
        cycles = opts.get("cycles", 1)
        out(f"# moecomm bench: {comm.size} ranks, dtype {','.join(opts['dtypes'])}, iters {opts['iters']}, "
            f"warmup {opts['warmup']}{f', cycles {cycles}' if cycles > 1 else ''}, check {opts['check']}, "
            f"device {device}, launch {comm.topology.launch}")
        if opts.get("cuda_graph", 0):
            out(f"# mode: CUDA graphs, {opts['cuda_graph']} calls captured per graph; time = replay time / "
                f"{opts['cuda_graph']}, out-of-place only; #wrong checks the result after the timed replays")
        out("# " + str(comm.topology).replace("\n", "\n# "))
        for i, sweep in enumerate(sweeps):
            rows += _run_one(sweep, opts, notes, printed_notes, out, lead, i == 0)
    finally:
        for sweep in sweeps:
            sweep.close()
    for line in summary(rows):
        out(line)
    bad_peers = sorted({r.transport for r in rows if r.library != "moecomm" and (r.wrong > 0 or r.ip_wrong > 0)})
    if bad_peers:
        out(f"# note: wrong results from {', '.join(bad_peers)} (a peer's problem; moecomm's exit code ignores it)")
    row_dicts = [r.as_dict() for r in rows]
    for table in (ratio_table(row_dicts), memcpy_table(row_dicts)):
        if table:
            out("")
            for line in table:
                out(line)
    topo = comm.topology
    meta = {"launch": topo.launch, "nranks": comm.size, "nodes": topo.num_nodes, "hosts": sorted(set(topo.hosts)),
            "cpus_per_rank": list(topo.cpus_per_rank), "transports_available": sorted(comm.transports),
            "peers": {p.name: p.describe() for sweep in sweeps for p in sweep.peers}, "device": device}
    if path_meta:
        meta["paths"] = path_meta
    return {"rows": row_dicts, "notes": notes + printed_notes, "meta": meta}


class _Sweep:
    """One run_sweep: its peers, the communicator that aggregates them, and for ``--path`` the path's
    row check and what to close afterwards."""

    def __init__(self, peers: list, stats: Any, on_row: Callable[[Any], None] | None = None, path: str = "",
                 owned: Any = None) -> None:
        self.peers, self.stats, self.on_row, self.path, self.owned = peers, stats, on_row, path, owned

    def close(self) -> None:
        for p in self.peers:
            p.close()
        if self.owned is not None:
            self.owned.close()
            self.owned = None


def _path_sweeps(comm, opts: dict[str, Any], device: str, meta: dict[str, Any]) -> tuple[list[_Sweep], list[str]]:
    """``--path``: one sweep per path, each on a communicator that can only take it (collective)."""
    from . import path_bench as pb
    from .peers import MoecommPeer, comm_gpu

    # self-launched ranks run on the machine the launching process checked; under mpirun/torchrun every
    # host looks at itself and the ranks agree
    if not opts.get("paths_checked"):
        pb.check_available(opts["paths"], pb.agreed_paths(comm))
    mdev = str(comm_gpu(comm)) if device == "cuda" else "cpu"
    log_dir = pb.nccl_log_dir()
    sweeps, notes = [], list(opts.get("path_notes", []))
    for path in opts["paths"]:
        transport = pb.transport_for(path, device, opts.get("path_transport"))
        view, owned = pb.path_comm(comm, path, transport)
        verify = pb.Verifier(view, path, transport, log_dir)
        peer = MoecommPeer(view, path, show_transport=True, device=mdev)
        sweeps.append(_Sweep([peer], view, verify, path, owned))
        where = f" within each of {comm.topology.num_nodes} nodes" if view.size < comm.size else ""
        notes.append(f"{path}: {transport} transport, {view.size} ranks{where}")
        meta[path] = {"transport": transport, "ranks": view.size, "within_node": view.size < comm.size}
    return sweeps, notes


def _run_one(sweep: _Sweep, opts: dict[str, Any], notes: list[str], printed_notes: list[str],
             out: Callable[[str], None], lead: bool, first: bool) -> list[sw.Row]:
    """Run one sweep, printing its notes, header and rows on the lead rank."""
    from . import path_bench as pb
    from .progress import Progress

    bar = Progress(0, enabled=False)

    def on_start(i: int, total: int, step: sw.Step) -> None:
        nonlocal bar
        if not lead:
            return
        if bar.total != total:
            bar = Progress(total, enabled=not opts["quiet"])
        bar.update(i, f"{step.op} {format_size(step.size)} {step.peer.name}")

    def on_notes(more: list[str]) -> None:
        printed_notes.extend(more)
        if sweep.path:
            if first:
                for line in notes:
                    out(f"# paths: {line}")
            out(f"# path {sweep.path} (checked at its first row; every row's path field is the path verified):")
        else:
            out("# peers: " + "; ".join(p.describe() for p in sweep.peers))
            more = notes + more
        for line in more:
            out(f"# note: {line}")
        for line in SWEEP.header():
            out(line)

    def on_row(row: sw.Row) -> None:
        if sweep.on_row is not None:
            sweep.on_row(row)
        if lead:
            bar.print(format_row(row))

    before = pb.interface_bytes() if sweep.path == "socket" else {}
    rows = sw.run_sweep({p.name: p for p in sweep.peers}, opts["ops"], opts["dtypes"], opts["sizes"],
                        iters=opts["iters"], warmup=opts["warmup"], check=opts["check"], seed=opts["seed"],
                        redops=opts["redops"], root=opts["root"], stats=sweep.stats, on_start=on_start,
                        cycles=opts.get("cycles", 1), graph_calls=opts.get("cuda_graph", 0),
                        on_notes=on_notes, on_row=on_row)
    bar.finish()
    if sweep.path == "socket":
        note = pb.traffic_note(sweep.path, before, pb.interface_bytes())
        printed_notes.append(note)
        out(f"# note: {note}")
    return rows


def _bench_paths(opts: dict[str, Any], path: str, nprocs: int) -> tuple[bool, dict[str, Any], list[str]]:
    """``bench --path``: check the paths, then one launch per set of ranks the paths need, merged.

    Returns (lead, the launches' rows, notes and environment merged, one message per path that was not
    taken); a launch whose path was not taken stops there, the others still run."""
    from . import path_bench as pb

    paths = pb.parse_paths(path)
    if opts["compare"]:
        raise click.BadParameter("--path measures one transport per path; it does not combine with --compare",
                                 param_hint="--path")
    transports = opts["transports"] or []
    if len(transports) > 1:
        raise click.BadParameter("with --path, --transport names at most one transport (the one under test)",
                                 param_hint="--transport")
    device = pb.resolve_device(opts["device"])
    external = pb.external_launch()
    infos = pb.local_paths()
    skipped = []
    if paths == ["all"]:
        paths = pb.available_paths(infos, device)
        skipped = [f"{i.path} not measured: {i.reason if not i.available else f'it does not carry {device} tensors'}"
                   for i in infos if i.path not in paths]
        if not paths:
            raise pb.PathUnavailable(f"no path here carries {device} tensors ({'; '.join(skipped)})")
    if not external:  # this machine is the launch: say now, before any rank starts
        pb.check_available(paths, infos)
    for p in paths:
        pb.transport_for(p, device, transports[0] if transports else None)
    launches = pb.plan_launches(paths, device, transports[0] if transports else None, infos, external=external)
    merged: dict[str, Any] = {"rows": [], "notes": [], "meta": {}}
    lead, failed, kept = True, [], []
    for launch in launches:
        o = dict(opts, paths=launch.paths, device=device, path_transport=transports[0] if transports else None,
                 path_notes=skipped if launch is launches[0] else [], paths_checked=not external)
        try:
            lead, res = on_ranks(_bench_rank, nprocs, o, timeout=opts["timeout"], check_size=_fits(opts),
                                 env=launch.env)
        except PathMismatchError as e:
            failed.append(f"{e}" + (f" (NCCL's log: {launch.log_dir})" if launch.log_dir else ""))
            kept.append(launch)
            continue
        merged["rows"] += res["rows"]
        merged["notes"] += res["notes"]
        paths_meta = {**merged["meta"].get("paths", {}), **res["meta"].get("paths", {})}
        merged["meta"] = {**res["meta"], "paths": paths_meta}
    pb.cleanup([launch for launch in launches if launch not in kept])
    return lead, merged, failed


def _write_outputs(res: dict[str, Any], opts: dict[str, Any], json_path: str | None, csv_path: str | None,
                   plot_path: str | None) -> None:
    """Write the run as JSON / CSV / a figure where asked; a path that cannot be written is a
    one-line error (exit 1), not a traceback."""
    from .output import environment, make_run, save_csv, save_json

    if not (json_path or csv_path or plot_path):
        return
    env = environment(res["meta"])
    options = {k: v for k, v in opts.items() if k not in ("quiet",)}
    run = make_run(res["rows"], env, options, res["notes"])
    try:
        if json_path:
            click.echo(f"# wrote {save_json(json_path, run).resolve()}")
        if csv_path:
            click.echo(f"# wrote {save_csv(csv_path, run).resolve()}")
        if plot_path:
            from .plot import plot_runs

            title = (f"moecomm bench: {env['nranks']} ranks ({env['launch']}) on {env['hostname']}, "
                     f"{env['cpus']} CPUs, {env.get('gpu_model') or 'no GPU'}")
            try:
                click.echo(f"# wrote {plot_runs([('', run['rows'])], plot_path, title=title).path.resolve()}")
            except ValueError as e:
                click.echo(f"# no plot: {e}", err=True)
    except OSError as e:
        raise click.ClickException(f"cannot write the results: {e}") from None


def _sweep_options(minbytes: int, maxbytes: int, stepfactor: int | None, stepbytes: int, ops: str, redop: str,
                   dtype: str, transport: str | None, compare: bool, peers: str | None,
                   memcpy: bool | None = None) -> dict[str, Any]:
    """The sweep's sizes, ops, dtypes, redops, transports and peers, or a usage error naming the option."""
    def parsed(parse: Callable[[str], list[str]], text: str, hint: str) -> list[str]:
        try:
            return parse(text)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=hint) from None

    try:
        size_list = sweep_sizes(minbytes, maxbytes, stepfactor, stepbytes)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="-b/-e/-f/-i") from None
    transports = comma_list(transport)
    # "hierarchical" (collectives/hierarchical.py) is a communicator's composed path, not a settings transport
    known = (*TRANSPORT_CHOICES, "hierarchical")
    bad = [t for t in transports if t not in known]
    if bad:
        raise click.BadParameter(f"unknown transport(s) {bad}; choose from {', '.join(known)}",
                                 param_hint="--transport")
    peer_list = comma_list(peers)
    bad = [p for p in peer_list if p not in EXTERNAL]
    if bad:
        raise click.BadParameter(f"unknown peer(s) {bad}; choose from {', '.join(EXTERNAL)}", param_hint="--peers")
    if peer_list and not compare:
        raise click.BadParameter("peers are measured with --compare only", param_hint="--peers")
    return dict(ops=parsed(parse_ops, ops, "--ops"), dtypes=parsed(parse_dtypes, dtype, "-d"),
                redops=parsed(parse_redops, redop, "-o"), compare=compare,
                memcpy=compare if memcpy is None else memcpy,
                sizes=size_list,
                transports=transports or None, peers=peer_list or None)


def _fits(opts: dict[str, Any]) -> Callable[[int], None]:
    """The checks that need the number of ranks: broadcast's root, and sizes that run at all."""
    def check(n: int) -> None:
        if opts["root"] >= n:
            raise click.BadParameter(f"root {opts['root']} is not a rank of {n}", param_hint="-r")
        empty = sw.too_small(opts["ops"], opts["dtypes"], opts["sizes"], n)
        if empty:
            raise click.BadParameter(f"no size from -b to -e runs: {'; '.join(empty)}", param_hint="-b/-e")
    return check


def _graph_device(device: str) -> str:
    """The device of a ``--cuda-graph`` sweep ("cuda"), or a usage error: graphs need CUDA tensors."""
    if device == "cpu":
        raise click.BadParameter("CUDA graphs capture CUDA tensors; use --device cuda (or auto) with it",
                                 param_hint="--cuda-graph")
    import torch

    if not torch.cuda.is_available():
        raise click.UsageError("--cuda-graph captures CUDA graphs and needs a CUDA GPU; torch.cuda.is_available() "
                               "is False here (run without --cuda-graph to time eager calls)")
    return "cuda"


@click.command()
@click.option("-b", "--minbytes", type=BYTES, default="8", show_default=True, help="Smallest size (B, K, M, G).")
@click.option("-e", "--maxbytes", type=BYTES, default="32M", show_default=True, help="Largest size.")
@click.option("-f", "--stepfactor", type=COUNT, default=None,
              help="Multiply the size by this each step [default: 4, or additive steps when -i is given].")
@click.option("-i", "--stepbytes", type=BYTES, default="0", show_default=True,
              help="Add this many bytes each step (used when -f is not given or is 1).")
@click.option("--ops", default=",".join(OPS), show_default=True,
              help=f"Comma-separated collectives ({', '.join(ALL_OPS)}), or all.")
@click.option("-o", "--op", "redop", default="sum", show_default=True,
              help=f"Reduction op(s) of all_reduce/reduce_scatter: {', '.join(REDOPS)}, comma-separated, or all.")
@click.option("-d", "--dtype", "--datatype", "dtype", default="float32", show_default=True,
              help=f"Data type(s): {', '.join(DTYPES)} (or float, double, half, ...), comma-separated, or all.")
@click.option("-r", "--root", type=NONNEGATIVE, default=0, show_default=True, help="Root rank of broadcast.")
@click.option("-n", "--iters", type=COUNT, default=20, show_default=True, help="Timed iterations per size.")
@click.option("-w", "--warmup", "--warmup_iters", "warmup", type=NONNEGATIVE, default=5, show_default=True,
              help="Untimed iterations per size.")
@click.option("--cycles", type=COUNT, default=1, show_default=True,
              help="Make the whole sweep this many times; each row pools its timed calls of every cycle "
                   "(time = mean, p50/p99 over all of them), spreading them over the run so that a short "
                   "slow phase of the machine moves one cycle, not the row.")
@click.option("-c", "--check", type=NONNEGATIVE, default=1, show_default=True,
              help="Checked calls per size and variant (0: no check).")
@click.option("--no-check", is_flag=True, help="Same as -c 0.")
@click.option("--transport", default=None,
              help="moecomm transport(s) to measure, comma-separated: auto, shm, mpi [default: auto; with "
                   "--compare every available one plus auto].")
@click.option("--compare", is_flag=True,
              help="Measure moecomm (each transport and auto), mpi4py (under mpiexec) and torch.distributed "
                   "(gloo on CPU, NCCL on GPU) side by side, and print moecomm auto / best peer ratios "
                   "(and the memcpy reference, see --memcpy).")
@click.option("--peers", default=None, help="With --compare: which of mpi4py, gloo, nccl [default: all that can run].")
@click.option("--memcpy/--no-memcpy", default=None,
              help="Measure the memory-bandwidth reference (every rank copies each size locally, at the same "
                   "time) and print each op's busbw as a % of it [default: on with --compare].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the tensors live; auto: cuda when every local rank has a GPU.")
@click.option("-G", "--cuda-graph", "cuda_graph", type=NONNEGATIVE, default=0, show_default=True, metavar="N",
              help="Capture N calls of each op into one CUDA graph per size and time its replays (nccl-tests' "
                   "-G), for every peer alike; out-of-place only. Needs a GPU (0: eager calls).")
@click.option("--nprocs", type=COUNT, default=2, show_default=True,
              help="Local ranks to launch (ignored under mpirun/torchrun).")
@click.option("--timeout", type=SECONDS, default=120.0, show_default=True, help="Communicator timeout in seconds.")
@click.option("-J", "--json", "json_path", default=None, metavar="FILE",
              help=f"Write rows and environment as JSON [default: ./{DEFAULT_JSON}].")
@click.option("--csv", "csv_path", default=None, metavar="FILE", help="Write rows and environment as CSV.")
@click.option("--plot", "plot_path", type=FIGURE, default=None,
              help=f"Plot algbw and busbw vs size [default: ./{DEFAULT_PLOT}].")
@click.option("--no-save", is_flag=True, help=f"Do not write the default {DEFAULT_JSON} / {DEFAULT_PLOT}.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("--seed", type=NONNEGATIVE, default=1, show_default=True, help="Seed of the random inputs.")
@click.option("--path", "path", default=None, metavar="P[,P..]|all",
              help="Force the bytes onto path(s) and verify the path taken (`moecomm paths` lists them): "
                   f"{', '.join(PATHS)}; all: every available one. CPU tensors: shm (shm transport), socket "
                   "(gloo); CUDA: cuda-ipc (ipc), the others NCCL (forced through its environment, verified "
                   "from its NCCL_DEBUG=INFO log). One line per path in the table and the plot; a path that is "
                   "not available exits 2, one that was not taken fails naming both.")
def bench(minbytes: int, maxbytes: int, stepfactor: int | None, stepbytes: int, ops: str, redop: str, dtype: str,
          root: int, iters: int, warmup: int, cycles: int, check: int, no_check: bool, transport: str | None, compare: bool,
          peers: str | None, memcpy: bool | None, device: str, cuda_graph: int, nprocs: int, timeout: float,
          json_path: str | None, csv_path: str | None, plot_path: str | None, no_save: bool, quiet: bool,
          seed: int, path: str | None) -> None:
    """Bandwidth sweep in nccl-tests' format: out-of-place and in-place time/algbw/busbw/#wrong, p50/p99.

    Self-launches --nprocs local ranks, or uses the job's ranks under mpirun/mpiexec/torchrun.
    Writes ./moecomm-bench.json and ./moecomm-bench.png unless told otherwise.
    """
    opts = _sweep_options(minbytes, maxbytes, stepfactor, stepbytes, ops, redop, dtype, transport, compare, peers,
                          memcpy)
    if cuda_graph:
        device = _graph_device(device)
    opts.update(root=root, iters=iters, warmup=warmup, cycles=cycles, check=0 if no_check else check, seed=seed,
                quiet=quiet, device=device, timeout=timeout, cuda_graph=cuda_graph)
    if not no_save:
        json_path = json_path or DEFAULT_JSON
        plot_path = plot_path or DEFAULT_PLOT
    failed: list[str] = []
    if path:
        lead, res, failed = _bench_paths(opts, path, nprocs)
    else:
        lead, res = on_ranks(_bench_rank, nprocs, opts, timeout=timeout, check_size=_fits(opts))
    if lead and res["rows"]:
        _write_outputs(res, opts, json_path, csv_path, plot_path)
    if failed:
        from .path_bench import PathFailed

        raise PathFailed("; ".join(failed))
    if any(r["library"] == "moecomm" and (r["wrong"] > 0 or r["ip_wrong"] > 0) for r in res["rows"]):
        sys.exit(1)
