"""Every collective x transport x dtype x op against a NumPy reference, on 2, 3 and 4 ranks.

Each grid cell (collective, dtype, op, shape) is checked on its own and failures are collected:
a test reports every failing cell, not just the first one.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from spmd import assert_reduced, rank_input, run, transports_under_test

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8,
          torch.bool]
# 0, 1, odd, not divisible by 3 or 4, past the one-shot limit, several slot rounds with a small slot
SIZES = [0, 1, 7, 1001, 70_001]
SMALL_SLOT = 64 << 10


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["max", "min"]
    if dtype.is_floating_point:
        return ["sum", "avg", "max", "min", "prod"]
    return ["sum", "max", "min", "prod"]


def _digest(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _small_slot(comm):
    """A sub-communicator over the same ranks whose shm slots are small, so messages take many rounds."""
    sub = comm.split(0, options={"shm_slot_bytes": SMALL_SLOT})
    assert "shm" not in sub.transports or sub.transports["shm"].slot_bytes == SMALL_SLOT
    return sub


class Cells:
    """The grid cells one rank checked, and the failures among them (cell name: what went wrong)."""

    def __init__(self, comm):
        self.comm = comm
        self.names: list[str] = []
        self.digests: list[int] = []
        self.failures: list[str] = []

    def check(self, name: str, fn, result: torch.Tensor | None = None) -> None:
        """Run the assertions of one cell; a failure is recorded and the next cell runs."""
        self.names.append(name)
        self.digests.append(_digest(result) if result is not None else 0)
        try:
            fn()
        except AssertionError as e:
            detail = str(e).split("\nassert")[0]  # drop pytest's rewritten-expression tail
            detail = detail[len(name):].lstrip(": ") if detail.startswith(name) else detail
            self.failures.append(f"rank {self.comm.rank}: {name}: {detail}")

    def report(self) -> tuple[int, list[str]]:
        """(cells checked, failures), including cells whose result bits differ across ranks."""
        mine = torch.tensor(self.digests, dtype=torch.int64)
        everyone = self.comm.all_gather(mine.reshape(1, -1))
        for i in torch.nonzero((everyone != mine).any(dim=0)).flatten().tolist():
            self.failures.append(f"rank {self.comm.rank}: {self.names[i]}: ranks got different bits")
        return len(self.names), self.failures


def assert_cells_pass(results: list[tuple[int, list[str]]], min_cells: int = 1) -> None:
    """Fail with every failing cell of every rank listed."""
    checked = results[0][0]
    failures = [f for _, fs in results for f in fs]
    assert checked >= min_cells, f"only {checked} cells checked"
    assert not failures, f"{len(failures)} failures in {checked} cells x {len(results)} ranks:\n" + "\n".join(
        failures[:200])


def _body_all_reduce(comm, seed: int, small_slot: bool):
    c = _small_slot(comm) if small_slot else comm
    n, r = c.size, c.rank
    cells = Cells(c)
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for numel in SIZES:
                shape = (numel,) if numel < 100 else (numel // 7, 7) if numel % 7 == 0 else (numel,)
                xs = [rank_input("ar", i, shape, dtype, seed) for i in range(n)]
                if op == "prod" and dtype.is_floating_point:
                    xs = [(x.double() * 0.25 + 1).to(dtype) for x in xs]  # keep products finite
                y = c.all_reduce(xs[r].clone(), op=op)
                what = f"all_reduce {dtype} {op} {shape} on {n} ranks"
                cells.check(what, lambda: assert_reduced(y, xs, op, what), y)
    return cells.report()


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_all_reduce(nprocs, transport):
    assert_cells_pass(run(_body_all_reduce, nprocs, 11, False, transport=transport), min_cells=100)


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_all_reduce_many_rounds(transport):
    assert_cells_pass(run(_body_all_reduce, 2, 12, True, transport=transport), min_cells=100)


def _body_gather_scatter(comm, seed: int, small_slot: bool):
    c = _small_slot(comm) if small_slot else comm
    n, r = c.size, c.rank
    cells = Cells(c)
    for dtype in DTYPES:
        for rows in [0, 1, 5, 2003]:
            for rest in [(), (3,)]:
                shape = (rows, *rest)
                xs = [rank_input("ag", i, shape, dtype, seed) for i in range(n)]
                y = c.all_gather(xs[r])
                cells.check(f"all_gather {dtype} {shape}", lambda: _assert_equal(y, torch.cat(xs)), y)
                # broadcast from every source
                for src in range(n):
                    b = c.broadcast(xs[r], src=src)
                    cells.check(f"broadcast {dtype} {shape} src {src}", lambda: _assert_equal(b, xs[src]), b)
                # reduce_scatter of [n * rows, *rest]
                big = (n * rows, *rest)
                xs2 = [rank_input("rs", i, big, dtype, seed) for i in range(n)]
                for op in ops_for(dtype)[:3]:
                    z = c.reduce_scatter(xs2[r], op=op)
                    blocks = [x[r * rows : (r + 1) * rows] for x in xs2]
                    what = f"reduce_scatter {dtype} {op} {big}"
                    cells.check(what, lambda: assert_reduced(z, blocks, op, what))  # blocks differ per rank
    return cells.report()


def _assert_equal(got: torch.Tensor, expect: torch.Tensor) -> None:
    assert got.dtype == expect.dtype and got.shape == expect.shape, \
        f"got {got.dtype} {tuple(got.shape)}, expected {expect.dtype} {tuple(expect.shape)}"
    if not torch.equal(got, expect):
        wrong = (got != expect).reshape(-1).nonzero().flatten()
        assert False, f"{wrong.numel()} of {got.numel()} elements differ, first at flat index {wrong[0].item()}"


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_all_gather_broadcast_reduce_scatter(nprocs, transport):
    assert_cells_pass(run(_body_gather_scatter, nprocs, 21, False, transport=transport), min_cells=100)


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_gather_scatter_many_rounds(transport):
    assert_cells_pass(run(_body_gather_scatter, 3, 22, True, transport=transport), min_cells=100)


def _send_counts(n: int, src: int, case: int, seed: int) -> list[int]:
    """Uneven counts with zeros; any rank can compute any rank's counts."""
    g = np.random.default_rng([seed, case, src])
    counts = g.integers(0, 40, size=n)
    counts[g.integers(0, n)] = 0
    if case % 4 == 0:
        counts[:] = 0  # this case: nobody sends anything
    if case % 4 == 1 and src == 0:
        counts[:] = 0  # rank 0 sends nothing
    if case % 4 == 2:
        counts = counts * 0 + (np.arange(n) == 1) * 5000  # everyone sends only to rank 1, several rounds
    return counts.tolist()


