"""The moecomm torch.distributed backend against what torch callers (and PyTorch's own suite) expect:
all_gather_coalesced's output layout, mismatches hidden by moving data as bytes or by running
reduce as an all-reduce, all_to_all_single on 16- and 32-bit integers moved as bytes, sparse
all_reduce (as gloo: DDP with sparse embeddings), and a timeout message that torch callers match.

One launch per rank count runs every check; each check reports on its own, so one failure does not
hide another. PyTorch's own suite over moecomm: tests/test_torch_dist_suite.py (opt-in, slow).
"""

from __future__ import annotations

import datetime
import functools
import operator
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from spmd import outcome

import collectives


def _all_gather_coalesced(r: int, n: int) -> None:
    """torch passes output_tensor_lists[rank][i]: rank's copy of input i."""
    inputs = [torch.full((2,), float(10 * r + 1)), torch.full((3, 2), float(10 * r + 2)), torch.tensor(float(r + 3))]
    outs = [[torch.empty_like(x) for x in inputs] for _ in range(n)]
    dist.all_gather_coalesced(outs, inputs)
    for q in range(n):
        for i, x in enumerate(inputs):
            assert torch.equal(outs[q][i], torch.full_like(x, float(10 * q + i + 1) if i < 2 else q + 3)), \
                f"output_tensor_lists[{q}][{i}] = {outs[q][i]}"


def _reduce_dst_mismatch(r: int, n: int) -> None:
    """dst differs on one rank: ValueError on every rank naming the ranks and both dsts; nothing lost."""
    dst = n - 1 if r == 0 else 0
    kind, msg = outcome(lambda: dist.reduce(torch.ones(4), dst=dst))
    assert kind == "ValueError", (kind, msg)
    assert "rank 0" in msg and f"rank {n - 1}" in msg and "dst" in msg and "reduce" in msg, msg
    assert f"rank 0: {n - 1}" in msg and "rank 1: 0" in msg, msg
    y = torch.ones(3)
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((3,), float(n))), "the group works after the mismatch"


def _broadcast_logical_dtype(r: int, n: int) -> None:
    """int16[4] on rank 0 against int8[8] elsewhere (both 8 bytes): ValueError on every rank."""
    t = torch.arange(4, dtype=torch.int16) if r == 0 else torch.zeros(8, dtype=torch.int8)
    kind, msg = outcome(lambda: dist.broadcast(t, src=0))
    assert kind == "ValueError" and "int16" in msg and "int8" in msg and "rank 0" in msg, (kind, msg)
    t = torch.arange(4, dtype=torch.int16) if r == 0 else torch.zeros(4, dtype=torch.uint16)
    kind, msg = outcome(lambda: dist.broadcast(t, src=0))
    assert kind == "ValueError" and "int16" in msg and "uint16" in msg, (kind, msg)
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3) if r == 0 else torch.zeros(3, 2, dtype=torch.int16)
    kind, msg = outcome(lambda: dist.broadcast(t, src=0))
    assert kind == "ValueError" and "(2, 3)" in msg and "(3, 2)" in msg, (kind, msg)
    x = torch.arange(4, dtype=torch.int16).reshape(2, 2) * (r + 1)
    ys = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(ys, x)
    assert all(torch.equal(y, torch.arange(4, dtype=torch.int16).reshape(2, 2) * (q + 1)) for q, y in enumerate(ys))
    kind, msg = outcome(lambda: dist.all_gather_into_tensor(
        torch.empty(8 * n, dtype=torch.int8) if r else torch.empty(4 * n, dtype=torch.int16),
        torch.zeros(8, dtype=torch.int8) if r else torch.zeros(4, dtype=torch.int16)))
    assert kind == "ValueError" and "int16" in msg and "int8" in msg, (kind, msg)
    x = torch.arange(6, dtype=torch.int16) * (r + 1)
    dist.broadcast(x, src=n - 1)
    assert torch.equal(x, torch.arange(6, dtype=torch.int16) * n), "broadcast of int16 after the mismatches"


def _all_to_all_single_small_ints(r: int, n: int) -> None:
    """1-d int16/uint16/uint32 (moved as bytes): the splits count elements, not bytes."""
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.int8, torch.complex64):
        counts = [1 + (q + r) % 2 for q in range(n)]  # rows this rank sends to rank q
        recv = [1 + (r + q) % 2 for q in range(n)]  # rows rank q sends this rank
        x = (torch.arange(sum(counts)) + 100 * r).to(dtype)
        y = torch.empty(sum(recv), dtype=dtype)
        dist.all_to_all_single(y, x, recv, counts)
        want = []
        for q in range(n):
            sent = [1 + (p + q) % 2 for p in range(n)]
            start = sum(sent[:r])
            want.append((torch.arange(start, start + sent[r]) + 100 * q).to(dtype))
        assert torch.equal(y, torch.cat(want)), (dtype, y, want)
        x2 = (torch.arange(2 * n * 3) + r).to(dtype).reshape(2 * n, 3)
        y2 = torch.empty_like(x2)
        dist.all_to_all_single(y2, x2)
        want2 = torch.cat([(torch.arange(2 * n * 3) + q).to(dtype).reshape(2 * n, 3)[2 * r:2 * r + 2]
                           for q in range(n)])
        assert torch.equal(y2, want2), (dtype, y2, want2)


