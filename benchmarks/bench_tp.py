"""``moecomm bench-tp``: forward+backward time of a tensor-parallel MLP block per TP size.

The block is ColumnParallelLinear(hidden -> ffn) -> GELU -> RowParallelLinear(ffn -> hidden), the
Megatron MLP. Its communicator is wrapped so that every collective call is timed on the rank that
makes it; that time (which includes waiting for slower peers) is shown apart from the total, and
compute = total - collectives. Times are means per iteration over the timed iterations, averaged
across ranks (nccl-tests' convention). ``max_rel_err`` compares the block's output with the same
block run dense in float64 (from ``to_dense``), so a fast wrong result shows.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any, Callable

import click
import torch
import torch.nn.functional as F

from transports.settings import TRANSPORT_CHOICES

from .common import DTYPES as _ALL_DTYPES
from .common import format_size
from .options import COUNT, NONNEGATIVE, SECONDS, positive_ints
from .ranks import launch_logged
from .table import Column, Table

DTYPES = {name: _ALL_DTYPES[name] for name in ("float32", "bfloat16", "float16", "float64")}
_TIMED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


class TimedComm:
    """A Communicator whose collectives are timed (wall time on this rank); everything else passes through.

    ``stats[(collective, phase)] = [calls, seconds, bytes_in]``; ``phase`` is whatever the caller set
    (e.g. "fwd", "bwd"); nothing is recorded while ``phase`` is None.
    """

    def __init__(self, comm, sync: Callable[[], None] = lambda: None) -> None:
        self._comm = comm
        self._sync = sync  # on a GPU: wait for queued work, so a collective's time is its own
        self.phase: str | None = None
        self.stats: dict = defaultdict(lambda: [0, 0.0, 0])
        for name in _TIMED:
            setattr(self, name, self._timed(getattr(comm, name), name))

    def _timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.phase is None:
                return fn(x, *args, **kwargs)
            self._sync()
            t0 = time.perf_counter()
            out = fn(x, *args, **kwargs)
            self._sync()
            s = self.stats[(name, self.phase)]
            s[0] += 1
            s[1] += time.perf_counter() - t0
            s[2] += x.numel() * x.element_size()
            return out
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def seconds(self, phase: str) -> float:
        """Seconds spent in collectives during ``phase``, summed over the collectives."""
        return sum(v[1] for (_, p), v in self.stats.items() if p == phase)


def _bench_group(comm, opts: dict[str, Any]) -> dict[str, Any] | None:
    """Measure the MLP block on this TP group (every rank of ``comm``); the group's rank 0 gets the row."""
    from collectives.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from .peers import bench_placement

    dev, sync = bench_placement(comm, opts["device"])
    on_gpu = dev.type == "cuda"
    dtype = DTYPES[opts["dtype"]]
    hidden, ffn, tokens, sp = opts["hidden"], opts["ffn"], opts["tokens"], opts["sequence_parallel"]
    tc = TimedComm(comm, sync)
    fc1 = ColumnParallelLinear(hidden, ffn, tc, sequence_parallel=sp, dtype=dtype, device=dev, seed=1)
    fc2 = RowParallelLinear(ffn, hidden, tc, sequence_parallel=sp, dtype=dtype, device=dev, seed=2)
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(tokens, hidden, generator=gen).to(dtype).to(dev)
    G = torch.randn(tokens, hidden, generator=gen).to(dtype).to(dev)
    rows = slice(comm.rank * tokens // comm.size, (comm.rank + 1) * tokens // comm.size) if sp else slice(None)
    x, g = X[rows].contiguous(), G[rows].contiguous()

    def step() -> tuple[float, float]:
        fc1.zero_grad(set_to_none=True)
        fc2.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_()
        tc.phase = "fwd"
        sync()
        t0 = time.perf_counter()
        y = fc2(F.gelu(fc1(xx)))
        sync()
        t1 = time.perf_counter()
        tc.phase = "bwd"
        y.backward(g)
        sync()
        t2 = time.perf_counter()
        tc.phase = None
        return t1 - t0, t2 - t1

    for _ in range(opts["warmup"]):
        step()
    tc.stats.clear()
    comm.barrier()
    fwd = bwd = 0.0
    for _ in range(opts["iters"]):
        f, b = step()
        fwd += f
        bwd += b
    it = max(opts["iters"], 1)
    comm_fwd, comm_bwd = tc.seconds("fwd"), tc.seconds("bwd")

    err = -1.0
    if opts["check"]:
        d1, d2 = fc1.to_dense().double(), fc2.to_dense().double()  # not timed: tc.phase is None
        with torch.no_grad():
            ref = d2(F.gelu(d1(X.double())))[rows]
            y = fc2(F.gelu(fc1(x))).double()
        err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

    keys = sorted(tc.stats)
    per_op = torch.tensor([v for k in keys for v in tc.stats[k]], dtype=torch.float64)
    mine = torch.tensor([fwd / it, bwd / it, comm_fwd / it, comm_bwd / it], dtype=torch.float64)
    summed = comm.all_reduce(torch.cat([mine, per_op])) / comm.size  # every rank made the same calls
    worst = comm.all_reduce(torch.tensor([err]), op="max")
    if comm.rank != 0:
        return None
    device = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    m = summed[:4].tolist()
    ops = {k: (summed[4 + 3 * i].item() / it, summed[5 + 3 * i].item() / it, summed[6 + 3 * i].item() / it)
           for i, k in enumerate(keys)}
    return dict(tp=comm.size, fwd=m[0], bwd=m[1], comm_fwd=m[2], comm_bwd=m[3], ops=ops, err=float(worst[0]),
                threads=torch.get_num_threads(), device=device)


def _bench_world(comm, opts: dict[str, Any], tp: int) -> dict[str, Any] | None:
    """Under mpirun/torchrun: the world split into groups of ``tp`` consecutive ranks, measured together."""
    group = comm.split(comm.rank // tp)
    try:
        row = _bench_group(group, opts)
    finally:
        group.close()
    return row if comm.rank == 0 else None


TABLE = Table([Column("tp", 3), Column("tokens", 7), Column("hidden", 7), Column("ffn", 7), Column("dtype", 9),
               Column("sp", 3), Column("thr", 4), Column("fwd(ms)", 10, ".3f"), Column("bwd(ms)", 10, ".3f"),
               Column("fwd+bwd(ms)", 11, ".3f"), Column("comm(ms)", 10, ".3f"), Column("comm%", 6, ".1f"),
               Column("compute(ms)", 11, ".3f"), Column("GFLOP/s", 9, ".2f"), Column("max_rel_err", 11)])


def _format(r: dict[str, Any], opts: dict[str, Any]) -> list[str]:
    """The table line of one TP size, then one ``#`` line per collective and phase."""
    total = r["fwd"] + r["bwd"]
    comm_t = r["comm_fwd"] + r["comm_bwd"]
    flops = 12.0 * opts["tokens"] * opts["hidden"] * opts["ffn"]  # 2 GEMMs x (1 forward + 2 backward) x 2 flop/MAC
    lines = [TABLE.line(r["tp"], opts["tokens"], opts["hidden"], opts["ffn"], opts["dtype"],
                        "on" if opts["sequence_parallel"] else "off", r["threads"], r["fwd"] * 1e3, r["bwd"] * 1e3,
                        total * 1e3, comm_t * 1e3, 100 * comm_t / total if total else 0.0, (total - comm_t) * 1e3,
                        flops / total / 1e9 if total else 0.0, "N/A" if r["err"] < 0 else f"{r['err']:.2e}")]
    lines.append(f"#      on {r['device']}")
    for (op, phase), (calls, secs, nbytes) in sorted(r["ops"].items(), key=lambda kv: (kv[0][1] != "fwd", kv[0][0])):
        lines.append(f"#      {phase} {op:<15} {calls:>4.0f} call(s)/iter, "
                     f"{format_size(nbytes / max(calls, 1)):>10} in per call, {secs * 1e3:>9.3f} ms/iter")
    return lines


@click.command("bench-tp")
@click.option("--hidden", type=COUNT, default=1024, show_default=True, help="Model (hidden) size.")
@click.option("--ffn", type=COUNT, default=4096, show_default=True, help="MLP inner size (split across the TP group).")
@click.option("--tokens", type=COUNT, default=512, show_default=True, help="Tokens per step (sequence x batch).")
@click.option("--sizes", default="1,2,4", show_default=True, help="Comma-separated TP sizes to measure.")
@click.option("-n", "--iters", type=COUNT, default=10, show_default=True, help="Timed iterations per TP size.")
@click.option("-w", "--warmup", type=NONNEGATIVE, default=3, show_default=True, help="Untimed iterations per TP size.")
@click.option("-d", "--dtype", default="float32", show_default=True, type=click.Choice(sorted(DTYPES)))
@click.option("--sequence-parallel/--no-sequence-parallel", default=False, show_default=True,
              help="All-gather / reduce-scatter along the tokens instead of all-reduce.")
@click.option("--check/--no-check", "-c", default=True, show_default=True,
              help="Compare the output with the dense block in float64.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True, help="Communicator timeout in seconds.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the block runs; auto: cuda when every local rank has a GPU (each phase and collective "
                   "is then timed after a device synchronisation).")
@click.option("--transport", type=click.Choice(TRANSPORT_CHOICES), default="auto", show_default=True,
              help="The communicator's transport for device tensors (auto: chosen per call; host tensors always "
                   "take a host transport). ipc runs two ranks on one GPU where the NCCL refuses them (< 2.30).")
def bench_tp(hidden: int, ffn: int, tokens: int, sizes: str, iters: int, warmup: int, dtype: str,
             sequence_parallel: bool, check: bool, timeout: float, device: str, transport: str) -> None:
    """Forward+backward time of the tensor-parallel MLP block (column -> GELU -> row) per TP size,
    with the time spent in collectives shown separately."""
    import collectives

    tps = positive_ints(sizes, "--sizes", "TP size")
    for t in tps:
        if ffn % t:
            raise click.BadParameter(f"--ffn {ffn} is not divisible by TP size {t}", param_hint="--sizes")
        if sequence_parallel and tokens % t:
            raise click.BadParameter(f"--tokens {tokens} is not divisible by TP size {t} (needed with "
                                     "--sequence-parallel)", param_hint="--sizes")
    if device == "cuda" and not torch.cuda.is_available():  # before the header; the ranks check it too (bench_device)
        raise click.BadParameter("needs a CUDA GPU (torch.cuda.is_available() is False here); use --device cpu",
                                 param_hint="--device")
    opts = dict(hidden=hidden, ffn=ffn, tokens=tokens, iters=iters, warmup=warmup, dtype=dtype,
                sequence_parallel=sequence_parallel, check=check, device=device)
    mode = collectives.detect_launch()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def header(world: int | None) -> None:
        click.echo(f"# moecomm bench-tp: MLP {hidden} -> {ffn} -> GELU -> {hidden}, {tokens} tokens, {dtype}, "
                   f"sequence_parallel {'on' if sequence_parallel else 'off'}, iters {iters}, warmup {warmup}, "
                   f"launch {mode}" + (f" ({world} ranks in groups of tp run concurrently; rows are rank 0's group)" if world else "")
                   + f", {cpus} CPUs here")
        click.echo("# times: mean per iteration, averaged over ranks; comm = wall time inside collectives on the "
                   "calling rank (includes waiting for peers); compute = fwd+bwd - comm; thr = torch threads per rank")
        for line in TABLE.header():
            click.echo(line)

    if mode in ("mpi", "torchrun"):
        with collectives.init(transport, timeout=timeout) as comm:
            if comm.rank == 0:
                header(comm.size)
            for t in tps:
                if comm.size % t:
                    if comm.rank == 0:
                        click.echo(f"# tp={t}: skipped, the world of {comm.size} ranks does not split into groups of {t}")
                    continue
                r = _bench_world(comm, opts, t)
                if comm.rank == 0:
                    for line in _format(r, opts):
                        click.echo(line)
        return
    header(None)
    for t in tps:
        if t > cpus:
            click.echo(f"# tp={t}: {t} ranks on {cpus} CPUs (oversubscribed): times include waiting for a CPU")
        r = launch_logged(_bench_group, t, opts, timeout=timeout, transport=transport)[0]
        for line in _format(r, opts):
            click.echo(line)
