"""The low-latency MoE dispatch/combine (moe.LowLatencyDispatcher over transports.ipc_moe) in emulation:
host provider + Triton's interpreter, ranks in forked processes.

Every rank's inputs are seeded, so the parent computes the reference from all of them: each local
expert's rows in source-rank, then token order, bitwise; exact counts and (src, token, slot)
info; combine as a float32 sum over slots in order, rounded once, bitwise; FP8 rows against
torch's own e4m3 cast with the same scales, bitwise, and within e4m3's precision of the input.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("triton")

from ipc_harness import run_ranks
from spmd import left_behind, shm_segments

import collectives

H, M, KM = 256, 16, 4


def _inputs(seed: int, rank: int, T: int, E: int, k: int, hidden: int = H) -> tuple:
    """x [T, hidden] bf16, topk_idx [T, k] (distinct ids, about a fifth -1), weights [T, k] float32."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = (torch.randn(T, hidden, generator=g) * 3).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
        torch.empty(0, k, dtype=torch.int64)
    idx[torch.rand(T, k, generator=g) < 0.2] = -1
    w = torch.rand(T, k, generator=g)
    return x, idx, w


def _experts(recv: torch.Tensor, rank: int) -> torch.Tensor:
    """A stand-in expert: local expert l multiplies its rows by (rank + 1) * (l + 1) / 4 (exact in bf16)."""
    scale = torch.tensor([(rank + 1) * (le + 1) / 4 for le in range(recv.shape[0])], device=recv.device)
    return (recv.float() * scale[:, None, None]).to(torch.bfloat16)


def _exchange(group, E, plan, programs, fp8_calls=()):
    """Run ``plan`` ([(seed, T per rank)] calls) through an IPCExpertExchange; per call the outputs."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group, programs=programs)
    ex = IPCExpertExchange(t, E, M, H, torch.bfloat16, max_topk=KM)
    me, out = group.rank, []
    for c, (seed, tokens, k) in enumerate(plan):
        x, idx, w = _inputs(seed, me, tokens[me], E, k)
        fp8 = c in fp8_calls
        recv, scales, info, count = ex.dispatch(x, idx, use_fp8=fp8)
        y = _experts(recv.float() * scales.repeat_interleave(128, -1) if fp8 else recv, me)
        comb = ex.combine(y, info, count, idx, w)
        n = count.tolist()
        rows = [recv[le, : n[le]].view(torch.uint8).clone() for le in range(len(n))]  # fp8 does not pickle
        out.append((n, [info[le, : n[le]].tolist() for le in range(len(n))], rows,
                    [scales[le, : n[le]].clone() for le in range(len(n))] if fp8 else None, comb))
    t.close()
    return out


def _expected(E: int, P: int, seed: int, tokens: list[int], k: int, m: int = M, hidden: int = H, km: int = KM
              ) -> tuple:
    """Every rank's inputs; per receiver: counts, infos and source rows per local expert."""
    L = E // P
    ins = [_inputs(seed, r, tokens[r], E, k, hidden) for r in range(P)]
    per = []
    for q in range(P):
        counts, infos, rows = [], [], []
        for le in range(L):
            e = q * L + le
            got = [(s, t, j) for s in range(P) for t in range(tokens[s]) for j in range(k) if ins[s][1][t, j] == e]
            counts.append(len(got))
            infos.append([s * m * km + t * km + j for s, t, j in got])
            rows.append(torch.stack([ins[s][0][t] for s, t, _ in got]) if got else
                        torch.empty(0, hidden, dtype=torch.bfloat16))
        per.append((counts, infos, rows))
    return ins, per


