"""``moecomm bench-moe``: expert-parallel dispatch / combine, moecomm against the plain torch.distributed way.

Per rank: T tokens of hidden H, each routed to k distinct experts of E (uniformly at random, as in
DeepEP's tests), identity experts (combine sends back what dispatch delivered).

moecomm: ``ExpertDispatcher.get_dispatch_layout`` (the count exchange: "layout"), ``dispatch``
with that layout, ``combine``. Baseline ("torch-gloo" on CPU tensors, "torch-nccl" with ``--device cuda``),
Megatron's all-to-all token dispatcher done in plain torch: layout = per-expert counts exchanged with
``all_to_all_single`` plus the sort that permutes the (token, expert) pairs; dispatch = gather the pair
rows, one uneven ``all_to_all_single`` over gloo (NCCL), regroup by local expert; combine = the reverse regroup, the
reverse ``all_to_all_single``, weighted un-permute. The baseline sends one row per (token,
expert) pair; moecomm one per (token, destination rank).

Across nodes the dispatcher takes its node-aware path (moe/internode.py: a token crosses the
network once per destination node and is forwarded inside the node); ``moecomm-flat`` then times
the flat path (``node_aware=False``, one row per (token, rank) over one all-to-all) beside it
(``--no-compare-flat``: not). ``inter_MB`` / ``intra_MB``: token bytes this rank sends per dispatch
to other nodes / to other ranks of its node (``DispatchLayout.traffic``; combine sends the same
back). A summary gives the node-aware / flat ratio of the inter-node bytes, and the ratio the
routing predicts: per token, expected distinct nodes / expected distinct ranks among its k experts
(``collectives.model.expected_distinct``; the share of them on other nodes is the same for both).

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
import logging
import os
import time
from typing import Any

import click
import torch

from transports.paths import PathMismatchError
from transports.settings import TRANSPORT_CHOICES, option_or_environment

from .bench_moe_ll import LL_IMPLS, low_latency_bytes, time_low_latency
from .common import DTYPES as _ALL_DTYPES
from .options import COUNT, NONNEGATIVE, OUTPUT_FILE, SECONDS
from .ranks import on_ranks
from .table import Column, Table

log = logging.getLogger("benchmarks")

DTYPES = {name: _ALL_DTYPES[name] for name in ("bfloat16", "float16", "float32")}
IMPLS = ("moecomm", "torch-gloo", "moecomm-flat", "torch-nccl", *LL_IMPLS)
TABLE = Table([Column("rank", 5), Column("impl", 12), Column("layout_us", 10, ".1f"), Column("dispatch_us", 12, ".1f"),
               Column("disp_GB/s", 10, ".2f"), Column("combine_us", 11, ".1f"), Column("comb_GB/s", 10, ".2f"),
               Column("recv_rows", 10), Column("moved_MB", 9, ".2f"), Column("inter_MB", 9, ".3f"),
               Column("intra_MB", 9, ".3f"), Column("check", 6)])


def _keep_freed_memory() -> bool:
    """glibc: serve every allocation from the heap and never trim it (M_MMAP_MAX=0, M_TRIM_THRESHOLD max)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-4, 0)) and bool(libc.mallopt(-1, 2**31 - 1))
    except (OSError, AttributeError):
        return False


