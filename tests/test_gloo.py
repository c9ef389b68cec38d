"""The gloo transport on its own, on one node: results against a reference, and failing loudly.

GlooTransport objects of one group are built in threads of this process over a loopback TCPStore (a
real ProcessGroupGloo each, real sockets), so the cases are cheap and interleavings can be forced.
Through a Communicator it is tested where it matters, across nodes (tests/test_multinode.py), and
forced on one node below.
"""

from __future__ import annotations

import time

import pytest
import torch

from collectives.rendezvous import StoreRendezvous, loopback_store_server, store_client
from spmd import assert_reduced, on_threads, rank_input
from transports.base import (
    F_RECV_COUNTS_GIVEN,
    CollectiveTimeoutError,
    CommunicatorBrokenError,
    GroupInfo,
    OpCode,
    PeerFailedError,
    ReduceOp,
    Signature,
)

pytest.importorskip("torch.distributed")
from transports.gloo import GlooTransport, gloo_usable, local_address_towards  # noqa: E402

if not torch.distributed.is_gloo_available():
    pytest.skip("this torch build has no gloo", allow_module_level=True)

_groups = 0


def _gloo_group(size: int, *, timeout: float = 10.0) -> list[GlooTransport]:
    """``size`` GlooTransport objects of one group, one per thread of this process."""
    global _groups
    _groups += 1
    server, port = loopback_store_server(timeout)
    prefix = f"test{_groups}"

    def make(r: int) -> GlooTransport:
        rdv = StoreRendezvous(store_client("127.0.0.1", port, timeout), r, size, timeout, prefix, range(size))
        info = GroupInfo(rank=r, size=size, timeout=timeout, rendezvous=rdv, global_ranks=list(range(size)),
                         pids=[0] * size, hosts=[f"node{r}" for r in range(size)])  # no pid watching
        return GlooTransport(info)

    made = on_threads(size, make)
    errors = [e for e in made.values() if isinstance(e, BaseException)]
    assert not errors, errors
    group = [made[r] for r in range(size)]
    group[0]._server = server  # keep the store server alive with the group
    return group


def _close(group: list[GlooTransport]) -> None:
    for t in group:
        t.close()


def _reduce_sig(opcode: OpCode, x: torch.Tensor, op: ReduceOp | None = None, root: int = 0) -> Signature:
    return Signature.of(opcode, dtype=x.dtype, shape=tuple(x.shape), op=op, root=root)


DTYPES_OPS = [(d, op) for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                torch.int32, torch.uint8)
              for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD)
              if not (op == ReduceOp.AVG and not d.is_floating_point)] + \
             [(torch.bool, ReduceOp.MAX), (torch.bool, ReduceOp.MIN)]


