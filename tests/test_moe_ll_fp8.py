"""FP8 quantization of the low-latency dispatch (transports/kernels/moe_ll.py) against torch, bitwise,
NaN and Inf included (issue #50, point 5), under Triton's interpreter.

The reference is torch's: ``s = |x|.amax(-1).clamp(min=1e-4) / 448`` per 128 channels, then
``(x / s).to(float8_e4m3fn)``. torch's amax and clamp propagate NaN, so a NaN anywhere in a group
makes its scale NaN and every byte of the group NaN (0x7F, or 0xFF where the quotient's NaN has its
sign bit set); an Inf makes the scale Inf, its own byte NaN (Inf / Inf) and the others +-0.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ipc_harness import run_ranks  # noqa: E402
from transports.ipc import load_kernels  # noqa: E402

load_kernels(True)  # the interpreter, before the test kernel below is defined

from transports.kernels.moe_ll import _e4m3  # noqa: E402

INF = float("inf")
P, E, M, H, KM = 2, 4, 8, 256, 2


@triton.jit
def _e4m3_kernel(X, Q, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Q + i, _e4m3(tl.load(X + i)).to(tl.uint8))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """float32 (possibly NaN) -> int32 bits, for bitwise comparisons (torch.equal says NaN != NaN)."""
    return x.contiguous().view(torch.int32)


def test_e4m3_is_torchs_cast_saturating_on_overflow():
    """Every bfloat16 value (both NaN signs, +-Inf, subnormals, +-0) and float32 values at and around
    every e4m3 rounding midpoint: torch's bits; finite overflow and Inf saturate to +-448 (0x7E/0xFE),
    as torch >= 2.13 and DeepEP's SATFINITE cast do (older torch gave NaN there, so the reference
    clamps first)."""
    every_bf16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2  # exact in float32
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(INF)), torch.nextafter(mids, torch.tensor(0.0)),
                      grid, torch.tensor([464.0, 479.9, 480.0, 1e10, 3.4e38, 2.0 ** -10, 2.0 ** -9 * 0.75])])
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FFFFFFF, -0x400000, -1], dtype=torch.int32).view(torch.float32)
    x = torch.cat([every_bf16, near, -near, nans])
    n = 1 << 17
    x = torch.cat([x, torch.zeros(n - x.numel())])
    q = torch.empty(n, dtype=torch.uint8)
    _e4m3_kernel[(n // 4096,)](x, q, BLOCK=4096)
    ref = torch.where(x.isnan(), x, x.clamp(-448.0, 448.0)).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (q != ref).nonzero().flatten()
    assert bad.numel() == 0, [(hex(int(_bits(x[i : i + 1])) & 0xFFFFFFFF), int(q[i]), int(ref[i])) for i in bad[:10]]
    # the cases the issue names, spelled out: NaN keeps its sign, Inf and overflow saturate
    special = torch.tensor([0.0, 0.0, INF, -INF, 500.0, -1e10, 0.0, -0.0])
    special.view(torch.int32)[:2] = torch.tensor([0x7FC00000, -0x400000], dtype=torch.int32)  # +NaN, -NaN
    q8 = torch.empty(8, dtype=torch.uint8)
    _e4m3_kernel[(1,)](special, q8, BLOCK=8)
    assert q8.tolist() == [0x7F, 0xFF, 0x7E, 0xFE, 0x7E, 0xFE, 0x00, 0x80]


def _rows(rank: int) -> torch.Tensor:
    """[6, H] bfloat16 rows, two 128-channel groups each, with NaN, Inf, zero and tiny groups."""
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(6, H, generator=g) * 3
    x[1, 5] = INF  # group 0: +Inf
    x[1, 128 + 77] = -INF  # group 1: -Inf
    x[2, 128 + 3], x[2, 128 + 90] = INF, -INF  # group 1: both infinities
    x[3, :128] = 0.0  # group 0: zeros (the scale is the 1e-4 floor), one -0
    x[3, 7] = -0.0
    x[3, 128:] = torch.randn(128, generator=g) * 1e-5  # group 1: amax below the floor, scale 1e-4 / 448
    x[3, 130] = 1e-38  # a float32 (and bfloat16) subnormal: byte 0
    x[4, 41] = -INF  # group 0: with a NaN (below): NaN wins
    x[4, 128:] *= 10.0 ** -torch.randint(0, 7, (128,), generator=g).float()  # group 1: e4m3 subnormals, zeros
    x = x.to(torch.bfloat16)
    bits = x.view(torch.int16)  # NaNs by their bits (torch's float32 -> bfloat16 cast may set the sign)
    bits[0, 17] = 0x7FC0  # group 0: a NaN among finite values
    bits[2, 100] = -0x40  # group 0: 0xFFC0, a NaN with its sign bit set
    bits[4, 40] = 0x7FFF  # group 0: a NaN with a payload
    return x.roll(rank, 0)  # the ranks send the rows in different orders


def _idx(rank: int) -> torch.Tensor:
    """top-2 of E=4 experts: every token goes to both ranks, to one expert each (or one slot unused)."""
    return torch.tensor([[(t + rank) % 2, 2 + (t // 2 + rank) % 2] if t != 5 else [-1, 3] for t in range(6)])


def _dispatch_fp8(group):
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group, programs=1)
    try:
        ex = IPCExpertExchange(t, E, M, H, torch.bfloat16, max_topk=KM)
        recv, scales, info, count = ex.dispatch(_rows(group.rank), _idx(group.rank), use_fp8=True)
        n = count.tolist()
        return ([recv[le, : n[le]].view(torch.uint8).clone() for le in range(len(n))],
                [_bits(scales[le, : n[le]]).clone() for le in range(len(n))])
    finally:
        t.close()


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bits uint8 [n, H], scale bits int32 [n, H/128]) as torch computes them."""
    xf = x.float().view(-1, H // 128, 128)
    s = xf.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (xf / s[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, H), _bits(s)


def test_dispatch_fp8_of_nan_inf_zero_and_tiny_groups_is_torchs_bitwise():
    results = run_ranks(_dispatch_fp8, P)
    assert all(r[0] == "ok" for r in results), results
    L = E // P
    inputs = [(_rows(s), _idx(s)) for s in range(P)]
    for q in range(P):
        rows, scales = results[q][1]
        for le in range(L):
            e = q * L + le
            src = torch.stack([x[t] for x, idx in inputs for t in range(len(idx)) if e in idx[t].tolist()])
            ref_q, ref_s = _reference(src)
            assert torch.equal(scales[le], ref_s), (q, le, scales[le], ref_s)
            bad = (rows[le] != ref_q).nonzero().tolist()
            assert not bad, (q, le, [(r, c, int(rows[le][r, c]), int(ref_q[r, c]), float(src[r, c]))
                                     for r, c in bad[:8]])
    # the special groups are where the test means them to be: NaN scales, Inf scales, NaN bytes
    x0, _ = _reference(_rows(0))
    s0 = _reference(_rows(0))[1].view(torch.float32)
    assert s0[0, 0].isnan() and s0[1].isinf().all() and s0[2, 0].isnan() and s0[2, 1].isinf() and s0[4, 0].isnan()
    assert (x0[0, :128] & 0x7F == 0x7F).all() and (x0[3, :128] & 0x7F == 0).all() and int(x0[3, 7]) == 0x80
