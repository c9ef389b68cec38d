"""``moecomm bench-p2p``: a send/recv ping-pong between ranks 0 and 1, moecomm against gloo, in one run.

Backends, all on the same two ranks in one launch:

- ``moecomm``: the Communicator's ``send``/``recv`` (its point-to-point channel: shm on one node,
  else mpi or gloo; ``--transport`` forces one);
- ``moecomm-dist``: ``torch.distributed.send``/``recv`` on a ``new_group(backend="moecomm")`` (the
  same channel under torch's API, as pipeline-parallel code calls it);
- ``gloo``: ``torch.distributed.send``/``recv`` on torch's gloo default group.

One round trip: rank 0 sends a tensor of the size, rank 1 receives it and sends it back, rank 0
receives it. Times are one-way (a round trip / 2), measured on rank 0; bandwidth = size / one-way
time. After warmup, repetitions alternate the backends' order (machine drift hits all alike).
``vs_gloo`` = gloo's median one-way time / this backend's (>1: faster than gloo). The echoed tensor
is compared with what was sent on every backend (a wrong byte fails the run, exit code 1).
Ranks other than 0 and 1 only take part in the set-up.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click
import torch

from transports.paths import PathMismatchError

from .options import BYTES, COUNT, NONNEGATIVE, OUTPUT_FILE, SECONDS, comma_list
from .ranks import on_ranks
from .table import Column, Table

BACKENDS = ("moecomm", "moecomm-dist", "gloo")
SCHEMA = "moecomm-bench-p2p/1"
# The host transports with a point-to-point channel (collectives/_p2p.py); bench-p2p moves CPU tensors.
CHANNELS = ("auto", "shm", "mpi", "gloo")
TABLE = Table([Column("size", 12, align=">"), Column("backend", 13, align="<"), Column("oneway_us", 11, ".1f"),
               Column("p50_us", 11, ".1f"), Column("min_us", 11, ".1f"), Column("GB/s", 8, ".3f"),
               Column("vs_gloo", 8), Column("check", 6)])


def _pingpong(send, recv, x: torch.Tensor, box: torch.Tensor, me: int) -> float:
    """One round trip between ranks 0 and 1; seconds on rank 0 (0.0 on rank 1)."""
    if me == 0:
        t0 = time.perf_counter()
        send(x, 1)
        recv(box, 1)
        return time.perf_counter() - t0
    recv(box, 0)
    send(box, 0)
    return 0.0


def _bench_rank(comm, o: dict[str, Any]) -> dict[str, Any] | None:
    """Body of `moecomm bench-p2p` on one rank (collective over ``comm``).

    Returns:
        On rank 0: {size: {backend: [round-trip seconds], ...}}, the checks and the channel's
        transport; None elsewhere.
    """
    import torch.distributed as dist

    import collectives  # noqa: F401 - registers the "moecomm" backend

    from .peers import init_torch_distributed

    torch.set_num_threads(1)
    init_torch_distributed(comm, "gloo", o["timeout"])
    me = comm.rank
    c = comm.using(o["transport"]) if o["transport"] != "auto" else comm
    try:
        group = dist.new_group(backend="moecomm", pg_options={"transport": o["transport"]}
                               if o["transport"] != "auto" else None)
        calls = {
            "moecomm": (lambda t, peer: c.send(t, peer), lambda t, peer: c.recv(t, peer)),
            "moecomm-dist": (lambda t, peer: dist.send(t, peer, group=group),
                             lambda t, peer: dist.recv(t, peer, group=group)),
            "gloo": (lambda t, peer: dist.send(t, peer), lambda t, peer: dist.recv(t, peer)),
        }
        times: dict[int, dict[str, list[float]]] = {}
        ok: dict[str, bool] = {b: True for b in BACKENDS}
        for size in o["sizes"]:
            n = max(1, size // 4)
            x = torch.randn(n, generator=torch.Generator().manual_seed(size))
            box = torch.empty_like(x)
            iters = o["iters"] if size < (16 << 20) else max(1, o["iters"] // 10)
            times[size] = {b: [] for b in BACKENDS}
            if me > 1:
                comm.barrier()
                for _ in range(o["reps"] * len(BACKENDS)):
                    comm.barrier()
                continue
            for b in BACKENDS:
                for _ in range(o["warmup"]):
                    _pingpong(*calls[b], x, box, me)
                box.zero_()
                _pingpong(*calls[b], x, box, me)  # checked
                ok[b] &= bool(torch.equal(box, x))
            comm.barrier()
            for rep in range(o["reps"]):
                order = BACKENDS if rep % 2 == 0 else tuple(reversed(BACKENDS))
                for b in order:
                    comm.barrier()
                    for _ in range(iters):
                        times[size][b].append(_pingpong(*calls[b], x, box, me))
        ch = c._p2p_host_channel()
        channel = type(ch).__name__
        verified = ""
        if o.get("path"):  # the channel that carried moecomm's rows is the path they took
            from .path_bench import agree_on_path, nccl_log_dir, taken_path

            taken = taken_path(o["path"], o["transport"], ch.name, nccl_log_dir())
            verified = agree_on_path(comm, o["path"], taken, "send/recv")
    finally:
        dist.destroy_process_group()
    bad = comm.all_reduce(torch.tensor([0 if all(ok.values()) else 1]), op="max").item()
    if me != 0:
        return None
    return {"times": times, "ok": ok if not bad else {b: False for b in BACKENDS}, "ranks": comm.size,
            "channel": channel, "path": verified}


def _report(r: dict[str, Any], o: dict[str, Any]) -> list[dict[str, Any]]:
    click.echo(f"# moecomm bench-p2p: send/recv ping-pong between ranks 0 and 1 of {r['ranks']}, one-way time = "
               f"round trip / 2 on rank 0; {o['reps']} repetitions per backend, interleaved, after {o['warmup']} "
               f"warmup round trips; moecomm's channel: {r['channel']}"
               + (f"; path {r['path']} (verified)" if r.get("path") else ""))
    for line in TABLE.header():
        click.echo(line)
    rows = []
    for size, per in r["times"].items():
        gloo = statistics.median(per["gloo"]) / 2
        for b in BACKENDS:
            ts = [t / 2 for t in per[b]]
            p50 = statistics.median(ts)
            mean = statistics.fmean(ts)
            row = {"size": size, "backend": b, "oneway_s": mean, "p50_s": p50, "min_s": min(ts),
                   "GBps": size / p50 / 1e9, "vs_gloo": gloo / p50, "ok": r["ok"][b], "round_trips": len(ts),
                   "path": r.get("path", "") if b == "moecomm" else ""}
            rows.append(row)
            click.echo(TABLE.line(size, b, mean * 1e6, p50 * 1e6, min(ts) * 1e6, row["GBps"],
                                  f"{row['vs_gloo']:.2f}x", "ok" if row["ok"] else "WRONG"))
    for size in r["times"]:
        ratios = {row["backend"]: row["vs_gloo"] for row in rows if row["size"] == size}
        click.echo(f"# {size} B: moecomm {ratios['moecomm']:.2f}x, moecomm-dist {ratios['moecomm-dist']:.2f}x "
                   "gloo's speed (median one-way time)")
    return rows


@click.command("bench-p2p")
@click.option("--sizes", default="1M,64M", show_default=True,
              help="Comma list of message sizes in bytes (K/M/G suffixes), float32 tensors.")
@click.option("--nprocs", type=COUNT, default=2, show_default=True,
              help="Local ranks to launch (ignored under mpirun/torchrun); ranks 0 and 1 ping-pong.")
@click.option("-n", "--iters", type=COUNT, default=20, show_default=True,
              help="Round trips per repetition (a tenth from 16 MiB).")
@click.option("--reps", type=COUNT, default=5, show_default=True,
              help="Repetitions per backend, interleaved between the backends.")
@click.option("-w", "--warmup", type=NONNEGATIVE, default=3, show_default=True, help="Untimed round trips first.")
@click.option("--transport", type=click.Choice(CHANNELS), default="auto", show_default=True,
              help="moecomm's transport for its channel (auto: shm on one node, else mpi or gloo; mpi needs "
                   "mpirun/mpiexec).")
@click.option("--json", "json_path", type=OUTPUT_FILE, default=None,
              help="Also write the rows with the run's environment to this JSON file.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True, help="Communicator timeout in seconds.")
@click.option("--path", default=None, metavar="P",
              help="Force moecomm's send/recv onto path P and verify it (`moecomm paths`): shm or socket (gloo); "
                   "not available here: exit 2.")
def bench_p2p(sizes: str, nprocs: int, iters: int, reps: int, warmup: int, transport: str, json_path: str | None,
              timeout: float, path: str | None) -> None:
    """Send/recv ping-pong between two ranks: moecomm (Communicator and torch backend) against gloo."""
    try:
        size_list = [int(BYTES.convert(s, None, None)) for s in comma_list(sizes)]
    except click.BadParameter as e:
        raise click.BadParameter(str(e), param_hint="--sizes") from None
    if not size_list or any(s < 4 for s in size_list):
        raise click.BadParameter("give sizes of at least 4 bytes", param_hint="--sizes")
    if transport == "mpi":
        from collectives import detect_launch

        if detect_launch() != "mpi":
            raise click.BadParameter("mpi needs a launch by mpirun/mpiexec", param_hint="--transport")

    def check_size(n: int) -> None:
        if n < 2:
            raise click.UsageError("bench-p2p needs at least 2 ranks")

    env = None
    if path:
        from .path_bench import single_path

        chosen = single_path(path, "cpu", None if transport == "auto" else transport)
        transport, env = chosen.transport, chosen.launch.env
    o = {"sizes": size_list, "iters": iters, "reps": reps, "warmup": warmup, "transport": transport,
         "timeout": timeout, "path": path}
    # created with the transport: gloo exists only where it is asked for (or between nodes)
    try:
        lead, result = on_ranks(_bench_rank, nprocs, o, timeout=timeout, check_size=check_size, transport=transport,
                                env=env)
    except PathMismatchError as e:
        from .path_bench import PathFailed

        raise PathFailed(str(e)) from None
    if not lead:
        return
    rows = _report(result, o)
    if json_path:
        from .output import environment, save_json

        run = {"schema": SCHEMA, "env": environment({"ranks": result["ranks"]}), "options": o,
               "channel": result["channel"], "rows": rows}
        click.echo(f"# wrote {save_json(json_path, run)}")
    if not all(row["ok"] for row in rows):
        raise SystemExit(1)
