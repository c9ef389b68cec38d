"""Receive hooks of the low-latency MoE exchange (issue #55): ``LowLatencyDispatcher.dispatch/combine(...,
return_recv_hook=True)`` in emulation (host provider + Triton's interpreter, ranks in forked processes).

A hooked call launches its send kernel, the caller computes, and the hook receives: its outputs must
equal the plain call's on the same inputs bit for bit (every row below recv_count, the counts, the
handle's info, the combine's y), over 50 hooked calls (25 dispatches, each followed by its combine)
of random token counts (0 on some rank, M on some), top-k with unused slots, bfloat16 and float32,
with and without FP8, in every order of plain and hooked calls and with two dispatchers' calls
overlapped (two micro-batches). Then the rules: a hook runs once, one call is in flight per
dispatcher, and a refused or unpaired hooked call raises from the hook on every rank (with 3 ranks, in
the slow tier: a bystander raises too). One launch per rank count runs all of it (each interpreted kernel costs
0.05-0.1 s of a 2-core machine: hence 25 rounds, M = 4).
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")

import collectives  # noqa: E402

# CALLS rounds of a hooked dispatch and a hooked combine (50 hooked calls), each beside its plain twin
H, M, KM, CALLS = 128, 4, 3, 25
DTYPES = (torch.bfloat16, torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (bitwise comparison; float8 and NaN-safe)."""
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _inputs(g: torch.Generator, T: int, E: int, k: int, dtype: torch.dtype) -> tuple:
    """x [T, H] of dtype, topk_idx int64 [T, k] (distinct ids, about a fifth -1), weights float32 [T, k]."""
    x = (torch.randn(T, H, generator=g) * 3).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
        torch.empty(0, k, dtype=torch.int64)
    idx[torch.rand(T, k, generator=g) < 0.2] = -1
    return x, idx, torch.rand(T, k, generator=g)


