"""moecomm as a torch.distributed backend (collectives/torch_backend): every dist.* collective
against a reference with random data on 2 and 3 ranks, functional collectives, async work, new_group,
DDP against gloo, FSDP2 against the unsharded model, errors on every rank; init under torchrun,
mpiexec (env:// from PMI_RANK/PMI_SIZE), file://, tcp:// and a HashStore; a rank that never arrives
or dies makes the others raise within the timeout given to init_process_group.

One launch per rank count runs every check (ranks come from ``collectives.launch``'s fork server;
each body then calls init_process_group itself).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import collectives
from collectives.torch_backend import MoecommProcessGroup, register
from spmd import assert_reduced, mpiexec_path, outcome, rank_input, run_side_by_side
from transports.base import SUPPORTED_DTYPES

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "tests" / "jobs" / "torch_backend_job.py")
RED = dist.ReduceOp
# the communicator's dtypes, plus two it does not reduce that the data-moving collectives carry as bytes
MOVED = [*SUPPORTED_DTYPES, torch.int8, torch.complex64]
SHAPES = [(7,), (2, 3, 5), (0, 3)]  # odd, several dims, empty
SEED = 14


def _x(kind: str, rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s random input (any rank can regenerate any other's); complex: random parts."""
    if dtype.is_complex:
        return torch.complex(rank_input(kind + "re", rank, shape, torch.float32, SEED),
                             rank_input(kind + "im", rank, shape, torch.float32, SEED))
    return rank_input(kind, rank, shape, dtype, SEED)


def _ops(dtype: torch.dtype) -> list[tuple[object, str, float | None]]:
    """(torch op, reference op, PREMUL_SUM factor) for every reduction moecomm runs on ``dtype``."""
    if dtype == torch.bool:
        return [(RED.MAX, "max", None), (RED.MIN, "min", None), (RED.BOR, "max", None), (RED.BAND, "min", None)]
    ops = [(RED.SUM, "sum", None), (RED.PRODUCT, "prod", None), (RED.MAX, "max", None), (RED.MIN, "min", None)]
    if dtype.is_floating_point:
        ops += [(RED.AVG, "avg", None), (dist._make_nccl_premul_sum(0.75), "sum", 0.75)]
    return ops


def _scaled(xs: list[torch.Tensor], factor: float | None) -> list[torch.Tensor]:
    return xs if factor is None else [x * factor for x in xs]


def _check_reductions(r: int, n: int) -> None:
    """all_reduce, reduce, reduce_scatter_tensor, reduce_scatter (even and uneven) per dtype and op."""
    for dtype in SUPPORTED_DTYPES:
        for shape in SHAPES:
            for op, ref, factor in _ops(dtype):
                what = f"{dtype} {shape} {op}"
                xs = [_x(f"ar{shape}", q, shape, dtype) for q in range(n)]
                y = xs[r].clone()
                dist.all_reduce(y, op=op)
                assert_reduced(y, _scaled(xs, factor), ref, f"all_reduce {what}")
                y = xs[r].clone()
                dist.reduce(y, dst=n - 1, op=op)
                if r == n - 1:
                    assert_reduced(y, _scaled(xs, factor), ref, f"reduce {what}")
                else:
                    assert torch.equal(y, xs[r]), f"reduce {what}: a non-root tensor changed"
                big = [_x(f"rs{shape}", q, (n * shape[0], *shape[1:]), dtype) for q in range(n)]
                out = torch.empty(shape, dtype=dtype)
                dist.reduce_scatter_tensor(out, big[r], op=op)
                block = [b[r * shape[0]:(r + 1) * shape[0]] for b in big]
                assert_reduced(out, _scaled(block, factor), ref, f"reduce_scatter_tensor {what}")
            op, ref, _ = _ops(dtype)[0]
            rows = [(q + 1) % 3 for q in range(n)]  # uneven blocks, one of them empty on 3 ranks
            for sizes in ([shape[0]] * n, rows):
                ins = [[_x(f"rsl{q}", p, (sizes[q], *shape[1:]), dtype) for q in range(n)] for p in range(n)]
                out = torch.empty((sizes[r], *shape[1:]), dtype=dtype)
                dist.reduce_scatter(out, ins[r], op=op)
                assert_reduced(out, [ins[p][r] for p in range(n)], ref, f"reduce_scatter {dtype} blocks {sizes}")


