"""``moecomm bench-moe``: expert-parallel dispatch / combine, moecomm against the plain torch.distributed way.

Per rank: T tokens of hidden H, each routed to k distinct experts of E (uniformly at random, as in
DeepEP's tests), identity experts (combine sends back what dispatch delivered).

moecomm: ``ExpertDispatcher.get_dispatch_layout`` (the count exchange: "layout"), ``dispatch``
with that layout, ``combine``. Baseline ("torch-gloo"), Megatron's all-to-all token dispatcher
done in plain torch: layout = per-expert counts exchanged with ``all_to_all_single`` plus the
sort that permutes the (token, expert) pairs; dispatch = gather the pair rows, one uneven
``all_to_all_single`` over gloo, regroup by local expert; combine = the reverse regroup, the
reverse ``all_to_all_single``, weighted un-permute. The baseline sends one row per (token,
expert) pair; moecomm one per (token, destination rank).

Bandwidth follows DeepEP's tests: bytes = rows received by this rank, one per (token,
destination rank), x hidden x element size, for both dispatch and combine (combine sends them
back) and for both implementations, so GB/s compare like for like; ``moved_MB`` is what the
implementation actually received. time = mean over the timed iterations; GB/s = 1e9 B/s.

On CPU, every fresh multi-MB tensor costs page faults when the allocator returns freed memory
to the OS (glibc does for large blocks); in a VM that can dominate both implementations. By
default each rank therefore asks glibc to keep freed memory (``mallopt``), as CUDA's caching
allocator does on GPU; ``--no-keep-freed-memory`` measures without it.
"""

from __future__ import annotations

import ctypes
import socket
import time

import click
import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_COLS = ("rank", "impl", "layout_us", "dispatch_us", "disp_GB/s", "combine_us", "comb_GB/s", "recv_rows",
         "moved_MB", "check")
_FMT = "{:>5} {:>10} {:>10} {:>12} {:>10} {:>11} {:>10} {:>10} {:>9} {:>6}"


