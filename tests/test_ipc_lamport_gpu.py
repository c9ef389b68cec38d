"""The ipc transport's Lamport kernels on data the other GPU tests never feed them, two ranks on cuda:0:

- all_reduce of float32, bfloat16 and float16 holding -0.0 and +0.0. An empty Lamport word is the
  float32 -0.0 bit pattern (``layout.LAMPORT_SENTINEL_BITS``); a -0.0 input, which a 16-bit float
  widens to exactly that pattern, must be pushed as +0.0 (``lamport._push``), or the reader takes
  it for "not arrived" and spins until the timeout, blaming its peer. Emulation computes the select
  in NumPy; only the compiled kernel can say whether the GPU compiler kept it.
- the fused all_reduce + residual + RMSNorm at hidden 7168 (DeepSeek-V3's; tests/test_ipc_gpu.py
  runs 1024): a row in one 8192-wide tile of a program, up to the 4 rows the slots hold.

One launch serves every GPU test (a launch costs seconds of process and CUDA start). The same body
runs in emulation on the CPU (``MOECOMM_IPC_EMULATE``, Triton's interpreter) at sizes that fit the
emulated slots, so the body and its reference are proven where there is no GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# a process that compiled for the GPU cannot emulate (TRITON_INTERPRET is read when kernels are defined)
emulated = pytest.mark.skipif(torch.cuda.is_available(), reason="emulation runs in the CPU suite")

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
PATTERNS = ("all -0.0", "all +0.0", "mixed")
EPS = 1e-6
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# GPU: the slot's whole 64 KiB (CUDA_LAMPORT_ELEMS, LAMPORT_MAX_BYTES at 2 ranks), a 4 KiB call and an odd tail
GPU_SIZES = {torch.float32: (777, 16384), torch.bfloat16: (777, 4096, 32768), torch.float16: (777, 32768)}
# the emulated slots hold 4096 elements and 8 KiB; the 16-bit floats, one call a case: the body and its
# reference proven in about a second (tests/test_ipc_lamport.py covers the emulated kernels themselves)
CPU_SIZES = {torch.bfloat16: (777,), torch.float16: (777,)}
# (dtype, weight dtype, rows, hidden): rows * hidden within the slots, rows * hidden * itemsize <= 64 KiB
GPU_FUSED = ((torch.bfloat16, torch.bfloat16, 1, 7168), (torch.bfloat16, torch.bfloat16, 4, 7168),
             (torch.float16, torch.float32, 4, 7168), (torch.float32, torch.float32, 2, 7168))
CPU_FUSED = ((torch.bfloat16, torch.bfloat16, 2, 2048), (torch.float32, torch.float32, 1, 2048))


def zeros_input(pattern: str, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input: every element -0.0 (each would be the sentinel if pushed as is), every
    element +0.0, or random values with -0.0 and +0.0 spread so that some elements are -0.0 on
    every rank, some -0.0 against a value or against +0.0."""
    if pattern == "all -0.0":
        return torch.full((numel,), -0.0, dtype=dtype)
    if pattern == "all +0.0":
        return torch.zeros(numel, dtype=dtype)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel * 10 + rank)) * 3
    i = torch.arange(numel)
    x[i % (3 + rank) == 0] = -0.0  # rank 0 every 3rd, rank 1 every 4th: both at every 12th
    x[i % 7 == 1] = 0.0 if rank else -0.0
    return x.to(dtype)


def reference_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """The Lamport kernel's sum: float32 in rank order, rounded once to the dtype."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def fused_inputs(dtype: torch.dtype, wdtype: torch.dtype, rows: int, hidden: int, n: int
                 ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every rank's x (with -0.0 spread in, as above), the replicated residual and weight."""
    g = [torch.Generator().manual_seed(hidden * 10 + rows * 3 + r) for r in range(n + 2)]
    xs = []
    for r in range(n):
        x = torch.randn(rows, hidden, generator=g[r]) * 2
        x.view(-1)[torch.arange(rows * hidden) % (5 + r) == 0] = -0.0
        xs.append(x.to(dtype))
    residual = torch.randn(rows, hidden, generator=g[n]).to(dtype)
    weight = (torch.rand(hidden, generator=g[n + 1]) + 0.5).to(wdtype)
    return xs, residual, weight


