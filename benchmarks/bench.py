"""``moecomm bench``: the nccl-tests-style sweep, optionally with every peer side by side."""

from __future__ import annotations

import sys

import click

from . import sweep as sw

DEFAULT_JSON = "moecomm-bench.json"
DEFAULT_PLOT = "moecomm-bench.png"


def _bench_rank(comm, opts: dict) -> dict:
    """Body of `moecomm bench` on one rank (collective); rank 0 prints as rows arrive.

    Returns {"rows": [Row dicts], "notes": [...], "meta": {...}}; rows are the same on every rank.
    """
    from .peers import build_peers, gpus_per_rank_available
    from .progress import Progress
    from .report import ratio_table

    device = opts["device"]
    has_gpus = gpus_per_rank_available(comm) if device in ("auto", "cuda") else False
    if device == "cuda" and not has_gpus:
        raise click.UsageError("--device cuda needs a CUDA GPU for every local rank (torch.cuda.device_count() "
                               f">= {comm.local_size}); use --device cpu")
    device = "cuda" if has_gpus else "cpu"
    try:
        peers, notes = build_peers(comm, transports=opts["transports"], compare=opts["compare"], peers=opts["peers"],
                                   device=device, timeout=opts["timeout"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    lead = comm.rank == 0
    bar = Progress(0, enabled=False)

    def out(text: str = "") -> None:
        if lead:
            bar.print(text)

    def on_start(i: int, total: int, step: tuple) -> None:
        nonlocal bar
        if not lead:
            return
        if bar.total != total:
            bar = Progress(total, enabled=not opts["quiet"])
        size, op, dname, redop, peer = step
        bar.update(i, f"{op} {sw.format_size(size)} {peer}")

    try:
        out(f"# moecomm bench: {comm.size} ranks, dtype {','.join(opts['dtypes'])}, iters {opts['iters']}, "
            f"warmup {opts['warmup']}, check {opts['check']}, device {device}, launch {comm.topology.launch}")
        out("# " + str(comm.topology).replace("\n", "\n# "))
        out("# peers: " + "; ".join(p.describe() for p in peers))
        printed_notes = []

        def on_notes(more: list[str]) -> None:
            printed_notes.extend(more)
            for line in notes + more:
                out(f"# note: {line}")
            out(sw.HEADER)

        rows = sw.run_sweep({p.name: p for p in peers}, opts["ops"], opts["dtypes"], opts["sizes"],
                            iters=opts["iters"], warmup=opts["warmup"], check=opts["check"], seed=opts["seed"],
                            redops=opts["redops"], root=opts["root"], stats=comm, on_start=on_start,
                            on_notes=on_notes, on_row=lambda r: out(sw.format_row(r)))
        bar.finish()
    finally:
        for p in peers:
            p.close()
    for line in sw.summary(rows):
        out(line)
    bad_peers = sorted({r.transport for r in rows if r.library != "moecomm" and (r.wrong > 0 or r.ip_wrong > 0)})
    if bad_peers:
        out(f"# note: wrong results from {', '.join(bad_peers)} (a peer's problem; moecomm's exit code ignores it)")
    table = ratio_table([r.as_dict() for r in rows])
    if table:
        out("")
        for line in table:
            out(line)
    topo = comm.topology
    meta = {"launch": topo.launch, "nranks": comm.size, "nodes": topo.num_nodes, "hosts": sorted(set(topo.hosts)),
            "cpus_per_rank": list(topo.cpus_per_rank), "transports_available": sorted(comm.transports),
            "peers": {p.name: p.describe() for p in peers}, "device": device}
    return {"rows": [r.as_dict() for r in rows], "notes": notes + printed_notes, "meta": meta}


def _write_outputs(res: dict, opts: dict, json_path, csv_path, plot_path) -> None:
    from .output import environment, make_run, save_csv, save_json

    if not (json_path or csv_path or plot_path):
        return
    env = environment(res["meta"])
    options = {k: v for k, v in opts.items() if k not in ("quiet",)}
    run = make_run(res["rows"], env, options, res["notes"])
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


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


@click.command()
@click.option("-b", "--minbytes", default="8", show_default=True, help="Smallest size (B, K, M, G).")
@click.option("-e", "--maxbytes", default="32M", show_default=True, help="Largest size.")
@click.option("-f", "--stepfactor", type=int, default=None,
              help="Multiply the size by this each step [default: 4, or additive steps when -i is given].")
@click.option("-i", "--stepbytes", default="0", show_default=True,
              help="Add this many bytes each step (used when -f is not given or is 1).")
@click.option("--ops", default=",".join(sw.OPS), show_default=True,
              help=f"Comma-separated collectives ({', '.join(sw.ALL_OPS)}).")
@click.option("-o", "--op", "redop", default="sum", show_default=True,
              help=f"Reduction op(s) of all_reduce/reduce_scatter: {', '.join(sw.REDOPS)}, comma-separated, or all.")
@click.option("-d", "--dtype", "--datatype", "dtype", default="float32", show_default=True,
              help=f"Data type(s): {', '.join(sw.DTYPES)} (or float, double, half, ...), comma-separated, or all.")
@click.option("-r", "--root", default=0, show_default=True, help="Root rank of broadcast.")
@click.option("-n", "--iters", default=20, show_default=True, help="Timed iterations per size.")
@click.option("-w", "--warmup", "--warmup_iters", "warmup", default=5, show_default=True,
              help="Untimed iterations per size.")
@click.option("-c", "--check", default=1, show_default=True, help="Checked calls per size and variant (0: no check).")
@click.option("--no-check", is_flag=True, help="Same as -c 0.")
@click.option("--transport", default=None,
              help="moecomm transport(s) to measure, comma-separated: auto, shm, mpi [default: auto; with "
                   "--compare every available one plus auto].")
@click.option("--compare", is_flag=True,
              help="Measure moecomm (each transport and auto), mpi4py (under mpiexec) and torch.distributed "
                   "(gloo on CPU, NCCL on GPU) side by side, and print moecomm auto / best peer ratios.")
@click.option("--peers", default=None, help="With --compare: which of mpi4py, gloo, nccl [default: all that can run].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the tensors live; auto: cuda when every local rank has a GPU.")
@click.option("--nprocs", default=2, show_default=True, help="Local ranks to launch (ignored under mpirun/torchrun).")
@click.option("--timeout", default=120.0, show_default=True, help="Communicator timeout in seconds.")
@click.option("-J", "--json", "json_path", default=None, metavar="FILE",
              help=f"Write rows and environment as JSON [default: ./{DEFAULT_JSON}].")
@click.option("--csv", "csv_path", default=None, metavar="FILE", help="Write rows and environment as CSV.")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help=f"Plot algbw and busbw vs size [default: ./{DEFAULT_PLOT}].")
@click.option("--no-save", is_flag=True, help=f"Do not write the default {DEFAULT_JSON} / {DEFAULT_PLOT}.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option("--seed", default=1, show_default=True, help="Seed of the random inputs.")
def bench(minbytes, maxbytes, stepfactor, stepbytes, ops, redop, dtype, root, iters, warmup, check, no_check,
          transport, compare, peers, device, nprocs, timeout, json_path, csv_path, plot_path, no_save, quiet, seed):
    """Bandwidth sweep in nccl-tests' format: out-of-place and in-place time/algbw/busbw/#wrong, p50/p99.

    Self-launches --nprocs local ranks, or uses the job's ranks under mpirun/mpiexec/torchrun.
    Writes ./moecomm-bench.json and ./moecomm-bench.png unless told otherwise.
    """
    import collectives

    op_list = _split(ops)
    bad = [o for o in op_list if o not in sw.ALL_OPS]
    if bad:
        raise click.BadParameter(f"unknown op(s) {bad}; choose from {', '.join(sw.ALL_OPS)}", param_hint="--ops")
    try:
        dtypes, redops = sw.parse_dtypes(dtype), sw.parse_redops(redop)
        lo, hi, step = sw.parse_size(minbytes), sw.parse_size(maxbytes), sw.parse_size(stepbytes)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if stepfactor is None:
        stepfactor = 1 if step > 0 else 4
    if stepfactor <= 1 and step <= 0:
        raise click.BadParameter("need -f > 1 or -i > 0 to step from -b to -e", param_hint="-f/-i")
    if iters < 1 or warmup < 0:
        raise click.BadParameter("-n must be >= 1 and -w >= 0")
    opts = dict(ops=op_list, dtypes=dtypes, redops=redops, root=root, iters=iters, warmup=warmup,
                check=0 if no_check else max(check, 0), seed=seed, quiet=quiet, compare=compare,
                sizes=sw.sizes(lo, hi, stepfactor if stepfactor > 1 else 0, step if stepfactor <= 1 else 0),
                transports=_split(transport) or None, peers=_split(peers) or None, device=device, timeout=timeout)
    if not no_save:
        json_path = json_path or DEFAULT_JSON
        plot_path = plot_path or DEFAULT_PLOT
    if collectives.detect_launch() in ("mpi", "torchrun"):
        with collectives.init(timeout=timeout) as comm:
            if not 0 <= root < comm.size:
                raise click.BadParameter(f"root {root} is not a rank of {comm.size}", param_hint="-r")
            res = _bench_rank(comm, opts)
            writer = comm.rank == 0
    else:
        if not 0 <= root < nprocs:
            raise click.BadParameter(f"root {root} is not a rank of {nprocs}", param_hint="-r")
        res = collectives.launch(_bench_rank, nprocs, opts, timeout=timeout)[0]
        writer = True
    if writer:
        _write_outputs(res, opts, json_path, csv_path, plot_path)
    if any(r["library"] == "moecomm" and (r["wrong"] > 0 or r["ip_wrong"] > 0) for r in res["rows"]):
        sys.exit(1)