def _sparse(r: int, dtype: torch.dtype, dense: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + r)
    nnz = 3 + 2 * r  # uneven sizes across ranks, with duplicate indices (uncoalesced input)
    idx = torch.randint(0, 6, (2, nnz), generator=g)
    if dtype.is_floating_point:  # any values: the sum is gloo's bit for bit (same order)
        val = torch.randn((nnz, *dense), generator=g, dtype=dtype)
    else:
        val = torch.randint(-5, 6, (nnz, *dense), generator=g).to(dtype)
    return torch.sparse_coo_tensor(idx, val, (6, 5, *dense))


def _sparse_all_reduce(r: int, n: int) -> None:
    """A sparse all_reduce equals gloo's: the coalesced sum of every rank's tensor."""
    gloo = dist.new_group(backend="gloo")
    for dtype, dense in ((torch.float32, ()), (torch.float64, (2,)), (torch.int64, ()), (torch.int16, (3,))):
        ours, ref = _sparse(r, dtype, dense), _sparse(r, dtype, dense)
        work = dist.all_reduce(ours, async_op=True)
        work.wait()
        if dtype == torch.int16:  # gloo: "Invalid scalar type"; moecomm moves its values as bytes
            ref = functools.reduce(operator.add, [_sparse(q, dtype, dense) for q in range(n)]).coalesce()
        else:
            dist.all_reduce(ref, group=gloo)
        assert ours.is_sparse and ours.is_coalesced() == ref.is_coalesced(), (ours, ref)
        assert torch.equal(ours.coalesce().indices(), ref.coalesce().indices()), (ours, ref)
        assert torch.equal(ours.coalesce().values(), ref.coalesce().values()), (ours, ref)
        want = sum(_sparse(q, dtype, dense).to_dense() for q in range(n))
        assert torch.allclose(ours.to_dense(), want)
        assert work.get_future().value()[0].is_sparse
    empty = torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.int64), torch.empty(0), (6, 5))
    x = empty if r == 0 else _sparse(r, torch.float32)
    dist.all_reduce(x)
    assert torch.allclose(x.to_dense(), sum(_sparse(q, torch.float32).to_dense() for q in range(1, n)))
    x = torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.int64), torch.ones(1), (6, 5 + (r == 1)))
    kind, msg = outcome(lambda: dist.all_reduce(x))
    assert kind == "ValueError" and "rank 1" in msg and "(6, 6)" in msg, (kind, msg)
    dist.destroy_process_group(gloo)


def _timeout_message(r: int, n: int) -> None:
    """A barrier rank 1 skips raises on the others after the group's timeout, with a message that
    PyTorch's test_barrier_timeout_* matches (" (Timed out|closed|timeout) ")."""
    import re

    group = dist.new_group(timeout=datetime.timedelta(seconds=1))
    if r != 1:
        t0 = time.monotonic()
        kind, msg = outcome(lambda: dist.barrier(group))
        assert kind == "CollectiveTimeoutError" and re.search(" (Timed out|closed|timeout) ", msg), (kind, msg)
        assert time.monotonic() - t0 > 0.9, "raised before the timeout"


CHECKS = [_all_gather_coalesced, _reduce_dst_mismatch, _broadcast_logical_dtype, _all_to_all_single_small_ints,
          _sparse_all_reduce, _timeout_message]


def run_checks(comm, checks: list) -> dict:
    """Every check(rank, size) in turn, each reported ("ok" or its traceback), then the group destroyed."""
    report = {}
    try:
        for check in checks:
            try:
                check(comm.rank, comm.size)
                report[check.__name__] = "ok"
            except Exception:  # noqa: BLE001 - reported per check
                report[check.__name__] = traceback.format_exc()[-2500:]
            comm.barrier()  # the next check starts together (a failed one may have left ranks apart)
    finally:
        dist.destroy_process_group()
    return report


def _body(comm, init_method: str) -> dict:
    n, r = comm.size, comm.rank
    dist.init_process_group("moecomm", init_method=init_method, rank=r, world_size=n,
                            timeout=datetime.timedelta(seconds=30))
    return run_checks(comm, CHECKS)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_round3_torch_callers(nprocs, tmp_path):
    reports = collectives.launch(_body, nprocs, f"file://{tmp_path / 'store'}", timeout=180.0)
    bad = {f"rank {r}: {name}": text for r, rep in enumerate(reports) for name, text in rep.items() if text != "ok"}
    assert not bad, "\n".join(f"{k}\n{v}" for k, v in bad.items())