def fused_reference(xs: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) as the fused kernel defines them (lamport.all_reduce_rmsnorm_lamport)."""
    new_res = reference_sum([x.reshape(-1) for x in xs]).reshape(residual.shape) + residual
    r32 = new_res.float()
    normed = (r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(residual.dtype)
    return normed, new_res


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (-0.0 == +0.0: the kernel pushes -0.0 as +0.0)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())


def _body(comm, device: str, sizes: dict, fused: tuple, calls: int) -> dict:
    """Per case on this rank: (what, algorithm, result right, seconds) or (what, "raised", message, 0):
    ``calls`` calls per all_reduce case (3: every Lamport slot, each cleared back to the sentinel after)."""
    view = comm.using("ipc")
    n, me = comm.size, comm.rank
    out: dict = {"zeros": [], "fused": []}
    for dtype, numels in sizes.items():
        for numel in numels:
            for pattern in PATTERNS:
                what = f"{pattern} {dtype} x {numel}"
                xs = [zeros_input(pattern, r, numel, dtype) for r in range(n)]
                want = reference_sum(xs)
                x = xs[me].to(device)
                t0 = time.monotonic()
                try:
                    algo = view.plan("all_reduce", x).algorithm
                    ok = all(_same(view.all_reduce(x).cpu(), want) for _ in range(calls))
                    view.synchronize()
                    out["zeros"].append((what, algo, ok, time.monotonic() - t0))
                except Exception as e:  # noqa: BLE001 - a wait that gave up: recorded, the rest still tried
                    out["zeros"].append((what, "raised", f"{type(e).__name__}: {e}"[:400], 0.0))
    for k, (dtype, wdtype, rows, hidden) in enumerate(fused):
        what = f"{dtype} weight {wdtype} [{rows}, {hidden}]"
        xs, residual, weight = fused_inputs(dtype, wdtype, rows, hidden, n)
        want_normed, want_res = fused_reference(xs, residual, weight)
        x, res, w = xs[me].to(device), residual.to(device), weight.to(device)
        t0 = time.monotonic()
        try:
            algo = view.plan("all_reduce_rmsnorm", x, weight_dtype=wdtype).algorithm
            if k % 2:  # in place, as vLLM's fused_add_rms_norm
                normed, new_res = view.all_reduce_rmsnorm(x, res, w, EPS, out=x, residual_out=res)
            else:
                normed, new_res = view.all_reduce_rmsnorm(x, res, w, EPS)
            view.synchronize()
            got_normed, got_res = normed.cpu(), new_res.cpu()
            res_ok = torch.equal(got_res, want_res)
            normed_ok = bool(torch.allclose(got_normed.float(), want_normed.float(), rtol=TOL[dtype], atol=TOL[dtype]))
            out["fused"].append((what, algo, res_ok, normed_ok, time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001
            out["fused"].append((what, "raised", f"{type(e).__name__}: {e}"[:400], False, 0.0))
    return out


def _check_zeros(results: list[dict], sizes: dict) -> None:
    cases = len(PATTERNS) * sum(len(v) for v in sizes.values())
    for q, res in enumerate(results):
        assert len(res["zeros"]) == cases, res["zeros"]
        wrong = [c for c in res["zeros"] if c[1:3] != ("lamport", True)]
        assert not wrong, f"rank {q}: {wrong}"


def _check_fused(results: list[dict], fused: tuple) -> None:
    for q, res in enumerate(results):
        assert len(res["fused"]) == len(fused), res["fused"]
        wrong = [c for c in res["fused"] if c[1:4] != ("lamport_rmsnorm", True, True)]
        assert not wrong, f"rank {q}: {wrong}"


@pytest.fixture(scope="module")
def on_gpu() -> list[dict]:
    import collectives
    from gpu_harness import DEVICE

    from benchmarks.gpu_checks import gpu_transports

    # a -0.0 taken for the sentinel makes the reader wait for the timeout: short, yet longer than the two
    # ranks' compiles of the 8192-wide fused tile can differ
    return collectives.launch(_body, 2, DEVICE, GPU_SIZES, GPU_FUSED, 3, device=DEVICE,
                              transport=gpu_transports(2)[1], timeout=20.0)


@needs_gpu
def test_lamport_all_reduce_of_signed_zeros_on_the_gpu(on_gpu):
    _check_zeros(on_gpu, GPU_SIZES)


@needs_gpu
def test_fused_all_reduce_rmsnorm_at_hidden_7168_on_the_gpu(on_gpu):
    _check_fused(on_gpu, GPU_FUSED)


@emulated
def test_the_same_body_in_emulation():
    import collectives

    results = collectives.launch(_body, 2, "cpu", CPU_SIZES, CPU_FUSED, 1, transport="ipc",
                                 options={"ipc_emulate": 1}, timeout=60.0)
    _check_zeros(results, CPU_SIZES)
    _check_fused(results, CPU_FUSED)


def test_the_inputs_hold_what_the_cases_are_for():
    """-0.0 on both ranks, -0.0 against +0.0 and against a value, in the mixed pattern; the sentinel's
    bits in every element of the all -0.0 one once widened to float32, as the kernel pushes them."""
    from transports.kernels.layout import LAMPORT_SENTINEL_BITS

    for dtype in FLOATS:
        a, b = (zeros_input("mixed", r, 777, dtype) for r in range(2))
        neg = lambda t: (t == 0) & torch.signbit(t)  # noqa: E731
        assert (neg(a) & neg(b)).any() and (neg(a) & (b == 0) & ~torch.signbit(b)).any() and (neg(a) & (b != 0)).any()
        words = zeros_input("all -0.0", 0, 5, dtype).float().view(torch.int32)
        assert (words == LAMPORT_SENTINEL_BITS).all()
    for dtype, wdtype, rows, hidden in GPU_FUSED:
        xs, residual, weight = fused_inputs(dtype, wdtype, rows, hidden, 2)
        assert rows * hidden * dtype.itemsize <= 64 << 10 and weight.dtype == wdtype
        assert all(((x == 0) & torch.signbit(x)).any() for x in xs)
