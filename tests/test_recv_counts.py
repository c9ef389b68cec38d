"""all_to_all(recv_counts=): the receive counts a caller already knows, checked against what the peers send.

Every transport must give the result of a plain all_to_all when the counts are right, and make
every rank raise ValueError naming the wrong rank and both counts when one rank's are wrong
(shm and the transports without native support here; mpi under mpiexec, started by
tests/test_launch_modes.py::test_collective_suite_under_mpiexec; nccl with a fake NCCL
module, since this machine has no GPU). ExpertDispatcher passes the counts its layout knows.
"""

from __future__ import annotations

import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import collectives
from moe import ExpertDispatcher
from transports.base import GroupInfo, OpCode, Signature
from transports.settings import resolve

import spmd

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _count_matrix(n: int, seed: int) -> torch.Tensor:
    """[n, n] rows rank s sends to rank d: random, some zero, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randint(0, 6, (n, n), generator=g)
    m[0, n - 1] = 0  # an empty pair
    return m


def _body_recv_counts(comm, native: bool = True) -> list[str]:
    """Every case on every rank; returns this rank's failures (all reported together)."""
    if not native:  # the base Transport's default: check after the exchange
        for t in comm.transports.values():
            type(t).takes_recv_counts = False
    n, me = comm.size, comm.rank
    failures: list[str] = []
    m = _count_matrix(n, 11)
    sc, rc = m[me].tolist(), m[:, me].tolist()
    x = spmd.rank_input("a2a", me, (sum(sc), 3), torch.float32, 5)
    plain, plain_rc = comm.all_to_all(x, sc, return_counts=True)
    expected = torch.cat([spmd.rank_input("a2a", s, (int(m[s].sum()), 3), torch.float32, 5)
                          [int(m[s, :me].sum()): int(m[s, :me + 1].sum())] for s in range(n)])
    if not torch.equal(plain, expected):
        failures.append("plain all_to_all differs from the reference")
    for kind, given in (("list", rc), ("tuple", tuple(rc)), ("tensor", torch.tensor(rc)),
                        ("ndarray", np.array(rc, dtype=np.int32))):
        y, got_rc = comm.all_to_all(x, sc, recv_counts=given, return_counts=True)
        if not torch.equal(y, plain) or got_rc.tolist() != rc:
            failures.append(f"recv_counts as {kind}: result or counts differ from the plain call")
    out = torch.empty(sum(rc), 3)
    if comm.all_to_all(x, sc, recv_counts=rc, out=out) is not out or not torch.equal(out, plain):
        failures.append("recv_counts with out=: out not written with the plain result")
    y = comm.all_to_all(x.numpy(), sc, recv_counts=rc)
    if not isinstance(y, np.ndarray) or not np.array_equal(y, plain.numpy()):
        failures.append("recv_counts with NumPy input")
    for j in range(3):  # repeated calls of one signature with other counts (nccl checks only the first)
        mj = _count_matrix(n, 100 + j)
        xj = spmd.rank_input("rep", me, (int(mj[me].sum()), 3), torch.float32, j)
        if not torch.equal(comm.all_to_all(xj, mj[me].tolist(), recv_counts=mj[:, me].tolist()),
                           comm.all_to_all(xj, mj[me].tolist())):
            failures.append(f"repeat {j}: recv_counts result differs")

    # one rank's counts are wrong: every rank raises ValueError naming that rank and both counts
    bad = n - 1
    for what, wrong in (("one more", [c + (1 if s == 0 else 0) for s, c in enumerate(rc)]),
                        ("one less", [max(c - 1, 0) if s == 1 else c for s, c in enumerate(rc)] if rc[1] else
                         [c + 2 if s == 1 else c for s, c in enumerate(rc)]),
                        ("swapped", rc[::-1] if rc[::-1] != rc else [c + 1 for c in rc])):
        kind, msg = spmd.outcome(lambda: comm.all_to_all(x, sc, recv_counts=wrong if me == bad else rc))
        mine = m[:, bad].tolist()
        if kind != "ValueError" or f"rank {comm.global_ranks[bad]} passed recv_counts" not in msg \
                or str(mine) not in msg or "recv_counts" not in msg:
            failures.append(f"wrong recv_counts ({what}) on rank {bad}: got {kind}: {msg[:300]}")
        elif me == bad and str(wrong) not in msg:
            failures.append(f"wrong recv_counts ({what}): the message lacks the declared {wrong}: {msg[:300]}")
    # given on some ranks only: the signatures differ
    kind, msg = spmd.outcome(lambda: comm.all_to_all(x, sc, recv_counts=rc if me != bad else None))
    if kind != "ValueError" or "recv_counts differs" not in msg:
        failures.append(f"recv_counts on some ranks only: got {kind}: {msg[:300]}")
    # a malformed value on one rank: TypeError/ValueError there, ValueError on the others
    for what, malformed, where in (("negative", [-1] + rc[1:], "must be >= 0"), ("short", rc[:-1], "one per rank"),
                                   ("floats", [float(c) for c in rc], "recv_counts[0]"),
                                   ("a string", "3", "recv_counts must be")):
        kind, msg = spmd.outcome(lambda: comm.all_to_all(x, sc, recv_counts=malformed if me == bad else rc))
        ok = (kind in ("TypeError", "ValueError") and where in msg) if me == bad else \
            (kind == "ValueError" and f"[{comm.global_ranks[bad]}] rejected" in msg)
        if not ok:
            failures.append(f"malformed recv_counts ({what}) on rank {bad}: got {kind}: {msg[:300]}")
    # still in step afterwards
    if not torch.equal(comm.all_to_all(x, sc, recv_counts=rc), plain):
        failures.append("all_to_all after the errors differs")
    return failures


