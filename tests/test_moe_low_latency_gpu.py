"""moe.LowLatencyDispatcher on CUDA: 2 ranks sharing cuda:0 over the ipc transport (CUDA IPC), bf16
and FP8, eager and captured in a CUDA graph (100 replays, each with new inputs, each checked).

The reference is tests/test_moe_low_latency.py's, computed on the CPU from every rank's seeded
inputs: received rows (bitwise for bf16), counts and (source, token, slot) info exactly; FP8 rows
within e4m3's precision and scales within float32 rounding of amax / 448; combine within
bfloat16 rounding (a GPU may fuse the multiply-adds). Replay ``r`` takes the inputs of seed
``400 + r % SEEDS``: the first SEEDS replays are checked against the reference, every later one
against the replay of its seed, bitwise (the kernels are deterministic), so 100 replays cost 10
references. ``validate-gpu --quick`` runs this file as its low-latency step.

Everything the captured step needs is built before the capture: a copy from pageable host memory
(``torch.tensor(list, device="cuda")``, as the CPU file's ``_experts`` builds its factors) is
refused by CUDA while a stream is capturing. A failed capture no longer takes the launch's eager
results with it: they are checked first, then the capture's error is reported.
"""

from __future__ import annotations

import pytest
import torch

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

P, E, M, K, CALLS = 2, 16, 64, 4, 3
REPLAYS = 100
SEEDS = 10  # distinct replay inputs (see the module docstring)


def expert_scale(rank: int, local: int, device: str | torch.device) -> torch.Tensor:
    """The factors of test_moe_low_latency._experts, ``(rank + 1) * (l + 1) / 4`` for local expert l,
    as the float32 tensor it builds, on ``device``: made once, outside any capture."""
    return torch.tensor([(rank + 1) * (le + 1) / 4 for le in range(local)], dtype=torch.float32, device=device)


def scaled_experts(recv: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """test_moe_low_latency._experts with its factors given (:func:`expert_scale`): the same float32
    product rounded once to bfloat16, so the CPU reference that calls ``_experts`` still matches."""
    return (recv.float() * scale[:, None, None]).to(torch.bfloat16)


def _same_record(a: tuple, b: tuple) -> bool:
    """Two replays' records (counts, infos, rows, scales, combine output) bitwise equal."""
    n, info, rows, scales, out = a
    if n != b[0] or info != b[1] or (scales is None) != (b[3] is None):
        return False
    pairs = [*zip(rows, b[2]), *zip(scales or [], b[3] or []), (out.view(torch.int16), b[4].view(torch.int16))]
    return all(torch.equal(x, y) for x, y in pairs)


def _body(comm, device: str, hidden: int, replays: int):
    from test_moe_low_latency import KM, _inputs

    from moe import LowLatencyDispatcher

    me = comm.rank
    disp = LowLatencyDispatcher(comm, num_experts=E, max_tokens_per_rank=M, hidden=hidden, max_topk=KM)
    scale = expert_scale(me, E // comm.size, device)

    def step(x, idx, w, fp8):
        recv, count, handle = disp.dispatch(x, idx, use_fp8=fp8)
        y = scaled_experts(recv[0].float() * recv[1].repeat_interleave(128, -1) if fp8 else recv, scale)
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
    graphs, error = {}, None
    if device != "cpu":
        for fp8 in (False, True):
            T = 45 + me
            x, idx, w = (t.to(device) for t in _inputs(300, me, T, E, K, hidden))
            step(x, idx, w, fp8)  # warm up: compiles the kernels' variants outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    recv, count, handle, out = step(x, idx, w, fp8)
                captured = 1
            except Exception as e:  # noqa: BLE001 - reported after the eager results are checked
                error, captured = f"{'FP8' if fp8 else 'bf16'} capture on rank {me}: {type(e).__name__}: {e}", 0
            # replay only where every rank captured: a rank replaying alone waits for its peer until the timeout
            agreed = torch.tensor([captured], dtype=torch.int32, device=device)
            if int(comm.all_reduce(agreed, "min").item()) == 0:
                error = error or f"{'FP8' if fp8 else 'bf16'} capture failed on a peer of rank {me}"
                break
            got = []
            for r in range(replays):
                nx, nidx, nw = _inputs(400 + r % SEEDS, me, T, E, K, hidden)
                x.copy_(nx)
                idx.copy_(nidx)
                w.copy_(nw)
                g.replay()
                got.append(record(recv, count, handle, out, fp8))
            graphs[fp8] = got
    comm.synchronize()
    return eager, graphs, error


def _plan_eager() -> list:
    return [(200 + c, [[M, 0, 37][(c + r) % 3] for r in range(P)], K) for c in range(2 * CALLS)]


@needs_gpu
@pytest.mark.parametrize("hidden", [1024, 7168])
def test_low_latency_dispatch_and_combine_on_one_gpu_eager_and_in_cuda_graphs(hidden):
    from gpu_harness import DEVICE
    from test_moe_low_latency import _check

    import collectives

    res = collectives.launch(_body, P, DEVICE, hidden, REPLAYS, device=DEVICE, transport="ipc", timeout=180)
    _check([r[0] for r in res], E, P, _plan_eager(), tuple(range(CALLS, 2 * CALLS)), exact=False, m=M, hidden=hidden)
    errors = [r[2] for r in res if r[2]]
    assert not errors, errors  # the eager calls passed; the CUDA-graph part did not run
    plan = [(400 + r, [45 + q for q in range(P)], K) for r in range(SEEDS)]
    for fp8 in (False, True):
        replays = [r[1][fp8] for r in res]
        assert all(len(got) == REPLAYS for got in replays)
        _check([got[:SEEDS] for got in replays], E, P, plan, tuple(range(SEEDS)) if fp8 else (), exact=False, m=M,
               hidden=hidden)
        for q, got in enumerate(replays):
            same = [r for r in range(SEEDS, REPLAYS) if not _same_record(got[r], got[r % SEEDS])]
            assert not same, f"rank {q}, {'FP8' if fp8 else 'bf16'}: replays {same} differ from the replay of their seed"


def test_the_prebuilt_factors_give_what_the_reference_experts_give():
    """scaled_experts(expert_scale(...)) equals test_moe_low_latency._experts bitwise (bf16 rows and the
    float32 rows that FP8 dequantizes to), so the CPU reference stays the GPU test's."""
    pytest.importorskip("triton")
    from test_moe_low_latency import _experts

    g = torch.Generator().manual_seed(3)
    for recv in ((torch.randn(8, 5, 256, generator=g) * 3).to(torch.bfloat16), torch.randn(8, 5, 256, generator=g)):
        for rank in range(P):
            want = _experts(recv, rank)
            got = scaled_experts(recv, expert_scale(rank, recv.shape[0], "cpu"))
            assert got.dtype == want.dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_same_record_compares_every_part_bitwise():
    rows = [torch.arange(4, dtype=torch.uint8)]
    a = ([1], [[7]], rows, None, torch.zeros(2, 3, dtype=torch.bfloat16))
    assert _same_record(a, ([1], [[7]], [r.clone() for r in rows], None, a[4].clone()))
    assert not _same_record(a, ([1], [[8]], rows, None, a[4]))
    assert not _same_record(a, (*a[:4], -a[4]))  # -0.0: equal values, other bits
    assert not _same_record(a, (*a[:3], [torch.ones(1)], a[4]))