def _keep_freed_memory() -> bool:
    """glibc: serve every allocation from the heap and never trim it (M_MMAP_MAX=0, M_TRIM_THRESHOLD max)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def _init_gloo(comm):
    """A torch.distributed gloo group over the same ranks: rank 0 picks a free loopback port."""
    import torch.distributed as dist

    port = torch.zeros(1, dtype=torch.int64)
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    port = int(comm.broadcast(port)[0]) if comm.size > 1 else int(port[0])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    return dist


class _Baseline:
    """Megatron-style all-to-all dispatch in plain torch over torch.distributed (see module docstring)."""

    def __init__(self, dist, num_experts: int):
        self.dist, self.E = dist, num_experts
        self.P = dist.get_world_size()
        self.L = num_experts // self.P

    def layout(self, experts: torch.Tensor):
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)                          # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.E)
        recv_counts = torch.empty_like(counts)
        self.dist.all_to_all_single(recv_counts, counts)                  # [P, L]: from each source, per local expert
        c = recv_counts.view(self.P, self.L)
        send_splits = counts.view(self.P, self.L).sum(1).tolist()
        recv_splits = c.sum(1).tolist()
        # received rows are (source, expert); regroup to (expert, source)
        seg = torch.arange(self.P * self.L).view(self.P, self.L).t().reshape(-1)
        starts = torch.cumsum(c.reshape(-1), 0) - c.reshape(-1)
        lens = c.reshape(-1)[seg]
        regroup = torch.repeat_interleave(starts[seg] - torch.cumsum(lens, 0) + lens, lens) + torch.arange(int(lens.sum()))
        return order, order // k, send_splits, recv_splits, regroup, c.sum(0)

    def dispatch(self, x, lay):
        order, tok, send_splits, recv_splits, regroup, _ = lay
        send = x.index_select(0, tok)
        recv = x.new_empty((sum(recv_splits), x.shape[1]))
        self.dist.all_to_all_single(recv, send, recv_splits, send_splits)
        return recv.index_select(0, regroup)

    def combine(self, expert_out, lay, weights, num_tokens):
        order, tok, send_splits, recv_splits, regroup, _ = lay
        back_in = torch.empty_like(expert_out)
        back_in[regroup] = expert_out
        back = expert_out.new_empty((len(tok), expert_out.shape[1]))
        self.dist.all_to_all_single(back, back_in, send_splits, recv_splits)
        w = weights.reshape(-1).index_select(0, order).to(torch.float32).unsqueeze(1)
        y = torch.zeros((num_tokens, expert_out.shape[1]), dtype=torch.float32)
        y.index_add_(0, tok, back.float() * w)
        return y.to(expert_out.dtype)


def _bench_rank(comm, o: dict) -> list[list[float]]:
    from moe import ExpertDispatcher

    if o["keep_freed_memory"] and not _keep_freed_memory() and comm.rank == 0:
        print("# note: could not configure glibc malloc; timings include page faults", flush=True)
    torch.manual_seed(1234 + comm.rank)
    dtype = DTYPES[o["dtype"]]
    T, H, k, E = o["tokens"], o["hidden"], o["top_k"], o["experts"]
    x = torch.randn(T, H).to(dtype)
    scores = torch.rand(T, E)
    weights, experts = torch.topk(scores, k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    disp = ExpertDispatcher(comm, E)
    impls = {"moecomm": None}
    if o["baseline"]:
        impls["torch-gloo"] = _Baseline(_init_gloo(comm), E)
    want = (x.float() * weights.sum(-1, keepdim=True)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rows = []
    uniq_rows = 0  # (token, rank) rows this rank receives: set by the moecomm run, which goes first
    with torch.no_grad():
        for name, base in impls.items():
            times = {"layout": 0.0, "dispatch": 0.0, "combine": 0.0}
            for it in range(o["warmup"] + o["iters"]):
                comm.barrier()
                t0 = time.perf_counter()
                lay = disp.get_dispatch_layout(x, experts) if base is None else base.layout(experts)
                t1 = time.perf_counter()
                if base is None:
                    recv_x, _, handle = disp.dispatch(x, experts, layout=lay)
                else:
                    recv_x = base.dispatch(x, lay)
                t2 = time.perf_counter()
                y = disp.combine(recv_x, handle, weights) if base is None else base.combine(recv_x, lay, weights, T)
                t3 = time.perf_counter()
                if it >= o["warmup"]:
                    times["layout"] += t1 - t0
                    times["dispatch"] += t2 - t1
                    times["combine"] += t3 - t2
            ok = bool(torch.allclose(y.float(), want.float(), rtol=tol, atol=tol))
            moved = (handle.num_recv_rows if base is None else recv_x.shape[0]) * H * x.element_size()
            if base is None:
                uniq_rows = handle.num_recv_rows
            n = o["iters"]
            rows.append([comm.rank, list(impls).index(name), *(times[p] / n for p in ("layout", "dispatch", "combine")),
                         uniq_rows, moved, int(ok)])
    if o["baseline"]:
        impls["torch-gloo"].dist.destroy_process_group()
    gathered = comm.all_gather(torch.tensor(rows, dtype=torch.float64).reshape(1, -1)) if comm.size > 1 else \
        torch.tensor(rows, dtype=torch.float64).reshape(1, -1)
    return gathered.reshape(comm.size, len(rows), -1).tolist()


def _print_table(stats, o: dict, names: list[str]) -> bool:
    esz = torch.tensor([], dtype=DTYPES[o["dtype"]]).element_size()
    print(f"# moecomm bench-moe: {o['nprocs_run']} ranks, {o['tokens']} tokens/rank, hidden {o['hidden']}, "
          f"top-{o['top_k']} of {o['experts']} experts, {o['dtype']}, iters {o['iters']}, warmup {o['warmup']}"
          + (f" (--cpu-scale: {o['tokens_full']}/8 tokens, {o['hidden_full']}/4 hidden)" if o["cpu_scale"] else "")
          + ("" if o["keep_freed_memory"] else ", --no-keep-freed-memory"))
    print("# bytes per rank = received (token, rank) rows x hidden x %d B; GB/s = bytes / time (1e9 B/s); "
          "times are means per call in microseconds" % esz)
    print(_FMT.format(*_COLS))
    all_ok = True
    means: dict[int, list[float]] = {}
    for per_rank in stats:
        for r in per_rank:
            rank, impl, lay_s, disp_s, comb_s, uniq, moved, ok = r
            nbytes = uniq * o["hidden"] * esz
            all_ok &= bool(ok)
            vals = [lay_s * 1e6, disp_s * 1e6, nbytes / disp_s / 1e9 if disp_s else 0.0,
                    comb_s * 1e6, nbytes / comb_s / 1e9 if comb_s else 0.0]
            m = means.setdefault(int(impl), [0.0] * 5)
            for i, v in enumerate(vals):
                m[i] += v / len(stats)
            print(_FMT.format(int(rank), names[int(impl)], f"{vals[0]:.1f}", f"{vals[1]:.1f}", f"{vals[2]:.2f}",
                              f"{vals[3]:.1f}", f"{vals[4]:.2f}", int(uniq), f"{moved / 1e6:.2f}",
                              "ok" if ok else "WRONG"))
    for impl, m in sorted(means.items()):
        print(_FMT.format("mean", names[impl], f"{m[0]:.1f}", f"{m[1]:.1f}", f"{m[2]:.2f}", f"{m[3]:.1f}",
                          f"{m[4]:.2f}", "", "", ""))
    return all_ok


@click.command("bench-moe")
@click.option("--tokens", default=4096, show_default=True, help="Tokens per rank.")
@click.option("--hidden", default=7168, show_default=True, help="Hidden size.")
@click.option("-k", "--top-k", "top_k", default=8, show_default=True, help="Experts per token.")
@click.option("--experts", default=256, show_default=True, help="Experts in total (divisible by the ranks).")
@click.option("-d", "--dtype", default="bfloat16", show_default=True, type=click.Choice(sorted(DTYPES)))
@click.option("--nprocs", default=2, show_default=True, help="Local ranks to launch (ignored under mpirun/torchrun).")
@click.option("-n", "--iters", default=10, show_default=True, help="Timed iterations.")
@click.option("-w", "--warmup", default=3, show_default=True, help="Untimed iterations first.")
@click.option("--cpu-scale/--full-scale", default=False, show_default=True,
              help="Scale down for CPU runs: tokens / 8 and hidden / 4 (4096 x 7168 -> 512 x 1792).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also time torch.distributed all_to_all_single over gloo (plain permutation).")
@click.option("--keep-freed-memory/--no-keep-freed-memory", default=True, show_default=True,
              help="CPU: keep freed memory in the process (glibc mallopt) so timings exclude page faults.")
@click.option("--timeout", default=300.0, show_default=True, help="Communicator timeout in seconds.")
def bench_moe(tokens, hidden, top_k, experts, dtype, nprocs, iters, warmup, cpu_scale, baseline, keep_freed_memory,
              timeout):
    """MoE dispatch / combine time and GB/s per rank (layout separately), with the torch.distributed baseline."""
    import collectives

    o = dict(tokens=tokens, hidden=hidden, top_k=top_k, experts=experts, dtype=dtype, iters=iters, warmup=warmup,
             baseline=baseline, cpu_scale=cpu_scale, tokens_full=tokens, hidden_full=hidden,
             keep_freed_memory=keep_freed_memory)
    if cpu_scale:
        o["tokens"], o["hidden"] = max(tokens // 8, 1), max(hidden // 4, 1)
    if top_k > experts or top_k < 1:
        raise click.BadParameter(f"top-k must lie in [1, {experts}]", param_hint="--top-k")
    if iters < 1 or warmup < 0:
        raise click.BadParameter("need --iters >= 1 and --warmup >= 0")
    launched = collectives.detect_launch() in ("mpi", "torchrun")
    size = None
    if launched:
        with collectives.init(timeout=timeout) as comm:
            size = comm.size
            if experts % size:
                raise click.BadParameter(f"--experts {experts} is not divisible by {size} ranks")
            stats = _bench_rank(comm, o)
            if comm.rank != 0:
                return
    else:
        if experts % nprocs:
            raise click.BadParameter(f"--experts {experts} is not divisible by --nprocs {nprocs}")
        size = nprocs
        stats = collectives.launch(_bench_rank, nprocs, o, timeout=timeout)[0]
    o["nprocs_run"] = size
    names = ["moecomm", "torch-gloo"]
    if not _print_table(stats, o, names):
        raise SystemExit(1)