@pytest.mark.parametrize("transport", spmd.transports_under_test(shm_paths=True))
def test_recv_counts_equal_plain_and_a_wrong_count_raises_everywhere(transport):
    res = spmd.run(_body_recv_counts, 3, transport=transport, timeout=30.0)
    assert all(r == [] for r in res), [f"rank {r}: {f}" for r, fs in enumerate(res) for f in fs]


def test_recv_counts_through_the_default_for_transports_without_them():
    if spmd.UNDER_MPI:
        pytest.skip("a launch() test")
    res = collectives.launch(_body_recv_counts, 3, False, transport="shm", timeout=30.0)
    assert all(r == [] for r in res), [f"rank {r}: {f}" for r, fs in enumerate(res) for f in fs]


@pytest.mark.skipif(spmd.UNDER_MPI, reason="a launch() test")
def test_recv_counts_over_emulated_ipc():
    """ipc takes recv_counts natively: they travel with the send counts through the signal areas
    (tests/test_ipc_transport.py checks that no barrier is added)."""
    pytest.importorskip("triton")
    res = collectives.launch(_body_recv_counts, 3, transport="ipc", timeout=60.0, options={"ipc_emulate": 1})
    assert all(r == [] for r in res), [f"rank {r}: {f}" for r, fs in enumerate(res) for f in fs]


# ---- ExpertDispatcher hands its known counts to every all_to_all ---------------------------------
class _Recording:
    """A communicator wrapper that records the recv_counts= of every all_to_all."""

    def __init__(self, comm):
        self._comm, self.calls = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_to_all(self, x, send_counts=None, **kw):
        self.calls.append(kw.get("recv_counts"))
        res = self._comm.all_to_all(x, send_counts, **kw)
        if kw.get("recv_counts") is not None:
            self.calls[-1] = (list(kw["recv_counts"]), int(res.shape[0]))
        return res


def _body_moe(comm, capacity_factor):
    rec = _Recording(comm)
    E, H, k = 2 * comm.size, 8, 2
    g = torch.Generator().manual_seed(3 + comm.rank)
    T = 6 + 2 * comm.rank
    x = torch.randn(T, H, generator=g, requires_grad=True)
    experts = torch.rand(T, E, generator=g).argsort(-1)[:, :k]
    weights = torch.rand(T, k, generator=g, requires_grad=True)
    d = ExpertDispatcher(rec, E, capacity_factor=capacity_factor)
    recv_x, tpe, handle = d.dispatch(x, experts, weights=weights.detach() if capacity_factor else None)
    y = d.combine(recv_x * 2.0, handle, weights if not capacity_factor else weights.detach())
    y.sum().backward()
    return rec.calls, handle.layout.recv_counts is not None


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_dispatcher_passes_the_receive_counts_it_knows(capacity_factor):
    if spmd.UNDER_MPI:
        pytest.skip("a launch() test")
    res = collectives.launch(_body_moe, 3, capacity_factor, transport="shm", timeout=30.0)
    for r, (calls, layout_knows) in enumerate(res):
        assert calls, f"rank {r}: no all_to_all"
        # capacity 0.5 drops pairs after the layout's exchange: dispatch then learns its counts itself
        assert layout_knows == (capacity_factor is None), f"rank {r}"
        known = calls if capacity_factor is None else calls[1:]
        assert capacity_factor is None or calls[0] is None, f"rank {r}: {calls}"
        assert all(c is not None and sum(c[0]) == c[1] for c in known), f"rank {r}: {calls}"


# ---- nccl, with a fake NCCL module and threads for ranks (no GPU here) ------------------------------
class _FakeNcclComm:
    def __init__(self, log):
        self.log = log

    def send(self, ptr, count, dtype, peer, stream):
        self.log.append(("send", count, dtype, peer))

    def recv(self, ptr, count, dtype, peer, stream):
        self.log.append(("recv", count, dtype, peer))

    def destroy(self):
        pass


