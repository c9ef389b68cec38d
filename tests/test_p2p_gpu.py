"""Point-to-point of CUDA tensors (the NCCL channel: a host handshake, then ncclSend/ncclRecv in
one group), two ranks on cuda:0, and its stream contract (torch's: a message posted under a side
stream is ordered after that stream's work queued before the post; ``wait()`` orders the current
stream after it). Skipped without CUDA; run by the GPU check (validate-gpu)."""

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


_SLEEP_CYCLES = 100_000_000  # ~50 ms of torch.cuda._sleep at the ~2 GHz clock of an H100/H200


def _post_time_stream(comm, device: str) -> list[str]:
    """Rank 0 fills x on a side stream s1 behind a ~50 ms sleep, posts ``isend(x)`` under s1, waits
    on the default stream; rank 1 overwrites ``out`` on its s1 behind the same sleep, posts
    ``irecv(out)`` under s1, waits on the default stream. A data step on the stream current at
    progress time (the default one, not ordered after s1) sends x before its fill, or lands under
    the late overwrite. Contiguous and non-contiguous (every other element of a [n, 2]) tensors."""
    from benchmarks.gpu_checks import gpu_transports

    if "nccl" not in comm.transports:
        return [f"no nccl: {gpu_transports(comm.size)[2]}"]
    n, peer = 1 << 16, 1 - comm.rank
    ref = torch.arange(n, dtype=torch.float32, device=device)
    s1 = torch.cuda.Stream(device)
    done = []
    for contiguous in (True, False):
        base = torch.zeros(n, 2, device=device)
        t = base[:, 0] if not contiguous else torch.zeros(n, device=device)
        torch.cuda.synchronize()
        s1.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            torch.cuda._sleep(_SLEEP_CYCLES)
            if comm.rank == 0:
                t.copy_(ref)
                w = comm.isend(t, peer)
            else:
                t.fill_(-1.0)
                w = comm.irecv(t, peer)
        w.wait()  # on the default stream
        if comm.rank == 1:
            got = t.cpu()  # on the default stream, ordered by wait()
            assert torch.equal(got, ref.cpu()), (contiguous, got[:4], got[-4:])
            if not contiguous:
                assert not base[:, 1].any().item(), "the copy-back wrote outside the strided view"
        torch.cuda.synchronize()
        done.append("contiguous" if contiguous else "strided")
    return done


def test_nccl_point_to_point_orders_after_the_stream_of_post_time():
    res = launch_on_gpu(_post_time_stream, 2)
    if res[0][0].startswith("no nccl"):
        pytest.skip(res[0][0])
    assert res[0] == res[1] == ["contiguous", "strided"], res
