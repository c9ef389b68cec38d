"""moe.LowLatencyDispatcher on CUDA: 2 ranks sharing cuda:0 over the ipc transport (CUDA IPC), bf16
and FP8, eager and captured in a CUDA graph (100 replays, each with new inputs, each checked).

The reference is tests/test_moe_low_latency.py's, computed on the CPU from every rank's seeded
inputs: received rows (bitwise for bf16), counts and (source, token, slot) info exactly; FP8 rows
within e4m3's precision and scales within float32 rounding of amax / 448; combine within
bfloat16 rounding (a GPU may fuse the multiply-adds). ``validate-gpu --quick`` runs this file as
its low-latency step.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

P, E, M, K, CALLS = 2, 16, 64, 4, 3
REPLAYS = 100


def _body(comm, device: str, hidden: int, replays: int):
    from test_moe_low_latency import KM, _experts, _inputs

    from moe import LowLatencyDispatcher

    me = comm.rank
    disp = LowLatencyDispatcher(comm, num_experts=E, max_tokens_per_rank=M, hidden=hidden, max_topk=KM)

    def step(x, idx, w, fp8):
        recv, count, handle = disp.dispatch(x, idx, use_fp8=fp8)
        y = _experts(recv[0].float() * recv[1].repeat_interleave(128, -1) if fp8 else recv, me)
        return recv, count, handle, disp.combine(y, idx, w, handle)

    def record(recv, count, handle, out, fp8):
        n = count.tolist()
        rows = recv[0] if fp8 else recv
        return (n, [handle.info[le, : n[le]].tolist() for le in range(len(n))],
                [rows[le, : n[le]].view(torch.uint8).cpu() for le in range(len(n))],
                [recv[1][le, : n[le]].cpu() for le in range(len(n))] if fp8 else None, out.cpu())

    eager = []
    for c in range(2 * CALLS):  # bf16 calls, then FP8 calls
        fp8 = c >= CALLS
        x, idx, w = (t.to(device) for t in _inputs(200 + c, me, [M, 0, 37][(c + me) % 3], E, K, hidden))
        eager.append(record(*step(x, idx, w, fp8), fp8))
    graphs = {}
    if device != "cpu":
        for fp8 in (False, True):
            T = 45 + me
            x, idx, w = (t.to(device) for t in _inputs(300, me, T, E, K, hidden))
            step(x, idx, w, fp8)  # warm up: compiles the kernels' variants outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                recv, count, handle, out = step(x, idx, w, fp8)
            got = []
            for r in range(replays):
                nx, nidx, nw = _inputs(400 + r, me, T, E, K, hidden)
                x.copy_(nx)
                idx.copy_(nidx)
                w.copy_(nw)
                g.replay()
                got.append(record(recv, count, handle, out, fp8))
            graphs[fp8] = got
    comm.synchronize()
    return eager, graphs


def _plan_eager() -> list:
    return [(200 + c, [[M, 0, 37][(c + r) % 3] for r in range(P)], K) for c in range(2 * CALLS)]


@pytest.mark.parametrize("hidden", [1024, 7168])
def test_low_latency_dispatch_and_combine_on_one_gpu_eager_and_in_cuda_graphs(hidden):
    from gpu_harness import DEVICE
    from test_moe_low_latency import _check

    import collectives

    res = collectives.launch(_body, P, DEVICE, hidden, REPLAYS, device=DEVICE, transport="ipc", timeout=180)
    eager = [r[0] for r in res]
    _check(eager, E, P, _plan_eager(), tuple(range(CALLS, 2 * CALLS)), exact=False, m=M, hidden=hidden)
    for fp8 in (False, True):
        plan = [(400 + r, [45 + q for q in range(P)], K) for r in range(REPLAYS)]
        _check([r[1][fp8] for r in res], E, P, plan, tuple(range(REPLAYS)) if fp8 else (), exact=False, m=M,
               hidden=hidden)