def _nccl_group(monkeypatch, n, check="first"):
    import contextlib

    import transports.nccl as nccl_mod

    logs = [[] for _ in range(n)]
    fake = types.SimpleNamespace(get_unique_id=lambda: (1, 2, 3), groupStart=lambda: None, groupEnd=lambda: None)
    fake.NcclCommunicator = lambda size, uid, rank: _FakeNcclComm(logs[rank])
    monkeypatch.setattr(nccl_mod, "nccl_module", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(nccl_mod.NCCLTransport, "_stream", staticmethod(lambda: 0))
    shared = {"slots": [None] * n, "barrier": threading.Barrier(n), "exchanges": 0}
    # creation is collective (the unique id travels over the rendezvous): one thread per rank
    ts = [None] * n

    def make(r):
        ts[r] = nccl_mod.NCCLTransport(GroupInfo(rank=r, size=n, timeout=10.0,
                                                 rendezvous=spmd.ThreadRendezvous(shared, r), global_ranks=list(range(n)),
                                                 settings=resolve({"nccl_check": check})))
    spmd.on_threads(n, make)
    return ts, logs, shared


@pytest.mark.parametrize("check", ["first", "always"])
def test_nccl_recv_counts_skip_the_count_exchange_and_are_checked(monkeypatch, check):
    n = 3
    ts, logs, shared = _nccl_group(monkeypatch, n, check)
    m = _count_matrix(n, 21)
    row = 4  # elements per row
    sig = Signature.of(OpCode.ALL_TO_ALL, dtype=torch.float32, shape=(0, row), root=1, compare_first_dim=False)
    allocated = {}

    def call(r, recv=None):
        x = torch.randn(int(m[r].sum()) * row)
        rc = m[:, r].tolist() if recv is None else recv

        def alloc(counts):
            allocated[r] = list(counts)
            return torch.empty(sum(counts) * row)
        logs[r].clear()
        ts[r].all_to_all(x, m[r].tolist(), row, alloc, sig, recv_counts=rc)
        return list(logs[r])

    before = shared["exchanges"]
    res = spmd.on_threads(n, call)
    assert shared["exchanges"] - before == 1  # the first call of the signature: checked over the rendezvous
    for r in range(n):
        assert not isinstance(res[r], Exception), res[r]
        assert allocated[r] == m[:, r].tolist()
        # no int64 count exchange: only the rows, of the right sizes, to and from each peer
        sends = sorted((p, c) for op, c, _, p in res[r] if op == "send")
        recvs = sorted((p, c) for op, c, _, p in res[r] if op == "recv")
        assert sends == [(p, int(m[r, p]) * row) for p in range(n) if m[r, p]], res[r]
        assert recvs == [(p, int(m[p, r]) * row) for p in range(n) if m[p, r]], res[r]
        assert all(dt == 7 for _, _, dt, _ in res[r])  # float32 only: no count messages
    before = shared["exchanges"]
    assert all(not isinstance(v, Exception) for v in spmd.on_threads(n, call).values())
    assert shared["exchanges"] - before == (1 if check == "always" else 0)
    # a wrong count on rank 1: checked when the signature is (always: every call; first: a new signature)
    bad_sig = Signature.of(OpCode.ALL_TO_ALL, dtype=torch.float16, shape=(0, row), root=1, compare_first_dim=False)
    for s in ([sig] if check == "always" else []) + [bad_sig]:
        sig = s
        wrong = [c + 1 if p == 0 else c for p, c in enumerate(m[:, 1].tolist())]
        res = spmd.on_threads(n, lambda r: call(r, wrong if r == 1 else None))
        for r in range(n):
            assert isinstance(res[r], ValueError), (r, res[r])
            assert f"rank 1 passed recv_counts {wrong}" in str(res[r]) and str(m[:, 1].tolist()) in str(res[r])
            assert logs[r] == []  # nothing was sent
    for t in ts:
        t.close()


def test_nccl_recv_counts_on_some_ranks_only_raise_everywhere(monkeypatch):
    n = 2
    ts, logs, shared = _nccl_group(monkeypatch, n)
    m = _count_matrix(n, 5)
    sigs = [Signature.of(OpCode.ALL_TO_ALL, dtype=torch.float32, shape=(0, 2), root=root, compare_first_dim=False)
            for root in (1, 0)]

    def call(r):
        x = torch.randn(int(m[r].sum()) * 2)
        alloc = lambda c: torch.empty(sum(c) * 2)  # noqa: E731
        if r == 0:
            return ts[r].all_to_all(x, m[r].tolist(), 2, alloc, sigs[0], recv_counts=m[:, r].tolist())
        return ts[r].all_to_all(x, m[r].tolist(), 2, alloc, sigs[1])

    res = spmd.on_threads(n, call)
    for r in range(n):
        assert isinstance(res[r], ValueError), res[r]
        assert "recv_counts differs (rank 0: given, rank 1: not given)" in str(res[r]), res[r]
