"""MoELayer(comm, ..., expert_tp_size=T) (issue #54): an EP x ETP layer equals the one-process layer.

EP=2 x ETP=2 on 4 ranks against ``MoELayer`` over a one-rank group with the same seed, run on every
rank's tokens concatenated (uneven counts, one rank without tokens), in float64: forward, the expert
weight gradients (each slot's shards gathered whole), the replicated parameters' gradients summed
over the ranks, the input gradients, the aux loss shares and the load counters; then Adam steps on
both (the router frozen, so that the trained weights compare to 1e-10 too) and the state dicts
both ways. The same with EPLB (2 redundant
experts, a non-default placement from ``balance`` of skewed loads, ``reduce_replica_grads``, and a
live rebalance with the optimizer state moved, then a Balancer step). Everything to 1e-10, the gradients through the
float32 router included (etp_forward gives the router each token's whole gradient, summed in
float64); a second pass with the routing detached in both layers covers the path without a router
gradient. The aux loss shares are float32 sums, grouped otherwise than in one process: to 1e-6.

All the checks run in one launch of 4 ranks, each check's result kept apart; the argument errors in
a second launch.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from spmd import outcome, run_checks
from test_expert_tp import _detach_routing, _Failures, _slice, launched_checks
from test_moe_eplb import _skewed

import collectives
import moe.rebalance as rebalance_mod
from collectives.agreement import reject
from moe import Balancer, MoELayer, Placement, balance, gather_state_dict, shard_state_dict
from moe.expert_tp import gather_expert_slots

F64 = torch.float64
P, T = 4, 2                              # EP = P / T = 2
H, FFN, E, K = 16, 24, 8, 2
KW = dict(activation="swiglu", aux_loss_coef=0.01, z_loss_coef=1e-3, shared_ffn_hidden_size=12)
SEED = 11
ROWS = [5, 0, 7, 3]                      # tokens per rank (rank 1 has none)
LR = 1e-2


def _data(seed: int, rows=ROWS, shape=()):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(sum(rows), *shape, H, dtype=F64, generator=g)
    return X, torch.randn(X.shape, dtype=F64, generator=g)


def _replicated(layer):
    """The parameters every rank holds whole: the router and the shared expert."""
    return [layer.router.weight, layer.shared.fc1, layer.shared.fc2]


def _compare(comm, bad, ref, layer, X, G, what):
    """One forward + backward of (y * G).sum() + aux on both layers, routing as it is then routing detached."""
    r = comm.rank
    sl = _slice(ROWS, r)
    for exact in (False, True):
        how = f"{what} ({'routing detached' if exact else 'full'}, rank {r})"
        if exact:
            _detach_routing(ref.router)
            _detach_routing(layer.router)
        ref.zero_grad(set_to_none=True)
        layer.zero_grad(set_to_none=True)
        Xr = X.clone().requires_grad_()
        y_ref, aux_ref = ref(Xr)
        ((y_ref * G).sum() + aux_ref).backward()
        x = X[sl].clone().requires_grad_()
        y, aux = layer(x)
        ((y * G[sl]).sum() + aux).backward()
        layer.reduce_replica_grads()
        bad.close(y, y_ref[sl].detach(), f"{how}: output")
        bad.close(comm.all_reduce(aux.detach().reshape(1))[0], aux_ref.detach(), f"{how}: aux shares summed",
                  rtol=1e-6, atol=0)  # float32 sums of other groupings
        p2l = layer.placement.physical_to_logical
        for name in layer.expert_keys:  # every slot's gradient, whole: its logical expert's
            grad = gather_expert_slots(layer, name, layer.get_parameter(name).grad)
            bad.close(grad, ref.get_parameter(name).grad[p2l], f"{how}: {name} grad of every slot")
        for p, q, name in zip(_replicated(layer), _replicated(ref), ("router", "shared fc1", "shared fc2")):
            if p.grad is None and exact and name == "router":
                continue  # detached routing: the router gets no gradient
            bad.close(comm.all_reduce(p.grad), q.grad, f"{how}: {name} grad summed over ranks")
        bad.close(x.grad, Xr.grad[sl], f"{how}: input grad")
        if layer.num_redundant_experts:  # the redundant replicas did serve tokens
            counts = layer.last_handle.layout.global_tokens_per_expert
            extra = layer.placement.logical_to_physical[:, 1:]
            bad.that(int(counts[extra[extra >= 0]].sum()) > 0, f"{how}: no token reached a redundant replica")
    bad.that(torch.equal(comm.all_reduce(layer.expert_load.clone()), ref.expert_load),
             f"{what}: expert_load summed over ranks {comm.all_reduce(layer.expert_load.clone()).tolist()} "
             f"!= one process {ref.expert_load.tolist()}")
    for m in (ref, layer):
        del m.router.route  # undo _detach_routing
        m.zero_grad(set_to_none=True)


def _train_step(comm, layer, opt, x, G):
    """Adam on the experts and the shared expert (the router frozen, so every gradient is exact in float64):
    the replicas' gradients reduced, the shared expert's summed over ranks."""
    y, aux = layer(x)
    ((y * G).sum() + aux).backward()
    layer.reduce_replica_grads()
    for p in (layer.shared.fc1, layer.shared.fc2):
        p.grad = comm.all_reduce(p.grad)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _trainer(layer):
    layer.router.weight.requires_grad_(False)
    return torch.optim.Adam([*layer.experts.parameters(), *layer.shared.parameters()], lr=LR)


def _layer_body(comm, R: int):
    r, bad = comm.rank, _Failures()
    alone = comm.split(r)
    layers = []
    try:
        placement = balance(_skewed(E), P // T, R) if R else None
        ref = MoELayer(alone, H, FFN, E, K, seed=SEED, **KW).double()
        layer = MoELayer(comm, H, FFN, E, K, seed=SEED, expert_tp_size=T, num_redundant_experts=R,
                         placement=placement, **KW).double()
        layers.append(layer)
        what = f"R={R}"
        L = (E + R) // (P // T)
        bad.that((layer.ep_comm.rank, layer.etp_comm.rank, layer.ep_comm.size) == (r // T, r % T, P // T),
                 f"{what}: EP rank {layer.ep_comm.rank}, ETP rank {layer.etp_comm.rank} on rank {r}")
        bad.that(tuple(layer.experts.fc1.shape) == (L, H, 2 * FFN // T)
                 and tuple(layer.experts.fc2.shape) == (L, FFN // T, H), f"{what}: shard shapes")
        if R:
            bad.that(layer.placement == placement != Placement.default(E, P // T, R), f"{what}: placement")
            slots = placement.slots_of(r // T)
            bad.that(layer.experts.expert_ids == placement.physical_to_logical[slots.start:slots.stop].tolist(),
                     f"{what}: expert ids")
        # the weights do not depend on the layout (nor on the redundant slots)
        full = gather_state_dict(layer)
        want = ref.state_dict()
        bad.that(full.keys() == want.keys() and all(torch.equal(full[n], want[n]) for n in want),
                 f"{what}: gathered weights differ from the one-process layer's")

        X, G = _data(100 + R)
        _compare(comm, bad, ref, layer, X, G, what)

        # training: Adam on both (one process on all tokens, each rank here on its own), a rebalance with
        # the optimizer state between the steps (EPLB), then the outputs and the state dicts again
        opt_ref, opt = _trainer(ref), _trainer(layer)
        sl = _slice(ROWS, r)
        for step in range(2):
            X, G = _data(200 + step)
            _train_step(alone, ref, opt_ref, X, G)
            _train_step(comm, layer, opt, X[sl], G[sl])
            if R and step == 0:
                new = balance(_skewed(E).flip(0), P // T, R)  # the cold experts become hot: experts move
                bad.that(new != layer.placement, "the rebalance target is the current placement")
                fc1 = layer.experts.fc1
                moved = layer.rebalance(new, opt, max_experts_per_round=2)
                bad.that(layer.placement == new and layer.experts.fc1 is fc1 and moved.rounds >= 1,
                         f"{what}: rebalance {moved}")
        if R:  # the Balancer: loads summed over all ranks, a placement over the EP ranks
            before = layer.placement
            moved = Balancer(layer, every=1, threshold=1.0, optimizer=opt).step()
            bad.that(moved == (layer.placement != before) and layer.placement.num_ranks == P // T,
                     f"{what}: Balancer moved={moved}, placement {layer.placement}")
        X, G = _data(300, shape=(3,))  # [T, 3, H]: B x S inputs
        with torch.no_grad():
            bad.close(layer(X[sl])[0], ref(X)[0][sl], f"{what}: output after training")
        full = gather_state_dict(layer)
        want = ref.state_dict()
        for n in want:
            bad.close(full[n], want[n], f"{what}: trained {n}, gathered")
        # gather -> a one-process layer of another seed; shard_state_dict -> an ETP layer of another seed
        other = MoELayer(alone, H, FFN, E, K, seed=SEED + 1, **KW).double()
        other.load_state_dict(full)
        etp2 = MoELayer(comm, H, FFN, E, K, seed=SEED + 2, expert_tp_size=T, num_redundant_experts=R, **KW).double()
        layers.append(etp2)
        etp2.load_state_dict(shard_state_dict(etp2, want))
        with torch.no_grad():
            y_ref = ref(X)[0]
            bad.close(other(X)[0], y_ref, f"{what}: one-process layer loaded from gather_state_dict")
            bad.close(etp2(X[sl])[0], y_ref[sl], f"{what}: ETP layer loaded by shard_state_dict")
        comm.barrier()
    finally:
        for layer in layers:
            layer.close()
        alone.close()
    bad.raise_any()


def _from_hf_body(comm):
    """MoELayer.from_hf(block, comm, expert_tp_size=2) on a DeepSeek-V3 block (shared expert, sigmoid
    group-limited routing): each rank's outputs equal the block's on its tokens."""
    if importlib.util.find_spec("transformers") is None:  # an extra
        return "skip"
    from test_moe_from_hf import FFN as HF_FFN, H as HF_H, _block

    r, bad = comm.rank, _Failures()
    block = _block("deepseek", seed=3)
    layer = MoELayer.from_hf(block, comm, expert_tp_size=T)
    try:
        bad.that(layer.expert_tp_size == T and tuple(layer.experts.fc2.shape[1:]) == (HF_FFN // T, HF_H),
                 f"from_hf shards: fc2 {tuple(layer.experts.fc2.shape)}")
        x = torch.randn(ROWS[r], HF_H, dtype=F64, generator=torch.Generator().manual_seed(r))
        with torch.no_grad():
            bad.close(layer(x)[0], block(x), "from_hf with expert_tp_size=2 against the block")
        comm.barrier()
    finally:
        layer.close()
    bad.raise_any()
    return "ok"


_CHECKS = {"plain": lambda comm: _layer_body(comm, 0), "eplb": lambda comm: _layer_body(comm, 2),
           "from_hf": _from_hf_body}


def _all_checks(comm) -> dict:
    return run_checks(_CHECKS, comm)


@pytest.fixture(scope="module")
def etp_layer_run():
    return launched_checks(_all_checks, timeout=120)


def test_ep2_x_etp2_layer_equals_the_one_process_layer(etp_layer_run):
    etp_layer_run("plain")


def test_ep2_x_etp2_layer_with_redundant_experts_and_a_rebalance_equals_the_one_process_layer(etp_layer_run):
    etp_layer_run("eplb")


def test_from_hf_with_expert_tp_matches_the_block(etp_layer_run):
    if etp_layer_run("from_hf") == "skip":
        pytest.skip("transformers is not installed")


# ---- argument errors: every rank raises, naming the rank (second launch) ------------------------------
def _errors_body(comm) -> dict:
    r = comm.rank

    def build(**kw):
        args = dict(dict(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, top_k=K, expert_tp_size=T), **kw)
        MoELayer(comm, **args).close()

    out = {
        "T=3 on rank 2": outcome(lambda: build(expert_tp_size=3 if r == 2 else T)),
        "T=0 on rank 1": outcome(lambda: build(expert_tp_size=0 if r == 1 else T)),
        "T differs": outcome(lambda: build(expert_tp_size=1 if r == 3 else T)),
        "F not divisible": outcome(lambda: build(ffn_hidden_size=10, expert_tp_size=4)),
        "E not divisible": outcome(lambda: build(num_experts=3)),
        "E + R not divisible": outcome(lambda: build(num_redundant_experts=1)),
    }
    # a shared expert failing on one rank at forward: every rank raises at once (not after a timeout)
    layer = MoELayer(comm, H, FFN, E, K, expert_tp_size=T, shared_ffn_hidden_size=8).double()
    if r == 1:
        def fail(x):
            raise RuntimeError("shared expert out of memory here")
        layer.shared.forward = fail
    x = torch.randn(3, H, dtype=F64, requires_grad=True)
    out["shared expert fails on rank 1"] = outcome(lambda: layer(x))
    comm.barrier()
    layer.close()

    # a rebalance failing on rank 1 in its EP group's move (as a local failure there is: rejected on ep_comm):
    # its EP peer raises in the next round, the other EP group at the final agreement; all refuse to run after
    layer = MoELayer(comm, H, FFN, E, K, expert_tp_size=T, num_redundant_experts=2).double()
    if r == 1:
        rebalance_mod._after_round = lambda lay, i: reject(lay.ep_comm, ValueError("injected failure after a round"))
    try:
        out["rebalance fails on rank 1"] = outcome(
            lambda: layer.rebalance(balance(_skewed(E), P // T, 2), max_experts_per_round=1))
    finally:
        rebalance_mod._after_round = None
    out["forward after"] = outcome(lambda: layer(x))
    comm.barrier()
    layer.close()
    return out


def test_bad_arguments_raise_on_every_rank_naming_the_rank():
    res = collectives.launch(_errors_body, P, timeout=20)  # a rank left waiting would time out after 20 s
    expected = {
        "T=3 on rank 2": "MoELayer on rank 2: expert_tp_size=3 does not divide the 4 ranks",
        "T=0 on rank 1": "MoELayer on rank 1: expert_tp_size must be a positive int",
        "T differs": "disagree on expert_tp_size (rank 0: 2, rank 1: 2, rank 2: 2, rank 3: 1)",
        "F not divisible": "ffn_hidden_size=10 is not divisible by expert_tp_size=4",
        "E not divisible": "num_experts=3 is not divisible by the 2 EP ranks",
        "E + R not divisible": "8 + 1 = 9 slots are not divisible by the 2 ranks",
    }
    wrong = [f"rank {r} {case}: {got}" for r, out in enumerate(res) for case, got in out.items()
             if case in expected and (got[0] != "ValueError" or expected[case] not in got[1])]
    # the shared expert: rank 1's ETP group (ranks 0, 1) agrees on its error; the other group learns it from
    # its EP peers at dispatch (their collective was rejected)
    for r, out in enumerate(res):
        kind, text = out["rebalance fails on rank 1"]
        if kind != "ValueError" or (r == 1 and "injected failure" not in text):
            wrong.append(f"rank {r} rebalance fails on rank 1: {kind}: {text}")
        kind, text = out["forward after"]
        if kind != "RuntimeError" or "was interrupted" not in text:
            wrong.append(f"rank {r} forward after the failed rebalance: {kind}: {text}")
        kind, text = out["shared expert fails on rank 1"]
        want = ("etp_forward on rank 1: the shared expert failed: RuntimeError: shared expert out of memory here"
                if r < 2 else "rejected their input for this collective")
        if kind != "ValueError" or want not in text:
            wrong.append(f"rank {r} shared expert fails on rank 1: {kind}: {text}")
    assert not wrong, "\n".join(wrong)
