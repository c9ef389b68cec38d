"""MoELayer with redundant experts (EPLB, issue #54): it equals the layer without them, before and after a live
rebalance, in training (Adam, optimizer state moved) too; the low-latency dispatcher over routed slots; the
rebalance's agreement and its failure when a peer dies; the Balancer's decision.

Every body compares a layer built with ``num_redundant_experts=R`` against the same-seed layer with R = 0 on the
same ranks, in float64, on random tokens (one rank without tokens).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import collectives
from collectives import CollectiveTimeoutError, PeerFailedError, RankFailedError
from moe import Balancer, MoELayer, Placement, balance, gather_state_dict, route, shard_state_dict
from moe.rebalance import _plan
from spmd import left_behind, outcome, shm_segments

H, F, K = 16, 12, 2
KW = dict(activation="swiglu", aux_loss_coef=0.01, z_loss_coef=1e-3, seed=5)
TOL = 1e-10


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


def _skewed(E: int) -> torch.Tensor:
    """Hot low ids, cold high ones: balance() replicates and moves experts."""
    return torch.tensor([1000.0 / (1 + e) ** 1.5 for e in range(E)])


def _step(comm, layer, x, G):
    """Forward + backward of (y * G).sum() + aux on this rank's rows; (y, aux, x.grad)."""
    x = x.clone().requires_grad_()
    y, aux = layer(x)
    ((y * G).sum() + aux).backward()
    return y.detach(), aux.detach(), x.grad


def _compare(comm, plain, eplb, x, G, what):
    """eplb (R > 0) against plain (R = 0): forward, aux, input grad, router grad, per-logical expert grads."""
    for layer in (plain, eplb):
        layer.zero_grad(set_to_none=True)
    y0, a0, gx0 = _step(comm, plain, x, G)
    y1, a1, gx1 = _step(comm, eplb, x, G)
    _close(y1, y0, f"{what}: forward")
    _close(a1, a0, f"{what}: aux loss (per-logical counts)")
    _close(gx1, gx0, f"{what}: grad x")
    _close(eplb.router.weight.grad, plain.router.weight.grad, f"{what}: grad router")
    eplb.reduce_replica_grads()
    ids = torch.tensor(eplb.experts.expert_ids)
    for name in ("fc1", "fc2"):
        want = comm.all_gather(getattr(plain.experts, name).grad)       # [E, ...]: plain is the identity
        _close(getattr(eplb.experts, name).grad, want[ids], f"{what}: grad {name} per logical expert")
    full0, full1 = gather_state_dict(plain), gather_state_dict(eplb)
    assert full0.keys() == full1.keys()
    for n in full0:
        assert torch.equal(full0[n], full1[n]), f"{what}: gathered {n}"
    # the redundant replicas did serve tokens (not only each expert's first slot)
    counts = eplb.last_handle.layout.global_tokens_per_expert
    extra = eplb.placement.logical_to_physical[:, 1:]
    assert int(counts[extra[extra >= 0]].sum()) > 0, (what, counts, eplb.placement)


