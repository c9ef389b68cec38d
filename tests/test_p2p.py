"""Point-to-point calls of the Communicator (collectives/_p2p.py) over shm (inline, single copy,
staged), gloo and mpi (the mpi cases run when pytest itself runs under mpiexec:
tests/test_launch_modes.py::test_collective_suite_under_mpiexec
starts that), and of the torch backend.

Issue 37 item 3: send/recv went through the rendezvous store (8 MiB at most, irecv blocked, so a
batch with receives posted first deadlocked); none of the Communicator cases existed.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from spmd import UNDER_MPI, rank_input, run

import collectives
from collectives import P2POp
from transports.base import CollectiveTimeoutError, PeerFailedError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# the shm paths (inline + single copy; single copy at every size; staged through the channel), and gloo
PATHS = {"shm": {}, "shm-staged": {"shm_single_copy": "off", "shm_native": "off"}, "gloo": {}}


def _launch(body, n, transport, *args, timeout=60.0):
    if UNDER_MPI:
        return run(body, n, *args, transport="mpi", timeout=timeout)
    t = "gloo" if transport == "gloo" else "shm"
    return collectives.launch(body, n, *args, transport=t, timeout=timeout, options=PATHS[transport] or None)


def _paths():
    return ["mpi"] if UNDER_MPI else list(PATHS)


def _msg(src: int, dst: int, k: int, shape, dtype) -> torch.Tensor:
    return rank_input(f"p2p-{dst}-{k}", src, shape, dtype, 37)


# (shape, dtype) of the messages every pair exchanges: odd sizes, empty, 0-d, several dtypes,
# inline (<= 8 KiB), single copy / staged (> 8 KiB, > one staging chunk), > 8 MiB
CASES = [((7,), torch.float32), ((0,), torch.float64), ((), torch.int64), ((3, 5, 2), torch.bfloat16),
         ((1001,), torch.int32), ((2049,), torch.float16), ((333, 7), torch.uint8), ((4097,), torch.bool),
         ((300_001,), torch.float32), ((2_400_007,), torch.float32)]


def _exchange_body(comm) -> str:
    """Every pair exchanges every case: each rank posts all its receives first, then its sends, in
    one batch (pipeline parallelism's pattern), with a tag per case listed in reverse order on the
    receiving side, so receives are matched by tag, not by posting order."""
    n, r = comm.size, comm.rank
    ops, expect = [], []
    for src in range(n):
        if src == r:
            continue
        for k in reversed(range(len(CASES))):
            shape, dtype = CASES[k]
            out = torch.empty(shape, dtype=dtype)
            ops.append(P2POp("irecv", out, src, tag=k))
            expect.append((out, _msg(src, r, k, shape, dtype)))
    for dst in range(n):
        if dst != r:
            for k, (shape, dtype) in enumerate(CASES):
                ops.append(P2POp("isend", _msg(r, dst, k, shape, dtype), dst, tag=k))
    works = comm.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    for out, ref in expect:
        assert out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref), (ref.dtype, ref.shape)
    # blocking calls in a ring: small (inline, completes at once) sends first
    x = _msg(r, (r + 1) % n, 99, (5, 3), torch.float64)
    comm.send(x, (r + 1) % n, tag=3)
    got = comm.recv((5, 3), (r - 1) % n, tag=3, dtype=torch.float64)
    assert torch.equal(got, _msg((r - 1) % n, r, 99, (5, 3), torch.float64))
    # several messages with one tag arrive in the order sent; non-contiguous tensors; NumPy
    if r == 0:
        base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
        comm.send(base.t(), 1)  # [10, 6], non-contiguous
        comm.send(np.arange(5, dtype=np.int32), 1)
        comm.send(torch.full((3,), 7.0), 1)
        comm.send(torch.full((3,), 8.0), 1)
    elif r == 1:
        out = torch.empty(6, 10).t()
        comm.recv(out, 0)
        assert torch.equal(out, torch.arange(60, dtype=torch.float32).reshape(6, 10).t())
        a = comm.recv(np.zeros(5, dtype=np.int32), 0)
        assert isinstance(a, np.ndarray) and a.tolist() == list(range(5))
        w1, w2 = comm.irecv((3,), 0), comm.irecv((3,), 0)
        assert w2.wait().tolist() == [8.0] * 3 and w1.wait().tolist() == [7.0] * 3
    comm.barrier()
    return "ok"


@pytest.mark.parametrize("transport", _paths())
@pytest.mark.parametrize("nprocs", [2, 3])
def test_messages_of_every_kind_arrive_whatever_the_posting_order(transport, nprocs):
    if transport == "gloo" and nprocs == 3:
        pytest.skip("gloo: 2 ranks are enough (slow on the 2-core CI machine)")
    assert _launch(_exchange_body, nprocs, transport) == ["ok"] * (1 if UNDER_MPI else nprocs)


def _mismatch_body(comm, small: bool) -> list[str]:
    """A dtype and then a shape that differ: both ranks raise ValueError with the same text, and the
    channel goes on working. An inline (small) send returned at once: one of the sender's next
    point-to-point calls raises its error before posting anything (issue #51 item 4), so the sender
    retries that call and every receive still gets its message."""
    r = comm.rank
    seen = []
    n = 100 if small else 300_000
    for send, recv in [(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.float64)),
                       (torch.zeros(n, 2), torch.zeros(n, 3))]:
        errors = []
        try:
            if r == 0:
                comm.send(send, 1, tag=4)
            elif r == 1:
                comm.recv(recv, 0, tag=4)
        except ValueError as e:
            errors.append(str(e))
        if small:
            for _ in range(3):
                comm.barrier()
                try:
                    if r == 0:
                        comm.send(torch.zeros(1), 1, tag=5)
                    elif r == 1:
                        comm.recv(torch.zeros(1), 0, tag=5)
                except ValueError as e:
                    errors.append(str(e))
                    if r == 0:
                        comm.send(torch.zeros(1), 1, tag=5)  # the call that raised posted nothing
        seen.append(errors[0] if len(errors) == 1 else f"{len(errors)} errors: {errors}")
    x = torch.arange(10.0)
    if r == 0:
        comm.send(x, 1)
    elif r == 1:
        assert torch.equal(comm.recv(torch.empty(10), 0), x)
    comm.barrier()
    return seen


@pytest.mark.parametrize("transport", _paths())
@pytest.mark.parametrize("small", [False, True])
def test_a_size_or_dtype_mismatch_raises_on_both_ranks_naming_them(transport, small):
    res = _launch(_mismatch_body, 2, transport, small)
    for seen in res:
        assert len(seen) == 2, seen
        assert "rank 0 sends int64 (" in seen[0] and "rank 1, which receives float64 (" in seen[0], seen
        assert "float32 (" in seen[1] and ", 2)" in seen[1] and ", 3)" in seen[1], seen
    if not UNDER_MPI:
        assert res[0] == res[1], "the same text on both ranks"


def _silent_body(comm) -> list:
    """Rank 0 waits for a message rank 1 sends only later: a bounded wait names rank 1, and waiting
    again (the receive stays posted) then completes."""
    r = comm.rank
    if r == 0:
        w = comm.irecv((1000,), 1, tag=8)
        t0 = time.monotonic()
        try:
            w.wait(timeout=1.0)
            return ["no timeout"]
        except CollectiveTimeoutError as e:
            took = time.monotonic() - t0
            comm.barrier()
            got = w.wait()
            return [str(e), e.missing_ranks, took, got[:3].tolist()]
    if r == 1:
        comm.barrier()  # after rank 0's timeout
        comm.send(torch.arange(1000.0), 0, tag=8)
    return []


@pytest.mark.parametrize("transport", _paths())
def test_a_silent_peer_is_named_within_the_timeout(transport):
    res = _launch(_silent_body, 2, transport)
    if UNDER_MPI and not res[0]:
        return
    msg, missing, took, got = res[0]
    assert missing == [1] and "rank(s) [1]" in msg and "tag 8" in msg, msg
    assert 0.9 <= took < 3.0, took
    assert got == [0.0, 1.0, 2.0]


def _dead_body(comm) -> str:
    if comm.rank == 1:
        os._exit(0)  # no close, no goodbye
    t0 = time.monotonic()
    try:
        comm.recv((4,), 1)
    except PeerFailedError as e:
        assert e.missing_ranks == [1] and "rank 1" in str(e), str(e)
        assert time.monotonic() - t0 < 10, "named at once, not at the timeout"
        return "ok"
    return "no error"


@pytest.mark.skipif(UNDER_MPI, reason="kills a rank")
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_dead_peer_raises_peer_failed(transport):
    res = _launch_allow_death(transport)
    assert res[0] == "ok", res


def _launch_allow_death(transport):
    res = collectives.launch(_dead_body, 2, transport="gloo" if transport == "gloo" else "shm", timeout=30.0,
                             return_exceptions=True)
    return res


def _arg_errors_body(comm) -> list[str]:
    errs = []
    for call in (lambda: comm.send(torch.zeros(1), comm.rank), lambda: comm.send(torch.zeros(1), comm.size),
                 lambda: comm.recv((1,), 1 - comm.rank, tag=-1), lambda: comm.recv(object(), 1 - comm.rank),
                 lambda: comm.recv(torch.zeros(1), 1 - comm.rank, dtype=torch.float32),
                 lambda: comm.send([1.0], 1 - comm.rank)):
        try:
            call()
            errs.append("no error")
        except (TypeError, ValueError) as e:
            errs.append(type(e).__name__)
    return errs


def test_bad_arguments_raise_locally():
    res = collectives.launch(_arg_errors_body, 2, transport="shm", timeout=20.0)
    assert res == [["ValueError", "ValueError", "ValueError", "TypeError", "ValueError", "TypeError"]] * 2


# ---- the torch backend ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_body(comm, method: str) -> str:
    n, r = comm.size, comm.rank
    dist.init_process_group("moecomm", init_method=method, rank=r, world_size=n,
                            timeout=datetime.timedelta(seconds=20))
    try:
        nxt, prv = (r + 1) % n, (r - 1) % n
        # 64 MiB: the store refused values above 8 MiB and was left broken
        big = rank_input("big", r, (16 << 20,), torch.float32, 1)
        out = torch.empty_like(big)
        # receives first on every rank: irecv blocked until its message came, so this deadlocked
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, prv), dist.P2POp(dist.isend, big, nxt)])
        for w in works:
            w.wait()
        assert torch.equal(out, rank_input("big", prv, (16 << 20,), torch.float32, 1)), "64 MiB ring"
        # an irecv Work does not block at creation: its message is sent only after a barrier
        box = torch.empty(3 << 20)
        rw = dist.irecv(box, prv, tag=6)
        dist.barrier()
        s = dist.isend(torch.full((3 << 20,), float(r)), nxt, tag=6)
        assert rw.wait() and s.wait()
        assert torch.equal(box, torch.full((3 << 20,), float(prv)))
        # blocking send/recv in both directions, several dtypes
        for dtype in (torch.float64, torch.int8, torch.bfloat16, torch.complex64):
            x = torch.arange(1001).to(dtype) + r
            if r % 2 == 0:
                dist.send(x, nxt)
                y = torch.empty_like(x)
                dist.recv(y, prv)
            else:
                y = torch.empty_like(x)
                dist.recv(y, prv)
                dist.send(x, nxt)
            assert torch.equal(y, torch.arange(1001).to(dtype) + prv), dtype
        # from any source (shm)
        if r == 1:
            dist.send(torch.full((4,), 5.0), 0, tag=2)
        elif r == 0:
            box = torch.empty(4)
            assert dist.recv(box, tag=2) == 1 and box.tolist() == [5.0] * 4
        # a mismatch raises on both ranks
        try:
            if r == 0:
                dist.send(torch.zeros(5000), 1, tag=9)
            elif r == 1:
                dist.recv(torch.zeros(5001), 0, tag=9)
            mm = "no error"
        except ValueError as e:
            mm = str(e)
        if r in (0, 1):
            assert "rank 0 sends float32 (5000,)" in mm and "receives float32 (5001,)" in mm, mm
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return "ok"


@pytest.mark.skipif(UNDER_MPI, reason="launches its own ranks")
@pytest.mark.parametrize("nprocs", [2, 3])
def test_torch_backend_send_recv_batches_and_64_mib(nprocs, tmp_path):
    method = f"file://{tmp_path / 'store'}" if nprocs == 2 else f"tcp://127.0.0.1:{_free_port()}"
    assert collectives.launch(_torch_body, nprocs, method, timeout=60.0) == ["ok"] * nprocs


@pytest.mark.skipif(UNDER_MPI, reason="launches its own ranks")
def test_bench_p2p_times_every_backend_and_checks_the_echo(tmp_path):
    """`moecomm bench-p2p` on 2 ranks: a checked row per size and backend with its ratio to gloo, the JSON run."""
    import json

    from click.testing import CliRunner

    from benchmarks.bench_p2p import bench_p2p

    out = tmp_path / "p2p.json"
    res = CliRunner().invoke(bench_p2p, ["--sizes", "4K,100000", "-n", "2", "--reps", "2", "-w", "1",
                                         "--json", str(out)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = [line.split() for line in res.output.splitlines() if line.startswith(" ")]
    assert [(r[0], r[1]) for r in rows] == [(s, b) for s in ("4096", "100000")
                                            for b in ("moecomm", "moecomm-dist", "gloo")], res.output
    assert all(r[-1] == "ok" and r[-2].endswith("x") for r in rows), res.output
    run = json.loads(out.read_text())
    assert run["schema"] == "moecomm-bench-p2p/1" and len(run["rows"]) == 6 and run["channel"] == "ShmChannel"
    bad = CliRunner().invoke(bench_p2p, ["--sizes", "1M,x"])
    assert bad.exit_code == 2 and "--sizes" in bad.output, bad.output


class _FakeNccl:
    """Stands in for the nccl transport: the handshakes run for real, the data steps are recorded."""

    name = "nccl"

    def close(self) -> None:
        pass

    def abort(self, why: str) -> None:
        pass


def _nccl_order_body(comm) -> list:
    import transports._p2p_nccl as p2p_nccl
    from collectives._p2p import _pending
    from transports._p2p import Op

    groups = []

    def record(transport, ops):
        if ops:
            groups.append([(op.kind, op.tag) for op in ops])
        for op in ops:
            op.enqueued = True
            op.complete()

    p2p_nccl.enqueue = record
    comm.transports["nccl"] = fake = _FakeNccl()
    try:
        ch = comm._p2p_host_channel()
        peer = 1 - comm.rank
        # every rank: receives first (tags 2, 1), then sends (tags 1, 2)
        ops = [Op("recv", peer, t, torch.empty(300_000), external=True) for t in (2, 1)]
        ops += [Op("send", peer, t, torch.zeros(300_000), external=True) for t in (1, 2)]
        for op in ops:
            ch.post(op)
            _pending(fake).append(op)
        comm._p2p_wait(ops, None)
    finally:
        comm.transports.pop("nccl")
    return groups


@pytest.mark.skipif(UNDER_MPI, reason="launches its own ranks")
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_nccl_steps_go_in_one_group_in_the_same_order_on_both_ranks(transport):
    """GPU-free check of the NCCL data steps' scheduling (transports/_p2p_nccl.py): a rank's sends and
    receives of an exchange are enqueued as one group (separate launches deadlock NCCL's two streams),
    and the sends of one rank come in the order its peer enqueues the matching receives (the order in
    which the receiver matched the messages, which need not be the order either side posted them)."""
    g0, g1 = _launch(_nccl_order_body, 2, transport)
    assert len(g0) == len(g1) == 1 and len(g0[0]) == len(g1[0]) == 4, (g0, g1)
    sends0 = [t for k, t in g0[0] if k == "send"]
    recvs1 = [t for k, t in g1[0] if k == "recv"]
    sends1 = [t for k, t in g1[0] if k == "send"]
    recvs0 = [t for k, t in g0[0] if k == "recv"]
    assert sends0 == recvs1 and sends1 == recvs0 and sorted(sends0) == sorted(sends1) == [1, 2], (g0, g1)


def _any_source_body(comm) -> str:
    r = comm.rank
    try:
        w = comm.irecv((2,), None, tag=1)
    except NotImplementedError as e:
        comm.barrier()
        return str(e)
    if r == 1:
        comm.send(torch.ones(2), 0, tag=1)
    if r == 0:
        got = w.wait()
        assert got.tolist() == [1.0, 1.0] and w.source == 1
    comm.barrier()
    return "ok" if r == 0 else ""


@pytest.mark.skipif(UNDER_MPI, reason="launches its own ranks")
def test_receive_from_any_source_over_shm_and_a_clear_error_elsewhere():
    assert collectives.launch(_any_source_body, 2, transport="shm", timeout=20.0)[0] == "ok"
    msgs = collectives.launch(_any_source_body, 2, transport="gloo", timeout=20.0)
    assert all("any source runs over shm only" in m and "gloo" in m for m in msgs), msgs
