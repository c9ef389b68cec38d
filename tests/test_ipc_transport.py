"""The ipc transport in emulation (host provider + Triton's interpreter), ranks in forked processes.

One launch per rank count runs every collective x dtype x op x size cell against a torch reference
computed from every rank's (seeded) input and reports all failing cells together: reductions sum
in fp32 in rank order and round once, so the reference is exact and the check is bitwise.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

pytest.importorskip("triton")

from ipc_harness import run_ranks  # noqa: E402
from spmd import mark_done, wait_done  # noqa: E402
from transports.base import (  # noqa: E402
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    OpCode,
    PeerFailedError,
    ReduceOp,
    Signature,
)

BUF = 4096  # the smallest buffer: sizes past it exercise chunking
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64)
OPS = ("sum", "avg", "max", "min")


def _input(seed: int, rank: int, numel: int, dtype: torch.dtype, nan: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype.is_floating_point:
        x = (torch.randn(numel, generator=g) * 4).to(dtype)
        if nan and numel > 2 and rank == 1:
            x[numel // 2] = float("nan")
        return x
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def _reduce_ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Rank-order reduction in the kernels' accumulation type, rounded once."""
    dtype = xs[0].dtype
    acc_t = torch.float32 if dtype in FLOATS else dtype
    acc = xs[0].to(acc_t)
    for x in xs[1:]:
        x = x.to(acc_t)
        acc = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op](acc, x)
    if op == "avg":
        acc = acc / len(xs)
    return acc.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))
    return torch.equal(a, b)