def _equal_body(comm, E: int, R: int) -> list:
    P, r = comm.size, comm.rank
    plain = MoELayer(comm, H, F, E, K, **KW).double()
    eplb = MoELayer(comm, H, F, E, K, num_redundant_experts=R, **KW).double()
    assert eplb.num_local_experts == (E + R) // P and eplb.placement == Placement.default(E, P, R)
    assert eplb.experts.expert_ids == eplb.placement.physical_to_logical[eplb.placement.slots_of(r)].tolist()
    g = torch.Generator().manual_seed(40 + r)
    rows = [[9, 0, 7, 4][q] for q in range(P)]
    x = torch.randn(rows[r], H, generator=g, dtype=torch.float64)
    G = torch.randn(rows[r], H, generator=g, dtype=torch.float64)
    _compare(comm, plain, eplb, x, G, "default placement")
    # load statistics: this rank's router choices per logical expert, accumulated over forwards, no reset between
    choices = torch.bincount(plain.router.route(x)[1].reshape(-1), minlength=E)
    assert eplb.expert_load.dtype == torch.int64 and torch.equal(eplb.expert_load, choices)
    eplb(x)
    assert torch.equal(eplb.expert_load, 2 * choices) and torch.equal(plain.expert_load, choices)
    eplb.reset_expert_load()
    assert int(eplb.expert_load.abs().sum()) == 0

    # live rebalance to balance() of skewed loads, one expert per round (several rounds), then the same checks
    new = balance(_skewed(E), P, R)
    assert new != eplb.placement
    fc1 = eplb.experts.fc1
    moved = eplb.rebalance(new, max_experts_per_round=1)
    assert eplb.placement == new and eplb.experts.fc1 is fc1
    assert eplb.experts.expert_ids == new.physical_to_logical[new.slots_of(r)].tolist()
    assert moved.rounds >= 2 and moved.received + moved.copied <= moved.rounds
    x2 = torch.randn([3, 6, 0, 5][r] if P == 4 else [0, 8][r], H, generator=g, dtype=torch.float64)
    G2 = torch.randn(x2.shape, generator=g, dtype=torch.float64)
    _compare(comm, plain, eplb, x2, G2, "after rebalance")

    # shard_state_dict slices a full (logical) state dict by physical_to_logical: a differently seeded layer with
    # the new placement loads it and computes the same
    other = MoELayer(comm, H, F, E, K, num_redundant_experts=R, placement=new, **dict(KW, seed=9)).double()
    other.load_state_dict(shard_state_dict(other, gather_state_dict(plain)))
    _close(other(x2)[0], plain(x2)[0], "loaded from a gathered state dict")
    return [moved.rounds, moved.received, moved.copied]


@pytest.mark.parametrize("nprocs,E,R", [(2, 4, 2), (4, 8, 4)])
def test_redundant_experts_equal_the_plain_layer_before_and_after_a_rebalance(nprocs, E, R):
    res = collectives.launch(_equal_body, nprocs, E, R, timeout=120)
    assert len({r[0] for r in res}) == 1, res  # every rank ran the same rounds
    assert sum(r[1] for r in res) > 0, res      # something crossed the wire


def _permute_body(comm) -> list:
    """R = 0 with a rotating placement: every slot is overwritten and is another slot's source, so later rounds
    read the old rows that earlier rounds overwrote (kept aside); then back to the identity."""
    plain = MoELayer(comm, H, F, 4, K, **KW).double()
    perm = MoELayer(comm, H, F, 4, K, **KW).double()
    rot = Placement(torch.tensor([1, 2, 3, 0]), 2, 4)
    out = [tuple(perm.rebalance(rot, max_experts_per_round=1))]
    g = torch.Generator().manual_seed(7 + comm.rank)
    x = torch.randn(6 + comm.rank, H, generator=g, dtype=torch.float64)
    _close(perm(x)[0], plain(x)[0], "rotated experts")
    assert "experts [" in repr(perm)
    out.append(tuple(perm.rebalance(Placement.default(4, 2), max_experts_per_round=3)))
    assert perm._identity
    for n, t in gather_state_dict(plain).items():
        assert torch.equal(gather_state_dict(perm)[n], t), n
    return out