def _fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [n, H], scales float32 [n, H/128]): amax / 448 per 128 channels, amax >= 1e-4."""
    hidden = x.shape[-1]
    xf = x.float().view(-1, hidden // 128, 128)
    s = xf.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (xf / s[..., None]).to(torch.float8_e4m3fn).view(-1, hidden), s


def _check(results: list, E: int, P: int, plan: list, fp8_calls=(), exact: bool = True, m: int = M,
           hidden: int = H, km: int = KM) -> None:
    """results[rank][call] against the reference of plan[call] ((seed, tokens per rank, k)).

    exact: bitwise FP8 bits, scales and combine (emulation); else (a GPU) scales within float32
    rounding, FP8 rows within e4m3's precision, combine within bfloat16 rounding.
    """
    L = E // P
    for c, (seed, tokens, k) in enumerate(plan):
        ins, per = _expected(E, P, seed, tokens, k, m, hidden, km)
        fp8 = c in fp8_calls
        for q in range(P):
            n, info, rows, scales, _ = results[q][c]
            counts, infos, ref_rows = per[q]
            assert n == counts, (c, q, n, counts)
            assert info == infos, (c, q)
            for le in range(L):
                if not fp8:
                    assert torch.equal(rows[le], ref_rows[le].view(torch.uint8)), (c, q, le)
                    continue
                ref_q, ref_s = _fp8_reference(ref_rows[le])
                if exact:
                    assert torch.equal(scales[le], ref_s), (c, q, le)
                    assert torch.equal(rows[le], ref_q.view(torch.uint8)), (c, q, le)
                else:
                    torch.testing.assert_close(scales[le], ref_s, rtol=1e-6, atol=0)
                deq = rows[le].view(torch.float8_e4m3fn).float().view(-1, hidden // 128, 128) * scales[le][..., None]
                src = ref_rows[le].float().view(-1, hidden // 128, 128)
                # e4m3: 3 mantissa bits (half an ulp is 1/16 relative), subnormal steps of 2**-9 * scale
                assert ((deq - src).abs() <= src.abs() / 16 + scales[le][..., None] / 1024 + 1e-12).all(), (c, q, le)
        for s in range(P):
            x, idx, w = ins[s]
            comb = results[s][c][4]
            ref = torch.zeros(tokens[s], hidden)
            for t in range(tokens[s]):
                for j in range(k):
                    e = int(idx[t, j])
                    if e < 0:
                        continue
                    owner, le = divmod(e, L)
                    row = x[t : t + 1]
                    if fp8:
                        qq, ss = _fp8_reference(row)
                        row = qq.float().view(1, -1, 128) * ss[..., None]
                    y = _experts(row.float().view(1, 1, hidden).expand(le + 1, 1, hidden).contiguous(), owner)[le, 0]
                    ref[t] = ref[t] + w[t, j] * y.float()
            if exact:
                assert torch.equal(comb.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16)), (c, s)
            else:
                torch.testing.assert_close(comb.float(), ref, rtol=1e-2, atol=1e-2 * max([1.0, *ref.abs().flatten().tolist()]))


def _ok(results):
    for r in results:
        assert r[0] == "ok", r
    return [r[1] for r in results]


@pytest.mark.parametrize("P", [2, 3, 4])
def test_dispatch_and_combine_equal_the_reference(P):
    """0, M and odd token counts, top-3 with unused slots, bf16 then FP8, against the reference."""
    E = 2 * P
    shapes = [[M, 0, 5, 11][: P], [7, M, 0, 3][: P], [0, 1, M, 9][: P]]
    plan = [(10 + c, tokens, 3) for c, tokens in enumerate(shapes)]
    results = _ok(run_ranks(_exchange, P, E, plan, 1, (2,)))
    _check(results, E, P, plan, (2,))


@pytest.mark.parametrize("programs", [2, 3])
def test_every_program_count_gives_the_same_result(programs):
    """Several programs split tokens and rows; each waits only for peers, never its own launch's others."""
    P, E = 3, 9
    plan = [(20, [M, 6, 0], 3), (21, [5, M, 13], 4)]
    results = _ok(run_ranks(_exchange, P, E, plan, programs, (1,)))
    _check(results, E, P, plan, (1,))


