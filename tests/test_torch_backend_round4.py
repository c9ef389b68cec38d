"""The moecomm torch.distributed backend, issue #51: what DTensor and dispatch-level tools need.

bool SUM/PRODUCT (DTensor reduces ``Tensor.any()`` with SUM and ``Tensor.all()`` with PRODUCT) and
int8 reductions, against torch's own bool and int8 arithmetic (int8 sums and products wrap), through
every reducing collective and on every host transport path (shm with and without its C helper and
single copy, gloo), with errors on every rank.

Also: the group's calls dispatch through torch's c10d operators to its registered Backend (CommDebugMode
counts them as gloo's), and a dist.batch_isend_irecv cut short by Ctrl-C closes the group. One launch per
rank count runs every check (and one with the groups in Python, where the backend's trampoline is not
built); each check reports on its own.
"""

from __future__ import annotations

import datetime
import functools

import pytest
import torch
import torch.distributed as dist
from spmd import outcome, rank_input

import collectives

RED = dist.ReduceOp
SEED = 51
# torch's meaning of each op on bool (gloo's a + b, a * b stored as bool; NCCL's max and min) and int8
_BOOL = {"SUM": torch.logical_or, "BOR": torch.logical_or, "MAX": torch.logical_or,
         "PRODUCT": torch.logical_and, "BAND": torch.logical_and, "MIN": torch.logical_and}
_INT8 = {"SUM": torch.add, "PRODUCT": torch.mul, "MAX": torch.maximum, "MIN": torch.minimum}
# the host transport paths a group can be put on (pg_options)
PATHS = {"shm": {"transport": "shm"},
         "shm-fallback": {"transport": "shm", "shm_native": "off", "shm_single_copy": "off"},
         "shm-single-copy": {"transport": "shm", "shm_single_copy": "always"}, "gloo": {"transport": "gloo"}}


def _x(kind: str, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input; int8 over its whole range, with -128, 127, 0, -1 at the front."""
    x = rank_input(kind, rank, shape, dtype, SEED)
    if dtype == torch.int8 and x.numel() >= 4:
        x.view(-1)[:4] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8).roll(rank)
    return x


def _ref(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """torch's result: the op applied rank by rank, in the dtype (int8 wraps as torch's int8 does)."""
    table = _BOOL if xs[0].dtype == torch.bool else _INT8
    return functools.reduce(table[op], xs).to(xs[0].dtype)


def _cases() -> list[tuple[torch.dtype, str]]:
    return [(torch.bool, op) for op in _BOOL] + [(torch.int8, op) for op in _INT8]


def _reductions_on(group: dist.ProcessGroup, where: str) -> None:
    """Every reducing collective, bool and int8, every op, odd and empty shapes, against ``_ref``."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    pg = group
    for dtype, name in _cases():
        op = getattr(RED, name)
        for shape in ((7,), (2, 3, 5), (0, 3)):
            what = f"{where}: {dtype} {name} {shape}"
            xs = [_x(f"ar{shape}", q, shape, dtype) for q in range(n)]
            y = xs[r].clone()
            dist.all_reduce(y, op=op, group=group)
            assert torch.equal(y, _ref(xs, name)), f"all_reduce {what}"
            y = xs[r].clone()
            dist.reduce(y, dst=dist.get_global_rank(group, n - 1), op=op, group=group)
            assert torch.equal(y, _ref(xs, name) if r == n - 1 else xs[r]), f"reduce {what}"
            big = [_x(f"rs{shape}", q, (n * shape[0], *shape[1:]), dtype) for q in range(n)]
            out = torch.empty(shape, dtype=dtype)
            dist.reduce_scatter_tensor(out, big[r], op=op, group=group)
            block = [b[r * shape[0]:(r + 1) * shape[0]] for b in big]
            assert torch.equal(out, _ref(block, name)), f"reduce_scatter_tensor {what}"
        # a transposed (non-contiguous) tensor, reduced in place
        xs = [_x("tr", q, (5, 3), dtype).t() for q in range(n)]
        y = xs[r].clone().t().contiguous().t()
        assert not y.is_contiguous()
        dist.all_reduce(y, op=op, group=group)
        assert torch.equal(y, _ref(xs, name)), f"all_reduce transposed {where}: {dtype} {name}"
        # reduce_scatter of lists: even blocks, then uneven ones (one empty on 3 ranks)
        for sizes in ([3] * n, [(q + 1) % 3 for q in range(n)]):
            ins = [[_x(f"rsl{q}", p, (sizes[q], 2), dtype) for q in range(n)] for p in range(n)]
            out = torch.empty((sizes[r], 2), dtype=dtype)
            dist.reduce_scatter(out, ins[r], op=op, group=group)
            assert torch.equal(out, _ref([ins[p][r] for p in range(n)], name)), f"reduce_scatter {sizes} {where}"
        # the coalesced calls (DDP, FSDP): bool and int8 beside a float32 tensor
        a = [_x("ca", q, (3, 4), dtype) for q in range(n)]
        b = [_x("cb", q, (5,), torch.float32) for q in range(n)]
        ts = [a[r].clone(), b[r].clone()]
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = RED.MAX if name in ("MAX", "BOR") else RED.MIN if name in ("MIN", "BAND") else op
        if name not in ("BOR", "BAND"):  # float32 has no BAND/BOR
            pg.allreduce_coalesced(ts, opts).wait()
            assert torch.equal(ts[0], _ref(a, name)), f"allreduce_coalesced {where}: {dtype} {name}"
        ins = [_x("rsc", q, (n * 2, 3), dtype) for q in range(n)]
        outs = [torch.empty(2, 3, dtype=dtype)]
        rs_opts = dist.ReduceScatterOptions()
        rs_opts.reduceOp = op
        pg.reduce_scatter_tensor_coalesced(outs, [ins[r]], rs_opts).wait()
        assert torch.equal(outs[0], _ref([x[2 * r:2 * r + 2] for x in ins], name)), f"rs coalesced {where}"