def _check_movement(r: int, n: int) -> None:
    """broadcast, all_gather (even, uneven), all_gather_into_tensor (both layouts), all_to_all_single
    (even, uneven), all_to_all, gather, scatter, for every dtype including ones moved as bytes."""
    for dtype in MOVED:
        for shape in SHAPES:
            what = f"{dtype} {shape}"
            xs = [_x(f"mv{shape}", q, shape, dtype) for q in range(n)]
            y = xs[r].clone()
            dist.broadcast(y, src=n - 1)
            assert torch.equal(y, xs[n - 1]), f"broadcast {what}"
            outs = [torch.empty(shape, dtype=dtype) for _ in range(n)]
            dist.all_gather(outs, xs[r])
            assert all(torch.equal(o, x) for o, x in zip(outs, xs)), f"all_gather {what}"
            cat = torch.empty((n * shape[0], *shape[1:]), dtype=dtype)
            stacked = torch.empty((n, *shape), dtype=dtype)
            dist.all_gather_into_tensor(cat, xs[r])
            dist.all_gather_into_tensor(stacked, xs[r])
            assert torch.equal(cat, torch.cat(xs)) and torch.equal(stacked, torch.stack(xs)), f"into_tensor {what}"
            gathered = [torch.empty(shape, dtype=dtype) for _ in range(n)] if r == 0 else None
            dist.gather(xs[r], gathered, dst=0)
            assert r != 0 or all(torch.equal(g, x) for g, x in zip(gathered, xs)), f"gather {what}"
            pieces = [_x(f"sc{shape}", q, shape, dtype) for q in range(n)]
            got = torch.empty(shape, dtype=dtype)
            dist.scatter(got, pieces if r == n - 1 else None, src=n - 1)
            assert torch.equal(got, pieces[r]), f"scatter {what}"
        # uneven all_gather: rank q contributes q + 1 rows
        xs = [_x("agu", q, (q + 1, 3), dtype) for q in range(n)]
        outs = [torch.empty((q + 1, 3), dtype=dtype) for q in range(n)]
        dist.all_gather(outs, xs[r])
        assert all(torch.equal(o, x) for o, x in zip(outs, xs)), f"uneven all_gather {dtype}"
        # all_to_all_single, uneven: rank p sends (p + 2q) % 3 rows to rank q (some zero)
        send = [(r + 2 * q) % 3 for q in range(n)]
        recv = [(q + 2 * r) % 3 for q in range(n)]
        ins = [_x("a2a", p, (sum((p + 2 * q) % 3 for q in range(n)), 2, 3), dtype) for p in range(n)]
        out = torch.empty((sum(recv), 2, 3), dtype=dtype)
        dist.all_to_all_single(out, ins[r], recv, send)

        def block(p: int, q: int) -> torch.Tensor:  # rows rank p sends to rank q
            start = sum((p + 2 * k) % 3 for k in range(q))
            return ins[p][start:start + (p + 2 * q) % 3]

        assert torch.equal(out, torch.cat([block(p, r) for p in range(n)])), f"uneven all_to_all_single {dtype}"
        even = [_x("a2ae", p, (2 * n, 5), dtype) for p in range(n)]
        out = torch.empty((2 * n, 5), dtype=dtype)
        dist.all_to_all_single(out, even[r])
        assert torch.equal(out, torch.cat([e[2 * r:2 * r + 2] for e in even])), f"even all_to_all_single {dtype}"
        lists = [[_x("a2al", p * n + q, (p + q + 1,), dtype) for q in range(n)] for p in range(n)]
        outs = [torch.empty((p + r + 1,), dtype=dtype) for p in range(n)]
        dist.all_to_all(outs, lists[r])
        assert all(torch.equal(o, lists[p][r]) for p, o in enumerate(outs)), f"all_to_all {dtype}"