# One region serves every call (the exchange's counters only grow): what a stale row or count needs is
# calls of every top-k (1 + c % KM) in bf16 and in FP8 (calls 1, 6, 11, 16: top-2, 3, 4, 1) after one
# another at random token counts, and a call that moves nothing; 17 calls reach all of them.
CALLS = 17


def test_buffers_are_reused_across_17_calls_without_stale_rows_or_counts():
    P, E = 2, 8
    g = torch.Generator().manual_seed(5)
    plan = [(100 + c, [int(v) for v in torch.randint(0, M + 1, (P,), generator=g)], 1 + c % KM) for c in range(CALLS)]
    plan[3] = (103, [0, 0], 2)  # nothing moves at all
    fp8 = tuple(range(1, CALLS, 5))
    assert {(1 + c % KM, c in fp8) for c in range(CALLS)} == {(k, f) for k in range(1, KM + 1) for f in (False, True)}
    results = _ok(run_ranks(_exchange, P, E, plan, 1, fp8))
    _check(results, E, P, plan, fp8)


# ---- errors --------------------------------------------------------------------------------------
def _refused(group, case):
    """Call 1 is refused on rank 1 (case); calls 0 and 2 are valid. Per call: the error or the counts."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group)
    E = 4
    ex = IPCExpertExchange(t, E, M, H, torch.bfloat16, max_topk=KM)
    outcome = []
    for c in range(3):
        x, idx, _ = _inputs(40 + c, group.rank, 6, E, 2)
        if c == 1 and group.rank == 1:
            if case == "too_many":
                x, idx, _ = _inputs(40, 1, M + 1, E, 2)
            elif case == "bad_id":
                idx[2, 1] = E
            elif case == "duplicate":
                idx[4] = torch.tensor([3, 3])
            elif case == "shape":
                x = x[:, :128]
        try:
            count = ex.dispatch(x, idx)[3]
            outcome.append(("ok", count.tolist()))
        except (ValueError, TypeError) as e:
            outcome.append((type(e).__name__, str(e)))
    t.close()
    return outcome


@pytest.mark.parametrize("case,words", [("too_many", "17 tokens, more than max_tokens_per_rank"),
                                        ("bad_id", "expert id 4, outside [-1, num_experts)"),
                                        ("duplicate", "expert 3 twice in one token's top-k"),
                                        ("shape", "")])
def test_refused_inputs_raise_on_every_rank_naming_the_rank_and_the_next_call_works(case, words):
    res = _ok(run_ranks(_refused, 2, case))
    for r in range(2):
        assert res[r][0][0] == "ok" and res[r][2][0] == "ok", res[r]
        kind, msg = res[r][1]
        assert kind == "ValueError", (r, kind, msg)
        assert "rank 1" in msg, msg
        assert words in msg, msg
    if case == "shape":  # the rank at fault says exactly what it refused
        assert "x must be [T, 256], got [6, 128]" in res[1][1][1], res[1][1]


def _killed_in_dispatch(group, victim):
    """The victim sends its tokens, then dies before it receives; the others wait for its rows' acks."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group)
    ex = IPCExpertExchange(t, 6, M, H, torch.bfloat16, max_topk=KM)
    x, idx, _ = _inputs(60, group.rank, 5, 6, 2)
    ex.dispatch(x, idx)  # everybody up
    if group.rank == victim:
        launch = t.launch_exchange

        def die_after_send(*launches):
            if launches[0][0].__name__ == "ll_dispatch_send":
                launch(launches[0])
                os._exit(3)
            launch(*launches)

        t.launch_exchange = die_after_send
    t0 = time.monotonic()
    try:
        ex.dispatch(x, idx)
        ex.dispatch(x, idx)  # the victim's acks for the first never come
        outcome = ("no error", "")
    except Exception as e:  # noqa: BLE001 - inspected by the test
        outcome = (type(e).__name__, str(e))
    waited = time.monotonic() - t0
    t.close()
    return outcome, waited