def _sizes(n: int, itemsize: int) -> list[int]:
    # 0, 1, odd, not divisible by the rank count, more than one buffer
    return [0, 1, 37, 5 * n + 1, BUF // itemsize + 3 * n + 1]


def _ops_at(sizes: list[int], numel: int, ops: tuple[str, ...]) -> tuple[str, ...]:
    """The reductions run at ``numel``: every op at an odd size and past one buffer (each combiner inside
    a chunk and across chunks), the first alone at the sizes that only move the partition (0, 1, 5n+1)."""
    return ops if numel in (sizes[2], sizes[-1]) else ops[:1]


def _matrix(group, dtypes=FLOATS + INTS, ops=None):
    """Every cell on this rank for ``dtypes`` (reductions: every op, or ``ops = (float ops, integer
    ops)``); returns (failures, digests of all_reduce outputs)."""
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF)
    n, me = group.size, group.rank
    fails: list[str] = []
    digests: list[bytes] = []
    seed = 0

    def check(name, got, want):
        if not _same(got, want):
            bad = (got != want).nonzero()[:3].flatten().tolist() if got.shape == want.shape else "shape"
            fails.append(f"rank {me} {name}: differs at {bad}")

    try:
        for dtype in dtypes:
            item = torch.empty(0, dtype=dtype).element_size()
            ops_of = (OPS, ("sum", "max", "min")) if ops is None else ops
            ops_of = ops_of[0] if dtype in FLOATS else ops_of[1]
            sizes = _sizes(n, item)
            for numel in sizes:
                for op in _ops_at(sizes, numel, ops_of):
                    rop = ReduceOp.parse(op)
                    for algo, limit in (("one_shot", 1 << 62), ("two_shot", 0)):
                        seed += 1  # fresh inputs per call: stale buffer contents must not pass
                        xs = [_input(seed, r, numel, dtype, nan=op in ("max", "min")) for r in range(n)]
                        want = _reduce_ref(xs, op)
                        t.one_shot_max = limit
                        out = torch.empty_like(xs[me])
                        sig = Signature.of(OpCode.ALL_REDUCE, dtype=dtype, shape=(numel,), op=rop)
                        t.all_reduce(xs[me].clone(), out, rop, sig)
                        check(f"all_reduce/{algo} {dtype} {op} n={numel}", out, want)
                        digests.append(out.view(torch.uint8).numpy().tobytes())
                    # reduce_scatter: numel elements per rank out
                    xs_rs = [_input(seed + 7, r, numel * n, dtype, nan=op in ("max", "min")) for r in range(n)]
                    full = _reduce_ref(xs_rs, op)
                    out = torch.empty(numel, dtype=dtype)
                    sig = Signature.of(OpCode.REDUCE_SCATTER, dtype=dtype, shape=(numel * n,), op=rop)
                    t.reduce_scatter(xs_rs[me], out, rop, sig)
                    check(f"reduce_scatter {dtype} {op} n={numel}", out, full[me * numel : (me + 1) * numel])
                # copy collectives (once per size and dtype)
                seed += 1
                xs = [_input(seed, r, numel, dtype) for r in range(n)]
                out = torch.empty(numel * n, dtype=dtype)
                t.all_gather(xs[me], out, Signature.of(OpCode.ALL_GATHER, dtype=dtype, shape=(numel,)))
                check(f"all_gather {dtype} n={numel}", out, torch.cat(xs))
                for root in {0, n - 1}:
                    out = torch.empty(numel, dtype=dtype)
                    t.broadcast(xs[me], out, root, Signature.of(OpCode.BROADCAST, dtype=dtype, shape=(numel,),
                                                                root=root))
                    check(f"broadcast {dtype} root={root} n={numel}", out, xs[root])
            # uneven all_to_all: rows of 3; a small and a multi-round exchange
            for scale in (4, 3 * BUF // (3 * item) // n):
                seed += 1
                g = torch.Generator().manual_seed(seed)
                counts = torch.randint(0, scale + 1, (n, n), generator=g).tolist()  # counts[src][dst]
                counts[0][n - 1] = 0  # an empty block
                sends = [_input(seed, r, sum(counts[r]) * 3, dtype) for r in range(n)]
                sig = Signature.of(OpCode.ALL_TO_ALL, dtype=dtype, shape=(0, 3), compare_first_dim=False,
                                   rows=sum(counts[me]))
                got = t.all_to_all(sends[me], counts[me], 3, lambda recv: torch.empty(sum(recv) * 3, dtype=dtype),
                                   sig)
                want = torch.cat([sends[s][sum(counts[s][:me]) * 3 : sum(counts[s][: me + 1]) * 3] for s in range(n)])
                check(f"all_to_all {dtype} scale={scale}", got, want)
    finally:
        t.close()
    return fails, digests


# What depends on the rank count (partitions, chunk windows, all_to_all tables) runs at 3 and 4 ranks
# for one float, bfloat16 and one integer type; what depends on the dtype alone (accumulators, the
# bfloat16 and float16 rounding, integer widths, every op's combiner) runs at 2 ranks for all of them.
# At 3 ranks the reductions take two ops each, avg (sum, then a division by 3) and max (NaN from one
# rank) for the floats, sum and min for int64; the slow tier's 4 ranks take every op. Every op runs at
# two sizes (_ops_at), the first op at the others. Under the interpreter on 2 cores the full matrix at
# 3 and 4 ranks took 3 minutes of the suite.
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_collective_dtype_op_and_size(ranks):
    dtypes = FLOATS + INTS if ranks == 2 else (torch.float32, torch.bfloat16, torch.int64)
    ops = (("avg", "max"), ("sum", "min")) if ranks == 3 else None
    results = run_ranks(_matrix, ranks, dtypes, ops, timeout=120.0)
    errors = [r[1] for r in results if r[0] != "ok"]
    assert not errors, errors
    fails = [f for r in results for f in r[1][0]]
    assert not fails, f"{len(fails)} failing cells:\n" + "\n".join(fails[:60])
    digests = [r[1][1] for r in results]
    assert all(d == digests[0] for d in digests), "all_reduce results differ across ranks"
    ops_of = (OPS, ("sum", "max", "min")) if ops is None else ops
    # one digest per all_reduce: (one- and two-shot) x (size, op) of every dtype
    assert len(digests[0]) == sum(2 * len(_ops_at(_sizes(ranks, 1), numel, ops_of[dt not in FLOATS]))
                                  for dt in dtypes for numel in _sizes(ranks, 1))


CALLS = 100  # sizes 1-7 in turn; EPOCH is an int64 that never wraps, so more calls check nothing new


def _long_run(group):
    from transports.ipc import IPCTransport
    from transports.kernels import layout as L

    t = IPCTransport(group, buffer_bytes=BUF, lamport_elems=0)  # the barrier one-shot, whose epochs we count
    bad = []
    try:
        start = t._regions.read(group.rank, L.EPOCH, 1)  # after creation's P2P probe (one all_gather)
        for i in range(CALLS):
            x = _input(i, group.rank, 1 + i % 7, torch.float32)
            xs = [_input(i, r, 1 + i % 7, torch.float32) for r in range(group.size)]
            out = torch.empty_like(x)
            sig = Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype, shape=x.shape, op=ReduceOp.SUM)
            t.all_reduce(x, out, ReduceOp.SUM, sig)
            if not _same(out, _reduce_ref(xs, "sum")):
                bad.append(i)
        epochs = (t._regions.read(group.rank, L.EPOCH, 1) - start).tolist()
    finally:
        t.close()
    return bad, epochs


