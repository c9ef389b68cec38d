"""Where a small ipc all_reduce's time goes on a GPU, phase by phase (issue 12: "if ipc is not at
least as fast as NCCL at <= 64 KiB, say why, with CUDA events per phase").

    python -m tools.profile_ipc [--bytes 8192] [--calls 2000] [--nprocs 2]

Every rank times, per call, on the host: the whole ``comm.using("ipc").all_reduce``; the
pre-bound launch (``transports._ipc_launch.BoundKernel``, which returns once the kernel is
queued); any stream synchronisation and signal-word read through the regions object (none per
call since errors are read lazily from the host-mapped status block: the "per call" column says
how many there were; one synchronize ends the run). A CUDA event pair around the launch gives
the kernel's own time on the GPU (including its wait for the peer). What is left of the whole call
is moecomm's Python around the transport.
Rank 0 prints each phase's median over the calls of every rank. Needs CUDA (exits 3 without).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import click

PHASES = ("call", "launch", "sync", "read_flags", "kernel_gpu")


def _timed_launches(times: dict[str, list[float]], events: list[tuple[Any, Any]]) -> Callable[[], None]:
    """Time every compiled ipc launch (``transports._ipc_launch.launch``, through which the bound
    kernels and the latency closures go) on the host and by CUDA events; returns the undo."""
    import torch

    import transports._ipc_launch as launch_mod
    import transports.ipc as ipc_mod

    real = launch_mod.launch

    def run(*args: Any, **kwargs: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        result = real(*args, **kwargs)
        times["launch"].append(time.perf_counter() - t0)
        end.record()
        events.append((start, end))
        return result

    launch_mod.launch = ipc_mod.launch = run

    def undo() -> None:
        launch_mod.launch = ipc_mod.launch = real

    return undo


def _timed(fn: Callable[..., Any], samples: list[float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            samples.append(time.perf_counter() - t0)
    return run


def _profile_rank(comm: Any, nbytes: int, calls: int, warmup: int, sync_every: int) -> dict[str, list[float]]:
    """On every rank: ``calls`` timed ipc all_reduces of ``nbytes`` float32 bytes; phase samples in µs.
    Every ``sync_every`` calls (0: never) the GPU catches up, outside the timed calls, so that a full
    launch queue does not make the host wait inside one."""
    import torch

    ipc = comm.transports["ipc"]
    view = comm.using("ipc")
    x = torch.randn(max(1, nbytes // 4), device=comm.device)
    for _ in range(warmup):
        view.all_reduce(x)
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    events: list[tuple[Any, Any]] = []
    undo = _timed_launches(times, events)
    ipc._regions.sync = _timed(ipc._regions.sync, times["sync"])
    ipc._regions.read = _timed(ipc._regions.read, times["read_flags"])
    try:
        for i in range(calls):
            if sync_every and i % sync_every == 0:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            view.all_reduce(x)
            times["call"].append(time.perf_counter() - t0)
        view.synchronize()
    finally:
        undo()
    torch.cuda.synchronize()
    times["kernel_gpu"] = [s.elapsed_time(e) / 1e3 for s, e in events]  # ms -> s
    return {p: [v * 1e6 for v in vs] for p, vs in times.items()}


@click.command()
@click.option("--bytes", "nbytes", type=click.IntRange(min=4), default=8192, show_default=True)
@click.option("--calls", type=click.IntRange(min=1), default=2000, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=200, show_default=True)
@click.option("--nprocs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--sync-every", type=click.IntRange(min=0), default=1, show_default=True,
              help="Let the GPU catch up every this many calls, untimed (0: never; then a full launch "
                   "queue can stall a call and its host time includes the GPU's).")
def main(nbytes: int, calls: int, warmup: int, nprocs: int, sync_every: int) -> None:
    """Per-phase medians of a small ipc all_reduce on the GPU (every rank on this machine's GPUs)."""
    import torch

    import collectives

    if not torch.cuda.is_available():
        click.echo("profile_ipc needs a CUDA GPU", err=True)
        sys.exit(3)
    per_rank = collectives.launch(_profile_rank, nprocs, nbytes, calls, warmup, sync_every, transport="ipc")
    click.echo(f"# ipc all_reduce of {nbytes} B float32, {nprocs} ranks, {calls} calls per rank, GPU caught up "
               f"every {sync_every or 'never'} ({torch.cuda.get_device_name(0)}); medians over every rank's calls, us")
    click.echo(f"# {'phase':<12} {'median':>9} {'p10':>9} {'p90':>9} {'per call':>9}")
    for p in PHASES:
        vs = sorted(v for r in per_rank for v in r[p])
        if vs:
            per_call = len(vs) / (nprocs * calls)
            click.echo(f"  {p:<12} {statistics.median(vs):9.1f} {vs[len(vs) // 10]:9.1f} "
                       f"{vs[9 * len(vs) // 10]:9.1f} {per_call:9.2f}")


if __name__ == "__main__":
    main()