def _rank_cases(t: GlooTransport, seed: int) -> None:
    """Every collective of one rank against a reference built from every rank's regenerable input."""
    n, me = t.size, t.rank
    for dtype, op in DTYPES_OPS:
        shape = (3, 5)
        xs = [rank_input("ar", r, shape, dtype, seed) for r in range(n)]
        if op == ReduceOp.PROD and dtype.is_floating_point:  # keep products of n values in range
            xs = [(x.double() / 2).to(dtype) for x in xs]
        what = f"all_reduce {dtype} {op.name} rank {me}"
        x = xs[me].clone()
        out = torch.empty_like(x)
        t.all_reduce(x.view(-1), out.view(-1), op, _reduce_sig(OpCode.ALL_REDUCE, x, op))
        assert_reduced(out, xs, op.name.lower(), what)
        assert torch.equal(x, xs[me]), f"{what}: the input changed"
        # reduce_scatter: this rank's block of the reduction
        rs_in = [rank_input("rs", r, (n * 4,), dtype, seed) for r in range(n)]
        rs_out = torch.empty(4, dtype=dtype)
        t.reduce_scatter(rs_in[me].clone(), rs_out, op, _reduce_sig(OpCode.REDUCE_SCATTER, rs_in[me], op))
        assert_reduced(rs_out, [x[4 * me: 4 * me + 4] for x in rs_in], op.name.lower(), f"reduce_scatter {what}")
    # NaN in max/min: propagated, the same on every rank
    x = rank_input("nan", me, (6,), torch.float32, seed)
    x[me] = float("nan")
    out = torch.empty_like(x)
    t.all_reduce(x, out, ReduceOp.MAX, _reduce_sig(OpCode.ALL_REDUCE, x, ReduceOp.MAX))
    assert torch.isnan(out[:n]).all() and not torch.isnan(out[n:]).any(), out
    # in place
    x = rank_input("inplace", me, (7,), torch.float64, seed)
    ref = [rank_input("inplace", r, (7,), torch.float64, seed) for r in range(n)]
    t.all_reduce(x, x, ReduceOp.SUM, _reduce_sig(OpCode.ALL_REDUCE, x, ReduceOp.SUM))
    assert_reduced(x, ref, "sum", "in-place all_reduce")
    for dtype in (torch.bfloat16, torch.bool, torch.int32):
        x = rank_input("ag", me, (2, 3), dtype, seed)
        out = torch.empty(n * 6, dtype=dtype)
        t.all_gather(x.view(-1), out, _reduce_sig(OpCode.ALL_GATHER, x))
        want = torch.cat([rank_input("ag", r, (2, 3), dtype, seed).view(-1) for r in range(n)])
        assert torch.equal(out, want), f"all_gather {dtype}"
        src = n - 1
        out = torch.empty(6, dtype=dtype)
        t.broadcast(x.view(-1), out, src, _reduce_sig(OpCode.BROADCAST, x, root=src))
        assert torch.equal(out, rank_input("ag", src, (2, 3), dtype, seed).view(-1)), f"broadcast {dtype}"
    # uneven all_to_all, zero rows included, with and without recv_counts
    counts = [[(s * 7 + d * 3 + seed) % 4 for d in range(n)] for s in range(n)]
    counts[0][n - 1] = 0
    for given in (False, True):
        rows = [rank_input("a2a", s, (sum(counts[s]), 2, 3), torch.bfloat16, seed) for s in range(n)]
        sig = Signature.of(OpCode.ALL_TO_ALL, dtype=torch.bfloat16, shape=(sum(counts[me]), 2, 3),
                           compare_first_dim=False, rows=sum(counts[me]), root=int(given))
        got = t.all_to_all(rows[me].view(-1), counts[me], 6, lambda rc: torch.empty(sum(rc) * 6, dtype=torch.bfloat16),
                           sig, recv_counts=[counts[s][me] for s in range(n)] if given else None)
        want = torch.cat([rows[s][sum(counts[s][:me]): sum(counts[s][:me + 1])] for s in range(n)])
        assert torch.equal(got.view(-1, 2, 3), want), f"all_to_all (recv_counts given: {given})"
    t.barrier(Signature.of(OpCode.BARRIER))


def test_every_collective_matches_the_reference():
    group = _gloo_group(3)
    try:
        res = on_threads(3, lambda r: _rank_cases(group[r], seed=11))
        assert all(v is None for v in res.values()), res
    finally:
        _close(group)


def test_a_signature_that_differs_raises_on_every_rank_naming_it_and_the_transport_goes_on():
    group = _gloo_group(3)
    try:
        def call(r: int) -> None:
            x = torch.randn(4 if r != 1 else 5)
            group[r].all_reduce(x, torch.empty_like(x), ReduceOp.SUM, _reduce_sig(OpCode.ALL_REDUCE, x, ReduceOp.SUM))

        res = on_threads(3, call)
        for r in range(3):
            assert isinstance(res[r], ValueError), res
            assert "rank 1: (5)" in str(res[r]) and "rank 0: (4)" in str(res[r]), res[r]
        assert all(v is None for v in on_threads(3, lambda r: group[r].barrier(Signature.of(OpCode.BARRIER))).values())
    finally:
        _close(group)