def _body_all_to_all(comm, seed: int, small_slot: bool):
    c = _small_slot(comm) if small_slot else comm
    n, r = c.size, c.rank
    cells = Cells(c)
    for dtype in DTYPES:
        for case in range(8):
            rest = (3, 2) if case % 2 else ()
            counts = [_send_counts(n, i, case, seed) for i in range(n)]
            xs = [rank_input("a2a", i, (sum(counts[i]), *rest), dtype, seed + case) for i in range(n)]
            y, rc = c.all_to_all(xs[r], counts[r], return_counts=True)
            offs = [np.concatenate([[0], np.cumsum(counts[i])]) for i in range(n)]
            expect = torch.cat([xs[i][offs[i][r] : offs[i][r + 1]] for i in range(n)])
            cells.check(f"all_to_all {dtype} case {case} counts {counts[r]}", lambda: _assert_equal(y, expect))
            cells.check(f"all_to_all {dtype} case {case} recv_counts",
                        lambda: _assert_equal(rc, torch.tensor([counts[i][r] for i in range(n)])))
        # equal split with send_counts=None
        x = rank_input("a2a-even", r, (2 * n, 4), dtype, seed)
        y = c.all_to_all(x)
        expect = torch.cat([rank_input("a2a-even", i, (2 * n, 4), dtype, seed)[2 * r : 2 * r + 2] for i in range(n)])
        cells.check(f"all_to_all {dtype} even split", lambda: _assert_equal(y, expect))
    return cells.report()


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_all_to_all_uneven(nprocs, transport):
    assert_cells_pass(run(_body_all_to_all, nprocs, 31, False, transport=transport), min_cells=100)


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_all_to_all_many_rounds(transport):
    assert_cells_pass(run(_body_all_to_all, 2, 32, True, transport=transport), min_cells=100)


