"""``moecomm bench-ddp``: a small MLP's DDP training step over torch.distributed, moecomm against gloo.

One run, the same ranks and group sizes for both backends: torch.distributed's default group is
gloo and ``new_group(backend="moecomm")`` spans the same ranks (``import collectives`` registered
the backend). Two copies of one MLP (``depth`` x Linear(width, width) + ReLU, fp32) are wrapped in
DistributedDataParallel, one per group, with the same bucket size (``--bucket-mb``: several
buckets, each all-reduced as backward produces it). A step is zero_grad, forward, MSE loss,
backward (the all-reduces) and an SGD step on fixed random data. After warmup, repetitions
alternate between the backends (moecomm first in even repetitions, gloo first in odd ones), so
machine drift hits both alike.

``local`` is the same step of a third copy without DDP (no communication): the compute floor.
Times are means per step over the timed steps, averaged across ranks (nccl-tests' convention);
p50 is the median over steps of the rank-averaged time. ``vs_gloo`` = gloo's mean / this mean.
Both DDP copies see the same data, so their parameters must match at the end (exactly on 2 ranks,
where a sum of two numbers does not depend on the order; to float rounding on more): the run
fails (exit code 1) if they do not, so a fast wrong all-reduce cannot pass.

Torch threads per rank default to the CPUs here divided by the ranks on this node (torchrun sets
OMP_NUM_THREADS=1 for the same reason: ranks oversubscribing the cores slow both backends).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from typing import Any

import click
import torch

from .options import COUNT, NONNEGATIVE, SECONDS, FiniteFloat
from .ranks import on_ranks
from .table import Column, Table

log = logging.getLogger("benchmarks")

BACKENDS = ("moecomm", "gloo")
SCHEMA = "moecomm-bench-ddp/1"
TABLE = Table([Column("backend", 8, align="<"), Column("step_ms", 9, ".3f"), Column("p50_ms", 9, ".3f"),
               Column("min_ms", 9, ".3f"), Column("vs_gloo", 8), Column("check", 6)])


def _mlp(width: int, depth: int) -> torch.nn.Sequential:
    """``depth`` x (Linear(width, width), ReLU), initialised from seed 0 (the same on every rank)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _bench_rank(comm, o: dict[str, Any]) -> dict[str, Any] | None:
    """Body of `moecomm bench-ddp` on one rank (collective over ``comm``).

    Returns:
        On rank 0: per backend the rank-averaged mean, median and minimum step time in seconds,
        the parameters' largest difference between the two DDP copies, the bucket count and the
        torch threads per rank; None elsewhere.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import collectives  # noqa: F401 - registers the "moecomm" backend

    from .peers import init_torch_distributed

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = o["threads"] or max(1, cpus // comm.local_size)
    torch.set_num_threads(threads)
    init_torch_distributed(comm, "gloo", o["timeout"])
    try:
        moecomm_group = dist.new_group(backend="moecomm")
        base = _mlp(o["width"], o["depth"])
        steps: dict[str, Any] = {}
        ddps: dict[str, Any] = {}
        for name, group in (("local", None), ("gloo", dist.group.WORLD), ("moecomm", moecomm_group)):
            model = copy.deepcopy(base)
            if group is not None:
                model = ddps[name] = DDP(model, process_group=group, bucket_cap_mb=o["bucket_mb"])
            steps[name] = _stepper(model, o["lr"])
        gen = torch.Generator().manual_seed(1000 + comm.rank)
        x = torch.randn(o["batch"], o["width"], generator=gen)
        y = torch.randn(o["batch"], o["width"], generator=gen)
        for name in ("local", *BACKENDS):
            for _ in range(o["warmup"]):
                steps[name](x, y)
        times: dict[str, list[float]] = {name: [] for name in ("local", *BACKENDS)}
        for rep in range(o["reps"]):
            order = ("local", *BACKENDS) if rep % 2 == 0 else ("local", *reversed(BACKENDS))
            for name in order:
                comm.barrier()
                for _ in range(o["iters"]):
                    t0 = time.perf_counter()
                    steps[name](x, y)
                    times[name].append(time.perf_counter() - t0)
        buckets = len(ddps["moecomm"].reducer._get_zeros_like_grad_buckets())  # as rebuilt after the first step
        diff = max((a.detach() - b.detach()).abs().max().item()
                   for a, b in zip(ddps["moecomm"].parameters(), ddps["gloo"].parameters()))
    finally:
        dist.destroy_process_group()
    names = ("local", *BACKENDS)
    per_step = torch.tensor([times[n] for n in names], dtype=torch.float64)  # [3, steps] seconds
    averaged = comm.all_reduce(per_step) / comm.size  # every rank timed the same steps
    worst = comm.all_reduce(torch.tensor([diff], dtype=torch.float64), op="max")
    if comm.rank != 0:
        return None
    return {"times": {n: {"mean": averaged[i].mean().item(), "p50": averaged[i].median().item(),
                          "min": averaged[i].min().item()} for i, n in enumerate(names)},
            "max_param_diff": worst.item(), "buckets": int(buckets), "threads": threads, "ranks": comm.size,
            "params": sum(p.numel() for p in base.parameters())}


def _stepper(model: torch.nn.Module, lr: float) -> Any:
    """One training step of ``model``: zero_grad, forward, MSE loss, backward, SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return step