def _bool_and_int8_reductions(r: int, n: int) -> None:
    """bool SUM/PRODUCT (any/all) and int8 reductions, as torch and gloo give them, on every host path."""
    _reductions_on(dist.group.WORLD, "world")
    for where, options in PATHS.items():
        group = dist.new_group(pg_options=dict(options))
        plan = group.comm.plan("all_reduce", torch.zeros(4, dtype=torch.uint8))  # how int8 travels
        assert plan.transport == options["transport"], (where, plan)
        _reductions_on(group, where)
        dist.destroy_process_group(group)


def _bool_and_int8_errors(r: int, n: int) -> None:
    """AVG and PREMUL_SUM on int8 or bool, and int8 on one rank against uint8 on another, raise on every
    rank, naming it; the group works after them."""
    for dtype in (torch.int8, torch.bool):
        kind, msg = outcome(lambda: dist.all_reduce(torch.zeros(4, dtype=dtype), op=RED.AVG))
        assert kind == "TypeError" and "AVG" in msg and str(dtype) in msg and "rank" in msg, (kind, msg)
        kind, msg = outcome(lambda: dist.all_reduce(torch.zeros(4, dtype=dtype), op=dist._make_nccl_premul_sum(2.0)))
        assert kind == "TypeError" and "PREMUL_SUM" in msg, (kind, msg)
    mixed = torch.zeros(4, dtype=torch.uint8 if r == 1 else torch.int8)
    kind, msg = outcome(lambda: dist.all_reduce(mixed))
    assert kind == "ValueError" and "int8" in msg and "uint8" in msg and "rank 1" in msg, (kind, msg)
    out = torch.empty(2, dtype=torch.uint8 if r == 1 else torch.int8)
    kind, msg = outcome(lambda: dist.reduce_scatter_tensor(out, torch.zeros(2 * n, dtype=out.dtype)))
    assert kind == "ValueError" and "int8" in msg and "uint8" in msg, (kind, msg)
    y = torch.full((3,), 100, dtype=torch.int8)
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((3,), 100 * n, dtype=torch.int64).to(torch.int8)), "the group works after"


