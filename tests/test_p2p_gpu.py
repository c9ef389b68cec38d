"""Point-to-point of CUDA tensors (the NCCL channel: a host handshake, then ncclSend/ncclRecv in
one group), two ranks on cuda:0. Skipped without CUDA; run by the GPU check (validate-gpu)."""

from __future__ import annotations

import pytest
import torch

from gpu_harness import DEVICE, launch_on_gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _exchanges(comm, device: str) -> list[str]:
    from benchmarks.gpu_checks import gpu_transports
    from collectives import P2POp

    if "nccl" not in comm.transports:
        return [f"no nccl: {gpu_transports(comm.size)[2]}"]
    r, peer = comm.rank, 1 - comm.rank
    done = []
    for numel, dtype in ((1 << 20, torch.float32), (1001, torch.bfloat16), (0, torch.int64), (16 << 20, torch.float32)):
        g = torch.Generator().manual_seed(numel + r)
        x = torch.randn(numel, generator=g).to(dtype).to(device)
        want = torch.randn(numel, generator=torch.Generator().manual_seed(numel + peer)).to(dtype)
        out = torch.empty(numel, dtype=dtype, device=device)
        for w in comm.batch_isend_irecv([P2POp("irecv", out, peer), P2POp("isend", x, peer)]):  # receive first
            w.wait()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), want), (numel, dtype)
        # blocking, in the order a pipeline stage uses
        if r == 0:
            comm.send(x, peer, tag=3)
            got = comm.recv(out, peer, tag=4)
        else:
            got = comm.recv(out, peer, tag=3)
            comm.send(x, peer, tag=4)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), want), (numel, dtype, "blocking")
        done.append(f"{numel}x{dtype}")
    try:  # a size mismatch raises on both ranks
        if r == 0:
            comm.send(torch.ones(10, device=device), peer)
        else:
            comm.recv(torch.empty(11, device=device), peer)
        mismatch = "no error"
    except ValueError as e:
        mismatch = str(e)
    assert "(10,)" in mismatch and "(11,)" in mismatch, mismatch
    return done


def test_nccl_point_to_point_two_ranks_on_one_gpu():
    res = launch_on_gpu(_exchanges, 2)
    if res[0][0].startswith("no nccl"):
        pytest.skip(res[0][0])
    assert res[0] == res[1] and len(res[0]) == 4, res