def _check_async_coalesced_aliases(r: int, n: int) -> None:
    """async_op=True in issue order with the outputs in the futures; coalesced calls; older method names."""
    xs = [[_x(f"as{i}", q, (5 + i,), torch.float32) for q in range(n)] for i in range(4)]
    ys = [x[r].clone() for x in xs]
    works = [dist.all_reduce(y, async_op=True) for y in ys]
    for w, y, x in zip(reversed(works), reversed(ys), reversed(xs)):
        assert w.wait() and w.is_completed()
        assert w.get_future().value()[0] is y
        assert_reduced(y, x, "sum", "async all_reduce")
    out = torch.empty(n * 5)
    w = dist.all_gather_into_tensor(out, xs[0][r], async_op=True)
    w.wait()
    assert w.get_future().value()[0] is out and torch.equal(out, torch.cat(xs[0]))
    # coalescing manager: one call per kind for the whole block
    a = [_x("ca", q, (3, 4), torch.float64) for q in range(n)]
    b = [_x("cb", q, (7,), torch.float64) for q in range(n)]
    ya, yb = a[r].clone(), b[r].clone()
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(ya)
        dist.all_reduce(yb)
    cm.wait()
    assert_reduced(ya, a, "sum", "coalesced a")
    assert_reduced(yb, b, "sum", "coalesced b")
    oa, ob = torch.empty(n * 3, 4, dtype=torch.float64), torch.empty(n * 7, dtype=torch.float64)
    with dist._coalescing_manager():
        dist.all_gather_into_tensor(oa, a[r])
        dist.all_gather_into_tensor(ob, b[r])
    assert torch.equal(oa, torch.cat(a)) and torch.equal(ob, torch.cat(b))
    big = [_x("crs", q, (n * 2, 3), torch.float64) for q in range(n)]
    ra, rb = torch.empty(3, 4, dtype=torch.float64), torch.empty(2, 3, dtype=torch.float64)
    ins_a = [_x("crsa", q, (n * 3, 4), torch.float64) for q in range(n)]
    with dist._coalescing_manager():
        dist.reduce_scatter_tensor(ra, ins_a[r])
        dist.reduce_scatter_tensor(rb, big[r])
    assert_reduced(ra, [x[3 * r:3 * r + 3] for x in ins_a], "sum", "coalesced reduce_scatter a")
    assert_reduced(rb, [x[2 * r:2 * r + 2] for x in big], "sum", "coalesced reduce_scatter b")
    # mixed dtypes in one allreduce_coalesced: one call per dtype, in first-appearance order
    pg = dist.group.WORLD
    mixed = [[_x("mx0", q, (4,), torch.float32) for q in range(n)], [_x("mx1", q, (2, 2), torch.int64) for q in range(n)],
             [_x("mx2", q, (3,), torch.float32) for q in range(n)]]
    ts = [m[r].clone() for m in mixed]
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = RED.MAX
    pg.allreduce_coalesced(ts, opts).wait()
    for t, m in zip(ts, mixed):
        assert_reduced(t, m, "max", "allreduce_coalesced mixed")
    # the older names torch < 2.13 calls
    out = torch.empty(n * 5)
    pg._allgather_base(out, xs[0][r]).wait()
    assert torch.equal(out, torch.cat(xs[0]))
    rs = torch.empty(2, 3, dtype=torch.float64)
    pg._reduce_scatter_base(rs, big[r], dist.ReduceScatterOptions()).wait()
    assert_reduced(rs, [x[2 * r:2 * r + 2] for x in big], "sum", "_reduce_scatter_base")
    o2 = torch.empty(2 * n, 5)
    even = [_x("a2ae", p, (2 * n, 5), torch.float32) for p in range(n)]
    pg.alltoall_base(o2, even[r], [], []).wait()
    assert torch.equal(o2, torch.cat([e[2 * r:2 * r + 2] for e in even]))
    outs = [torch.empty(n * 3, 4, dtype=torch.float64), torch.empty(n * 7, dtype=torch.float64)]
    pg.allgather_into_tensor_coalesced(outs, [a[r], b[r]]).wait()
    assert torch.equal(outs[0], torch.cat(a)) and torch.equal(outs[1], torch.cat(b))
    rso = [torch.empty(3, 4, dtype=torch.float64), torch.empty(2, 3, dtype=torch.float64)]
    pg.reduce_scatter_tensor_coalesced(rso, [ins_a[r], big[r]], dist.ReduceScatterOptions()).wait()
    assert_reduced(rso[1], [x[2 * r:2 * r + 2] for x in big], "sum", "reduce_scatter_tensor_coalesced")
    # mixed dtypes: pair by pair
    ci = [_x("cmix", q, (5,), torch.int64) for q in range(n)]
    outs = [torch.empty(n * 7, dtype=torch.float64), torch.empty(n * 5, dtype=torch.int64)]
    pg.allgather_into_tensor_coalesced(outs, [b[r], ci[r]]).wait()
    assert torch.equal(outs[0], torch.cat(b)) and torch.equal(outs[1], torch.cat(ci))
    ri = [_x("crsi", q, (n * 2,), torch.int64) for q in range(n)]
    rso = [torch.empty(2, 3, dtype=torch.float64), torch.empty(2, dtype=torch.int64)]
    pg.reduce_scatter_tensor_coalesced(rso, [big[r], ri[r]], dist.ReduceScatterOptions()).wait()
    assert_reduced(rso[0], [x[2 * r:2 * r + 2] for x in big], "sum", "reduce_scatter_tensor_coalesced mixed")
    assert_reduced(rso[1], [x[2 * r:2 * r + 2] for x in ri], "sum", "reduce_scatter_tensor_coalesced mixed int")