def test_100_calls_keep_epochs_in_step():
    results = run_ranks(_long_run, 2, timeout=60.0)
    assert all(r[0] == "ok" for r in results), results
    for bad, epochs in (r[1] for r in results):
        assert bad == []
        assert epochs == [2 * CALLS]  # two barriers a call, advanced by the kernel only


def _killed_peer(group, victim):
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF)
    name = t._regions.name
    x = torch.randn(64)
    sig = Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype, shape=x.shape, op=ReduceOp.SUM)
    t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)  # everybody up
    if group.rank == victim:
        time.sleep(0.5)  # the others are inside the kernel by now
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)
        outcome = ("no error", "", [])
    except Exception as e:  # noqa: BLE001 - inspected by the test
        outcome = (type(e).__name__, str(e), getattr(e, "missing_ranks", None))
    waited = time.monotonic() - t0
    try:
        t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)
        later = "no error"
    except CommunicatorBrokenError:
        later = "broken"
    t.close()
    return outcome, waited, later, name


def test_sigkilled_peer_makes_the_others_raise_naming_it():
    results = run_ranks(_killed_peer, 3, 2, timeout=60.0)
    assert results[2][0] == "missing"
    for r in (0, 1):
        assert results[r][0] == "ok", results[r]
        (kind, msg, missing), waited, later, name = results[r][1]
        assert kind == "PeerFailedError", msg
        assert missing == [2] or "rank 2" in msg, msg
        assert waited < 10.0, waited  # well inside the 60 s timeout
        assert later == "broken"
        assert not os.path.exists(os.path.join("/dev/shm", name))
    assert not [f for f in os.listdir("/dev/shm") if f == results[0][1][3]]


def _stalled_or_closed(group, how, flags):
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF)
    x = torch.randn(16)
    sig = Signature.of(OpCode.ALL_GATHER, dtype=x.dtype, shape=x.shape)
    if group.rank == 1:
        if how == "close":
            t.close()
        else:
            wait_done(flags, [0])  # stalled: neither calls nor closes until rank 0 is done
            t.close()
        return None
    t0 = time.monotonic()
    try:
        t.all_gather(x, torch.empty(32), sig)
        return "no error", time.monotonic() - t0
    except (CollectiveTimeoutError, PeerFailedError) as e:
        return (type(e).__name__, str(e), e.missing_ranks), time.monotonic() - t0
    finally:
        mark_done(flags, 0)
        t.close()


@pytest.mark.parametrize("how", ["close", "stall"])
def test_closed_or_stalled_peer(how, tmp_path):
    results = run_ranks(_stalled_or_closed, 2, how, str(tmp_path), timeout=1.5)
    assert results[1][0] == "ok", results[1]
    assert results[0][0] == "ok", results[0]
    (kind, msg, missing), waited = results[0][1]
    if how == "close":
        assert kind == "PeerFailedError" and "rank 1 closed" in msg, msg
    else:
        assert kind == "CollectiveTimeoutError" and missing == [1], msg
        assert 1.4 < waited < 4.0, waited


def _closed_after_finishing(group):
    """Rank 0 completes a barrier and closes while rank 2 has not yet signalled rank 1.

    Rank 0's side of the barrier is written by hand (a real rank 0 is done once rank 2's flag to
    it lands, which can be before rank 2's flag to rank 1: rank 2 writes its peers in turn).
    """
    from transports.ipc import IPCTransport
    from transports.kernels import layout as L

    t = IPCTransport(group, buffer_bytes=BUF)
    sig = Signature.of(OpCode.BARRIER)
    me, n = group.rank, group.size
    try:
        if me == 0:
            r = t._regions
            e0 = r.read(0, L.EPOCH, t.programs)
            for p in range(t.programs):
                r.write(0, L.DIGEST + p, sig.value)
                for peer in range(1, n):
                    r.write(peer, L.FLAGS + p * L.MAX_RANKS + 0, int(e0[p]) + 2)
                r.write(0, L.EPOCH + p, int(e0[p]) + 2)
            return "closed"
        if me == 2:
            time.sleep(1.0)  # several watchdog periods after rank 0's close
        t.barrier(sig)
        return "passed"
    finally:
        t.close()