def _experts(recv, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """A stand-in expert on the received rows (dequantized with FP8): local expert l scales by (rank+1)(l+1)/4."""
    rows = recv[0].float() * recv[1].repeat_interleave(128, -1) if isinstance(recv, tuple) else recv.float()
    scale = torch.tensor([(rank + 1) * (le + 1) / 4 for le in range(rows.shape[0])])
    return (rows * scale[:, None, None]).to(dtype)


def _compare_dispatch(plain: tuple, hooked: tuple, what: str) -> None:
    """(recv_x, recv_count, handle) of a plain and a hooked dispatch: counts, rows below them, info."""
    (rx, n, h), (rx2, n2, h2) = plain, hooked
    assert torch.equal(n, n2), (what, n, n2)
    assert _same(h.recv_count, n2) and h2.dispatched.call // 2 != h.dispatched.call // 2, what
    for le, c in enumerate(n.tolist()):
        if isinstance(rx, tuple):  # FP8: the bytes and the scales
            assert _same(rx[0][le, :c], rx2[0][le, :c]) and _same(rx[1][le, :c], rx2[1][le, :c]), (what, le)
        else:
            assert _same(rx[le, :c], rx2[le, :c]), (what, le)
        assert torch.equal(h.info[le, :c], h2.info[le, :c]), (what, le)


def _work(a: torch.Tensor) -> float:
    """A real computation between a send and its hook."""
    return float((a @ a.T).relu().sum())


def _plan(P: int, seed: int) -> list[tuple]:
    """Per call, the same on every rank: (dtype index, fp8, k, tokens per rank, order, overlap)."""
    g = torch.Generator().manual_seed(seed)
    plan = []
    for c in range(CALLS):
        tokens = [int(v) for v in torch.randint(0, M + 1, (P,), generator=g)]
        if c % 3 == 0:
            tokens[c % P] = 0
        if c % 4 == 1:
            tokens[(c + 1) % P] = M
        di, overlap = c % 2, c % 16 == 4
        # order 3 and overlap use the second (bfloat16) dispatcher, which has one call in flight
        order = int(torch.randint(0, 4 if di == 0 and not overlap else 3, (1,), generator=g))
        plan.append((di, c % 5 in (1, 3), 1 + int(torch.randint(0, KM, (1,), generator=g)), tokens, order, overlap))
    plan[5] = (1, False, 2, [0] * P, 0, False)  # nothing moves at all
    assert {(d, f) for d, f, *_ in plan} == {(d, f) for d in (0, 1) for f in (False, True)}
    assert {p[4] for p in plan} == {0, 1, 2, 3} and any(p[5] for p in plan)
    assert any(0 in p[3] for p in plan) and any(M in p[3] for p in plan)
    return plan


def _hooked_equal_plain(comm, disp: dict, spare, plan: list[tuple]) -> float:
    """Every call of ``plan``, plain and hooked on the same inputs, compared bitwise (see the module docstring).

    Orders: 0 plain dispatch, hooked dispatch, hooked combine, plain combine; 1 hooked first, plain
    after; 2 plain dispatch and combine, then hooked ones; 3 (bfloat16) the plain calls on a second
    dispatcher between the hooked sends and their hooks. overlap: a second dispatcher's hooked calls
    go out before the first's hooks are called (two micro-batches), and an all_reduce of the
    communicator runs between the sends and the hooks.
    """
    me, E = comm.rank, 2 * comm.size
    g = torch.Generator().manual_seed(1000 + me)
    a = torch.randn(96, 96, generator=g)
    acc = 0.0
    for c, (di, fp8, k, tokens, order, overlap) in enumerate(plan):
        dtype = DTYPES[di]
        d = disp[dtype]
        x, idx, w = _inputs(g, tokens[me], E, k, dtype)
        if order in (0, 2):
            plain = d.dispatch(x, idx, use_fp8=fp8)
        if order == 2:
            y_plain = d.combine(_experts(plain[0], dtype, me), idx, w, plain[2])
        *hooked, hook = d.dispatch(x, idx, use_fp8=fp8, return_recv_hook=True)
        if overlap:  # the second micro-batch's send, before the first's hook
            x2, idx2, w2 = _inputs(g, tokens[(me + 1) % comm.size], E, k, torch.bfloat16)
            *h2, hook2 = spare.dispatch(x2, idx2, return_recv_hook=True)
        if order == 3:
            plain = spare.dispatch(x, idx, use_fp8=fp8)
        if overlap:  # another collective of the communicator between a send and its hook
            acc += float(comm.all_reduce(torch.ones(4))[0])
        acc += _work(a)
        hook()
        if overlap:
            hook2()
        if order == 1:
            plain = d.dispatch(x, idx, use_fp8=fp8)
        _compare_dispatch(plain, hooked, (c, "dispatch"))
        out = _experts(plain[0], dtype, me)
        y, hook = d.combine(out, idx, w, hooked[2], return_recv_hook=True)
        if overlap:
            y2, hook2 = spare.combine(_experts(h2[0], torch.bfloat16, me), idx2, w2, h2[2], return_recv_hook=True)
        if order == 3:
            y_plain = spare.combine(out, idx, w, plain[2])
        acc += _work(a)
        if overlap:
            hook2()  # the hooks in the other order than the sends
        hook()
        if order in (0, 1):
            y_plain = d.combine(out, idx, w, plain[2])
        assert _same(y, y_plain) and y.shape == (tokens[me], H), (c, "combine")
        if overlap:
            p2 = spare.dispatch(x2, idx2)
            _compare_dispatch(p2, h2, (c, "overlapped"))
            assert _same(y2, spare.combine(_experts(p2[0], torch.bfloat16, me), idx2, w2, p2[2])), (c, "overlapped")
    return acc


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - inspected by the test
        return type(e).__name__, str(e)
    return "ok", ""


def _rules(comm, d) -> dict:
    """Hook twice, calls while a hook is pending, refused and unpaired hooked calls; per check the outcomes."""
    me, E = comm.rank, 2 * comm.size
    g = torch.Generator().manual_seed(77 + me)
    x, idx, w = _inputs(g, M, E, 2, torch.bfloat16)
    ref = d.dispatch(x, idx)
    out = _experts(ref[0], torch.bfloat16, me)
    y_ref = d.combine(out, idx, w, ref[2])
    res = {}

    # a hook runs once; the communicator and the dispatcher go on
    *_, hook = d.dispatch(x, idx, return_recv_hook=True)
    hook()
    res["twice"] = _outcome(hook)
    y, hook = d.combine(out, idx, w, ref[2], return_recv_hook=True)
    hook()
    res["combine twice"] = _outcome(hook)
    assert _same(y, y_ref)

    # one call in flight: a dispatch or a combine while a hook is pending is refused here, nothing launched
    *hooked, hook = d.dispatch(x, idx, return_recv_hook=True)
    res["dispatch pending"] = _outcome(lambda: d.dispatch(x, idx))
    res["combine pending"] = _outcome(lambda: d.combine(out, idx, w, ref[2]))
    res["hooked dispatch pending"] = _outcome(lambda: d.dispatch(x, idx, return_recv_hook=True))
    hook()
    _compare_dispatch(ref, hooked, "after pending")
    y, hook = d.combine(out, idx, w, hooked[2], return_recv_hook=True)
    res["dispatch pending combine"] = _outcome(lambda: d.dispatch(x, idx))
    hook()
    assert _same(y, y_ref)
    _compare_dispatch(ref, d.dispatch(x, idx), "after pending 2")
    assert _same(d.combine(out, idx, w, ref[2]), y_ref)

    # refused inputs in hooked calls: the send returns on every rank, the hook raises on every rank
    for case in ("too_many", "bad_id", "shape", "fp8"):
        xx, ii, fp8 = x, idx, False
        if me == 1:
            if case == "too_many":
                xx, ii, _ = _inputs(g, M + 1, E, 2, torch.bfloat16)
            elif case == "bad_id":
                ii = idx.clone()
                ii[2, 1] = E + 3
            elif case == "shape":
                xx = torch.zeros(M, 2 * H, dtype=torch.bfloat16)
            else:
                fp8 = True  # the ranks' use_fp8 differ: the calls do not pair
        hooks = []
        sent = _outcome(lambda: hooks.append(d.dispatch(xx, ii, use_fp8=fp8, return_recv_hook=True)[3]))
        res[f"refused {case}"] = (sent, _outcome(hooks[0]) if hooks else None)
        _compare_dispatch(ref, d.dispatch(x, idx), f"after refused {case}")  # the next call works
    # a refused hooked combine (a wrong expert_out shape on rank 1), then a good one
    bad = out[:, :-1] if me == 1 else out
    y, hook = d.combine(bad, idx, w, ref[2], return_recv_hook=True)
    res["refused combine"] = (("ok", ""), _outcome(hook))
    pr = d.dispatch(x, idx)
    assert _same(d.combine(out, idx, w, pr[2]), y_ref)
    return res


def _body(comm, rules: bool) -> tuple[float, dict, float]:
    from moe import LowLatencyDispatcher

    t0 = time.monotonic()
    E = 2 * comm.size
    disp = {dt: LowLatencyDispatcher(comm, num_experts=E, max_tokens_per_rank=M, hidden=H, dtype=dt, max_topk=KM)
            for dt in DTYPES}
    spare = LowLatencyDispatcher(comm, num_experts=E, max_tokens_per_rank=M, hidden=H, max_topk=KM)
    acc = _hooked_equal_plain(comm, disp, spare, _plan(comm.size, 55 + comm.size))
    res = _rules(comm, disp[torch.bfloat16]) if rules else {}
    return acc, res, time.monotonic() - t0


@pytest.mark.parametrize("P", [2, 3])
def test_hooked_calls_equal_plain_ones_bitwise_and_the_rules_hold(P):
    rules = True
    results = collectives.launch(_body, P, rules, transport="ipc", timeout=60.0, options={"ipc_emulate": 1})
    for r, (acc, res, _) in enumerate(results):
        assert acc > 0
        if not rules:
            continue
        for key in ("twice", "combine twice"):
            kind, msg = res[key]
            assert kind == "RuntimeError" and "called twice" in msg and f"rank {r}" in msg, (r, key, msg)
        for key in ("dispatch pending", "combine pending", "hooked dispatch pending", "dispatch pending combine"):
            kind, msg = res[key]
            assert kind == "RuntimeError" and "one call is in flight per dispatcher" in msg, (r, key, msg)
            pending = "combine" if key == "dispatch pending combine" else "dispatch"
            assert f"the {pending} launched with return_recv_hook=True" in msg, (r, key, msg)
        words = {"too_many": "5 tokens, more than max_tokens_per_rank 4", "bad_id": f"expert id {2 * P + 3},",
                 "shape": "", "fp8": "do not pair"}
        for case, w in words.items():
            sent, hooked = res[f"refused {case}"]
            assert sent == ("ok", ""), (r, case, sent)  # every refusal waits for the hook
            kind, msg = hooked
            assert kind in ("ValueError", "TypeError") and w in msg, (r, case, hooked)
            if case != "fp8":
                assert "rank 1" in msg, (r, case, msg)
        kind, msg = res["refused combine"][1]
        assert kind == "ValueError" and "rank 1" in msg, (r, msg)
    if rules:  # the rank at fault names exactly what its host refused
        assert "x must be [T, 128], got [4, 256]" in results[1][1]["refused shape"][1][1], results[1][1]
    print(f"P={P}: the ranks' bodies took {max(t for *_, t in results):.1f} s")