def _check_functional_p2p_groups(r: int, n: int) -> None:
    """Functional collectives, send/recv (and from any source, and batched), object collectives,
    barrier, new_group, a 2-d DeviceMesh."""
    import torch.distributed._functional_collectives as fc

    pg = dist.group.WORLD
    xs = [_x("fc", q, (2 * n, 3), torch.float32) for q in range(n)]
    y = fc.all_reduce(xs[r], "sum", pg)
    assert_reduced(fc.wait_tensor(y), xs, "sum", "functional all_reduce")
    assert torch.equal(fc.wait_tensor(fc.all_gather_tensor(xs[r], 0, pg)), torch.cat(xs))
    rs = fc.wait_tensor(fc.reduce_scatter_tensor(xs[r], "sum", 0, pg))
    assert_reduced(rs, [x[2 * r:2 * r + 2] for x in xs], "sum", "functional reduce_scatter_tensor")
    send = [(r + q) % 3 + 1 for q in range(n)]
    recv = [(q + r) % 3 + 1 for q in range(n)]
    ins = [_x("fca", p, (sum((p + q) % 3 + 1 for q in range(n)), 2), torch.float32) for p in range(n)]
    got = fc.wait_tensor(fc.all_to_all_single(ins[r], recv, send, pg))
    want = [ins[p][sum((p + k) % 3 + 1 for k in range(r)):][:(p + r) % 3 + 1] for p in range(n)]
    assert torch.equal(got, torch.cat(want)), "functional all_to_all_single"
    # point to point: a ring, then one message from any source
    msgs = [_x("p2p", q, (4, 3), torch.float64) for q in range(n)]
    box = torch.empty(4, 3, dtype=torch.float64)
    dist.send(msgs[r], (r + 1) % n)
    dist.recv(box, (r - 1) % n)
    assert torch.equal(box, msgs[(r - 1) % n]), "send/recv ring"
    if r == 1:
        dist.send(msgs[1], 0, tag=5)
    if r == 0:
        assert dist.recv(box, tag=5) == 1 and torch.equal(box, msgs[1]), "recv from any source"
    ring = torch.empty(4, 3, dtype=torch.float64)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, msgs[r], (r + 1) % n),
                                    dist.P2POp(dist.irecv, ring, (r - 1) % n)])
    assert all(w.wait() for w in works) and torch.equal(ring, msgs[(r - 1) % n]), "batch_isend_irecv"
    # object collectives (pickles as uint8 tensors, sizes as int64)
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "pad": "x" * (7 * r)})
    assert objs == [{"rank": q, "pad": "x" * (7 * q)} for q in range(n)], objs
    box_list = [("from", r)]
    dist.broadcast_object_list(box_list, src=n - 1)
    assert box_list == [("from", n - 1)], box_list
    dist.barrier()
    # a sub-group of the first and last rank; the others are not members
    ends = dist.new_group([0, n - 1])
    if r in (0, n - 1):
        assert isinstance(ends, MoecommProcessGroup) and ends.size() == 2
        v = xs[r].clone()
        dist.all_reduce(v, group=ends)
        assert_reduced(v, [xs[0], xs[n - 1]], "sum", "new_group all_reduce")
        assert dist.get_process_group_ranks(ends) == [0, n - 1]
    else:
        assert ends == dist.GroupMember.NON_GROUP_MEMBER
    # a 2-d DeviceMesh: each dimension is a moecomm group of its own (the "dp" one of a single rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, n), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    assert isinstance(dp, MoecommProcessGroup) and isinstance(tp, MoecommProcessGroup)
    assert (dp.size(), tp.size()) == (1, n)
    v, w = xs[r].clone(), xs[r].clone()
    dist.all_reduce(v, group=tp)
    dist.all_reduce(w, group=dp)
    assert_reduced(v, xs, "sum", "DeviceMesh tp")
    assert torch.equal(w, xs[r]), "a group of one leaves the tensor as it is"
    dist.barrier()