def test_a_peer_that_finished_the_call_and_closed_is_no_failure():
    results = run_ranks(_closed_after_finishing, 3, timeout=20.0)
    assert [r for r in results] == [("ok", "closed"), ("ok", "passed"), ("ok", "passed")], results


def _mismatch(group):
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF)
    out = []
    try:
        # shapes differ (rank 1 needs more chunks than rank 0)
        numel = 8 if group.rank == 0 else 3000
        x = torch.randn(numel)
        try:
            t.all_reduce(x, torch.empty_like(x), ReduceOp.SUM,
                         Signature.of(OpCode.ALL_REDUCE, dtype=x.dtype, shape=x.shape, op=ReduceOp.SUM))
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
        # different collectives
        try:
            if group.rank == 0:
                t.all_gather(x, torch.empty(numel * group.size), Signature.of(OpCode.ALL_GATHER, dtype=x.dtype,
                                                                              shape=x.shape))
            else:
                t.broadcast(x, torch.empty_like(x), 0, Signature.of(OpCode.BROADCAST, dtype=x.dtype, shape=x.shape))
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
        # still in step afterwards
        y = torch.full((5,), float(group.rank + 1))
        res = torch.empty_like(y)
        t.all_reduce(y, res, ReduceOp.SUM, Signature.of(OpCode.ALL_REDUCE, dtype=y.dtype, shape=y.shape,
                                                        op=ReduceOp.SUM))
        out.append(res.tolist())
    finally:
        t.close()
    return out


def test_signature_mismatch_raises_value_error_on_every_rank():
    results = run_ranks(_mismatch, 3, timeout=30.0)
    for r in results:
        assert r[0] == "ok", r
        shape_msg, op_msg, after = r[1]
        assert "shape differs" in shape_msg and "rank 0: (8)" in shape_msg and "rank 1: (3000)" in shape_msg
        assert "collective differs" in op_msg and "all_gather" in op_msg and "broadcast" in op_msg
        assert after == [6.0] * 5