def test_a_peer_killed_inside_dispatch_makes_the_others_raise_naming_it_and_leaves_no_segment():
    before = shm_segments()
    res = run_ranks(_killed_in_dispatch, 3, 1, timeout=60.0)
    assert res[1][0] == "missing"
    for r in (0, 2):
        assert res[r][0] == "ok", res[r]
        (kind, msg), waited = res[r][1]
        assert kind == "PeerFailedError", msg
        assert "rank 1" in msg, msg
        assert waited < 15.0, waited  # well inside the 60 s timeout
    assert not left_behind(before)


# ---- the moe facade ------------------------------------------------------------------------------
def _facade(comm):
    from moe import LowLatencyDispatcher

    E = 2 * comm.size
    disp = LowLatencyDispatcher(comm, num_experts=E, max_tokens_per_rank=M, hidden=H, max_topk=KM)
    x, idx, w = _inputs(80, comm.rank, 5 + comm.rank, E, 3)
    recv, count, handle = disp.dispatch(x, idx)
    y = disp.combine(_experts(recv, comm.rank), idx, w, handle)
    (q, scales), count8, handle8 = disp.dispatch(x, idx, use_fp8=True)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (2, comm.size * M, H)
    assert scales.dtype == torch.float32 and tuple(scales.shape) == (2, comm.size * M, H // 128)
    assert torch.equal(count8, count)
    assert all(torch.equal(handle8.info[le, :n], handle.info[le, :n]) for le, n in enumerate(count.tolist()))
    disp.combine(_experts(q.float() * scales.repeat_interleave(128, -1), comm.rank).to(torch.bfloat16), idx, w,
                 handle8)
    n = count.tolist()
    return n, [handle.info[le, : n[le]].tolist() for le in range(2)], \
        [recv[le, : n[le]].view(torch.uint8).clone() for le in range(2)], \
        None, y


def test_the_facade_over_a_communicator_with_emulated_ipc():
    P, E = 2, 4
    res = collectives.launch(_facade, P, transport="ipc", timeout=60.0, options={"ipc_emulate": 1})
    _check([[r] for r in res], E, P, [(80, [5, 6], 3)])


def _no_ipc(comm):
    from moe import LowLatencyDispatcher

    try:
        LowLatencyDispatcher(comm, num_experts=4, max_tokens_per_rank=M, hidden=H)
    except RuntimeError as e:
        return str(e)
    return "constructed"


def test_without_ipc_construction_raises_and_says_why():
    for msg in collectives.launch(_no_ipc, 2, transport="shm", timeout=30.0):
        assert "needs the communicator's ipc transport" in msg and "MOECOMM_IPC_EMULATE" in msg, msg


def _differing(group):
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group)
    try:
        IPCExpertExchange(t, 4, M, H * (1 + group.rank), torch.bfloat16)
        return "constructed"
    except ValueError as e:
        return str(e)
    finally:
        t.close()


def test_ranks_constructing_with_different_sizes_raise_on_every_rank():
    for r in _ok(run_ranks(_differing, 2)):
        assert "arguments differ" in r and "hidden=256" in r and "hidden=512" in r, r