def _check_ddp_and_fsdp(r: int, n: int) -> None:
    """DDP over moecomm ends with gloo's parameters; FSDP2 with the unsharded model's (twice: the
    default AVG reduce-scatter, and a divide factor that makes FSDP2 use PREMUL_SUM)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.functional import mse_loss
    from torch.nn.parallel import DistributedDataParallel as DDP

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 16))

    def data(step: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _x(f"in{step}", q, (4, 16), torch.float32), _x(f"out{step}", q, (4, 16), torch.float32)

    gloo = dist.new_group(backend="gloo")
    params = {}
    for name, group in (("gloo", gloo), ("moecomm", dist.group.WORLD)):
        model = DDP(net(), process_group=group, bucket_cap_mb=0.001)  # several buckets
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            mse_loss(model(data(step, r)[0]), data(step, r)[1]).backward()
            opt.step()
        params[name] = [p.detach() for p in model.parameters()]
    for a, b in zip(params["moecomm"], params["gloo"]):
        # 2 ranks: a sum of two numbers is the same in any order; 3: float rounding of the order
        assert torch.equal(a, b) if n == 2 else torch.allclose(a, b, rtol=1e-5, atol=1e-7), "DDP != gloo"
    mesh = init_device_mesh("cpu", (n,))
    for divide in (None, 2.0 * n):
        ref, sharded = net(), net()
        for layer in (sharded[0], sharded[2], sharded):
            fully_shard(layer, mesh=mesh)
        if divide is not None:  # not the group size: FSDP2 reduce-scatters with PREMUL_SUM(1 / divide)
            for layer in (sharded[0], sharded[2], sharded):
                layer.set_gradient_divide_factor(divide)
        o_ref, o_sh = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(sharded.parameters(), lr=0.1)
        scale = n / divide if divide is not None else 1.0
        for step in range(3):
            o_ref.zero_grad()
            (sum(mse_loss(ref(data(step, q)[0]), data(step, q)[1]) for q in range(n)) * (scale / n)).backward()
            o_ref.step()
            o_sh.zero_grad()
            mse_loss(sharded(data(step, r)[0]), data(step, r)[1]).backward()
            o_sh.step()
        for a, b in zip(sharded.parameters(), ref.parameters()):
            assert torch.allclose(a.full_tensor(), b, rtol=1e-5, atol=1e-6), f"FSDP2 (divide factor {divide})"


def _check_errors(r: int, n: int) -> None:
    """A mismatch or a bad argument on one rank raises on every rank, naming it; the group goes on."""
    kind, msg = outcome(lambda: dist.all_reduce(torch.ones(3 + (r == 1))))
    assert kind == "ValueError" and "rank 1" in msg and "shape" in msg, (kind, msg)
    out = torch.empty(5 if r == 0 else 4 * n)
    kind, msg = outcome(lambda: dist.all_gather_into_tensor(out, torch.ones(4)))
    assert kind == "ValueError" and ("rank 0" in msg or "[0]" in msg), (kind, msg)
    kind, msg = outcome(lambda: dist.all_reduce(torch.ones(2), op=RED.BXOR))
    assert kind == "TypeError" and "BXOR" in msg, (kind, msg)
    counts = [1] * n if r != n - 1 else [2] + [1] * (n - 1)  # the last rank sends rank 0 two rows
    kind, msg = outcome(lambda: dist.all_to_all_single(torch.empty(n, 2), torch.ones(sum(counts), 2),
                                                       [1] * n, counts))
    assert kind == "ValueError" and str(n - 1) in msg, (kind, msg)
    y = torch.ones(3)
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((3,), float(n))), "the group works after the errors"


def _suite(comm, init_method: str) -> str:
    """Every check on this rank, with torch.distributed's default group over moecomm."""
    n, r = comm.size, comm.rank
    dist.init_process_group("moecomm", init_method=init_method, rank=r, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, MoecommProcessGroup) and dist.get_backend() == "moecomm"
        assert pg.name() == pg.getBackendName() == "moecomm" and pg.group_name == pg.getGroupName() != ""
        _check_reductions(r, n)
        _check_movement(r, n)
        _check_async_coalesced_aliases(r, n)
        _check_functional_p2p_groups(r, n)
        _check_ddp_and_fsdp(r, n)
        _check_errors(r, n)
    finally:
        dist.destroy_process_group()
    assert pg.comm.closed, "destroy_process_group shuts the communicator"
    return "ok"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nprocs", [2, 3])