def _dtensor_bool_and_int8(r: int, n: int) -> None:
    """DTensor: Tensor.all()/any() of a sharded bool tensor and a partial int8 sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (n,))
    for pattern in ([True] * 2 * n, [True] * (2 * n - 1) + [False], [False] * 2 * n, [False] * (2 * n - 1) + [True]):
        full = torch.tensor(pattern)
        d = distribute_tensor(full, mesh, [Shard(0)])
        assert d.all().full_tensor().item() == full.all().item(), ("all", pattern)
        assert d.any().full_tensor().item() == full.any().item(), ("any", pattern)
    xs = [_x("dt", q, (9,), torch.int8) for q in range(n)]
    d = DTensor.from_local(xs[r], mesh, [Partial()]).redistribute(mesh, [Replicate()])
    assert torch.equal(d.to_local(), _ref(xs, "SUM")), "DTensor int8 partial sum"


def _comm_script(r: int, n: int, group: dist.ProcessGroup) -> None:
    """One call of each collective torch dispatches as a c10d operator, and a functional one."""
    import torch.distributed._functional_collectives as fc

    x = torch.arange(2.0 * n) + r
    dist.all_reduce(x, group=group)
    dist.broadcast(x, src=0, group=group)
    dist.all_gather([torch.empty(2 * n) for _ in range(n)], x, group=group)
    dist.all_gather_into_tensor(torch.empty(2 * n * n), x, group=group)
    dist.reduce_scatter_tensor(torch.empty(2), x, group=group)
    dist.reduce(x, dst=0, group=group)
    dist.all_to_all_single(torch.empty(2 * n), x, group=group)
    dist.gather(x, [torch.empty(2 * n) for _ in range(n)] if r == 0 else None, dst=0, group=group)
    dist.scatter(torch.empty(2), [torch.full((2,), float(q)) for q in range(n)] if r == 0 else None, src=0,
                 group=group)
    dist.barrier(group=group)
    fc.wait_tensor(fc.all_reduce(x, "sum", group))
    with dist._coalescing_manager(group=group):
        dist.all_reduce(x, group=group)
        dist.all_reduce(x * 2, group=group)


def _dispatcher_sees_the_calls(r: int, n: int) -> None:
    """The group's calls go through torch's c10d operators to its registered Backend, as gloo's do:
    CommDebugMode counts the same collectives for both, ``_get_backend`` returns moecomm's backend, and
    parallelize_module's src_data_rank (torch's test_parallelize_module_src_data_rank) counts as over gloo."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    assert backend.name() == "moecomm" and backend.comm is pg.comm, backend
    assert pg._get_backend(torch.device("cuda")) is backend and pg.name() == "moecomm"
    gloo = dist.new_group(backend="gloo")
    counts = {}
    for name, group in (("gloo", gloo), ("moecomm", pg)):
        with CommDebugMode() as mode:
            _comm_script(r, n, group)
        counts[name] = {str(op): k for op, k in mode.get_comm_counts().items()}
        mesh = DeviceMesh.from_group(group, "cpu")
        for src in (1, None):  # None: every rank keeps its own weights, nothing moves
            torch.manual_seed(r)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
            with CommDebugMode() as mode:
                parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}, src_data_rank=src)
            counts[f"{name} src_data_rank={src}"] = {str(op): k for op, k in mode.get_comm_counts().items()}
            if src is not None:  # rank src's weights, sharded
                torch.manual_seed(src)
                ref = torch.nn.Linear(8, 16)
                assert torch.equal(model[0].weight.full_tensor(), ref.weight), f"{name}: src_data_rank={src}"
    assert counts["moecomm"] == counts["gloo"] and sum(counts["moecomm"].values()) >= 11, counts
    for src in (1, None):
        assert counts[f"moecomm src_data_rank={src}"] == counts[f"gloo src_data_rank={src}"], counts
    assert sum(counts["moecomm src_data_rank=1"].values()) > 0 == sum(counts["moecomm src_data_rank=None"].values())
    dist.destroy_process_group(gloo)