def _overhead(step_s: float, local_s: float) -> str:
    """A DDP step's time above the local step's. A DDP step does the local step's work and more, so a mean at
    or below local's is timing noise between the two measurements, said as such rather than as a negative."""
    extra = step_s - local_s
    return f"{extra * 1e3:.3f} ms" if extra > 0 else "none measurable (within noise of local's time)"


def _report(r: dict[str, Any], o: dict[str, Any]) -> bool:
    """Print the table; True if the two DDP copies ended with matching parameters."""
    mb = r["params"] * 4 / 1e6
    # 2 ranks: a + b is the same in any order, so the copies match exactly; more ranks: float
    # rounding of the sum order (relative 1e-7 per step) times a few steps, on weights of ~0.1
    limit = 0.0 if r["ranks"] <= 2 else 1e-5
    ok = r["max_param_diff"] <= limit
    click.echo(f"# moecomm bench-ddp: MLP {o['depth']} x (Linear({o['width']}, {o['width']}) + ReLU), "
               f"{r['params'] / 1e6:.2f}M params = {mb:.1f} MB of fp32 gradients, DDP buckets of <= {o['bucket_mb']} MB"
               + f" ({r['buckets']} buckets)"
               + f", batch {o['batch']} per rank, {r['ranks']} ranks, {r['threads']} torch thread(s) per rank")
    click.echo(f"# step = zero_grad + forward + MSE + backward (all-reduces) + SGD; {o['iters']} steps x "
               f"{o['reps']} repetitions per backend, interleaved, after {o['warmup']} warmup steps; times: mean "
               "per step averaged over ranks; local = the same step without DDP (no communication)")
    for line in TABLE.header():
        click.echo(line)
    gloo = r["times"]["gloo"]["mean"]
    for name in ("local", *BACKENDS):
        t = r["times"][name]
        vs = f"{gloo / t['mean']:.2f}x" if name != "local" else ""
        check = "" if name == "local" else ("ok" if ok else "DIFF")
        click.echo(TABLE.line(name, t["mean"] * 1e3, t["p50"] * 1e3, t["min"] * 1e3, vs, check))
    click.echo(f"# moecomm step is {gloo / r['times']['moecomm']['mean']:.2f}x faster than gloo's "
               f"(communication + DDP overhead above local: moecomm "
               f"{_overhead(r['times']['moecomm']['mean'], r['times']['local']['mean'])}, gloo "
               f"{_overhead(gloo, r['times']['local']['mean'])}); parameters after training differ by at "
               f"most {r['max_param_diff']:.3g} (allowed {limit:g})")
    return ok


@click.command("bench-ddp")
@click.option("--width", type=COUNT, default=512, show_default=True, help="Features of every Linear layer.")
@click.option("--depth", type=COUNT, default=4, show_default=True, help="Linear + ReLU layers.")
@click.option("--batch", type=COUNT, default=8, show_default=True, help="Samples per rank per step.")
@click.option("--bucket-mb", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True,
              help="DDP bucket_cap_mb (the same for both backends).")
@click.option("--nprocs", type=COUNT, default=2, show_default=True,
              help="Local ranks to launch (ignored under mpirun/torchrun).")
@click.option("-n", "--iters", type=COUNT, default=10, show_default=True, help="Timed steps per repetition.")
@click.option("--reps", type=COUNT, default=8, show_default=True,
              help="Repetitions per backend, interleaved between the backends.")
@click.option("-w", "--warmup", type=NONNEGATIVE, default=5, show_default=True, help="Untimed steps per backend first.")
@click.option("--threads", type=NONNEGATIVE, default=0, show_default=True,
              help="Torch threads per rank (0: CPUs here / ranks on this node).")
@click.option("--lr", type=FiniteFloat(0.0), default=0.01, show_default=True, help="SGD learning rate (> 0).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the result with the run's environment to this JSON file.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True, help="Communicator timeout in seconds.")
def bench_ddp(width: int, depth: int, batch: int, bucket_mb: float, nprocs: int, iters: int, reps: int, warmup: int,
              threads: int, lr: float, json_path: str | None, timeout: float) -> None:
    """DDP training step of a small MLP over torch.distributed: moecomm's backend against gloo."""
    o = dict(width=width, depth=depth, batch=batch, bucket_mb=bucket_mb, iters=iters, reps=reps, warmup=warmup,
             threads=threads, lr=lr, timeout=timeout)
    lead, result = on_ranks(_bench_rank, nprocs, o, timeout=timeout)
    if not lead:
        return
    ok = _report(result, o)
    if json_path:
        from .output import environment, save_json

        run = {"schema": SCHEMA, "env": environment({"ranks": result["ranks"], "threads": result["threads"]}),
               "options": o, "notes": [], "rows": [{"backend": n, **t} for n, t in result["times"].items()],
               "max_param_diff": result["max_param_diff"], "buckets": result["buckets"]}
        click.echo(f"# wrote {save_json(json_path, run)}")
    if not ok:
        raise SystemExit(1)