class _Baseline:
    """Megatron-style all-to-all dispatch in plain torch over torch.distributed (see module docstring)."""

    def __init__(self, dist: Any, num_experts: int) -> None:
        self.dist, self.E = dist, num_experts
        self.P = dist.get_world_size()
        self.L = num_experts // self.P

    def layout(self, experts: torch.Tensor) -> tuple:
        """experts: [T, k] int64 -> (pair order, token of each pair, send/recv splits, regroup index,
        rows per local expert); exchanges the per-expert counts."""
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
        dev = experts.device
        seg = torch.arange(self.P * self.L, device=dev).view(self.P, self.L).t().reshape(-1)
        starts = torch.cumsum(c.reshape(-1), 0) - c.reshape(-1)
        lens = c.reshape(-1)[seg]
        regroup = (torch.repeat_interleave(starts[seg] - torch.cumsum(lens, 0) + lens, lens)
                   + torch.arange(int(lens.sum()), device=dev))
        return order, order // k, send_splits, recv_splits, regroup, c.sum(0)

    def dispatch(self, x: torch.Tensor, lay: tuple) -> torch.Tensor:
        """x: [T, H] -> the rows of this rank's experts, [received pairs, H], grouped by local expert."""
        order, tok, send_splits, recv_splits, regroup, _ = lay
        send = x.index_select(0, tok)
        recv = x.new_empty((sum(recv_splits), x.shape[1]))
        self.dist.all_to_all_single(recv, send, recv_splits, send_splits)
        return recv.index_select(0, regroup)

    def combine(self, expert_out: torch.Tensor, lay: tuple, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """expert_out: [received pairs, H] -> y: [T, H], each token's rows weighted by weights [T, k]."""
        order, tok, send_splits, recv_splits, regroup, _ = lay
        back_in = torch.empty_like(expert_out)
        back_in[regroup] = expert_out
        back = expert_out.new_empty((len(tok), expert_out.shape[1]))
        self.dist.all_to_all_single(back, back_in, send_splits, recv_splits)
        w = weights.reshape(-1).index_select(0, order).to(torch.float32).unsqueeze(1)
        y = torch.zeros((num_tokens, expert_out.shape[1]), dtype=torch.float32, device=expert_out.device)
        y.index_add_(0, tok, back.float() * w)
        return y.to(expert_out.dtype)


def _bench_rank(comm, o: dict[str, Any]) -> list[list[list[float]]]:
    """Body of `moecomm bench-moe` on one rank (collective).

    Returns:
        Every rank's measurements, the same on every rank: [rank][impl] = [rank, impl index,
        layout s, dispatch s, combine s, received (token, rank) rows (low latency: (token, expert)
        rows), bytes moved, inter-node bytes sent, intra-node bytes sent (-1, -1 for the baseline
        and low latency), ok, nodes, dispatch bytes, combine bytes (what GB/s counts)].
    """
    from moe import ExpertDispatcher

    from .peers import bench_placement, init_torch_distributed

    dev, sync = bench_placement(comm, o["device"])
    device = dev.type
    if device == "cpu" and o["keep_freed_memory"] and not _keep_freed_memory() and comm.rank == 0:
        log.warning("could not configure glibc malloc; timings include page faults")
    torch.manual_seed(1234 + comm.rank)
    dtype = DTYPES[o["dtype"]]
    T, H, k, E = o["tokens"], o["hidden"], o["top_k"], o["experts"]
    x = torch.randn(T, H).to(dtype).to(dev)
    scores = torch.rand(T, E).to(dev)
    weights, experts = torch.topk(scores, k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    disp = ExpertDispatcher(comm, E)
    impls: dict[str, Any] = {"moecomm": disp}
    if disp.node_aware and o["compare_flat"]:
        impls["moecomm-flat"] = ExpertDispatcher(comm, E, node_aware=False)
    backend = "nccl" if device == "cuda" else "gloo"
    baseline = f"torch-{backend}"
    if o["baseline"]:
        import torch.distributed as dist

        init_torch_distributed(comm, backend, o["timeout"])
        impls[baseline] = _Baseline(dist, E)
    num_nodes = len(getattr(comm.topology, "nodes", ())) or 1
    want = (x.float() * weights.sum(-1, keepdim=True)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rows = []
    uniq_rows = 0  # (token, rank) rows this rank receives: set by the moecomm run, which goes first
    with torch.no_grad():
        for name, impl in impls.items():
            _progress(comm, f"{name}: {o['warmup']} + {o['iters']} iterations of {T} tokens")
            base = impl if isinstance(impl, _Baseline) else None
            d = impl if base is None else disp
            times = {"layout": 0.0, "dispatch": 0.0, "combine": 0.0}
            for it in range(o["warmup"] + o["iters"]):
                sync()
                comm.barrier()
                t0 = time.perf_counter()
                lay = d.get_dispatch_layout(x, experts) if base is None else base.layout(experts)
                sync()
                t1 = time.perf_counter()
                if base is None:
                    recv_x, _, handle = d.dispatch(x, experts, layout=lay)
                else:
                    recv_x = base.dispatch(x, lay)
                sync()
                t2 = time.perf_counter()
                y = d.combine(recv_x, handle, weights) if base is None else base.combine(recv_x, lay, weights, T)
                sync()
                t3 = time.perf_counter()
                if it >= o["warmup"]:
                    times["layout"] += t1 - t0
                    times["dispatch"] += t2 - t1
                    times["combine"] += t3 - t2
            ok = bool(torch.allclose(y.float(), want.float(), rtol=tol, atol=tol))
            esz = x.element_size()
            if base is None:
                uniq_rows = handle.num_recv_rows
                moved = handle.num_recv_rows * H * esz
                if d.node_aware:  # the node-aware path also receives its rail rows (this rank's own included)
                    moved += sum(lay.recv_counts) * H * esz
                inter, intra = lay.traffic.internode_bytes, lay.traffic.intranode_bytes
            else:
                moved, inter, intra = recv_x.shape[0] * H * esz, -1, -1   # not counted for the baseline
            n = o["iters"]
            rows.append([comm.rank, IMPLS.index(name), *(times[p] / n for p in ("layout", "dispatch", "combine")),
                         uniq_rows, moved, inter, intra, int(ok), num_nodes, uniq_rows * H * esz, uniq_rows * H * esz])
        if o.get("path"):  # the transport that ran the dispatcher's all-to-alls is the path they took
            from .path_bench import agree_on_path, nccl_log_dir, taken_path

            ran = comm.plan("all_to_all", x).transport
            agree_on_path(comm, o["path"], taken_path(o["path"], o["path_transport"], ran, nccl_log_dir()),
                          "dispatch/combine")
        if o.get("mode") == "low_latency":
            _progress(comm, f"low latency: {o['warmup']} + {o['iters']} iterations per variant")
            for name, t_d, t_c, b_d, b_c, recv_rows, ok in time_low_latency(comm, o, x, experts, weights, sync, want):
                rows.append([comm.rank, IMPLS.index(name), 0.0, t_d, t_c, recv_rows, recv_rows * H * x.element_size(),
                             -1, -1, int(ok), num_nodes, b_d, b_c])
    if o["baseline"]:
        impls[baseline].dist.destroy_process_group()
    for d in impls.values():
        if isinstance(d, ExpertDispatcher):
            d.close()
    gathered = comm.all_gather(torch.tensor(rows, dtype=torch.float64).reshape(1, -1)) if comm.size > 1 else \
        torch.tensor(rows, dtype=torch.float64).reshape(1, -1)
    return gathered.reshape(comm.size, len(rows), -1).tolist()


def _progress(comm, text: str) -> None:
    """A line on rank 0's stderr as each implementation starts: a long run is not silent."""
    if comm.rank == 0:
        click.echo(f"# bench-moe: {text}", err=True)


def _check_low_latency(o: dict[str, Any], ranks: int, on_cuda: bool) -> None:
    """Usage errors before any rank starts: the dispatcher's hidden size, and buffers that cannot fit."""
    if o["hidden"] % 128:
        scaled = f" ({o['hidden_full']} / 4 by --cpu-scale)" if o["cpu_scale"] else ""
        raise click.BadParameter(f"--mode low_latency needs a hidden size that is a multiple of 128, got "
                                 f"{o['hidden']}{scaled}", param_hint="--hidden")
    itemsize = DTYPES[o["dtype"]].itemsize
    region, outputs = low_latency_bytes(o["experts"], ranks, o["tokens"], o["hidden"], o["top_k"], itemsize, o["fp8"])
    if on_cuda:  # each rank on a GPU of its own
        if not torch.cuda.is_available():
            return  # --device cuda without a GPU: refused where the ranks place their tensors
        need, where = region + outputs, "per rank"
        limit, what = torch.cuda.get_device_properties(0).total_memory, "a GPU's memory"
    else:  # emulated: every rank on this node, the regions in one /dev/shm segment
        need, where = ranks * (region + outputs), f"for {ranks} ranks on this node"
        limit, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this node's memory"
        try:
            shm = os.statvfs("/dev/shm")
            if ranks * region > shm.f_bavail * shm.f_frsize:
                need, limit, what = ranks * region, shm.f_bavail * shm.f_frsize, "the free space of /dev/shm"
        except OSError:
            pass
    if need > limit:
        L, PM = o["experts"] // ranks, ranks * o["tokens"]
        raise click.BadParameter(
            f"{o['tokens']} tokens per rank: the low-latency dispatcher's fixed buffers ([L={L}, P*M={PM}, "
            f"H={o['hidden']}] {o['dtype']} and the region every rank maps) need about {need / 1e9:.1f} GB {where}, "
            f"more than {what} ({limit / 1e9:.1f} GB); lower --tokens (the dispatcher's M), --experts or --hidden",
            param_hint="--tokens")


def _print_table(stats: list[list[list[float]]], o: dict[str, Any]) -> bool:
    """Print the per-rank rows and the means; True if every result was correct."""
    esz = torch.tensor([], dtype=DTYPES[o["dtype"]]).element_size()
    click.echo(f"# moecomm bench-moe: {o['nprocs_run']} ranks, {o['tokens']} tokens/rank, hidden {o['hidden']}, "
               f"top-{o['top_k']} of {o['experts']} experts, {o['dtype']}, iters {o['iters']}, warmup {o['warmup']}"
               + (f" (--cpu-scale: {o['tokens_full']}/8 tokens, {o['hidden_full']}/4 hidden)" if o["cpu_scale"] else "")
               + ("" if o["keep_freed_memory"] else ", --no-keep-freed-memory"))
    click.echo(f"# bytes per rank = received (token, rank) rows x hidden x {esz} B; GB/s = bytes / time (1e9 B/s); "
               "times are means per call in microseconds"
               + ("; moecomm-ll*: DeepEP's low-latency count per sent (token, expert) selection, 2 x hidden B "
                  "(dispatch with FP8: hidden + hidden/128 x 4 + 16 B); -graph: CUDA graphs of N calls, time / N"
                  if o.get("mode") == "low_latency" else ""))
    for line in TABLE.header():
        click.echo(line)
    all_ok = True
    means: dict[int, list[float]] = {}
    for per_rank in stats:
        for r in per_rank:
            rank, impl, lay_s, disp_s, comb_s, uniq, moved, inter, intra, ok, _nodes, b_disp, b_comb = r
            all_ok &= bool(ok)
            vals = [lay_s * 1e6, disp_s * 1e6, b_disp / disp_s / 1e9 if disp_s else 0.0,
                    comb_s * 1e6, b_comb / comb_s / 1e9 if comb_s else 0.0]
            m = means.setdefault(int(impl), [0.0] * 5)
            for i, v in enumerate(vals):
                m[i] += v / len(stats)
            inter_mb, intra_mb = ("-", "-") if inter < 0 else (inter / 1e6, intra / 1e6)
            click.echo(TABLE.line(int(rank), IMPLS[int(impl)], *vals, int(uniq), moved / 1e6, inter_mb, intra_mb,
                                  "ok" if ok else "WRONG"))
    for impl, m in sorted(means.items()):
        click.echo(TABLE.line("mean", IMPLS[impl], *m, "", "", "", "", ""))
    _print_node_summary(stats, o)
    _print_baseline_summary(stats)
    _print_low_latency_summary(stats, o)
    return all_ok


def _means(stats: list[list[list[float]]]) -> dict[str, dict[str, float]]:
    """impl -> mean over ranks of its layout / dispatch / combine seconds (row layout: see _bench_rank)."""
    by_impl: dict[str, list[list[float]]] = {}
    for per_rank in stats:
        for r in per_rank:
            by_impl.setdefault(IMPLS[int(r[1])], []).append(r)
    return {impl: {p: sum(r[2 + i] for r in rows) / len(rows) for i, p in enumerate(("layout", "dispatch", "combine"))}
            for impl, rows in by_impl.items()}


def baseline_summary(stats: list[list[list[float]]]) -> dict[str, float] | None:
    """moecomm against the torch.distributed baseline, per phase: x faster = t(baseline) / t(moecomm), from the
    means over ranks; None without a baseline row. Keys: dispatch, combine, dispatch+combine, with the layout."""
    means = _means(stats)
    base = next((means[b] for b in ("torch-gloo", "torch-nccl") if b in means), None)
    if base is None or "moecomm" not in means:
        return None
    mine = means["moecomm"]
    phases = {"dispatch": ("dispatch",), "combine": ("combine",), "dispatch+combine": ("dispatch", "combine"),
              "with the layout": ("layout", "dispatch", "combine")}
    out = {}
    for name, parts in phases.items():
        t_base, t_mine = sum(base[p] for p in parts), sum(mine[p] for p in parts)
        out[name] = t_base / t_mine if t_mine else float("nan")
    return out


def low_latency_summary(stats: list[list[list[float]]]) -> dict[str, dict[str, float]] | None:
    """Per low-latency variant: its dispatch + combine (us, mean over ranks) and how many times faster it is
    than the normal mode's and the baseline's layout + dispatch + combine (a decoding step's routing
    changes every step, so those pay their layout every time); None without low-latency rows."""
    means = _means(stats)
    full = {impl: sum(m.values()) for impl, m in means.items()}
    base = next((b for b in ("torch-gloo", "torch-nccl") if b in means), None)
    out = {}
    for impl in LL_IMPLS:
        if impl not in means:
            continue
        t = means[impl]["dispatch"] + means[impl]["combine"]
        out[impl] = {"dispatch+combine_us": t * 1e6,
                     "x_faster_than_normal": full["moecomm"] / t if t and "moecomm" in full else float("nan"),
                     "x_faster_than_baseline": full[base] / t if t and base else float("nan")}
    return out or None


def _print_low_latency_summary(stats: list[list[list[float]]], o: dict[str, Any]) -> None:
    summary = low_latency_summary(stats)
    if summary is None:
        return
    for impl, v in summary.items():
        click.echo(f"# {impl}: dispatch+combine {v['dispatch+combine_us']:.1f} us; x faster than the normal mode's "
                   f"layout+dispatch+combine {v['x_faster_than_normal']:.2f}x, than the baseline's "
                   f"{v['x_faster_than_baseline']:.2f}x")
    if o.get("emulated"):
        click.echo("# low latency emulated (MOECOMM_IPC_EMULATE=1): its kernels ran in Triton's interpreter on the "
                   "CPU; the results were checked, the times mean nothing")


def _print_baseline_summary(stats: list[list[list[float]]]) -> None:
    """One line: how many times faster than the baseline moecomm is, per phase (means over ranks)."""
    summary = baseline_summary(stats)
    if summary is not None:
        click.echo("# x faster than the baseline (mean over ranks): "
                   + ", ".join(f"{name} {x:.2f}x" for name, x in summary.items()))


def _bench_skew(o: dict[str, Any], skew: float | None, redundant: int | None, nprocs: int, transport: str,
                json_path: str | None) -> None:
    """``--skew S``: skewed routing without and with EPLB (benchmarks/bench_moe_skew.py)."""
    from .bench_moe_skew import skew_rank, skew_report

    if skew is None:
        raise click.BadParameter("--redundant sets the EPLB variant of --skew: give --skew S too",
                                 param_hint="--redundant")
    if o["mode"] != "normal":
        raise click.UsageError("--skew times the normal-mode dispatcher; drop --mode low_latency")
    E = o["experts"]

    def check_size(n: int) -> None:
        if E % n:
            raise click.BadParameter(f"--experts {E} is not divisible by {n} ranks", param_hint="--experts")
        if o["redundant"] is not None and o["redundant"] % n:
            raise click.BadParameter(f"{o['redundant']} redundant slots do not spread evenly over {n} ranks: give a "
                                     f"multiple of {n}", param_hint="--redundant")

    o.update(skew=skew, redundant=redundant)
    lead, res = on_ranks(skew_rank, nprocs, o, timeout=o["timeout"], check_size=check_size, transport=transport)
    if not lead:
        return
    o.update(ranks=len(res["no-eplb"]["pairs_per_rank"]), redundant=res["redundant"])
    rows = skew_report(res, o)
    if json_path:
        from .output import environment, save_json

        doc = {"schema": "moecomm-bench-moe-skew/1", "env": environment(), "options": o, "rows": rows}
        click.echo(f"# wrote {save_json(json_path, doc).resolve()}")
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


def _json_doc(stats: list[list[list[float]]], o: dict[str, Any]) -> dict[str, Any]:
    """The run as JSON: environment, options, one row per (rank, impl) in microseconds and bytes, the summary."""
    from .output import environment

    keys = ("rank", "impl", "layout_us", "dispatch_us", "combine_us", "recv_rows", "moved_bytes", "inter_bytes",
            "intra_bytes", "ok", "nodes", "dispatch_bytes", "combine_bytes")
    rows = []
    for per_rank in stats:
        for r in per_rank:
            row = dict(zip(keys, r))
            row.update(rank=int(r[0]), impl=IMPLS[int(r[1])], ok=bool(r[9]), nodes=int(r[10]), recv_rows=int(r[5]))
            # the verified path of the normal-mode rows (--path; bench_moe raises before writing when not taken)
            row["path"] = (o.get("path") or "") if row["impl"] in ("moecomm", "moecomm-flat") else ""
            for k in ("layout_us", "dispatch_us", "combine_us"):
                row[k] *= 1e6
            rows.append(row)
    return {"schema": "moecomm-bench-moe/1", "env": environment(), "options": o, "rows": rows,
            "x_faster_than_baseline": baseline_summary(stats), "low_latency": low_latency_summary(stats)}


def _print_node_summary(stats: list[list[list[float]]], o: dict[str, Any]) -> None:
    """Node-aware vs flat: inter-node bytes (all ranks) and dispatch + combine time, with the ratios."""
    from collectives.model import expected_distinct

    by_impl: dict[str, list[list[float]]] = {}
    for per_rank in stats:
        for r in per_rank:
            by_impl.setdefault(IMPLS[int(r[1])], []).append(r)
    if "moecomm-flat" not in by_impl:
        return
    aware, flat = by_impl["moecomm"], by_impl["moecomm-flat"]
    inter_a, inter_f = sum(r[7] for r in aware), sum(r[7] for r in flat)   # row: see _bench_rank
    t_a = sum(r[3] + r[4] for r in aware) / len(aware)
    t_f = sum(r[3] + r[4] for r in flat) / len(flat)
    tl_a = t_a + sum(r[2] for r in aware) / len(aware)
    tl_f = t_f + sum(r[2] for r in flat) / len(flat)
    nodes, ranks = o["nodes"], o["nprocs_run"]
    k, E = o["top_k"], o["experts"]
    predicted = expected_distinct(k, nodes, E) / expected_distinct(k, ranks, E)
    click.echo(f"# inter-node bytes per dispatch, all ranks: node-aware {inter_a / 1e6:.3f} MB, flat "
               f"{inter_f / 1e6:.3f} MB, ratio {inter_a / inter_f if inter_f else float('nan'):.4f}; routing predicts "
               f"{predicted:.4f} (expected distinct nodes {expected_distinct(k, nodes, E):.4f} / ranks "
               f"{expected_distinct(k, ranks, E):.4f} per token, top-{k} of {E} on {nodes} nodes x {ranks // nodes})")
    click.echo(f"# dispatch + combine, mean over ranks: node-aware {t_a * 1e6:.1f} us, flat {t_f * 1e6:.1f} us, "
               f"ratio {t_a / t_f if t_f else float('nan'):.3f}; with the layout: node-aware {tl_a * 1e6:.1f} us, "
               f"flat {tl_f * 1e6:.1f} us, ratio {tl_a / tl_f if tl_f else float('nan'):.3f}")


@click.command("bench-moe")
@click.option("--tokens", type=COUNT, default=None, help="Tokens per rank [default: 4096; 128 with --mode low_latency].")
@click.option("--hidden", type=COUNT, default=7168, show_default=True, help="Hidden size.")
@click.option("-k", "--top-k", "top_k", type=COUNT, default=8, show_default=True, help="Experts per token.")
@click.option("--experts", type=COUNT, default=256, show_default=True,
              help="Experts in total (divisible by the ranks).")
@click.option("-d", "--dtype", default="bfloat16", show_default=True, type=click.Choice(sorted(DTYPES)))
@click.option("--nprocs", type=COUNT, default=2, show_default=True,
              help="Local ranks to launch (ignored under mpirun/torchrun).")
@click.option("-n", "--iters", type=COUNT, default=10, show_default=True, help="Timed iterations.")
@click.option("-w", "--warmup", type=NONNEGATIVE, default=3, show_default=True, help="Untimed iterations first.")
@click.option("--cpu-scale/--full-scale", default=False, show_default=True,
              help="Scale down for CPU runs: tokens / 8 and hidden / 4 (4096 x 7168 -> 512 x 1792).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also time torch.distributed all_to_all_single over gloo, NCCL on GPU (plain permutation).")
@click.option("--compare-flat/--no-compare-flat", default=True, show_default=True,
              help="Across nodes: also time the flat path (node_aware=False) beside the node-aware one.")
@click.option("--keep-freed-memory/--no-keep-freed-memory", default=True, show_default=True,
              help="CPU: keep freed memory in the process (glibc mallopt) so timings exclude page faults.")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True, help="Communicator timeout in seconds.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the tokens live; auto: cuda when every local rank has a GPU (the baseline is then "
                   "torch.distributed over NCCL, and every phase is timed after a device synchronisation).")
@click.option("--transport", type=click.Choice(TRANSPORT_CHOICES), default="auto", show_default=True,
              help="The communicator's transport for device tensors (auto: chosen per call; host tensors always "
                   "take a host transport). ipc runs two ranks on one GPU where the NCCL refuses them (< 2.30).")
@click.option("--mode", type=click.Choice(["normal", "low_latency"]), default="normal", show_default=True,
              help="low_latency: also time moe.LowLatencyDispatcher (fixed buffers, no host sync; needs the ipc "
                   "transport: one node, or MOECOMM_IPC_EMULATE=1 on the CPU, set by itself there) beside the normal "
                   "mode and the baseline.")
@click.option("--fp8", is_flag=True, help="--mode low_latency: also time FP8 (e4m3) dispatch.")
@click.option("--cuda-graph", "cuda_graph", type=NONNEGATIVE, default=0, show_default=True, metavar="N",
              help="--mode low_latency on CUDA: also time CUDA graphs of N dispatches and of N combines.")
@click.option("-J", "--json", "json_path", type=OUTPUT_FILE, default=None,
              help="Also write the rows, the summary and the environment as JSON.")
@click.option("--skew", type=click.FloatRange(min=0.0), default=None, metavar="S",
              help="Zipf-skewed routing (expert i drawn with weight 1/(i+1)^S; DeepSeek-like loads near 1.2): time "
                   "dispatch + experts + combine without and with redundant experts placed by moe.eplb (normal mode).")
@click.option("--redundant", type=NONNEGATIVE, default=None, metavar="R",
              help="--skew: redundant expert slots of the EPLB variant, a multiple of the ranks [default: E/4 rounded "
                   "down to a multiple of the ranks, at least one per rank].")
@click.option("--path", default=None, metavar="P",
              help="Force the normal mode's dispatch/combine onto path P and verify it (`moecomm paths`): CPU: shm, "
                   "socket (gloo); CUDA: cuda-ipc (ipc) or an NCCL path. Not available here: exit 2.")
def bench_moe(tokens: int, hidden: int, top_k: int, experts: int, dtype: str, nprocs: int, iters: int, warmup: int,
              cpu_scale: bool, baseline: bool, compare_flat: bool, keep_freed_memory: bool, timeout: float,
              device: str, transport: str, mode: str, fp8: bool, cuda_graph: int, json_path: str | None,
              skew: float | None, redundant: int | None, path: str | None) -> None:
    """MoE dispatch / combine time and GB/s per rank (layout separately), with the torch.distributed baseline."""
    if tokens is None:
        tokens = 128 if mode == "low_latency" else 4096
    if mode != "low_latency" and (fp8 or cuda_graph):
        raise click.UsageError("--fp8 and --cuda-graph time the low-latency dispatcher: add --mode low_latency")
    emulated, on_cuda, settings = False, False, None
    if mode == "low_latency":
        on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if cuda_graph and not on_cuda:
            raise click.UsageError("--cuda-graph captures CUDA graphs and needs a CUDA GPU")
        if not on_cuda:  # the ranks' ipc transport runs the kernels in Triton's interpreter
            settings = {"ipc_emulate": 1}
        emulated = option_or_environment("ipc_emulate", settings, source="bench-moe") != 0
    o = dict(mode=mode, fp8=fp8, cuda_graph=cuda_graph, emulated=emulated, tokens=tokens, hidden=hidden, top_k=top_k, experts=experts, dtype=dtype, iters=iters, warmup=warmup,
             baseline=baseline, compare_flat=compare_flat, cpu_scale=cpu_scale, tokens_full=tokens, hidden_full=hidden,
             keep_freed_memory=keep_freed_memory, timeout=timeout, device=device)
    if cpu_scale:
        o["tokens"], o["hidden"] = max(tokens // 8, 1), max(hidden // 4, 1)
    if top_k > experts:
        raise click.BadParameter(f"top-k {top_k} exceeds --experts {experts}", param_hint="--top-k")
    if skew is not None or redundant is not None:
        _bench_skew(o, skew, redundant, nprocs, transport, json_path)
        return

    def check_size(n: int) -> None:
        if experts % n:
            raise click.BadParameter(f"--experts {experts} is not divisible by {n} ranks", param_hint="--experts")
        if mode == "low_latency":
            _check_low_latency(o, n, on_cuda)

    env, chosen = None, None
    if path:
        from . import path_bench as pb

        chosen = pb.single_path(path, pb.resolve_device(device), None if transport == "auto" else transport)
        transport, env = chosen.transport, chosen.launch.env
        o.update(path=chosen.path, path_transport=chosen.transport)
    try:
        lead, stats = on_ranks(_bench_rank, nprocs, o, timeout=timeout, check_size=check_size, transport=transport,
                               options=settings, env=env)
    except PathMismatchError as e:
        from .path_bench import PathFailed

        raise PathFailed(f"{e}" + (f" (NCCL's log: {chosen.launch.log_dir})" if chosen.launch.log_dir else "")) from None
    if chosen is not None:
        from .path_bench import cleanup

        cleanup([chosen.launch])
    if not lead:
        return
    o["nprocs_run"] = len(stats)
    o["nodes"] = int(stats[0][0][10])
    ok = _print_table(stats, o)
    if json_path:
        from .output import save_json

        click.echo(f"# wrote {save_json(json_path, _json_doc(stats, dict(o, transport=transport))).resolve()}")
    if not ok:
        raise SystemExit(1)
