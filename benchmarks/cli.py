"""The ``moecomm`` command line."""

from __future__ import annotations

import logging
import sys

import click

from . import sweep as sw


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="-v: INFO logs, -vv: DEBUG (one line per transport decision).")
def main(verbose: int) -> None:
    """moecomm: collective communication and MoE all-to-all benchmarks and tools."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def _bench_rank(comm, opts: dict) -> list[dict]:
    """Body of `moecomm bench` on one rank; rank 0 prints as rows arrive."""
    names = opts["transports"] or ["auto"]
    missing = [t for t in names if t != "auto" and t not in comm.transports]
    if missing:
        raise click.UsageError(f"transport(s) {missing} not available here (available: {sorted(comm.transports)}); "
                               "the mpi transport needs `mpiexec -n N moecomm bench`")
    comms = {t: comm.using(t) for t in names}
    if "auto" in comms:  # label auto by what it picked
        comms = {(comm.plan("all_reduce", sw._inputs("all_reduce", 1, 1, 0, sw.DTYPES[opts["dtype"]], 0)).transport
                  if t == "auto" else t): c for t, c in comms.items()}
    out = print if comm.rank == 0 else (lambda *a, **k: None)
    out(f"# moecomm bench: {comm.size} ranks, dtype {opts['dtype']}, iters {opts['iters']}, "
        f"warmup {opts['warmup']}, launch {comm.topology.launch}")
    out("# " + str(comm.topology).replace("\n", "\n# "))
    out(sw.HEADER)
    rows = sw.run_sweep(comms, opts["ops"], opts["dtype"], opts["sizes"], iters=opts["iters"], warmup=opts["warmup"],
                        check=opts["check"], on_row=lambda r: out(f"{r.op:>14}" + sw.format_row(r), flush=True))
    for line in sw.summary(rows):
        out(line)
    return [r.as_dict() for r in rows]


@main.command()
@click.option("-b", "--minbytes", default="8", show_default=True, help="Smallest size (B, K, M, G).")
@click.option("-e", "--maxbytes", default="32M", show_default=True, help="Largest size.")
@click.option("-f", "--stepfactor", default=4, show_default=True, help="Multiply the size by this each step.")
@click.option("--ops", default=",".join(sw.OPS), show_default=True, help="Comma-separated collectives.")
@click.option("-d", "--dtype", default="float32", show_default=True, type=click.Choice(sorted(sw.DTYPES)))
@click.option("-n", "--iters", default=20, show_default=True, help="Timed iterations per size.")
@click.option("-w", "--warmup", default=5, show_default=True, help="Untimed iterations per size.")
@click.option("-c", "--check/--no-check", default=True, show_default=True, help="Check results against a reference.")
@click.option("--transport", default="auto", show_default=True,
              help="auto, shm, mpi, or several comma-separated to measure side by side (interleaved per size).")
@click.option("--nprocs", default=2, show_default=True, help="Local ranks to launch (ignored under mpirun/torchrun).")
@click.option("--timeout", default=120.0, show_default=True, help="Communicator timeout in seconds.")
def bench(minbytes, maxbytes, stepfactor, ops, dtype, iters, warmup, check, transport, nprocs, timeout):
    """Bandwidth sweep in nccl-tests' format (algbw/busbw, #wrong) on this machine's ranks."""
    import collectives

    op_list = [o.strip() for o in ops.split(",") if o.strip()]
    bad = [o for o in op_list if o not in sw.ALL_OPS]
    if bad:
        raise click.BadParameter(f"unknown op(s) {bad}; choose from {', '.join(sw.ALL_OPS)}", param_hint="--ops")
    opts = dict(ops=op_list, dtype=dtype, iters=iters, warmup=warmup, check=check,
                sizes=sw.sizes(sw.parse_size(minbytes), sw.parse_size(maxbytes), stepfactor),
                transports=[t.strip() for t in transport.split(",") if t.strip()])
    if collectives.detect_launch() in ("mpi", "torchrun"):
        with collectives.init(timeout=timeout) as comm:
            rows = _bench_rank(comm, opts)
    else:
        rows = collectives.launch(_bench_rank, nprocs, opts, timeout=timeout)[0]
    if any(r["wrong"] > 0 for r in rows):
        sys.exit(1)


# Commands that live in their own modules.
from .bench_moe import bench_moe  # noqa: E402
from .bench_tp import bench_tp  # noqa: E402
from .topo import topo  # noqa: E402

main.add_command(bench_moe)
main.add_command(bench_tp)
main.add_command(topo)

if __name__ == "__main__":
    main()
