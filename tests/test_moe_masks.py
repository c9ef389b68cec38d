"""Masks in ExpertDispatcher (issue #55): calls without some ranks (dead or stopped), over moe.elastic.MaskedGroup.

Every rank builds the same global batch from a seed and takes its contiguous slice of tokens; the
unmasked ranks compare their part of combine's output (and of the gradients) with a float64
reference computed in one process over the unmasked ranks' tokens, with the slots of the masked
ranks' experts dropped (weights not renormalised). Few launches, many checks in each.
"""

from __future__ import annotations

import math
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch

import collectives
from moe import ExpertDispatcher, MaskedGroup
from moe.elastic import check_masked_ranks
from spmd import UNDER_MPI, left_behind, mark_done, outcome, run, shm_segments, wait_done

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="masked ranks sit calls out; fault injection needs spawned ranks")

H, H2, K = 6, 5, 3
L = 2  # local experts per rank


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal within 1e-12 (float64). Not torch.testing.assert_close: its first call imports torch.distributed.tensor
    (seconds), which would be timed as the first masked call."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (what, (got - want).abs().max().item())


def _inner(disp: ExpertDispatcher, masked: tuple[int, ...]) -> ExpertDispatcher:
    """The dispatcher a call with these masks ran on (white box: the masked group's)."""
    return disp._masks.paths[masked].dispatcher if masked else disp


class _Nodes:
    """A communicator that reports ``nodes`` as its topology's nodes, also in the groups it shrinks to
    (tests/jobs/moe_internode_job.py's FakeNodes, which forwards everything else)."""

    def __init__(self, comm, nodes: tuple[tuple[int, ...], ...]):
        self._comm, self.topology = comm, SimpleNamespace(nodes=nodes)

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def shrink(self, exclude, *, key=""):
        active = [r for r in range(self._comm.size) if r not in exclude]
        nodes = tuple(t for t in (tuple(active.index(r) for r in n if r in active) for n in self.topology.nodes) if t)
        return _Nodes(self._comm.shrink(exclude, key=key), nodes)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _batch(P: int, case: int) -> dict:
    """The global batch of one case: per-rank token counts (one rank empty), tokens, top-k with -1 slots,
    weights, per-expert linear maps and the output gradient; float64."""
    g = torch.Generator().manual_seed(7000 + case)
    ts = [3 + (2 * r + case) % 4 for r in range(P)]
    ts[(case + 1) % P] = 0
    E = L * P
    Tg = sum(ts)
    e = torch.rand(Tg, E, generator=g).argsort(-1)[:, :K]
    e = torch.where(torch.rand(Tg, K, generator=g) < 0.25, torch.full_like(e, -1), e)
    return {"ts": ts, "E": E, "X": torch.randn(Tg, H, generator=g, dtype=torch.float64), "e": e,
            "W": torch.rand(Tg, K, generator=g, dtype=torch.float64),
            "We": torch.randn(E, H, H2, generator=g, dtype=torch.float64) / math.sqrt(H),
            "G": torch.randn(Tg, H2, generator=g, dtype=torch.float64)}


def _reference(b: dict, masked: tuple[int, ...], P: int) -> dict:
    """y, and the gradients of x, weights and expert maps, over the unmasked ranks' tokens (float64,
    one process): the slots of masked ranks' experts dropped, the other weights as they are."""
    ts, e = b["ts"], b["e"]
    rows = torch.cat([torch.arange(sum(ts[:r]), sum(ts[:r + 1])) for r in range(P) if r not in masked])
    X, W, We = (t.clone().requires_grad_() for t in (b["X"], b["W"], b["We"]))
    keep = (e >= 0) & ~torch.isin(torch.div(e, L, rounding_mode="floor"), torch.tensor(masked, dtype=torch.long))
    keep[torch.ones(len(e), dtype=torch.bool).index_fill_(0, rows, False)] = False  # masked ranks' tokens: absent
    out = torch.einsum("th,tjhg->tjg", X, We[e.clamp(min=0)])
    y = torch.einsum("tj,tjg->tg", W * keep, out)
    (y * b["G"]).sum().backward()
    return {"y": y.detach(), "x": X.grad, "w": W.grad, "we": We.grad, "keep": keep}


