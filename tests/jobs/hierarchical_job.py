"""One rank of a hierarchical-collectives job across the testbed's nodes (tests/test_hierarchical.py).

Every rank checks that host all_reduce / all_gather / reduce_scatter above the size threshold take the
hierarchical path (``comm.plan()`` names it and its stages), that its results equal the flat transport's
(``comm.using(<mpi or gloo>)``) for several dtypes, ops, odd sizes and empty tensors (integers, max/min and
gathers bit for bit; float sums to rounding), that every rank gets the same all_reduce bits (compared over
an all_gather), that a shape differing on one rank makes every rank raise ValueError naming it, and that a
failure in the intra-node stage on one node makes every rank raise (the other node's ranks wait in the rail
stage) well within the timeout. Then it writes ``<out>/<rank>.json``.

    python hierarchical_job.py --nodes N --ppn P --launcher torchrun|mpiexec --out DIR
"""

from __future__ import annotations

import socket
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: spmd's references

import collectives  # noqa: E402
from collectives import selection  # noqa: E402
from spmd import node_job_args, rank_input, write_rank_report  # noqa: E402

SEED = 1516
# (dtype, op, elements): odd sizes (not divisible by the ranks per node), one over the default threshold
CASES = [(torch.float32, "sum", 70_001), (torch.float64, "avg", 33), (torch.bfloat16, "sum", 1_001),
         (torch.float16, "max", 257), (torch.float32, "min", 4_099), (torch.int64, "sum", 12_347),
         (torch.int32, "prod", 999), (torch.uint8, "max", 5), (torch.bool, "min", 77), (torch.float32, "sum", 0)]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(-1).view(torch.uint8),
                                                                      b.view(-1).view(torch.uint8))


def close_to(got: torch.Tensor, flat: torch.Tensor, dtype: torch.dtype, op: str) -> bool:
    """Integers and max/min bit for bit; float sums within rounding (another summation order)."""
    if not dtype.is_floating_point or op in ("max", "min"):
        return torch.equal(got, flat) or (dtype.is_floating_point and torch.equal(got.isnan(), flat.isnan())
                                          and torch.equal(got.nan_to_num(), flat.nan_to_num()))
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    return torch.allclose(got.double(), flat.double(), rtol=tol, atol=tol)


def check(comm: collectives.Communicator, flat_name: str) -> int:
    flat = comm.using(flat_name)
    n, r, checks = comm.size, comm.rank, 0
    big = torch.randn(selection.HIERARCHICAL_MIN_BYTES[selection.OpCode.ALL_REDUCE] // 4 + 3)
    plan = comm.plan("all_reduce", big)
    assert plan.transport == "hierarchical" and f"{flat_name} all_reduce" in plan.algorithm \
        and "shm reduce_scatter" in plan.algorithm, plan
    small = comm.plan("all_reduce", torch.zeros(5))
    assert small.transport == flat_name and "not hierarchical: 20 B <" in small.reason, small
    # from here on every size goes hierarchical: the stages, padding and empty tensors under test
    for op in selection.HIERARCHICAL_MIN_BYTES:
        selection.HIERARCHICAL_MIN_BYTES[op] = 0
    for i, (dtype, op, numel) in enumerate(CASES):
        x = rank_input(f"ar{i}", r, (numel,), dtype, SEED)
        if op == "prod":
            x = x % 3 + 1
        if dtype == torch.float16 and numel:
            x[r] = float("nan")  # max propagates NaN through every stage
        got, want = comm.all_reduce(x, op=op), flat.all_reduce(x, op=op)
        assert close_to(got, want, dtype, op), f"all_reduce {dtype} {op} {numel}: {(got - want).abs().max()}"
        every = comm.all_gather(got.reshape(1, -1))
        assert all(same_bits(every[k], got) for k in range(n)), f"all_reduce {dtype} {op}: ranks got other bits"
        g = rank_input(f"ag{i}", r, (numel % 7, 3), dtype, SEED)
        assert same_bits(comm.all_gather(g), flat.all_gather(g)), f"all_gather {dtype} {numel % 7}"
        rows = n * (numel % 5)
        b = rank_input(f"rs{i}", r, (rows, 2), dtype, SEED)
        if op == "prod":
            b = b % 3 + 1
        got, want = comm.reduce_scatter(b, op=op), flat.reduce_scatter(b, op=op)
        assert close_to(got, want, dtype, op), f"reduce_scatter {dtype} {op} rows {rows}"
        checks += 4
    assert comm.plan("all_gather", torch.zeros(3)).transport == "hierarchical"
    # a shape that differs on the last rank (another node): every rank raises naming it
    bad = n - 1
    try:
        comm.all_reduce(torch.ones(6 if r == bad else 5))
    except ValueError as e:
        assert f"rank {bad}: (6)" in str(e), str(e)
    else:
        raise AssertionError("a shape that differs on one rank did not raise")
    checks += 1
    # still usable after the mismatch (it was caught before any stage)
    x = rank_input("after", r, (101,), torch.int64, SEED)
    assert torch.equal(comm.all_reduce(x), flat.all_reduce(x))
    return checks + 1


def intra_stage_failure(comm: collectives.Communicator) -> dict:
    """Rank 1's node group is gone (closed on rank 1 only), so its intra-node stage fails: every rank must
    raise, the other node's ranks (waiting in the rail stage) told by the closed sub-groups, not the timeout."""
    if comm.rank == 1:
        comm.transports["hierarchical"]._groups[0].close()  # fault injection: the node (shm) group
    t0 = time.monotonic()
    try:
        comm.all_reduce(rank_input("fail", comm.rank, (4_001,), torch.float32, SEED))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0,
                "where": traceback.format_exc()[-1500:]}
    return {"error": None, "seconds": time.monotonic() - t0}


def main() -> None:
    a = node_job_args()
    torch.set_num_threads(1)
    comm = collectives.init(timeout=30.0)

    def fill(report: dict) -> None:
        report["checks"] = check(comm, "mpi" if a.launcher == "mpiexec" else "gloo")
        report["plan"] = str(comm.plan("all_reduce", torch.zeros(1 << 20)))
        comm.barrier()
        report["failure"] = intra_stage_failure(comm)
        comm.barrier()  # the flat transport still serves

    write_rank_report(Path(a.out) / f"{comm.rank}.json", {"rank": comm.rank, "hostname": socket.gethostname()}, fill)
    comm.close()


if __name__ == "__main__":
    main()