def _interrupted_batch(r: int, n: int) -> None:
    """Ctrl-C (a real SIGINT) on rank 0 inside dist.batch_isend_irecv, after its irecv is posted and before
    its isend: rank 0's next batch raises CommunicatorBrokenError, rank 1's pending batch PeerFailedError
    naming rank 0, instead of rank 1 receiving rank 0's next iteration's data."""
    import signal

    import torch.distributed.distributed_c10d as c10d
    from transports.base import CommunicatorBrokenError, PeerFailedError

    pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=10))
    if r > 1:
        return
    peer, real_irecv = 1 - r, c10d.irecv

    def irecv_then_ctrl_c(*args, **kwargs):
        work = real_irecv(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt at the next instruction
        return work

    # a batch whose first operation is refused before posting (a bad tag) cuts nothing: the group goes on
    box, bad = torch.zeros(4), dist.P2POp(c10d.isend, torch.ones(4), peer, pair, tag=1 << 23)
    kind, msg = outcome(lambda: dist.batch_isend_irecv([bad, dist.P2POp(c10d.irecv, box, peer, pair)]))
    assert kind == "ValueError" and "tag" in msg, (kind, msg)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    got = []
    try:
        for step in range(3):
            box, mine = torch.full((4,), -1.0), torch.full((4,), float(10 * step + r))
            c10d.irecv = irecv_then_ctrl_c if (r, step) == (0, 0) else real_irecv  # P2POp checks the module's
            try:
                ops = [dist.P2POp(c10d.irecv, box, peer, pair), dist.P2POp(c10d.isend, mine, peer, pair)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                got.append(box.tolist())
            except KeyboardInterrupt:
                got.append("interrupted")
            except (CommunicatorBrokenError, PeerFailedError) as e:
                got.append((type(e).__name__, str(e)))
            finally:
                c10d.irecv = real_irecv
    finally:
        signal.signal(signal.SIGINT, previous)
    failed = [g if isinstance(g, tuple) else ("data", g) for g in got]  # data: the batch returned
    if r == 0:
        kind, msg = failed[1]
        assert got[0] == "interrupted" and kind == "CommunicatorBrokenError", got
        assert "batch_isend_irecv" in msg and "rank 0" in msg and failed[2][0] == "CommunicatorBrokenError", got
    else:
        kind, msg = failed[0]  # never rank 0's step-1 data
        assert kind == "PeerFailedError" and "rank 0" in msg, got
        assert all(g[0] in ("PeerFailedError", "CommunicatorBrokenError") for g in failed[1:]), got


CHECKS = [_bool_and_int8_reductions, _bool_and_int8_errors, _dtensor_bool_and_int8, _dispatcher_sees_the_calls,
          _interrupted_batch]


def _body(comm, init_method: str, native: bool) -> dict:
    import os

    from collectives.torch_backend import _native
    from collectives.torch_backend._group import PythonProcessGroup

    n, r = comm.size, comm.rank
    if not native:  # the groups of a torch where the trampoline cannot be built
        os.environ[_native.ENV] = "0"
        _native._loaded.clear()
    dist.init_process_group("moecomm", init_method=init_method, rank=r, world_size=n,
                            timeout=datetime.timedelta(seconds=30))
    assert isinstance(dist.group.WORLD, PythonProcessGroup) != native, type(dist.group.WORLD)
    from test_torch_backend_round3 import run_checks

    return run_checks(comm, CHECKS if native else [c for c in CHECKS if c is not _dispatcher_sees_the_calls])


@pytest.mark.parametrize("nprocs,native", [(2, True), (3, True), (2, False)], ids=["2", "3", "2-python"])
def test_round4_torch_callers(nprocs, native, tmp_path):
    """The "2-python" case: the groups run their calls in Python (the trampoline not built)."""
    reports = collectives.launch(_body, nprocs, f"file://{tmp_path / 'store'}", native, timeout=180.0)
    bad = {f"rank {r}: {name}": text for r, rep in enumerate(reports) for name, text in rep.items() if text != "ok"}
    assert not bad, "\n".join(f"{k}\n{v}" for k, v in bad.items())


def test_without_the_trampoline_groups_run_in_python(monkeypatch, caplog):
    """A trampoline that cannot be built (no compiler) or is turned off: load() says why, once, and
    returns None (groups are then PythonProcessGroups, checked by the "2-python" case above)."""
    from collectives.torch_backend import _native

    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setattr(_native, "_load_or_build", lambda: (_ for _ in ()).throw(OSError("no C++ compiler")))
    with caplog.at_level("WARNING", logger="collectives"):
        assert _native.load() is None and _native.load() is None
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "OSError: no C++ compiler" in caplog.text and "CommDebugMode" in caplog.text
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setenv(_native.ENV, "0")
    assert _native.load() is None and f"{_native.ENV}=0" in caplog.text