def _error_between_kernels(group):
    """On rank 1 an input error lands in the status block while a dispatch is between its two kernels:
    the call still launches both, so no peer waits for a missing half; it raises after them, in that
    call, and the next calls work on both ranks."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange
    from transports.kernels import layout as L

    t = IPCTransport(group, eager_check=False)
    ex = IPCExpertExchange(t, 4, M, H, torch.bfloat16, max_topk=KM)
    if group.rank == 1:
        bind = t._bind

        def bind_then_record(kernel, const):
            bound = bind(kernel, const)
            if kernel.__name__ != "ll_dispatch_send":
                return bound

            def run(*args):
                bound(*args)
                t._status[L.S_INPUT] = (L.INPUT_BAD_ID + 256 * 9) * L.MAX_RANKS + 0
            return run

        t._bind = bind_then_record
    outcome = []
    for c in range(3):
        x, idx, _ = _inputs(90 + c, group.rank, 5, 4, 2)
        try:
            outcome.append(("ok", ex.dispatch(x, idx)[3].tolist()))
            t.synchronize()
        except ValueError as e:
            outcome.append(("ValueError", str(e)))
        if group.rank == 1 and c == 0:
            t._bind = bind
    t.close()
    return outcome


def test_an_error_recorded_between_a_calls_kernels_raises_after_both_not_midway():
    res = _ok(run_ranks(_error_between_kernels, 2, timeout=20.0))
    # rank 0's call 0 completed: rank 1 launched both kernels before it raised
    assert [o[0] for o in res[0]] == ["ok", "ok", "ok"], res[0]
    assert [o[0] for o in res[1]] == ["ValueError", "ok", "ok"], res[1]
    assert "rank 0 passed expert id 9" in res[1][0][1], res[1]


# ---- every rank leaves a refused call at that call (GPU behaviour: eager_check=False) --------------
# On a GPU the host reads the status block without waiting for the stream, so a refusal that reaches
# the peers only through their kernels would raise there at some later call, while the rank at fault
# raised at once: the ranks would leave the exchange at different calls and pair the next ones wrongly.
def _refused_lazily(group, case, with_combine):
    """Call 1 is refused on rank 1 (case); per call: the error, or what _check compares."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group, eager_check=False)
    E, me, out = 4, group.rank, []
    ex = IPCExpertExchange(t, E, M, H, torch.bfloat16, max_topk=KM)
    for c in range(4):
        x, idx, w = _inputs(140 + c, me, 6 + 3 * me, E, 2)
        if c == 1 and me == 1:
            if case == "too_many":
                x, idx, w = _inputs(140, 1, M + 1, E, 2)
            else:
                idx[2, 1] = E
        try:
            recv, _, info, count = ex.dispatch(x, idx)
            comb = ex.combine(_experts(recv, me), info, count, idx, w) if with_combine else None
        except (ValueError, TypeError) as e:
            out.append((type(e).__name__, str(e)))
            continue
        n = count.tolist()
        out.append(("ok", (n, [info[le, : n[le]].tolist() for le in range(len(n))],
                           [recv[le, : n[le]].view(torch.uint8).clone() for le in range(len(n))], None, comb)))
    t.close()
    return out


@pytest.mark.parametrize("case,words", [("too_many", "17 tokens, more than max_tokens_per_rank 16"),
                                        ("bad_id", "expert id 4, outside [-1, num_experts)")])
@pytest.mark.parametrize("with_combine", [True, False], ids=["dispatch+combine", "dispatch only"])
def test_without_eager_checks_every_rank_raises_at_the_refused_call_and_later_calls_pair(case, words, with_combine):
    res = _ok(run_ranks(_refused_lazily, 2, case, with_combine, timeout=30.0))
    for r in range(2):
        assert [o[0] for o in res[r]] == ["ok", "ValueError", "ok", "ok"], (r, res[r])
        assert "rank 1" in res[r][1][1] and words in res[r][1][1], res[r][1]
    E, P = 4, 2
    for c in (0, 2, 3):
        plan = [(140 + c, [6, 9], 2)]
        got = [[res[r][c][1]] for r in range(P)]
        if with_combine:
            _check(got, E, P, plan)
        else:  # counts, infos and rows of the call itself (not another call's)
            _, per = _expected(E, P, *plan[0])
            for q in range(P):
                n, info, rows, _, _ = got[q][0]
                assert n == per[q][0] and info == per[q][1], (c, q)
                assert all(torch.equal(rows[le], per[q][2][le].view(torch.uint8)) for le in range(len(n))), (c, q)