def _check(comm, disp: ExpertDispatcher, masked: tuple[int, ...], case: int, *, mode: str = "call",
           grad: bool = True) -> dict:
    """One masked dispatch + combine (this rank unmasked) against the reference; mode "call" passes
    masked_ranks=, "layout" goes through get_dispatch_layout(masked_ranks=), "none" passes no masks
    (the dispatcher's permanent ones apply). Returns what the caller asserts on further."""
    P, r = comm.size, comm.rank
    b = _batch(P, case)
    ref = _reference(b, masked, P)
    off, T = sum(b["ts"][:r]), b["ts"][r]
    sl = slice(off, off + T)
    x = b["X"][sl].clone().requires_grad_(grad)
    w = b["W"][sl].clone().requires_grad_(grad)
    we = b["We"][r * L:(r + 1) * L].clone().requires_grad_(grad)
    e = b["e"][sl]
    arg = list(masked) if mode != "none" else None
    if mode == "layout":
        lay = disp.get_dispatch_layout(x, e, weights=w.detach(), masked_ranks=arg)
        assert lay.masked_ranks == masked
        recv_x, tpe, h = disp.dispatch(x, e, layout=lay)
    else:
        recv_x, tpe, h = disp.dispatch(x, e, weights=w.detach() if case % 2 else None, masked_ranks=arg)
    assert h.masked_ranks == masked and tpe.shape == (L,) and tpe.dtype == torch.int64
    # this rank's experts, their rows in (expert, source rank, token, slot) order: exact copies of the tokens
    kept = torch.where(ref["keep"], b["e"], -1).reshape(-1)
    p = ((kept >= r * L) & (kept < (r + 1) * L)).nonzero(as_tuple=True)[0]
    p = p[torch.argsort(kept[p], stable=True)]
    want = b["X"][p // K]
    if not getattr(_inner(disp, masked), "node_aware", False):
        assert torch.equal(recv_x.detach(), want), "recv_x rows"
    else:  # the node-aware path orders each expert's rows by forwarder, then source node and token
        for got_j, want_j in zip(torch.split(recv_x.detach(), tpe.tolist()), torch.split(want, tpe.tolist())):
            assert torch.equal(got_j[got_j[:, 0].argsort()], want_j[want_j[:, 0].argsort()]), "recv_x rows"
    assert tpe.tolist() == torch.bincount(kept[p] - r * L, minlength=L).tolist()
    out = torch.cat([c @ we[i] for i, c in enumerate(torch.split(recv_x, tpe.tolist()))])
    y = disp.combine(out, h, w)
    _close(y.detach(), ref["y"][sl], "y")
    if grad:
        (y * b["G"][sl]).sum().backward()
        _close(x.grad, ref["x"][sl], "x.grad")
        _close(w.grad, ref["w"][sl], "weights.grad")
        _close(we.grad, ref["we"][r * L:(r + 1) * L], "expert grad")
    return {"handle": h, "pairs": int(tpe.sum())}


# ---- (a) per-call masks -------------------------------------------------------------------------
def _per_call_body(comm, sets: list[tuple[int, ...]], nodes: tuple[tuple[int, ...], ...] | None = None) -> dict:
    comm.barrier()  # the group's own connections are up (gloo's open on use)
    fds0 = _fds()
    P, r = comm.size, comm.rank
    base = comm
    if nodes is not None:
        comm = _Nodes(comm, nodes)
    disp = ExpertDispatcher(comm, L * P)
    cap = ExpertDispatcher(comm, L * P, capacity_factor=1.0, node_aware=False)
    done, builds, node_aware = [], {}, {}
    for i, masked in enumerate(sets):
        if r in masked:  # a masked rank sits the call out
            continue
        t0 = time.monotonic()
        _check(comm, disp, masked, case=i, mode="layout" if i == 3 else "call")
        builds.setdefault(masked, time.monotonic() - t0)
        node_aware[masked] = _inner(disp, masked).node_aware
        done.append(i)
    assert disp.masked_ranks == () and disp.active_comm is disp.comm  # per-call masks are not permanent
    # capacity with masks: C counts the unmasked ranks' tokens and experts
    masked = sets[0]
    if r not in masked:
        b = _batch(P, 99)
        off, T = sum(b["ts"][:r]), b["ts"][r]
        x, e, w = b["X"][off:off + T], b["e"][off:off + T], b["W"][off:off + T]
        _, _, h = cap.dispatch(x, e, weights=w, masked_ranks=masked)
        active = [q for q in range(P) if q not in masked]
        t_act = sum(b["ts"][q] for q in active)
        assert h.layout.num_global_tokens == t_act
        assert h.layout.capacity == math.ceil(1.0 * t_act * K / (len(active) * L))
        assert h.layout.global_tokens_per_expert.shape == (len(active) * L,)
    disp.close()
    cap.close()
    base.barrier()
    return {"done": done, "fds": (fds0, _fds()), "build_s": max(builds.values()) if builds else 0.0,
            "node_aware": node_aware}


@pytest.mark.parametrize("nprocs,transport", [(2, "shm"), (3, "shm"), (4, "shm"), (3, "gloo")])
def test_per_call_masks_match_the_reference(nprocs, transport):
    """Several mask sets in turn on one dispatcher ({1}, then {2}, none, {1} again, two ranks); the masked
    ranks do not call; outputs and gradients equal the reference within 1e-12; nothing leaks."""
    sets = {2: [(1,), (0,), (), (1,)],
            3: [(1,), (2,), (), (1,), (0, 2)],
            4: [(1,), (2,), (), (1,), (1, 3), (0, 2, 3)]}[nprocs]
    before = shm_segments()
    res = collectives.launch(_per_call_body, nprocs, sets, transport=transport, timeout=30)
    for r, out in enumerate(res):
        assert out["done"] == [i for i, m in enumerate(sets) if r not in m], (r, out)
        assert out["fds"][0] == out["fds"][1], (r, out["fds"])
        assert out["build_s"] < 5, out
    assert not left_behind(before)


def test_per_call_masks_on_the_node_aware_path():
    """6 ranks as 3 "nodes" of 2: masking a whole node leaves 2 nodes of 2 (the masked group takes the
    node-aware path too), masking one rank leaves unequal nodes (flat); results as the reference."""
    sets = [(4, 5), (5,), (), (2, 3), (0,)]
    nodes = ((0, 1), (2, 3), (4, 5))
    res = collectives.launch(_per_call_body, 6, sets, nodes, timeout=30)
    for r, out in enumerate(res):
        assert out["done"] == [i for i, m in enumerate(sets) if r not in m], (r, out)
        assert out["fds"][0] == out["fds"][1], (r, out["fds"])
        want = {(4, 5): True, (5,): False, (): True, (2, 3): True, (0,): False}
        assert out["node_aware"] == {m: want[m] for m in sets if r not in m}, (r, out["node_aware"])


# ---- (b) a stopped rank ---------------------------------------------------------------------------
CALLS = 20


def _stopped_body(comm) -> dict:
    pids = comm.all_gather(torch.tensor([[os.getpid()]]))[:, 0].tolist()
    disp = ExpertDispatcher(comm, L * comm.size)
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # until a peer sends SIGCONT
        disp.close()
        comm.barrier()
        return {}
    deadline = time.monotonic() + 10
    while open(f"/proc/{pids[2]}/stat").read().split(") ")[1][0] != "T":  # rank 2 is stopped
        assert time.monotonic() < deadline, "rank 2 did not stop"
        time.sleep(0.01)
    times = []
    for i in range(CALLS):
        t0 = time.monotonic()
        _check(comm, disp, (2,), case=i, grad=i % 5 == 0)
        times.append(time.monotonic() - t0)
    if comm.rank == 0:
        os.kill(pids[2], signal.SIGCONT)
    disp.close()
    comm.barrier()  # the whole group again, once rank 2 runs
    return {"times": times}


def test_a_stopped_rank_is_not_waited_for():
    """Rank 2 stops itself (SIGSTOP); ranks 0 and 1 run 20 masked dispatch + combine calls without it:
    each call after the first (which builds the group) < 1 s, all 20 < 10 s; then it resumes."""
    before = shm_segments()
    res = collectives.launch(_stopped_body, 3, timeout=30)
    for r in (0, 1):
        times = res[r]["times"]
        assert len(times) == CALLS and max(times[1:]) < 1.0 and sum(times) < 10.0, times
    assert not left_behind(before)


# ---- (c) a rank dies ------------------------------------------------------------------------------
def _death_body(comm) -> dict:
    fds0 = _fds()
    P, r = comm.size, comm.rank
    other = comm.split(0)
    d_mask = ExpertDispatcher(comm, L * P, on_peer_failure="mask")
    d_raise = ExpertDispatcher(other, L * P)
    comm.barrier()
    if r == 2:
        os._exit(1)
    out: dict = {}
    t0 = time.monotonic()
    _check(comm, d_mask, (2,), case=0, mode="none")  # the very call that meets the death: re-run on 0, 1, 3
    out["mask_s"] = time.monotonic() - t0
    out["masked"] = d_mask.masked_ranks
    out["active"] = (d_mask.active_comm.size, d_mask.active_comm.rank)
    _check(comm, d_mask, (2,), case=1, mode="none")                # later calls: on the survivors
    if r != 3:
        _check(comm, d_mask, (2, 3), case=2, mode="call")         # plus a per-call mask
    # "raise": PeerFailedError naming rank 2, then mask([2]) and go on
    out["raise"] = outcome(lambda: _check(comm, d_raise, (2,), case=3, mode="none"))
    t0 = time.monotonic()
    d_raise.mask([2])
    out["shrink_s"] = time.monotonic() - t0
    _check(comm, d_raise, (2,), case=4, mode="none")
    # a death between dispatch and combine: combine masks it and raises again; the next step runs
    b = _batch(P, 5)
    off, T = sum(b["ts"][:r]), b["ts"][r]
    recv_x, _, h = d_mask.dispatch(b["X"][off:off + T], b["e"][off:off + T])
    if r == 3:
        os._exit(1)
    out["combine"] = outcome(lambda: d_mask.combine(recv_x, h, b["W"][off:off + T]))
    out["masked2"] = d_mask.masked_ranks
    _check(comm, d_mask, (2, 3), case=6, mode="none")
    d_mask.close()
    d_raise.close()
    other.close()
    out["fds"] = (fds0, _fds())
    return out


def test_a_dead_rank_is_masked_in_the_call_that_meets_it():
    """4 ranks, rank 2 exits before a dispatch: with on_peer_failure="mask" ranks 0, 1, 3 get that very
    call's result (rank 2's experts dropped, its tokens absent) without an error, within 5 s, and later
    calls work; with "raise" they get PeerFailedError naming rank 2, then mask([2]) and go on. Rank 3
    then exits between a dispatch and its combine: combine raises PeerFailedError, rank 3 is masked."""
    before = shm_segments()
    res = collectives.launch(_death_body, 4, timeout=20, return_exceptions=True)
    assert isinstance(res[2], Exception) and isinstance(res[3], Exception)
    for r in (0, 1):
        out = res[r]
        assert not isinstance(out, BaseException), out
        assert out["mask_s"] < 5, out
        assert out["masked"] == (2,) and out["active"] == (3, r), out
        kind, msg = out["raise"]
        assert kind == "PeerFailedError" and "rank 2" in msg, out["raise"]
        assert out["shrink_s"] < 5, out
        kind, msg = out["combine"]
        assert kind == "PeerFailedError" and "rank 3" in msg and "masked now" in msg, out["combine"]
        assert out["masked2"] == (2, 3), out
        assert out["fds"][1] <= out["fds"][0], out["fds"]
    assert not left_behind(before)


def _out_of_step_body(comm) -> dict:
    disp = ExpertDispatcher(comm, L * comm.size, on_peer_failure="mask")
    comm.barrier()
    if comm.rank == 2:
        os._exit(1)
    if comm.rank == 1:
        disp._masks.calls[()] += 1  # as if rank 1 had gone on to the next call when rank 2 died
    out = {"call": outcome(lambda: _check(comm, disp, (2,), case=0, mode="none")), "masked": disp.masked_ranks}
    _check(comm, disp, (2,), case=1, mode="none")  # the masks stand: the next call runs on the survivors
    disp.close()
    return out


def test_survivors_in_different_calls_raise_value_error():
    """Rank 2 dies while the survivors are (as far as their call counters say) in different calls of the
    dispatcher: every survivor raises ValueError saying so instead of re-running the call; the next call works."""
    before = shm_segments()
    res = collectives.launch(_out_of_step_body, 3, timeout=20, return_exceptions=True)
    for r in (0, 1):
        out = res[r]
        assert not isinstance(out, BaseException), out
        kind, msg = out["call"]
        assert kind == "ValueError" and "not all in the same call" in msg and "rank 0: 1, rank 1: 2" in msg, msg
        assert out["masked"] == (2,)
    assert not left_behind(before)


# ---- (d) bad and differing masks ------------------------------------------------------------------
def _errors_body(comm, tmp: str) -> dict:
    fds0 = _fds()
    r = comm.rank
    disp = ExpertDispatcher(comm, L * comm.size)
    x, e = torch.randn(4, H, dtype=torch.float64), torch.randint(0, L * comm.size, (4, K))
    out = {"range": outcome(lambda: disp.dispatch(x, e, masked_ranks=[7])),
           "self": outcome(lambda: disp.dispatch(x, e, masked_ranks=[r])),
           "twice": outcome(lambda: disp.dispatch(x, e, masked_ranks=[(r + 1) % 4] * 2)),
           "mask_self": outcome(lambda: disp.mask([r])),
           "ctor": outcome(lambda: ExpertDispatcher(comm, 8, on_peer_failure="ignore"))}
    # a bad expert id in a masked call is rejected on every unmasked rank, naming the caller's E
    if r != 3:
        out["ids"] = outcome(lambda: disp.dispatch(x, torch.full((4, K), 9 if r == 1 else 0), masked_ranks=[3]))
        _check(comm, disp, (3,), case=0)          # builds the group of {3} and works
        # ranks 0 and 2 mask {3}, rank 1 masks {2, 3}: they wait on different groups until the timeout
        t0 = time.monotonic()
        out["differ"] = outcome(lambda: disp.dispatch(x, e, masked_ranks=[2, 3] if r == 1 else [3]))
        out["differ_s"] = time.monotonic() - t0
        mark_done(tmp, r)
    else:  # rank 3 waits for the others' timeouts before the call of all four
        assert wait_done(tmp, [0, 1, 2], limit=30)
    _check(comm, disp, (), case=1)                 # the communicator itself is fine: all four ranks
    disp.close()
    out["fds"] = (fds0, _fds())
    return out


def test_bad_and_differing_masks_raise_value_error(tmp_path):
    """Out-of-range, repeated and self-masking masked_ranks raise ValueError naming the rank; unmasked ranks
    that pass different masks raise ValueError after the timeout (they wait on different groups)."""
    timeout = 3.0
    before = shm_segments()
    res = run(_errors_body, 4, str(tmp_path), timeout=timeout)
    for r, out in enumerate(res):
        for case, needle in (("range", "out of range"), ("self", f"rank {r} masks itself"), ("twice", "twice"),
                             ("mask_self", f"rank {r} masks itself"), ("ctor", "on_peer_failure")):
            kind, msg = out[case]
            assert kind == "ValueError" and needle in msg, (r, case, msg)
            if case != "ctor":
                assert f"on rank {r}" in msg, (r, case, msg)
        if r != 3:
            kind, msg = out["ids"]
            assert kind == "ValueError" and "[0, 8)" in msg and "rank 1" in msg, (r, msg)
            kind, msg = out["differ"]
            assert kind == "ValueError" and "same masked_ranks" in msg, (r, msg)
            assert out["differ_s"] < timeout + 3, out["differ_s"]
        assert out["fds"][0] == out["fds"][1], (r, out["fds"])
    assert not left_behind(before)


# ---- local: the id map and the argument check ----------------------------------------------------
class _FakeComm:
    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.global_ranks = rank, size, list(range(size))
        self.shrunk = None

    def shrink(self, exclude, *, key):
        self.shrunk = (list(exclude), key)
        return self


def test_map_experts_and_check_masked_ranks():
    c = _FakeComm(0, 4)
    g = MaskedGroup(c, [3, 1], 8)
    assert c.shrunk == ([1, 3], "mask1-3")
    assert (g.masked, g.active, g.num_active_experts) == ((1, 3), (0, 2), 4)
    e = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [-1, 5, 8, -2]], dtype=torch.int32)
    m = g.map_experts(e)
    assert m.dtype == torch.int64 and m.shape == e.shape
    assert m.tolist() == [[0, 1, -1, -1], [2, 3, -1, -1], [-1, 3, 8, -2]]  # bad ids pass through
    assert g.map_experts(torch.empty(0, 2, dtype=torch.long)).shape == (0, 2)
    assert check_masked_ranks(c, None, where="t") == ()
    assert check_masked_ranks(c, [3, torch.tensor(1)], where="t") == (1, 3)
    for bad, needle in (([4], "out of range"), ([-1], "out of range"), ([1, 1], "twice"), ([0], "masks itself"),
                        ([1.0], "ints")):
        with pytest.raises(ValueError, match=needle):
            check_masked_ranks(c, bad, where="t")
    with pytest.raises(TypeError):
        check_masked_ranks(c, 3, where="t")