def test_wrong_recv_counts_raise_on_every_rank_naming_the_rank():
    group = _gloo_group(2)
    try:
        def call(r: int) -> None:
            x = torch.randn(3, 2)
            declared = [1, 2] if r == 0 else [2, 9]  # rank 1 receives 2 rows from rank 1, not 9
            sig = Signature.of(OpCode.ALL_TO_ALL, dtype=x.dtype, shape=(3, 2), compare_first_dim=False, rows=3,
                               root=1)
            assert sig.meta[F_RECV_COUNTS_GIVEN] == 1
            group[r].all_to_all(x.view(-1), [1, 2] if r == 0 else [2, 1], 2,
                                lambda rc: torch.empty(sum(rc) * 2), sig, recv_counts=declared)

        res = on_threads(2, call)
        for r in range(2):
            assert isinstance(res[r], ValueError) and "rank 1 passed recv_counts [2, 9]" in str(res[r]), res
    finally:
        _close(group)


def test_a_rank_that_never_arrives_is_named_at_the_timeout():
    group = _gloo_group(3, timeout=1.0)
    try:
        def call(r: int) -> float:
            if r == 2:
                time.sleep(2.0)  # never calls; still here, outside any call
                return 0.0
            t0 = time.monotonic()
            group[r].barrier(Signature.of(OpCode.BARRIER))
            return time.monotonic() - t0

        res = on_threads(3, call)
        for r in (0, 1):
            assert isinstance(res[r], CollectiveTimeoutError), res
            assert res[r].missing_ranks == [2] and "rank(s) [2] never arrived" in str(res[r]), res[r]
        with pytest.raises(CommunicatorBrokenError, match="earlier failure"):
            group[0].barrier(Signature.of(OpCode.BARRIER))
    finally:
        _close(group)


def test_a_peer_that_closes_fails_the_waiting_rank_at_once():
    group = _gloo_group(2, timeout=30.0)
    try:
        group[1].close()
        t0 = time.monotonic()
        with pytest.raises(PeerFailedError, match="rank 1 closed its communicator") as info:
            group[0].barrier(Signature.of(OpCode.BARRIER))
        assert info.value.missing_ranks == [1] and time.monotonic() - t0 < 10
        with pytest.raises(CommunicatorBrokenError, match="closed"):
            group[1].barrier(Signature.of(OpCode.BARRIER))
    finally:
        _close(group)


def test_a_peer_whose_connections_drop_is_named():
    """A crash as gloo sees it: rank 2's connections close with no notice (its process group is aborted and
    dropped); ranks 0 and 1 raise PeerFailedError naming rank 2, long before the timeout."""
    group = _gloo_group(3, timeout=30.0)
    try:
        x = torch.randn(1 << 16)
        sig = _reduce_sig(OpCode.ALL_REDUCE, x, ReduceOp.SUM)

        def call(r: int) -> float:
            if r == 2:
                pg, group[2].pg = group[2].pg, None
                pg.abort()
                del pg
                return 0.0
            t0 = time.monotonic()
            group[r].all_reduce(x, torch.empty_like(x), ReduceOp.SUM, sig)
            return time.monotonic() - t0

        res = on_threads(3, call)
        for r in (0, 1):
            assert isinstance(res[r], PeerFailedError), res
            assert 2 in res[r].missing_ranks and "rank(s) [2]" in str(res[r]), res[r]
    finally:
        group[2].pg = None
        _close(group)


def test_routing_address_and_usability():
    assert local_address_towards("127.0.0.1", 1) == "127.0.0.1"
    assert gloo_usable(object()) is not None and "store" in gloo_usable(object())


def _forced_body(comm) -> str:
    """On every rank of a one-node launch forced to gloo: the plan, results, and a rank's bad shape."""
    n, r = comm.size, comm.rank
    assert "gloo" in comm.transports, comm.transports
    plan = comm.plan("all_reduce", torch.zeros(3))
    assert plan.transport == "gloo" and "forced" in plan.reason, plan
    xs = [rank_input("forced", k, (1000,), torch.float32, 7) for k in range(n)]
    assert_reduced(comm.all_reduce(xs[r]), xs, "sum", "forced all_reduce")
    assert torch.equal(comm.all_gather(xs[r]), torch.cat(xs))
    try:
        comm.all_reduce(torch.zeros(4 if r else 5))
    except ValueError as e:
        return str(e)
    return "no error"


def test_forced_through_the_communicator_on_one_node():
    import collectives

    for msg in collectives.launch(_forced_body, 2, transport="gloo", timeout=30.0):
        assert "rank 0: (5)" in msg and "rank 1: (4)" in msg, msg