def _mispaired(group, how):
    """Call 1 of the exchange does not pair: rank 1 skipped a launch ("skipped": its host raised before
    launching, as an earlier collective's lazily read error does), sent FP8 against bfloat16 ("fp8"),
    or combined an older dispatch's handle ("handle"). Per call: the error or the counts."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group, eager_check=False)
    E, me, out = 4, group.rank, []
    ex = IPCExpertExchange(t, E, M, H, torch.bfloat16, max_topk=KM)
    calls = [0, 1, 2, 3]
    if how == "skipped" and me == 1:
        calls = [0, "skip", 1, 2, 3]  # its calls 1.. pair with its peer's one call later
    for c in calls:
        if c == "skip":
            start = t._start

            def refuse():
                t._start = start
                raise ValueError("an earlier collective's error, raised before the launch")
            t._start = refuse
            c = 1
        x, idx, w = _inputs(160 + c, me, 5 + me, E, 2)
        try:
            recv, _, info, count = ex.dispatch(x, idx, use_fp8=how == "fp8" and c == 1 and me == 1)
            if how == "handle" and c == 1:
                older = (info, count, ex.last)
                recv, _, info, count = ex.dispatch(x, idx)
                if me == 1:
                    info, count = older[0], older[1]
                    ex.combine(_experts(recv, me), info, count, idx, w, dispatched=older[2])
                else:
                    ex.combine(_experts(recv, me), info, count, idx, w)
            out.append(("ok", count.tolist()))
        except ValueError as e:
            out.append(("ValueError", str(e)))
    t.close()
    return out


@pytest.mark.parametrize("how,words", [
    ("skipped", ["calls do not pair", "skipped a call"]),
    ("fp8", ["calls do not pair", "different use_fp8", "(FP8)", "(no FP8)"]),
    ("handle", ["combined the handle of its dispatch #", "dispatch #1 ", "dispatch #2 ", "the same dispatch"])])
def test_a_mispaired_exchange_raises_on_every_rank_instead_of_returning_data_and_the_next_call_pairs(how, words):
    res = _ok(run_ranks(_mispaired, 2, how, timeout=30.0))
    if how == "skipped":  # rank 1's extra attempt: it raised its own error before launching
        assert res[1][1] == ("ValueError", "an earlier collective's error, raised before the launch"), res[1]
        del res[1][1]
    E, P = 4, 2
    for r in range(P):
        assert [o[0] for o in res[r]] == ["ok", "ValueError", "ok", "ok"], (r, res[r])
        assert all(w in res[r][1][1] for w in words), (r, res[r][1][1])
    for c in (0, 2, 3):  # rank 0's calls 2, 3 pair with rank 1's calls 2, 3 again
        _, per = _expected(E, P, 160 + c, [5, 6], 2)
        assert [res[q][c][1] for q in range(P)] == [per[q][0] for q in range(P)], c


# ---- small sizes; combine refusals (#51) ------------------------------------------------------------
def _record(recv, count, info, comb) -> tuple:
    n = count.tolist()
    return (n, [info[le, : n[le]].tolist() for le in range(len(n))],
            [recv[le, : n[le]].view(torch.uint8).clone() for le in range(len(n))], None, comb)


def _small(group):
    """E=4, M=4, H=128, max_topk 2: the exchange region is smaller than a signal area (it was refused)."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group)
    ex = IPCExpertExchange(t, 4, 4, 128, torch.bfloat16, max_topk=2)
    x, idx, w = _inputs(170, group.rank, [4, 3][group.rank], 4, 2, 128)
    recv, _, info, count = ex.dispatch(x, idx)
    out = _record(recv, count, info, ex.combine(_experts(recv, group.rank), info, count, idx, w))
    t.close()
    return out


def test_small_sizes_whose_region_is_smaller_than_a_signal_area():
    res = _ok(run_ranks(_small, 2))
    _check([[r] for r in res], 4, 2, [(170, [4, 3], 2)], m=4, hidden=128, km=2)