def _recv_counts(group):
    """all_to_all with recv_counts= (the entry the communicator calls) against a plain one: the same
    rows and the same epoch advance (no barrier more), and a wrong count on the last rank raising
    ValueError on every rank before any data is read. Returns (failures, epochs of the failing calls)."""
    from transports._schedule import all_to_all_pulls
    from transports.ipc import IPCTransport
    from transports.kernels import layout as L

    t = IPCTransport(group, buffer_bytes=BUF)
    n, me, bad = group.size, group.rank, group.size - 1
    fails: list[str] = []
    failing_epochs: list[int] = []

    def epoch() -> int:
        return int(t._regions.read(me, L.EPOCH, 1)[0])

    allocated: list[list[int]] = []  # the receive counts of each output allocation of the last call

    def call(send, counts, recv_counts=None):
        """(rows, epoch advance) of one all_to_all (recv_counts: through all_to_all_with_recv_counts)."""
        allocated.clear()

        def alloc(recv):
            allocated.append(list(recv))
            return torch.empty(sum(recv) * 3)
        sig = Signature.of(OpCode.ALL_TO_ALL, dtype=send.dtype, shape=(0, 3), compare_first_dim=False,
                           rows=sum(counts[me]), root=int(recv_counts is not None))
        e0 = epoch()
        if recv_counts is None:
            y = t.all_to_all(send, counts[me], 3, alloc, sig)
        else:
            y = t.all_to_all_with_recv_counts(send, counts[me], recv_counts, 3, alloc, sig)
        return y, epoch() - e0

    try:
        for seed, scale in ((41, 4), (42, BUF // 12)):  # one round; several rounds of the 4 KiB buffer
            g = torch.Generator().manual_seed(seed)
            counts = torch.randint(0, scale + 1, (n, n), generator=g).tolist()  # counts[src][dst]
            counts[0][n - 1] = 0  # an empty block
            sends = [_input(seed, r, sum(counts[r]) * 3, torch.float32) for r in range(n)]
            want = torch.cat([sends[s][sum(counts[s][:me]) * 3 : sum(counts[s][: me + 1]) * 3] for s in range(n)])
            rc = [counts[s][me] for s in range(n)]
            plain, plain_epochs = call(sends[me], counts)
            rounds = len(all_to_all_pulls(counts, me, 12, BUF))  # 12: bytes of a row
            if plain_epochs != 2 * rounds or (scale > 4) != (rounds > 1):
                fails.append(f"scale {scale}: a plain call of {rounds} round(s) advanced the epoch by {plain_epochs}")
            given, given_epochs = call(sends[me], counts, rc)
            if not torch.equal(plain, want) or not torch.equal(given, want):
                fails.append(f"scale {scale}: rows differ from the reference (plain {torch.equal(plain, want)})")
            if allocated != [rc]:
                fails.append(f"scale {scale}: allocated {allocated}, expected {[rc]}")
            if given_epochs != plain_epochs:
                fails.append(f"scale {scale}: recv_counts advanced the epoch by {given_epochs}, a plain call "
                             f"by {plain_epochs} (a barrier more)")
            bad_rc = [counts[s][bad] for s in range(n)]
            wrong = [c + 1 if s == 0 else c for s, c in enumerate(bad_rc)]
            try:
                _, e = call(sends[me], counts, wrong if me == bad else rc)
                fails.append(f"scale {scale}: a wrong count on rank {bad} did not raise (advanced {e})")
            except ValueError as err:
                if f"rank {bad} passed recv_counts {wrong} but its peers send it {bad_rc}" not in str(err):
                    fails.append(f"scale {scale}: wrong count: {str(err)[:300]}")
                if allocated:
                    fails.append(f"scale {scale}: wrong count: allocated {allocated} (read data) before raising")
                failing_epochs.append(epoch())
            after, after_epochs = call(sends[me], counts, rc)  # still in step
            if not torch.equal(after, want) or after_epochs != plain_epochs:
                fails.append(f"scale {scale}: the call after the error differs (epochs {after_epochs})")
    finally:
        t.close()
    return fails, failing_epochs


def test_recv_counts_taken_natively_no_extra_barrier_and_a_wrong_count_raises_everywhere():
    results = run_ranks(_recv_counts, 3, timeout=60.0)
    assert all(r[0] == "ok" for r in results), results
    assert [f for r in results for f in r[1][0]] == []
    epochs = [r[1][1] for r in results]
    assert len(epochs[0]) == 2 and all(e == epochs[0] for e in epochs), epochs  # in step after raising


def _other_dtypes(group):
    """float64, uint8, bool and prod: the dtypes and op the communicator also hands to transports."""
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF)
    n, me = group.size, group.rank
    fails = []
    cases = [(torch.float64, "sum"), (torch.float64, "prod"), (torch.float64, "max"), (torch.float32, "prod"),
             (torch.int64, "prod"), (torch.uint8, "sum"), (torch.uint8, "max"), (torch.bool, "max"),
             (torch.bool, "min")]
    try:
        for i, (dtype, op) in enumerate(cases):
            g = [torch.Generator().manual_seed(i * 10 + r) for r in range(n)]
            if dtype == torch.bool:
                xs = [torch.rand(700, generator=g[r]) < 0.5 for r in range(n)]
            elif dtype == torch.uint8:
                xs = [torch.randint(0, 256, (700,), generator=g[r], dtype=dtype) for r in range(n)]
            elif dtype.is_floating_point:
                xs = [torch.rand(700, generator=g[r], dtype=dtype) + 0.5 for r in range(n)]
            else:
                xs = [torch.randint(-3, 4, (700,), generator=g[r], dtype=dtype) for r in range(n)]
            fn = {"sum": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}[op]
            acc = xs[0].to(torch.float32 if dtype == torch.float32 else xs[0].dtype)
            for x in xs[1:]:
                acc = fn(acc, x)
            want = acc.to(dtype)
            out = torch.empty_like(xs[me])
            rop = ReduceOp.parse(op)
            t.all_reduce(xs[me], out, rop, Signature.of(OpCode.ALL_REDUCE, dtype=dtype, shape=(700,), op=rop))
            if not torch.equal(out, want):
                fails.append(f"{dtype} {op}")
    finally:
        t.close()
    return fails


def test_float64_uint8_bool_and_prod():
    results = run_ranks(_other_dtypes, 2, timeout=60.0)
    assert all(r[0] == "ok" for r in results), results
    assert [f for r in results for f in r[1]] == []


def _through_the_communicator(comm):
    """Every collective of a communicator whose calls go to ipc (launched with transport="ipc")."""
    n, me = comm.size, comm.rank
    g = torch.Generator().manual_seed(me)
    x = torch.randn(300, generator=g)
    xs = [torch.randn(300, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    plans = [str(comm.plan(c, x)) for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")]
    got = {
        "all_reduce": torch.equal(comm.all_reduce(x), _reduce_ref(xs, "sum")),
        "all_gather": torch.equal(comm.all_gather(x).reshape(-1), torch.cat(xs)),
        "broadcast": torch.equal(comm.broadcast(x, src=n - 1), xs[n - 1]),
        "all_to_all": torch.equal(comm.all_to_all(x[: 2 * n], [2] * n),
                                  torch.cat([xs[s][2 * me : 2 * me + 2] for s in range(n)])),
    }
    return plans, got


def test_launch_with_transport_ipc():
    import collectives

    results = collectives.launch(_through_the_communicator, 2, transport="ipc", options={"ipc_emulate": 1},
                                 timeout=60.0)
    for plans, got in results:
        assert all("-> ipc/" in p for p in plans), plans
        assert "ipc/lamport" in plans[0]  # 1200 B of float32: the Lamport one-shot
        assert all(got.values()), got


def _auto_keeps_shm_for_cpu(comm):
    x = torch.arange(10, dtype=torch.float32) + comm.rank
    auto = str(comm.plan("all_reduce", x))
    via = comm.using("ipc")
    forced = str(via.plan("all_reduce", x))
    return auto, forced, via.all_reduce(x).tolist()


def test_auto_chooses_shm_for_cpu_and_using_ipc_routes_to_ipc():
    import collectives

    results = collectives.launch(_auto_keeps_shm_for_cpu, 2, options={"ipc_emulate": 1}, timeout=60.0)
    for auto, forced, value in results:
        assert "-> shm/" in auto, auto
        assert "-> ipc/lamport" in forced, forced
        assert value == [float(2 * i + 1) for i in range(10)]


def test_init_with_transport_ipc_and_the_emulation_variable():
    import subprocess
    import sys

    code = ("import torch, collectives\n"
            "comm = collectives.init(transport='ipc')\n"
            "x = torch.arange(5, dtype=torch.float32)\n"
            "print(comm.plan('all_reduce', x)); print(comm.all_reduce(x).tolist()); comm.close()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOECOMM_", "TRITON_"))}
    env.update(MOECOMM_IPC_EMULATE="1", MOECOMM_LAUNCH="single", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "-> ipc/lamport" in proc.stdout and "[0.0, 1.0, 2.0, 3.0, 4.0]" in proc.stdout, proc.stdout
    env.pop("MOECOMM_IPC_EMULATE")  # without it ipc serves CUDA tensors only: not here
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "'ipc' is not available" in proc.stderr, proc.stderr[-2000:]


def _multi_program(group):
    """3 programs of 64-element tiles per launch: each program meets only the same program of its
    peers, and tiles are spread over programs the same way when staged and when read."""
    from transports.ipc import IPCTransport

    t = IPCTransport(group, buffer_bytes=BUF, programs=3, block=64)
    n, me = group.size, group.rank
    fails = []
    try:
        for numel in (1, 37, 5 * n + 1, 1500):
            for limit in (1 << 62, 0):  # fresh inputs each time: stale buffer contents must not pass
                xs = [_input(numel + limit % 7, r, numel, torch.bfloat16) for r in range(n)]
                t.one_shot_max = limit
                out = torch.empty(numel, dtype=torch.bfloat16)
                t.all_reduce(xs[me], out, ReduceOp.SUM,
                             Signature.of(OpCode.ALL_REDUCE, dtype=out.dtype, shape=(numel,), op=ReduceOp.SUM))
                if not _same(out, _reduce_ref(xs, "sum")):
                    fails.append(f"all_reduce limit={limit} n={numel}")
            ys = [_input(numel + 1, r, numel * n, torch.float32) for r in range(n)]
            out = torch.empty(numel)
            t.reduce_scatter(ys[me], out, ReduceOp.MAX,
                             Signature.of(OpCode.REDUCE_SCATTER, dtype=out.dtype, shape=(numel * n,), op=ReduceOp.MAX))
            if not _same(out, _reduce_ref(ys, "max")[me * numel : (me + 1) * numel]):
                fails.append(f"reduce_scatter n={numel}")
            out = torch.empty(numel * n, dtype=torch.bfloat16)
            t.all_gather(xs[me], out, Signature.of(OpCode.ALL_GATHER, dtype=out.dtype, shape=(numel,)))
            if not _same(out, torch.cat(xs)):
                fails.append(f"all_gather n={numel}")
    finally:
        t.close()
    return fails


def test_several_programs_per_launch():
    results = run_ranks(_multi_program, 3, timeout=60.0)
    assert all(r[0] == "ok" for r in results), results
    assert [f for r in results for f in r[1]] == []