def test_plans_of_random_placements_move_every_slot_right_within_the_round_bound():
    """_plan on random old/new slot tables, replayed on logical ids the way _move does (reads, then the rows
    kept aside, then writes, per round): every slot ends right, from a slot of its rank where there is one."""
    rng = torch.Generator().manual_seed(3)

    def table(E, N):
        return torch.cat([torch.arange(E), torch.randint(0, E, (N - E,), generator=rng)])[
            torch.randperm(N, generator=rng)].tolist()

    kept_aside = 0
    for _ in range(400):
        P, S, m = (int(v) for v in torch.randint(1, 5, (3,), generator=rng))
        E = int(torch.randint(1, P * S + 1, (1,), generator=rng))
        old, new = table(E, P * S), table(E, P * S)
        source, round_of, hold_until = _plan(old, new, S, P, m)
        assert set(source) == {d for d in range(P * S) if old[d] != new[d]}
        slots, held = list(old), {}
        for i in range(max(round_of.values(), default=-1) + 1):
            now = [d for d, r in round_of.items() if r == i]
            assert all(sum(d // S == q for d in now) <= m for q in range(P))
            rows = {d: held.get(source[d], slots[source[d]]) for d in now}
            held.update((d, slots[d]) for d in now if hold_until.get(d, -1) > i)
            for d in now:
                slots[d] = rows[d]
            held = {s: v for s, v in held.items() if hold_until[s] > i}
        assert slots == new, (old, new, source, round_of)
        mine = [{old[s] for s in range(q * S, (q + 1) * S)} for q in range(P)]
        assert all(source[d] // S == d // S for d in source if new[d] in mine[d // S])
        for s in hold_until:  # rows are kept aside only to break a cycle of moves (s's source chain returns to s)
            d, seen = source[s], 0
            while d != s and d in source and seen <= len(source):
                d, seen = source[d], seen + 1
            assert d == s, (old, new, source, round_of, hold_until)
        kept_aside += len(hold_until)
    assert kept_aside > 0


def test_a_rotation_needs_old_rows_kept_aside_and_comes_back():
    source, round_of, hold_until = _plan([0, 1, 2, 3], [1, 2, 3, 0], 2, 2, 1)
    assert hold_until, (source, round_of)  # the case the body checks end to end
    res = collectives.launch(_permute_body, 2, timeout=60)
    assert res[0][0][0] == res[1][0][0] == max(round_of.values()) + 1 >= 2, res


# ---- training: Adam with a rebalance in the middle --------------------------------------------------
def _train(comm, layer, opt, steps, rebalance_after=None):
    losses = []
    for i in range(steps):
        g = torch.Generator().manual_seed(1000 * i + comm.rank)
        x = torch.randn(0 if (i == 3 and comm.rank == 1) else 5 + 2 * comm.rank + i, H, generator=g,
                        dtype=torch.float64)
        G = torch.randn(x.shape, generator=g, dtype=torch.float64)
        y, aux = layer(x)
        loss = (y * G).sum() + aux
        loss.backward()
        layer.reduce_replica_grads()
        for p in (layer.router.weight, layer.shared.fc1, layer.shared.fc2):  # data-parallel replicated params
            p.grad = comm.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(comm.all_reduce(loss.detach().reshape(1))[0])
        if i + 1 == rebalance_after:
            loads = comm.all_reduce(layer.expert_load.clone())
            new = balance(loads.double() ** 2 + _skewed(layer.num_experts), comm.size, layer.num_redundant_experts)
            assert new != layer.placement
            params = [id(p) for p in layer.parameters()]
            moved = layer.rebalance(new, opt, max_experts_per_round=2)
            assert int(comm.all_reduce(torch.tensor([moved.received]))[0]) > 0
            assert [id(p) for p in layer.parameters()] == params
            assert layer.experts.fc1.grad is None
    return torch.stack(losses)


def _adam_body(comm) -> None:
    kw = dict(KW, shared_ffn_hidden_size=6)
    plain = MoELayer(comm, H, F, 4, K, **kw).double()
    eplb = MoELayer(comm, H, F, 4, K, num_redundant_experts=2, **kw).double()
    opts = [torch.optim.Adam(m.parameters(), lr=0.05) for m in (plain, eplb)]
    l0 = _train(comm, plain, opts[0], 5)
    l1 = _train(comm, eplb, opts[1], 5, rebalance_after=2)
    _close(l1, l0, "losses")
    full0, full1 = gather_state_dict(plain), gather_state_dict(eplb)
    for n in full0:
        _close(full1[n], full0[n], f"parameter {n} after 5 Adam steps")
    start = gather_state_dict(MoELayer(comm, H, F, 4, K, **kw).double())
    assert float((full0["experts.fc1"] - start["experts.fc1"]).abs().max()) > 1e-3  # training changed them
    # replicas stayed identical, and so did their optimizer state (moved along)
    st = opts[1].state[eplb.experts.fc1]
    for t in (eplb.experts.fc1.detach(), st["exp_avg"], st["exp_avg_sq"]):
        rows = comm.all_gather(t.contiguous())
        p = eplb.placement
        for e in range(4):
            reps = [s for s in p.logical_to_physical[e].tolist() if s >= 0]
            for s in reps[1:]:
                _close(rows[s], rows[reps[0]], f"replicas of expert {e}")


def test_adam_with_a_rebalance_equals_adam_without_eplb():
    collectives.launch(_adam_body, 2, timeout=120)


# ---- errors: a differing placement, a peer that dies mid-move -----------------------------------------
def _errors_body(comm) -> dict:
    import moe.rebalance as rb

    r = comm.rank
    out = {
        "R not dividing": outcome(lambda: MoELayer(comm, H, F, 6, K, num_redundant_experts=1)),
        "R negative on rank 1": outcome(lambda: MoELayer(comm, H, F, 6, K, num_redundant_experts=-1 if r == 1 else 3)),
        "construction placement": outcome(lambda: MoELayer(
            comm, H, F, 6, K, num_redundant_experts=3,
            placement=balance(_skewed(6), 3, 3) if r == 2 else None)),
    }
    layer = MoELayer(comm, H, F, 6, K, num_redundant_experts=3, **KW).double()
    x = torch.randn(4 + r, H, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
    y = layer(x)[0].detach()
    good = balance(_skewed(6), 3, 3)
    other = balance(torch.arange(6.0) + 1, 3, 3)
    assert good != other
    out["placement differs on rank 2"] = outcome(lambda: layer.rebalance(other if r == 2 else good))
    out["placement for other sizes on rank 1"] = outcome(
        lambda: layer.rebalance(balance(_skewed(6), 3, 6) if r == 1 else good))
    assert layer._moving is None and layer.placement == Placement.default(6, 3, 3)
    _close(layer(x)[0], y, "after refused rebalances")   # nothing moved
    seen = []
    rb._after_round = lambda lay, i: seen.append(outcome(lambda: lay(x)))
    try:
        layer.rebalance(good, max_experts_per_round=1)
    finally:
        rb._after_round = None
    out["forward during a rebalance"] = seen[0]
    _close(layer(x)[0], y, "after a rebalance")
    return out


def test_rebalance_refuses_a_differing_placement_on_every_rank():
    res = collectives.launch(_errors_body, 3, timeout=60)
    expected = {
        "R not dividing": ("ValueError", "6 + 1 = 7 slots are not divisible by the 3 ranks"),
        "R negative on rank 1": ("ValueError", "MoELayer on rank 1: num_redundant_experts must be an int >= 0"),
        "construction placement": ("ValueError", "placement (digest) (rank 0:"),
        "placement differs on rank 2": ("ValueError", "the placement on rank 2 differs from the one on rank 0, rank 1"),
        "placement for other sizes on rank 1": ("ValueError", "MoELayer.rebalance on rank 1: placement has 6 experts "
                                                              "in 12 slots"),
        "forward during a rebalance": ("RuntimeError", "MoELayer on rank"),
    }
    wrong = [f"rank {r} {case}: {got}" for r, out in enumerate(res) for case, got in out.items()
             if got[0] != expected[case][0] or expected[case][1] not in got[1]]
    wrong += [f"rank {r}: {out['forward during a rebalance']}" for r, out in enumerate(res)
              if "is under way" not in out["forward during a rebalance"][1]]
    assert not wrong, "\n".join(wrong)


def _killed_body(comm) -> tuple:
    import moe.rebalance as rb

    layer = MoELayer(comm, H, F, 6, K, num_redundant_experts=3, **KW).double()
    x = torch.randn(5, H, dtype=torch.float64)
    layer(x)
    if comm.rank == 1:
        rb._after_round = lambda lay, i: os._exit(3)  # dies after the first round's writes
    t0 = time.monotonic()
    try:
        layer.rebalance(balance(_skewed(6), 3, 3), max_experts_per_round=1)
    except CollectiveTimeoutError as e:  # PeerFailedError is one
        waited = time.monotonic() - t0
        return (type(e).__name__, str(e), waited, outcome(lambda: layer(x)),
                outcome(lambda: layer.rebalance(Placement.default(6, 3, 3))))
    return "no error", "", 0.0, None, None


def test_a_peer_killed_mid_rebalance_makes_the_others_raise_and_refuse_to_run():
    before = shm_segments()
    timeout = 20.0
    res = collectives.launch(_killed_body, 3, timeout=timeout, return_exceptions=True)
    assert isinstance(res[1], RankFailedError), res[1]
    for r in (0, 2):
        kind, msg, waited, forward, again = res[r]
        assert kind == PeerFailedError.__name__ and "rank 1" in msg, res[r]
        assert waited < timeout, waited
        for what in (forward, again):
            assert what[0] == "RuntimeError" and "was interrupted" in what[1] and "PeerFailedError" in what[1], what
    assert not left_behind(before)


# ---- the Balancer ----------------------------------------------------------------------------------------
def _balancer_body(comm) -> list:
    layer = MoELayer(comm, H, F, 4, K, num_redundant_experts=2, **KW).double()
    start = layer.placement
    bal = Balancer(layer, every=2, threshold=1.1)
    # only the sum over ranks counts: each rank's loads alone are skewed, their sum is uniform
    mine = torch.tensor([0, 0, 60, 0]) if comm.rank == 0 else torch.tensor([0, 0, 0, 60])
    assert start.imbalance(mine) == pytest.approx(2.0) and start.imbalance(torch.tensor([0, 0, 60, 60])) == 1.0
    log = []
    layer.expert_load.copy_(mine)
    log.append(bal.step())                          # step 1: not a checking step, loads kept
    assert torch.equal(layer.expert_load, mine)
    log.append(bal.step())                          # step 2: uniform in sum -> no move; loads reset
    assert bal.last_imbalance == pytest.approx(1.0) and int(layer.expert_load.abs().sum()) == 0
    assert layer.placement == start
    skew = torch.tensor([1, 2, 60, 5]) * (1 + comm.rank)
    layer.expert_load.copy_(skew)
    log.append(bal.step())                          # step 3
    high = Balancer(layer, every=1, threshold=100.0)
    log.append(high.step())                         # skewed, under a high threshold: no move
    assert layer.placement == start and high.last_imbalance > 1.1
    layer.expert_load.copy_(skew)
    log.append(bal.step())                          # step 4: skewed above 1.1 -> moves to balance() of the sum
    assert layer.placement == balance(3 * torch.tensor([1, 2, 60, 5]), 2, 2) != start
    assert bal.last_imbalance > 1.1 and int(layer.expert_load.abs().sum()) == 0
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(comm.rank), dtype=torch.float64)
    plain = MoELayer(comm, H, F, 4, K, **KW).double()
    _close(layer(x)[0], plain(x)[0], "after the balancer moved")
    return log


def test_balancer_moves_only_above_the_threshold():
    for log in collectives.launch(_balancer_body, 2, timeout=60):
        assert log == [False, False, False, False, True], log


# ---- the low-latency dispatcher over routed slots (emulated ipc: Triton's interpreter, tiny sizes) ---------
def _expert(rows, e):
    """Logical expert e (an int, or [T, 1] ids), elementwise: the same bits whatever rows it runs with."""
    return torch.tanh(rows * (e + 1) / 4)


def _low_latency_body(comm) -> tuple:
    from moe import LowLatencyDispatcher

    P, r = comm.size, comm.rank
    E, R, M, HL = 4, 2, 4, 128
    placement = balance(_skewed(E), P, R)
    g = torch.Generator().manual_seed(60 + r)
    T = [4, 0][r]
    x = torch.randn(T, HL, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]) if T else \
        torch.empty(0, 2, dtype=torch.int64)
    w = torch.rand(T, 2, generator=g)
    slots = route(idx, placement, offset=r)
    out, counts = [], []
    for ids, logical in ((idx, [r * E // P + le for le in range(E // P)]),
                         (slots, placement.physical_to_logical[placement.slots_of(r)].tolist())):
        disp = LowLatencyDispatcher(comm, num_experts=len(logical) * P, max_tokens_per_rank=M, hidden=HL,
                                    dtype=torch.float32, max_topk=2)
        recv, count, handle = disp.dispatch(x, ids)
        y = torch.stack([_expert(recv[le], e) for le, e in enumerate(logical)])
        out.append(disp.combine(y, ids, w, handle))
        counts.append(comm.all_gather(count.long()))
    ref = sum(w[:, j:j + 1] * _expert(x, idx[:, j:j + 1]) for j in range(2))
    return out, ref, counts[1], placement.logical_to_physical


def test_low_latency_dispatch_over_routed_slots_equals_logical_experts():
    """LowLatencyDispatcher over E + R slots fed route()d ids combines what it does over the E logical experts."""
    pytest.importorskip("triton")
    res = collectives.launch(_low_latency_body, 2, transport="ipc", timeout=120.0, options={"ipc_emulate": 1})
    for (logical, physical), ref, slot_counts, l2p in res:
        assert torch.equal(physical, logical)
        torch.testing.assert_close(logical, ref, rtol=1e-6, atol=1e-6)
    extra = l2p[:, 1:]
    assert int(slot_counts[extra[extra >= 0]].sum()) > 0  # the redundant replicas received rows