def _combine_refused(group, case):
    """Rank 1's combine of call 1 is refused (case); the peers must raise in that call, promptly,
    and call 2 must work. Per call: the error (with seconds) or the record."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group, eager_check=False)
    E, me, out = 4, group.rank, []
    ex = IPCExpertExchange(t, E, M, H, torch.bfloat16, max_topk=KM)
    for c in range(3):
        x, idx, w = _inputs(180 + c, me, 5 + me, E, 2)
        recv, _, info, count = ex.dispatch(x, idx)
        y = _experts(recv, me)
        if c == 1 and me == 1:
            if case == "shape":
                y = y[:, :-1]
            elif case == "dtype":
                y = y.float()
            elif case == "weights":
                w = w[:, :1]
            elif case == "handle":
                info = None
        t0 = time.monotonic()
        try:
            out.append(("ok", _record(recv, count, info, ex.combine(y, info, count, idx, w))))
        except (ValueError, TypeError) as e:
            out.append((type(e).__name__, str(e), time.monotonic() - t0))
    t.close()
    return out


@pytest.mark.parametrize("case,kind,words", [("shape", "ValueError", "expert_out must be [2, 32, 256], got [2, 31, 256]"),
                                             ("dtype", "TypeError", "expert_out is torch.float32"),
                                             ("weights", "ValueError", "topk_idx and topk_weights must be [6, 2]"),
                                             ("handle", "TypeError", "must be tensors")])
def test_a_combine_refused_on_one_rank_raises_on_every_rank_in_that_call_and_the_next_works(case, kind, words):
    res = _ok(run_ranks(_combine_refused, 2, case, timeout=30.0))
    for r in range(2):
        assert [o[0] for o in res[r]] == ["ok", kind if r == 1 else "ValueError", "ok"], (r, res[r])
        assert res[r][1][2] < 10.0, res[r][1]  # at once, not at the 30 s timeout
    assert words in res[1][1][1] and "rank 1" in res[1][1][1], res[1][1]
    assert "low-latency combine: rank 1 passed inputs of the wrong shape or dtype" in res[0][1][1], res[0][1]
    for c in (0, 2):
        _check([[res[q][c][1]] for q in range(2)], 4, 2, [(180 + c, [5, 6], 2)])


def _stale(group):
    """Dispatch A, dispatch B; combine B's outputs with A's handle (refused on every rank: its
    topk_idx are B's); then A's handle with A's own outputs and ids, and B's with B's (both valid)."""
    from transports.ipc import IPCTransport
    from transports.ipc_moe import IPCExpertExchange

    t = IPCTransport(group, eager_check=False)
    E, me = 4, group.rank
    ex = IPCExpertExchange(t, E, M, H, torch.bfloat16, max_topk=KM)
    calls = []
    for seed in (190, 191):
        x, idx, w = _inputs(seed, me, 5 + me, E, 2)
        recv, _, info, count = ex.dispatch(x, idx)
        calls.append((recv, info, count, idx, w, ex.last))
    (ra, ia, ca, xa, wa, da), (rb, ib, cb, xb, wb, db) = calls
    try:
        ex.combine(_experts(rb, me), ia, ca, xb, wb, dispatched=da)
        stale = ("ok", "")
    except ValueError as e:
        stale = ("ValueError", str(e))
    a = _record(ra, ca, ia, ex.combine(_experts(ra, me), ia, ca, xa, wa, dispatched=da))
    b = _record(rb, cb, ib, ex.combine(_experts(rb, me), ib, cb, xb, wb, dispatched=db))
    t.close()
    return stale, a, b


def test_a_stale_handle_raises_on_every_rank_and_an_older_handle_with_its_own_ids_combines_right():
    res = _ok(run_ranks(_stale, 2, timeout=30.0))
    for r in range(2):
        kind, msg = res[r][0]
        assert kind == "ValueError" and "differ from those its handle's dispatch sent" in msg, res[r][0]
    _check([[r[1]] for r in res], 4, 2, [(190, [5, 6], 2)])
    _check([[r[2]] for r in res], 4, 2, [(191, [5, 6], 2)])
