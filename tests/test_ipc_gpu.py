"""The ipc transport's GPU host path, two ranks on cuda:0 (CUDA IPC between processes of one device):
the Lamport one-shot and the staged all_reduce after the pre-bound launch took over, the fused
all_reduce_rmsnorm, symmetric tensors, CUDA-graph replays of a Lamport all_reduce, lazy errors at
synchronize(). Skipped without CUDA; run by the GPU check (validate-gpu). Emulation proves the same
paths on the CPU (test_ipc_lamport.py, test_ipc_lazy.py); this file is what only a GPU can say.
"""

from __future__ import annotations

import pytest
import torch

from gpu_harness import DEVICE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _reference(numel: int, dtype: torch.dtype, n: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    xs = [(torch.randn(numel, generator=torch.Generator().manual_seed(seed * 10 + r)) * 3).to(dtype)
          for r in range(n)]
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return xs, acc.to(dtype)


def _host_path(comm, device: str) -> dict:
    ipc = comm.transports["ipc"]
    view = comm.using("ipc")
    n, me = comm.size, comm.rank
    out = {}
    for numel, dtype in ((2048, torch.bfloat16), (4096, torch.float32), (1 << 20, torch.float32), (777, torch.float16)):
        xs, ref = _reference(numel, dtype, n, numel)
        x = xs[me].to(device)
        algo = view.plan("all_reduce", x).algorithm
        ok = True
        for _ in range(50):  # the first call compiles, the rest go through the bound launcher
            ok &= torch.equal(view.all_reduce(x).cpu(), ref)
        view.synchronize()
        out[f"{numel}x{dtype}"] = (algo, ok)
    # the compiled launcher took over after the first call
    out["bound"] = sum(len(b._compiled) for b in ipc._bound.values()) > 0
    # fused all_reduce + residual + RMSNorm, against the composition
    H = 1024
    xs, _ = _reference(6 * H, torch.bfloat16, n, 7)
    residual = torch.randn(6, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    weight = (torch.rand(H, generator=torch.Generator().manual_seed(4)) + 0.5).to(torch.bfloat16).to(device)
    x = xs[me].reshape(6, H).to(device)
    normed, new_res = view.all_reduce_rmsnorm(x, residual, weight, 1e-6)
    a = view.all_reduce(x)
    want_res = a + residual
    r32 = want_res.float()
    want = (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(torch.bfloat16)
    out["fused"] = (view.plan("all_reduce_rmsnorm", x, weight_dtype=torch.bfloat16).algorithm,
                    torch.equal(new_res, want_res), bool(torch.allclose(normed.float(), want.float(), atol=2e-2)))
    # symmetric tensors, in place and out of place
    xs, ref = _reference(100_000, torch.float32, n, 11)
    s = view.symmetric_empty((100_000,), torch.float32)
    s.copy_(xs[me].to(device))
    o = view.all_reduce(s)
    view.all_reduce(s, out=s)
    out["symmetric"] = torch.equal(o.cpu(), ref) and torch.equal(s.cpu(), ref)
    # a Lamport all_reduce captured in a CUDA graph, replayed
    xs, ref = _reference(4096, torch.bfloat16, n, 13)
    g_in = xs[me].to(device)
    g_out = torch.empty_like(g_in)
    view.all_reduce(g_in, out=g_out)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        view.all_reduce(g_in, out=g_out)
    replays_ok = True
    for i in range(100):
        g_in.copy_((xs[me] * (i % 3 + 1)).to(device))
        graph.replay()
        acc = sum(((x * (i % 3 + 1)).float() for x in xs), torch.zeros(4096))
        replays_ok &= torch.equal(g_out.cpu(), acc.to(torch.bfloat16))
    view.synchronize()
    out["graph"] = replays_ok
    return out


def test_ipc_host_path_lamport_fused_symmetric_and_graphs():
    import collectives

    from benchmarks.gpu_checks import gpu_transports

    results = collectives.launch(_host_path, 2, DEVICE, device=DEVICE, transport=gpu_transports(2)[1], timeout=180)
    for res in results:
        for key in ("2048xtorch.bfloat16", "4096xtorch.float32", "777xtorch.float16"):
            assert res[key] == ("lamport", True), (key, res[key])
        assert res["1048576xtorch.float32"][1], res
        assert res["bound"], res
        assert res["fused"] == ("lamport_rmsnorm", True, True), res["fused"]
        assert res["symmetric"] and res["graph"], res


def _late_peer(comm, device: str) -> tuple:
    import time

    view = comm.using("ipc")
    x = torch.ones(1024, device=device)
    view.all_reduce(x)
    view.synchronize()
    if comm.rank == 1:
        time.sleep(8.0)  # never arrives within rank 0's timeout
        return ("slept",)
    t0 = time.monotonic()
    view.all_reduce(x)  # returns once queued
    queued = time.monotonic() - t0
    try:
        view.synchronize()
        return ("no error", queued)
    except Exception as e:  # noqa: BLE001 - inspected by the test
        return (type(e).__name__, str(e), queued, time.monotonic() - t0)


def test_a_late_peer_raises_at_synchronize_on_the_gpu():
    import collectives

    from benchmarks.gpu_checks import gpu_transports

    results = collectives.launch(_late_peer, 2, DEVICE, device=DEVICE, transport=gpu_transports(2)[1], timeout=3.0)
    kind, msg, queued, raised = results[0]
    assert queued < 1.0, queued  # the call did not wait for the peer
    assert kind == "CollectiveTimeoutError" and "rank 1" in msg, msg
    assert raised < 7.0, raised