def test_every_collective_ddp_fsdp_and_errors(nprocs, tmp_path):
    """2 ranks through file://, 3 through tcp:// (the TCPStore of rank 0)."""
    method = f"file://{tmp_path / 'store'}" if nprocs == 2 else f"tcp://127.0.0.1:{_free_port()}"
    assert collectives.launch(_suite, nprocs, method, timeout=120.0) == ["ok"] * nprocs


def test_registration_and_a_hash_store_group_of_one():
    """Registered once, for cpu and cuda; a world of one over a HashStore with moecomm options
    (pg_options) works and shuts down; pg_options that are not a dict raise TypeError."""
    assert register() and register()
    assert list(dist.Backend._plugins).count("MOECOMM") == 1
    assert dist.Backend.backend_capability["moecomm"] == ["cpu", "cuda"]
    dist.init_process_group("moecomm", store=dist.HashStore(), rank=0, world_size=1,
                            pg_options={"shm_slot_bytes": 1 << 16, "transport": "shm"})
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, MoecommProcessGroup) and pg.comm.settings["shm_slot_bytes"] == 1 << 16
        x = torch.randn(5)
        y = x.clone()
        dist.all_reduce(y, op=RED.AVG)
        assert torch.equal(x, y)
        kind, msg = outcome(lambda: dist.new_group([0], pg_options=["not", "a", "dict"]))
        assert kind == "TypeError" and "pg_options" in msg, (kind, msg)
    finally:
        dist.destroy_process_group()
    assert pg.comm.closed


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOECOMM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _reports(out: str, nprocs: int) -> list[dict]:
    # ranks share one pipe, so their lines can interleave: pick out the JSON objects
    reports = sorted((json.loads(m) for m in re.findall(r'\{"rank"[^{}]*\}', out)), key=lambda d: d["rank"])
    assert [d["rank"] for d in reports] == list(range(nprocs)), out[-3000:]
    return reports


