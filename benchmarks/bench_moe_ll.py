"""``moecomm bench-moe --mode low_latency``: moe.LowLatencyDispatcher timed beside the normal mode and
the torch.distributed baseline of :mod:`benchmarks.bench_moe`, in the same launch.

Variants: bf16 dispatch, FP8 dispatch (``--fp8``), each eagerly and, with ``--cuda-graph N``,
as CUDA graphs of N dispatches and of N combines (replay time / N: launch overhead amortized, as
``bench --cuda-graph``). Identity experts: the expert output is the received rows (dequantized
with FP8), untimed. Bytes follow DeepEP's low-latency tests: per (token, expert) selection this
rank sends, dispatch ``hidden + hidden / 128 * 4 + 16`` B with FP8 (``2 * hidden`` in bf16) and
combine ``2 * hidden`` B; GB/s = 1e9 B/s. In emulation (``MOECOMM_IPC_EMULATE=1``, CPU) the
kernels run in Triton's interpreter: the run checks results; its times mean nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

LL_IMPLS = ("moecomm-ll", "moecomm-ll-fp8", "moecomm-ll-graph", "moecomm-ll-fp8-graph")


def dispatch_bytes(selections: int, hidden: int, fp8: bool) -> int:
    """DeepEP's low-latency count of what a rank's dispatch sends (its test_low_latency.py)."""
    return selections * ((hidden + hidden // 128 * 4 + 16) if fp8 else hidden * 2)


def low_latency_bytes(experts: int, ranks: int, tokens: int, hidden: int, top_k: int, itemsize: int,
                      fp8: bool) -> tuple[int, int]:
    """About what one rank's low-latency dispatcher holds, for a check before the run.

    Returns:
        (region, outputs): the region every rank maps (``transports.ipc_moe.region_layout``'s, as
        the dispatcher of :func:`time_low_latency` makes it) and a call's new tensors (recv_x
        [L, P*M, H] and the identity experts' output fed to combine, and FP8's [L, P*M, H] bytes
        with scales).
    """
    from transports.ipc_moe import region_layout

    slots = experts // ranks * ranks * tokens  # L * P * M received rows
    region = region_layout(ranks, experts, tokens, hidden, itemsize, top_k)[-1]
    outputs = 2 * slots * hidden * itemsize + (slots * (hidden + hidden // 32) if fp8 else 0)
    return region, outputs


def _expert_input(recv: Any, fp8: bool, dtype: torch.dtype) -> torch.Tensor:
    """Identity experts: the received rows (dequantized with FP8) in ``dtype``."""
    if not fp8:
        return recv
    from moe.low_latency import dequantize

    return dequantize(*recv).to(dtype)


def time_low_latency(comm, o: dict[str, Any], x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     sync: Callable[[], None], want: torch.Tensor) -> list[tuple[str, float, float, int, int, int, bool]]:
    """Time every low-latency variant on this rank (collective).

    Args:
        o: bench-moe's options (``iters``, ``warmup``, ``experts``, ``fp8``, ``cuda_graph``).
        x: [T, H] bfloat16; experts: int64 [T, k]; weights: [T, k]; want: the identity experts' y.

    Returns:
        [(impl, dispatch s, combine s, dispatch bytes, combine bytes, rows received, ok)] per variant.
    """
    from moe import LowLatencyDispatcher

    T, H = x.shape
    k = experts.shape[1]
    disp = LowLatencyDispatcher(comm, num_experts=o["experts"], max_tokens_per_rank=T, hidden=H, dtype=x.dtype,
                                max_topk=k)
    selections = int((experts >= 0).sum())
    out = []
    for fp8 in (False, True) if o["fp8"] else (False,):
        tol = 0.07 if fp8 else 2e-2  # e4m3 keeps 3 mantissa bits
        times = [0.0, 0.0]
        for it in range(o["warmup"] + o["iters"]):
            sync()
            comm.barrier()
            t0 = time.perf_counter()
            recv, _count, handle = disp.dispatch(x, experts, use_fp8=fp8)
            sync()
            t1 = time.perf_counter()
            y_in = _expert_input(recv, fp8, x.dtype)
            sync()
            t2 = time.perf_counter()
            y = disp.combine(y_in, experts, weights, handle)
            sync()
            t3 = time.perf_counter()
            if it >= o["warmup"]:
                times[0] += t1 - t0
                times[1] += t3 - t2
        comm.synchronize()  # asynchronous errors of the kernels raise here
        ok = bool(torch.allclose(y.float(), want.float(), rtol=tol, atol=tol))
        received = int(handle.recv_count.sum())
        name = "moecomm-ll-fp8" if fp8 else "moecomm-ll"
        n = o["iters"]
        out.append((name, times[0] / n, times[1] / n, dispatch_bytes(selections, H, fp8), selections * H * 2,
                    received, ok))
        if o["cuda_graph"]:
            g = _time_graphs(comm, disp, x, experts, weights, fp8, o, sync, want, tol, selections)
            out.append((*g[:5], received, g[5]))
    return out


def _time_graphs(comm, disp, x, experts, weights, fp8: bool, o: dict[str, Any], sync, want, tol: float,
                 selections: int) -> tuple[str, float, float, int, int, bool]:
    """Graphs of N dispatches and of N combines (the dispatch's handle), each replayed ``iters`` times
    after ``warmup`` replays; the last combine's output checked."""
    N = o["cuda_graph"]
    recv, _count, handle = disp.dispatch(x, experts, use_fp8=fp8)  # variants compiled outside the capture
    y_in = _expert_input(recv, fp8, x.dtype)
    disp.combine(y_in, experts, weights, handle)
    sync()
    g_d, g_c = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_d):
        for _ in range(N):
            recv, _count, handle = disp.dispatch(x, experts, use_fp8=fp8)
    g_d.replay()
    sync()
    y_in = _expert_input(recv, fp8, x.dtype)
    with torch.cuda.graph(g_c):
        for _ in range(N):
            y = disp.combine(y_in, experts, weights, handle)
    times = [0.0, 0.0]
    for it in range(o["warmup"] + o["iters"]):
        for j, g in enumerate((g_d, g_c)):
            sync()
            comm.barrier()
            t0 = time.perf_counter()
            g.replay()
            sync()
            if it >= o["warmup"]:
                times[j] += time.perf_counter() - t0
    comm.synchronize()
    ok = bool(torch.allclose(y.float(), want.float(), rtol=tol, atol=tol))
    n = o["iters"] * N
    return ("moecomm-ll-fp8-graph" if fp8 else "moecomm-ll-graph", times[0] / n, times[1] / n,
            dispatch_bytes(selections, x.shape[1], fp8), selections * x.shape[1] * 2, ok)