def _body_large(comm, seed: int):
    """8 MiB messages through every collective (float32 and bfloat16): many rounds of the 1 MiB staging
    slots, and per-rank blocks past the single-copy sizes (1 MiB all_gather, 2 MiB all_to_all)."""
    n, r = comm.size, comm.rank
    numel = (2 << 20) + 3  # 8 MiB + 12 B of float32
    for dtype in (torch.float32, torch.bfloat16):
        xs = [rank_input("big", i, (numel,), dtype, seed) for i in range(n)]
        assert_reduced(comm.all_reduce(xs[r]), xs, "sum", f"all_reduce large {dtype}")
        rows = numel // n
        assert torch.equal(comm.all_gather(xs[r][:rows]), torch.cat([x[:rows] for x in xs]))
        z = comm.reduce_scatter(xs[r][: rows * n])
        assert_reduced(z, [x[r * rows : (r + 1) * rows] for x in xs], "sum", "reduce_scatter large")
        counts = [rows // 3] * n
        counts[(r + 1) % n] += numel - sum(counts)  # uneven: one destination gets the rest
        allc = []
        for i in range(n):
            ci = [rows // 3] * n
            ci[(i + 1) % n] += numel - sum(ci)
            allc.append(ci)
        y = comm.all_to_all(xs[r], counts)
        offs = [np.concatenate([[0], np.cumsum(c)]) for c in allc]
        assert torch.equal(y, torch.cat([xs[i][offs[i][r] : offs[i][r + 1]] for i in range(n)]))
        assert torch.equal(comm.broadcast(xs[r], src=n - 1), xs[n - 1])
    return True


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
@pytest.mark.parametrize("nprocs", [2, 3])
def test_large_messages(nprocs, transport):
    run(_body_large, nprocs, 41, transport=transport)


def _body_layouts(comm, seed: int):
    """NumPy in/out, non-contiguous inputs, out= (contiguous, strided, in place), 0-d tensors."""
    n, r = comm.size, comm.rank
    xs = [rank_input("lay", i, (6, 10), torch.float32, seed) for i in range(n)]
    ref = sum(x.double() for x in xs).float()
    # NumPy in -> NumPy out
    y = comm.all_reduce(xs[r].numpy())
    assert isinstance(y, np.ndarray) and np.allclose(y, ref.numpy(), rtol=1e-6, atol=1e-6)
    g = comm.all_gather(xs[r].numpy())
    assert isinstance(g, np.ndarray) and np.array_equal(g, torch.cat(xs).numpy())
    # non-contiguous input (transpose) and a NumPy view with negative strides
    yt = comm.all_reduce(xs[r].t())
    assert torch.allclose(yt, ref.t(), rtol=1e-6, atol=1e-6)
    yn = comm.all_reduce(xs[r].numpy()[::-1])
    assert np.allclose(yn, ref.numpy()[::-1], rtol=1e-6, atol=1e-6)
    # out=: contiguous, strided, in place
    out = torch.empty(6, 10)
    assert comm.all_reduce(xs[r], out=out) is out and torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    strided = torch.empty(10, 6).t()
    assert comm.all_reduce(xs[r], out=strided) is strided and torch.allclose(strided, ref, rtol=1e-6, atol=1e-6)
    inplace = xs[r].clone()
    assert comm.all_reduce(inplace, out=inplace) is inplace and torch.allclose(inplace, ref, rtol=1e-6, atol=1e-6)
    outg = torch.empty(6 * n, 10)
    assert comm.all_gather(xs[r], out=outg) is outg and torch.equal(outg, torch.cat(xs))
    npout = np.empty((6, 10), dtype=np.float32)
    assert comm.broadcast(xs[r].numpy(), src=0, out=npout) is npout and np.array_equal(npout, xs[0].numpy())
    # out= that overlaps the input goes through a temporary; the result is still right
    buf = torch.empty(n * 60)
    buf[:60] = xs[r].reshape(-1)
    res = comm.all_gather(buf[:60].view(6, 10), out=buf.view(6 * n, 10))
    assert torch.equal(res, torch.cat(xs))
    # 0-d tensors
    s = torch.tensor(float(r + 1))
    assert comm.all_reduce(s).item() == n * (n + 1) / 2
    assert comm.all_gather(s).tolist() == [float(i + 1) for i in range(n)]
    # requires_grad inputs are detached, not rejected
    w = xs[r].clone().requires_grad_(True)
    assert not comm.all_reduce(w).requires_grad
    return True


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_layouts_numpy_out_and_noncontiguous(transport):
    run(_body_layouts, 2, 51, transport=transport)


def _body_inplace_all_to_all(comm, seed: int):
    """all_to_all with out=x, repeated: fresh data every call, sizes that grow and shrink. shm exchanges
    in place (these sizes stage in one round); other transports send from a kept copy of x on the host,
    copied afresh above the kept buffer's bound. Returns whether that copy was ever made."""
    from collectives import _all_to_all

    n, r = comm.size, comm.rank
    _all_to_all.INPLACE_SCRATCH_MAX_BYTES = 40 * 1000 * 8  # this process: the 50-row case is copied afresh
    for step, rows in enumerate([3, 7, 50, 2, 7, 50, 7]):
        for again in range(3):  # the first call makes the plan, the others take the latency path
            tag = seed + 10 * step + again
            x = rank_input("a2a-ip", r, (rows * n, 8), torch.float64, tag)
            got = comm.all_to_all(x, out=x)
            want = torch.cat([rank_input("a2a-ip", s, (rows * n, 8), torch.float64, tag)[r * rows : (r + 1) * rows]
                              for s in range(n)])
            assert got is x and torch.equal(x, want), f"rank {r}, {rows} rows, call {again}"
    # uneven counts whose blocks sit elsewhere in out than in x (rank s sends k[(d - s) % n] rows to d, so it
    # receives as many as it sends): a transport exchanging in place must move its own block first
    for step, k in enumerate([(1, 2, 4, 3), (5, 0, 3, 9), (300, 7, 1200, 40)]):
        counts = [[k[(d - s) % n] for d in range(n)] for s in range(n)]
        for again in range(3):
            tag = seed + 100 + 10 * step + again
            inputs = [rank_input("a2a-ip-uneven", s, (sum(counts[s]), 5), torch.float32, tag) for s in range(n)]
            x = inputs[r].clone()
            got = comm.all_to_all(x, counts[r], out=x)
            want = torch.cat([inputs[s][sum(counts[s][:r]) : sum(counts[s][: r + 1])] for s in range(n)])
            assert got is x and torch.equal(x, want), f"rank {r}, counts {counts}, call {again}"
    return comm._inplace_scratch is not None


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_in_place_all_to_all_repeated(transport):
    copied = run(_body_inplace_all_to_all, 3, 57, transport=transport)
    assert not any(copied) if transport.startswith("shm") else all(copied), copied


def _body_repeated_small(comm, seed: int):
    """Small calls repeated with fresh data (the first makes the cached entry, the others take the
    latency path: on shm with the compiled helper a call by addresses), out of place, into out=,
    without out= and in nccl-tests' in-place layouts; against a torch reference in float64."""
    n, r = comm.size, comm.rank
    for step in range(3):
        tag = seed + step
        for dtype, ops in ((torch.float32, ("sum", "max", "avg")), (torch.int32, ("sum", "min", "prod"))):
            xs = [rank_input("small", i, (5 * n,), dtype, tag) for i in range(n)]
            for op in ops:
                stacked = torch.stack([x.double() for x in xs])
                want = {"sum": stacked.sum(0), "avg": stacked.mean(0), "prod": stacked.prod(0),
                        "max": stacked.max(0).values, "min": stacked.min(0).values}[op]
                got = comm.all_reduce(xs[r], op=op)
                out = torch.empty_like(xs[r])
                assert comm.all_reduce(xs[r], op=op, out=out) is out and torch.equal(out, got)
                inplace = xs[r].clone()
                comm.all_reduce(inplace, op=op, out=inplace)
                assert torch.equal(inplace, got)
                assert torch.allclose(got.double(), want.to(got.dtype).double(), rtol=1e-5, atol=1e-5), (op, dtype)
                block = comm.reduce_scatter(xs[r], op=op)
                assert torch.equal(block, got[r * 5 : (r + 1) * 5]), (op, dtype)
                whole = xs[r].clone()  # in place: out is this rank's block of x
                comm.reduce_scatter(whole, op=op, out=whole[r * 5 : (r + 1) * 5])
                assert torch.equal(whole[r * 5 : (r + 1) * 5], block)
            gathered = torch.empty(n * 5 * n, dtype=dtype)
            assert comm.all_gather(xs[r], out=gathered) is gathered and torch.equal(gathered, torch.cat(xs))
            buf = torch.empty(n * 5 * n, dtype=dtype)
            buf[r * 5 * n : (r + 1) * 5 * n] = xs[r]  # in place: x is this rank's block of out
            comm.all_gather(buf[r * 5 * n : (r + 1) * 5 * n], out=buf)
            assert torch.equal(buf, torch.cat(xs)) and torch.equal(comm.all_gather(xs[r]), buf)
            # all_to_all of an even split: rows [s * 5, s * 5 + 5) of rank s's x arrive from s
            a2a_want = torch.cat([x.view(n, 5)[r] for x in xs])
            a2a_out = torch.empty_like(xs[r])
            assert comm.all_to_all(xs[r], out=a2a_out) is a2a_out and torch.equal(a2a_out, a2a_want)
            assert torch.equal(comm.all_to_all(xs[r]), a2a_want)
            assert torch.equal(comm.all_to_all(xs[r], [5] * n), a2a_want)  # the even counts, given
    shm = comm.transports.get("shm")
    by_address = [e.by_address is not None for key, e in comm._cpu_cache.items() if key[0].name != "ALL_TO_ALL"]
    by_address += [plan.even_by_address is not None for plan in comm._a2a_plans.values()]
    return getattr(shm, "native_status", None), by_address


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_small_calls_repeated(transport):
    res = run(_body_repeated_small, 3, 59, transport=transport)
    for native, by_address in (res if isinstance(res, list) else res.values()):
        if native == "compiled helper" and transport == "shm":  # "always" single copy has no latency path
            assert by_address and all(by_address), by_address  # every small host call went by address


def _body_split(comm, seed: int):
    n, r = comm.size, comm.rank
    color = r % 2
    sub = comm.split(color, key=-r)  # key reverses the order inside each group
    members = [i for i in range(n) if i % 2 == color]
    assert sub.size == len(members)
    assert sub.rank == sorted(members, key=lambda i: -i).index(r)
    assert sub.global_ranks == sorted(members, key=lambda i: -i)
    none = comm.split(None if r == 0 else 1)
    assert (none is None) if r == 0 else (none.size == n - 1)
    # the parent and the sub-communicators used alternately
    for step in range(20):
        x = rank_input("split", r, (17 + step,), torch.float64, seed + step)
        xs = [rank_input("split", i, (17 + step,), torch.float64, seed + step) for i in range(n)]
        total = comm.all_reduce(x)
        assert torch.allclose(total, sum(xs))
        part = sub.all_reduce(x)
        assert torch.allclose(part, sum(xs[i] for i in members))
        g = sub.all_gather(x)
        assert torch.equal(g, torch.cat([xs[i] for i in sorted(members, key=lambda i: -i)]))
        if none is not None:
            none.barrier()
    sub.close()
    if none is not None:
        none.close()
    return sub.global_ranks


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
@pytest.mark.parametrize("nprocs", [3, 4])
def test_split_subgroups(nprocs, transport):
    run(_body_split, nprocs, 61, transport=transport)


def _body_soak(comm, seed: int, calls: int):
    """Back-to-back mixed calls of random sizes: no corruption, no desynchronisation."""
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(seed)  # same stream on every rank: same sequence of calls
    for i in range(calls):
        kind = rng.integers(0, 5)
        numel = int(rng.choice([0, 1, 3, 100, 4097, 60_000]))
        dtype = [torch.float32, torch.int32, torch.bfloat16][rng.integers(0, 3)]
        xs = [rank_input("soak", j, (numel * n,), dtype, seed + i) for j in range(n)]
        if kind == 0:
            assert_reduced(comm.all_reduce(xs[r]), xs, "sum", f"call {i}")
        elif kind == 1:
            assert torch.equal(comm.all_gather(xs[r]), torch.cat(xs)), f"call {i}"
        elif kind == 2:
            assert_reduced(comm.reduce_scatter(xs[r], op="max"), [x[r * numel : (r + 1) * numel] for x in xs],
                           "max", f"call {i}")
        elif kind == 3:
            assert torch.equal(comm.all_to_all(xs[r]), torch.cat([x[r * numel : (r + 1) * numel] for x in xs]))
        else:
            src = int(rng.integers(0, n))
            assert torch.equal(comm.broadcast(xs[r], src=src), xs[src]), f"call {i}"
    return calls


@pytest.mark.parametrize("transport", transports_under_test(shm_paths=True))
def test_500_mixed_calls(transport):
    assert run(_body_soak, 2, 71, 500, transport=transport)[0] == 500


def test_500_mixed_calls_oversubscribed():
    """4 ranks on this 2-core machine: waits must yield, not spin the peers off their cores."""
    assert run(_body_soak, 4, 72, 500)[0] == 500


def _body_plan(comm):
    x = torch.randn(1000)
    p = comm.plan("all_reduce", x)
    assert p.transport in comm.transports and p.algorithm in ("one_shot", "two_shot", "Iallreduce")
    big = comm.plan("all_reduce", torch.empty(1 << 22))
    return str(p), p.algorithm, big.algorithm, sorted(comm.transports)


def test_plan_reports_transport_and_algorithm():
    res = run(_body_plan, 4)
    text, small, big, names = res[0]
    assert "shm" in names
    assert small == "one_shot" and big == "two_shot", res
    assert "all_reduce of 4000 B -> shm/one_shot" in text


def _body_all_to_all_repeated(comm):
    """The second call of a signature takes the communicator's fast path: same results, same checks."""
    n, r = comm.size, comm.rank
    counts = [(r + d) % 3 + 1 for d in range(n)]
    x = rank_input("a2a-rep", r, (sum(counts), 3), torch.float32, 5)
    first = comm.all_to_all(x, send_counts=counts)
    for _ in range(2):
        again = comm.all_to_all(x, send_counts=counts)
        assert torch.equal(again, first) and again.shape == first.shape
        out = torch.empty_like(first)
        assert comm.all_to_all(x, send_counts=counts, out=out) is out and torch.equal(out, first)
    wrong = torch.empty(first.shape[0] + 1, 3)
    with pytest.raises(ValueError, match=f"out has {first.shape[0] + 1} rows but rank {r} received"):
        comm.all_to_all(x, send_counts=counts, out=wrong)
    even = rank_input("a2a-even", r, (2 * n, 3), torch.float32, 5)
    ref = comm.all_to_all(even.clone())
    assert torch.equal(comm.all_to_all(even), ref)
    # even splits of different row counts per rank: a rank receives more or fewer rows than it sends,
    # so the output guessed from x's shape is wrong there (and right on the rank in the middle)
    rows = (r + 1) * n
    uneven = rank_input("a2a-even-rows", r, (rows,), torch.float64, 5)
    want = torch.cat([rank_input("a2a-even-rows", s, ((s + 1) * n,), torch.float64, 5)[r * (s + 1) : (r + 1) * (s + 1)]
                      for s in range(n)])
    for _ in range(3):
        assert torch.equal(comm.all_to_all(uneven), want)
        out = torch.empty(want.shape[0], dtype=torch.float64)
        assert comm.all_to_all(uneven, out=out) is out and torch.equal(out, want)
    with pytest.raises(ValueError, match=f"out has {rows} rows but rank {r} received {want.shape[0]}"
                       if rows != want.shape[0] else "out has"):
        comm.all_to_all(uneven, out=torch.empty(rows + (rows == want.shape[0]), dtype=torch.float64))
    return first.shape[0]


@pytest.mark.parametrize("transport", transports_under_test())
def test_all_to_all_repeated_calls_keep_results_and_checks(transport):
    run(_body_all_to_all_repeated, 3, transport=transport)
