"""Expert tensor parallelism (moe.expert_tp): the building blocks, and EP x ETP layers against a one-process MoELayer.

The collective checks run in one launch of 4 ranks (each check's result kept apart), the error
checks in a second one; the local ones (weight sharding, the FFN pieces shared with moe.layer) run
here. Everything is float64 so that the layouts must agree to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from spmd import run_checks

import collectives
import moe.layer as layer_mod
from moe import ffn
from moe import ExpertDispatcher, GroupedExperts, MoELayer, TopKRouter
from moe import expert_tp as etp_mod
from moe.expert_tp import (ShardedExperts, etp_forward, expert_tp_groups, gather_tokens, reduce_scatter_tokens,
                           shard_expert_weights, shard_indices)

F64 = torch.float64
H, FFN, E, K, SEED = 16, 24, 8, 2, 7
P = 4
ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu", "silu")

# name -> EP x ETP layout (T = ETP size), activation, rows per rank (one rank without tokens), input
# shape, router options (both losses somewhere, so that the aux share and its gradient are checked)
LAYERS = {
    "ep2_etp2_swiglu": dict(T=2, activation="swiglu", rows=[5, 0, 7, 3], shape="2d",
                            kw=dict(aux_loss_coef=0.01, z_loss_coef=1e-3)),
    "ep2_etp2_gelu": dict(T=2, activation="gelu", rows=[4, 6, 0, 2], shape="3d",
                          kw=dict(score="sigmoid", aux_loss_coef=0.02)),
    "ep1_etp4_geglu": dict(T=4, activation="geglu", rows=[3, 0, 6, 2], shape="2d",
                           kw=dict(aux_loss_coef=0.01, z_loss_coef=1e-3)),
    "ep4_etp1_swiglu": dict(T=1, activation="swiglu", rows=[0, 4, 5, 3], shape="2d",
                            kw=dict(aux_loss_coef=0.01)),
}


def _close(a, b, what, rtol=1e-10, atol=1e-10):
    """a == b within atol + rtol * |b| (torch.testing's first call costs a launched rank seconds of imports)."""
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    a, b = a.detach(), b.detach()
    excess = (a - b).abs() - atol - rtol * b.abs()
    if excess.numel() and float(excess.max()) > 0:
        raise AssertionError(f"{what}: max |a - b| {float((a - b).abs().max()):.3g} over atol {atol} + rtol {rtol} * |b|")


def _slice(rows, r):
    return slice(sum(rows[:r]), sum(rows[:r + 1]))


class _Failures(list):
    """Failed comparisons, kept until the end of a check: every rank runs every collective of the check
    before any raises, so that one failing on some ranks only does not leave the others waiting."""

    def close(self, *args, **tol):
        try:
            _close(*args, **tol)
        except AssertionError as e:
            self.append(str(e))

    def that(self, ok, what):
        if not ok:
            self.append(what)

    def raise_any(self):
        assert not self, "\n".join(self)


# ---- collective checks (one launch) ---------------------------------------------------------------
def _groups_body(comm):
    r, bad = comm.rank, _Failures()
    for T in (1, 2, 4):
        ep, etp = expert_tp_groups(comm, T)
        try:
            bad.that(etp.global_ranks == [r // T * T + i for i in range(T)], f"T={T}: etp {etp.global_ranks}")
            bad.that(ep.global_ranks == [j * T + r % T for j in range(P // T)], f"T={T}: ep {ep.global_ranks}")
            bad.that((etp.rank, ep.rank) == (r % T, r // T), f"T={T}: etp rank {etp.rank}, ep rank {ep.rank}")
            comm.barrier()
        finally:
            ep.close()
            etp.close()
    for name, T, text in (("T=3", 3, "expert_tp_size=3 does not divide the 4 ranks"),
                          ("T differs", 2 if r == 0 else 1, "disagree on expert_tp_size"),
                          ("T=0", 0, "expert_tp_size must be a positive int")):
        try:
            expert_tp_groups(comm, T)
        except ValueError as e:
            bad.that(str(e).startswith("expert_tp_groups") and text in str(e), f"{name}: {e}")
        else:
            bad.append(f"{name}: expert_tp_groups did not raise on rank {r}")
    comm.barrier()  # every rank raised at the same point: still in step
    bad.raise_any()


def _regions_body(comm):
    """gather_tokens / reduce_scatter_tokens against their definitions, for T = 2 and 4 and uneven rows."""
    r, bad = comm.rank, _Failures()
    for T, rows in ((2, [3, 0, 0, 0]), (4, [3, 0, 5, 2]), (2, [4, 4, 2, 2])):
        # T=2 with rows [3, 0, 0, 0]: the second group has no tokens at all; [4, 4, 2, 2]: even groups
        ep, etp = expert_tp_groups(comm, T)
        try:
            g = torch.Generator().manual_seed(10 * T + sum(rows))
            data = [torch.randn(n, H, dtype=F64, generator=g) for n in rows]          # every rank's x
            grads = [torch.randn(sum(rows[q // T * T:(q // T + 1) * T]), H, dtype=F64, generator=g)
                     for q in range(P)]                                              # every rank's dL/dX
            members = list(range(r // T * T, (r // T + 1) * T))
            mine, i = [rows[q] for q in members], r % T
            x = data[r].clone().requires_grad_()
            X, counts = gather_tokens(x, etp)
            bad.that(counts == tuple(mine), f"T={T} {rows}: counts {counts}, want {mine}")
            bad.close(X, torch.cat([data[q] for q in members]), f"T={T} {rows}: gather_tokens forward")
            (X * grads[r]).sum().backward()
            # backward: the sum over the group of each rank's gradient of this rank's rows
            want = sum(grads[q][_slice(mine, i)] for q in members)
            bad.close(x.grad, want, f"T={T} {rows}: gather_tokens backward (sum over the group)")

            # reduce_scatter_tokens: every rank's partial for all of X; this rank keeps its rows of the sum
            partials = [torch.randn(sum(mine), H + 1, dtype=F64, generator=torch.Generator().manual_seed(q))
                        for q in members]
            gy = [torch.randn(n, H + 1, dtype=F64, generator=torch.Generator().manual_seed(50 + q))
                  for q, n in zip(members, mine)]
            yp = partials[i].clone().requires_grad_()
            y = reduce_scatter_tokens(yp, etp, tuple(mine))
            bad.close(y, sum(partials)[_slice(mine, i)], f"T={T} {rows}: reduce_scatter_tokens forward")
            (y * gy[i]).sum().backward()
            bad.close(yp.grad, torch.cat(gy), f"T={T} {rows}: reduce_scatter_tokens backward (all-gathered)")
            comm.barrier()
        finally:
            ep.close()
            etp.close()
    bad.raise_any()


def _detach_routing(router):
    """Make ``router.route`` return detached weights and scores: the routing becomes a constant for autograd."""
    route = router.route

    def detached(x):
        weights, chosen, scores = route(x)
        return weights.detach(), chosen, type(scores)(*(t.detach() for t in scores))

    router.route = detached


def _layer_body(comm, name):
    """An EP x ETP layer assembled from the blocks equals MoELayer over one rank on all ranks' tokens.

    The router computes its softmax in float32 whatever the dtype; etp_forward sums the routing
    weights' partial gradients over the ETP group in float64 before the router's backward (each
    token's on its own rank), so gradients through the routing match to 1e-10 too: the first pass
    checks them so, the second detaches the routing in both layers (the path without that sum). Every
    comparison runs on every rank before any raises (a check failing on some ranks only must not
    leave the others waiting in a collective).
    """
    cfg = LAYERS[name]
    T, act, rows, kw = cfg["T"], cfg["activation"], cfg["rows"], cfg["kw"]
    r = comm.rank
    alone = comm.split(r)
    ep, etp = expert_tp_groups(comm, T)
    disp = None
    bad = _Failures()
    check = bad.close
    try:
        ref = MoELayer(alone, H, FFN, E, K, activation=act, seed=SEED, **kw).double()
        router = TopKRouter(H, E, K, seed=SEED, **kw).double()
        disp = ExpertDispatcher(ep, E)
        experts = ShardedExperts(disp.num_local_experts, disp.first_local_expert, H, FFN, act, SEED,
                                 etp_rank=etp.rank, expert_tp_size=T).double()
        L, first = disp.num_local_experts, disp.first_local_expert
        bad.that(L == E // (P // T) and first == r // T * L, f"{name}: experts {first}.. ({L}) on rank {r}")
        cols, frows = shard_indices(FFN, act, etp.rank, T)

        def full(shard_fc1, shard_fc2):
            """This rank's shards placed into [E, H, 2F or F] / [E, F, H], summed over all ranks."""
            f1 = torch.zeros(E, *ref.experts.fc1.shape[1:], dtype=F64)
            f2 = torch.zeros(E, *ref.experts.fc2.shape[1:], dtype=F64)
            f1[first:first + L].index_add_(2, cols, shard_fc1)
            f2[first:first + L].index_add_(1, frows, shard_fc2)
            return comm.all_reduce(f1), comm.all_reduce(f2)

        # the weights do not depend on the layout
        w1, w2 = full(experts.fc1.detach(), experts.fc2.detach())
        if not (torch.equal(w1, ref.experts.fc1.detach()) and torch.equal(w2, ref.experts.fc2.detach())):
            bad.append("sharded weights differ from the one-process layer's")

        g = torch.Generator().manual_seed(sum(rows) + T)
        n = sum(rows)
        X = torch.randn((n, 3, H) if cfg["shape"] == "3d" else (n, H), dtype=F64, generator=g)
        G = torch.randn(X.shape, dtype=F64, generator=g)
        sl = _slice(rows, r)
        for exact in (False, True):
            what = f"{name} ({'routing detached' if exact else 'full'}, rank {r})"
            if exact:
                _detach_routing(ref.router)
                _detach_routing(router)
            for p in (*ref.parameters(), *router.parameters(), *experts.parameters()):
                p.grad = None
            Xr = X.clone().requires_grad_()
            y_ref, aux_ref = ref(Xr)
            ((y_ref * G).sum() + aux_ref).backward()
            x = X[sl].clone().requires_grad_()
            y, aux, handle, chosen = etp_forward(x, router, disp, experts, etp, return_routing=True)
            ((y * G[sl]).sum() + aux).backward()
            check(y, y_ref[sl].detach(), f"{what}: output rows")
            # this rank's own tokens' experts; the handle's layout counts the whole batch once
            bad.that(torch.equal(chosen, ref.router.route(X.reshape(-1, H))[1].reshape(n, -1, K)[sl].reshape(-1, K)),
                     f"{what}: return_routing experts of this rank's tokens")
            bad.that(handle.layout.num_global_tokens == Xr.numel() // H, f"{what}: the handle's batch")
            g1, g2 = full(experts.fc1.grad, experts.fc2.grad)
            check(g1, ref.experts.fc1.grad, f"{what}: expert fc1 grad (shards placed, summed over ranks)")
            check(g2, ref.experts.fc2.grad, f"{what}: expert fc2 grad (shards placed, summed over ranks)")
            aux_sum = comm.all_reduce(aux.detach().reshape(1))[0]
            check(aux_sum, aux_ref.detach(), f"{what}: aux loss shares summed over ranks", rtol=1e-6, atol=1e-9)
            check(x.grad, Xr.grad[sl], f"{what}: input grad")
            if not exact:  # replicated router: the ranks' shares sum to the whole
                check(comm.all_reduce(router.weight.grad), ref.router.weight.grad, f"{what}: router grad summed")
                if not float(aux_ref.detach()) > 0:
                    bad.append(f"{what}: no aux loss to check")
        comm.barrier()
    finally:
        if disp is not None:
            disp.close()
        for c in (ep, etp, alone):
            c.close()
    bad.raise_any()


_CHECKS = {"groups": _groups_body, "regions": _regions_body,
           **{f"layer:{n}": (lambda comm, n=n: _layer_body(comm, n)) for n in LAYERS}}


def launched_checks(all_checks, timeout: float):
    """``get(name)``: launches ``all_checks`` (a module-level ``run_checks`` caller) on P ranks at its first
    call; fails the test of a check that failed on some rank (naming the ranks, showing the first one's
    traceback), else returns what the check returned on rank 0."""
    cache = {}

    def get(name):
        if "all" not in cache:
            cache["all"] = collectives.launch(all_checks, P, timeout=timeout)
        fails = [(r, res[name][1]) for r, res in enumerate(cache["all"]) if res[name][0] == "fail"]
        if fails:
            pytest.fail(f"check {name!r} failed on ranks {[r for r, _ in fails]}; rank {fails[0][0]}:\n{fails[0][1]}",
                        pytrace=False)
        return cache["all"][0][name][1]

    return get


def _all_checks(comm) -> dict:
    return run_checks(_CHECKS, comm)


@pytest.fixture(scope="module")
def etp_run():
    return launched_checks(_all_checks, timeout=60)


def test_groups_layout_and_an_indivisible_or_differing_size_fails_every_rank(etp_run):
    etp_run("groups")


def test_gather_and_reduce_scatter_tokens_forward_and_backward_with_uneven_rows(etp_run):
    etp_run("regions")


@pytest.mark.parametrize("name", list(LAYERS))
def test_ep_x_etp_layer_equals_the_one_process_layer(etp_run, name):
    etp_run(f"layer:{name}")


# ---- errors: one rank fails, every rank raises at once (second launch) ------------------------------
def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        return type(e).__name__, str(e)
    return "no error", ""


def _errors_body(comm):
    """Each case on fresh groups: one rank fails in etp_forward; what each rank raised."""
    out = {}
    for case, bad in (("bad_x", 1), ("experts_fail", 2)):
        ep, etp = expert_tp_groups(comm, 2)
        disp = ExpertDispatcher(ep, E)
        try:
            router = TopKRouter(H, E, K, seed=SEED).double()
            experts = ShardedExperts(disp.num_local_experts, disp.first_local_expert, H, FFN, "swiglu", SEED,
                                     etp_rank=etp.rank, expert_tp_size=2).double()
            width = H + 1 if case == "bad_x" and comm.rank == bad else H
            x = torch.randn(3, width, dtype=F64, requires_grad=True)
            if case == "experts_fail" and comm.rank == bad:
                def fail(*args):
                    raise RuntimeError("expert shard failed here")
                experts.forward = fail

            def step():
                y, aux = etp_forward(x, router, disp, experts, etp)
                (y.sum() + aux).backward()

            out[case] = _outcome(step)
        finally:
            comm.barrier()
            disp.close()
            ep.close()
            etp.close()
    return out


def test_one_rank_failing_makes_every_rank_raise_at_once():
    # A rank left waiting would raise CollectiveTimeoutError after 20 s instead.
    per_rank = collectives.launch(_errors_body, P, timeout=20)
    wrong = []
    for r, got in enumerate(per_rank):
        kind, text = got["bad_x"]
        # rank 1's x is bad: its ETP group (ranks 0, 1) agrees on raising, naming it; the other group
        # learns it at dispatch, from the EP peers
        if kind != "ValueError" or (r in (0, 1) and "rank 1" not in text):
            wrong.append(f"bad_x: rank {r} raised {kind}: {text!r}")
        kind, text = got["experts_fail"]
        want = "RuntimeError" if r == 2 else "ValueError"
        if kind != want:
            wrong.append(f"experts_fail: rank {r} raised {kind}: {text!r}; expected {want}")
    assert not wrong, "\n".join(wrong)


# ---- local checks ---------------------------------------------------------------------------------
def test_the_ffn_pieces_are_one_definition():
    # moe.layer's experts and moe.expert_tp's shards take the activations and the weight draw from moe.ffn
    assert etp_mod._ACTIVATIONS is layer_mod._ACTIVATIONS is ffn._ACTIVATIONS
    assert etp_mod._GATED is ffn._GATED and layer_mod._ffn_weights is ffn._ffn_weights
    assert etp_mod._expert_weights is layer_mod._expert_weights is ffn._expert_weights


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_the_shards_sum_to_the_expert(act):
    fc1, fc2 = (w.double() for w in ffn._ffn_weights(H, FFN, act, torch.Generator().manual_seed(1)))
    x = torch.randn(9, H, dtype=F64)
    f = ffn._ACTIVATIONS[act]
    whole = f(x @ fc1) @ fc2
    for T in (1, 2, 3, 4):
        n = FFN // T
        parts = []
        for r in range(T):
            s1, s2 = shard_expert_weights(fc1, fc2, act, r, T)
            c = slice(r * n, (r + 1) * n)
            want1 = torch.cat([fc1[:, c], fc1[:, FFN:][:, c]], 1) if act in ("swiglu", "geglu") else fc1[:, c]
            assert torch.equal(s1, want1) and torch.equal(s2, fc2[c]), (act, T, r)
            parts.append(f(x @ s1) @ s2)
        _close(sum(parts), whole, f"{act} T={T}: sum of the shards' outputs", rtol=1e-12, atol=1e-12)


def test_shard_arguments_are_checked():
    fc1, fc2 = ffn._ffn_weights(H, FFN, "swiglu", torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="not divisible by expert_tp_size=5"):
        shard_expert_weights(fc1, fc2, "swiglu", 0, 5)
    with pytest.raises(ValueError, match=r"etp_rank must be an int in \[0, 2\)"):
        shard_expert_weights(fc1, fc2, "swiglu", 2, 2)
    with pytest.raises(ValueError, match="fc1 must be"):
        shard_expert_weights(fc1, fc2, "gelu", 0, 2)  # a gated fc1 for a plain activation
    with pytest.raises(ValueError, match="activation must be one of"):
        ShardedExperts(2, 0, H, FFN, "tanh", 0, etp_rank=0, expert_tp_size=2)


@pytest.mark.parametrize("act", ["swiglu", "relu"])
def test_sharded_experts_sum_to_grouped_experts(act):
    L, first, T = 3, 2, 4
    whole = GroupedExperts(L, first, H, FFN, act, SEED).double()
    shards = [ShardedExperts(L, first, H, FFN, act, SEED, etp_rank=r, expert_tp_size=T).double() for r in range(T)]
    tpe = torch.tensor([4, 0, 5])
    x = torch.randn(9, H, dtype=F64)
    _close(sum(s(x, tpe) for s in shards), whole(x, tpe), f"{act}: ShardedExperts summed over the shards")
    cols, rows = shard_indices(FFN, act, 1, T)
    assert torch.equal(shards[1].fc1.detach(), whole.fc1.detach()[:, :, cols])
    assert torch.equal(shards[1].fc2.detach(), whole.fc2.detach()[:, rows])