@pytest.fixture(scope="module")
def launched_jobs() -> dict[str, subprocess.CompletedProcess]:
    """tests/jobs/torch_backend_job.py under torchrun (2 ranks) and, where there is an mpiexec, under
    mpiexec (3 ranks), the two launches side by side (each mostly interpreters importing torch)."""
    commands = {"torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             JOB]}
    if mpiexec_path() is not None:
        commands["mpiexec"] = [mpiexec_path(), "-genv", "MASTER_ADDR", "127.0.0.1", "-genv", "MASTER_PORT",
                               str(_free_port()), "-n", "3", sys.executable, JOB]
    done = run_side_by_side(list(commands.values()), timeout=240, envs=[_env()] * len(commands))
    return dict(zip(commands, done))


def test_init_under_torchrun(launched_jobs):
    p = launched_jobs["torchrun"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    for rep in _reports(p.stdout, 2):
        assert rep["ok"] and rep["backend"] == "moecomm" and rep["size"] == 2, rep


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra)")
def test_init_under_mpiexec_from_pmi_rank_and_size(launched_jobs):
    """env:// with RANK/WORLD_SIZE taken from PMI_RANK/PMI_SIZE; the groups get MPI communicators
    (the sub-group's from MPI_Comm_create_group), and the sub-group forced onto mpi computes right."""
    p = launched_jobs["mpiexec"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    reports = _reports(p.stdout, 3)
    for rep in reports:
        assert rep["ok"] and rep["size"] == 3 and "mpi" in rep["transports"], rep
    assert reports[0]["pair_plan"] == reports[2]["pair_plan"] == "mpi", reports


def _faults(comm, init_method: str) -> dict:
    """Rank 2 skips an all-reduce of the world group, rank 0 aborts a group, rank 1 dies in DDP's backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = comm.rank
    dist.init_process_group("moecomm", init_method=init_method, rank=r, world_size=comm.size,
                            timeout=datetime.timedelta(seconds=3))
    report: dict = {}
    try:
        if r != 2:
            t0 = time.monotonic()
            report["timeout"] = outcome(lambda: dist.all_reduce(torch.ones(4)))
            report["timeout_s"] = time.monotonic() - t0
        comm.barrier()  # rank 2 waits here (launch's own communicator) until ranks 0 and 1 gave up
        aborted = dist.new_group(backend="moecomm", timeout=datetime.timedelta(seconds=30))
        if r == 0:
            aborted.abort()
        comm.barrier()
        report["abort"] = outcome(lambda: dist.all_reduce(torch.ones(4), group=aborted))
        group = dist.new_group(backend="moecomm", timeout=datetime.timedelta(seconds=30))
        model = DDP(torch.nn.Linear(8, 8), process_group=group)
        model(torch.randn(2, 8)).sum().backward()
        if r == 1:
            os._exit(3)  # dies without closing anything
        t0 = time.monotonic()
        report["death"] = outcome(lambda: model(torch.randn(2, 8)).sum().backward())
        report["death_s"] = time.monotonic() - t0
    finally:
        dist.destroy_process_group()
    return report


def test_a_rank_that_never_arrives_or_dies_makes_the_others_raise(tmp_path):
    """Rank 2 skips an all-reduce: ranks 0 and 1 raise a timeout naming it after the 3 s given to
    init_process_group; rank 0 aborts a group: the others' next call on it raises PeerFailedError
    naming rank 0 (rank 0's own raises CommunicatorBrokenError); then rank 1 dies in DDP's backward:
    ranks 0 and 2 raise PeerFailedError naming it."""
    reports = collectives.launch(_faults, 3, f"file://{tmp_path / 'store'}", timeout=60.0, return_exceptions=True)
    assert isinstance(reports[1], collectives.RankFailedError) and "exit code 3" in str(reports[1]), reports
    for rep in reports[:2]:
        if isinstance(rep, dict):
            kind, msg = rep["timeout"]
            assert kind == "CollectiveTimeoutError" and "[2]" in msg and 2.5 < rep["timeout_s"] < 30, rep
    assert isinstance(reports[0], dict) and isinstance(reports[2], dict), reports
    assert reports[0]["abort"][0] == "CommunicatorBrokenError", reports[0]
    kind, msg = reports[2]["abort"]
    assert kind == "PeerFailedError" and "rank 0" in msg, reports[2]
    for rep in (reports[0], reports[2]):
        kind, msg = rep["death"]
        assert kind == "PeerFailedError" and "rank 1" in msg and rep["death_s"] < 30, rep


def test_bench_ddp_runs_both_backends_and_checks_them(tmp_path):
    """`moecomm bench-ddp` on 2 ranks: a row per backend, the ratio, matching parameters, the JSON run."""
    from click.testing import CliRunner

    from benchmarks.bench_ddp import bench_ddp

    out = tmp_path / "ddp.json"
    res = CliRunner().invoke(bench_ddp, ["--width", "40", "--depth", "2", "--batch", "3", "--bucket-mb", "0.002",
                                         "-n", "2", "--reps", "2", "-w", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = {line.split()[0]: line.split() for line in res.output.splitlines() if line.startswith(" ")}
    assert set(rows) == {"local", "moecomm", "gloo"} and rows["moecomm"][-1] == rows["gloo"][-1] == "ok", res.output
    buckets = re.search(r"\((\d+) buckets\)", res.output)
    assert "faster than gloo's" in res.output and buckets and int(buckets.group(1)) >= 2, res.output
    run = json.loads(out.read_text())
    assert run["schema"] == "moecomm-bench-ddp/1" and run["max_param_diff"] == 0.0
    assert {r["backend"] for r in run["rows"]} == {"local", "moecomm", "gloo"} and run["env"]["ranks"] == 2
