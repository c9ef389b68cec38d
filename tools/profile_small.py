"""Where a small collective's time goes: per-call time and a cProfile of moecomm's call path.

    mpiexec -n 2 python -m tools.profile_small [--op all_reduce] [--bytes 8] [--calls 20000]

Every rank runs the calls in lockstep; rank 0 prints the mean time per call (moecomm, and MPICH's
through mpi4py on the same buffers), then the functions cProfile charges the most time to (the
profiler's own overhead inflates every number it shows; the ranking is what matters). Run it with
MOECOMM_SHM_NATIVE=off to see the Python path.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import click
import torch


def _calls(comm, mpi, op: str, numel: int):
    """(moecomm call, mpi4py call) of ``op`` on the same float32 buffers, ``numel`` elements per block."""
    n = comm.size
    in_numel = numel * n if op in ("reduce_scatter", "all_to_all") else numel
    out_numel = numel * n if op in ("all_gather", "all_to_all") else numel
    x, out = torch.randn(in_numel), torch.empty(out_numel)
    xs, os_ = x.numpy(), out.numpy()
    if op == "all_reduce":
        return (lambda: comm.all_reduce(x, out=out)), (lambda: mpi.Allreduce(xs, os_))
    if op == "all_gather":
        return (lambda: comm.all_gather(x, out=out)), (lambda: mpi.Allgather(xs, os_))
    if op == "reduce_scatter":
        return (lambda: comm.reduce_scatter(x, out=out)), (lambda: mpi.Reduce_scatter_block(xs, os_))
    return (lambda: comm.all_to_all(x, out=out)), (lambda: mpi.Alltoall(xs, os_))


@click.command()
@click.option("--op", type=click.Choice(["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]),
              default="all_reduce", show_default=True)
@click.option("--bytes", "nbytes", type=int, default=8, show_default=True, help="Bytes per rank (float32).")
@click.option("--calls", type=int, default=20000, show_default=True)
@click.option("--top", type=int, default=15, show_default=True, help="Functions shown.")
def main(op: str, nbytes: int, calls: int, top: int) -> None:
    """Time and profile one small collective under mpiexec."""
    from mpi4py import MPI

    import collectives

    comm = collectives.init()
    mpi = MPI.COMM_WORLD.Dup()
    numel = max(1, nbytes // 4)
    ours, theirs = _calls(comm, mpi, op, numel)
    results = {}
    for name, fn in (("moecomm", ours), ("mpi4py", theirs)):
        for _ in range(calls // 10):
            fn()
        mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        results[name] = (time.perf_counter() - t0) / calls * 1e6
    profiler = cProfile.Profile() if comm.rank == 0 else None
    mpi.Barrier()
    if profiler:
        profiler.enable()
    for _ in range(calls):
        ours()
    if profiler:
        profiler.disable()
        plan = comm.plan(op, torch.empty(numel * (comm.size if op in ("reduce_scatter", "all_to_all") else 1)))
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
        click.echo(f"# {op} of {nbytes} B per rank on {comm.size} ranks: {plan}")
        click.echo(f"# mean per call, {calls} calls in lockstep: moecomm {results['moecomm']:.2f} us, "
                   f"mpi4py {results['mpi4py']:.2f} us")
        click.echo("\n".join(line for line in text.getvalue().splitlines() if line.strip()))
    mpi.Free()
    comm.close()


if __name__ == "__main__":
    main()
