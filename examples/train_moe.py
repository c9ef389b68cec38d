"""Train a small MoE transformer on 4 local ranks: 2 data-parallel replicas x 2 model-parallel ranks.

What it shows: moecomm's pieces working together in one training loop, with the result checked.
The model is a 2-block decoder (embedding, [attention + dense MLP], [attention + MoE], final norm,
LM head), written once (:class:`TinyMoETransformer`) on top of a model-parallel group ``mp``:

* the embedding, attention, the dense MLP and the LM head are tensor-parallel (TP) over ``mp``
  (``collectives.tensor_parallel``, Megatron-style, with sequence parallelism);
* the MoE layer (``moe.MoELayer``) is expert-parallel (EP) over the same ``mp`` (``--layout ep``,
  the default), or EP over ``dp`` x expert-tensor-parallel (ETP) over ``mp`` (``--layout ep-etp``);
* over a group of one rank the same code is the plain one-process model.

Layout, rank ``r = 2 * dp_rank + mp_rank``, two groups made with ``comm.split``::

                 mp_rank 0   mp_rank 1
    replica 0:   rank 0      rank 1       <- mp group {0, 1}: TP (+ EP, or ETP), one copy of the model
    replica 1:   rank 2      rank 3       <- mp group {2, 3}
                 dp {0, 2}   dp {1, 3}    <- dp groups: the same TP shards, different data (+ EP in ep-etp)

The two layouts of the MoE layer (the rest of the model is the same in both):

======  =========================================  ===========================================
layout  MoE layer                                  each rank's expert weights
======  =========================================  ===========================================
ep      ``MoELayer(mp, ...)``: EP over mp; each    E / 2 whole experts (the same in both
        replica holds all the experts              replicas): half of all expert weights
ep-etp  ``MoELayer(comm, ..., expert_tp_size=2)``  E / 2 experts (EP rank = dp_rank), of each
        over all 4 ranks: rank = ep_rank * 2 +     the mp_rank-th half of the inner dim (fc1
        etp_rank, so its ETP groups are the mp     columns, fc2 rows): a quarter of all expert
        groups and its EP groups the dp groups     weights, none of them held twice
======  =========================================  ===========================================

Why ep-etp suits this grid: the ETP group gathers its ranks' tokens, which are the
mp group's two halves of the sequence (the gather a column layer does anyway), routes them, sends
them over dp to the ranks that hold their experts' shards (the experts are spread over the
replicas, so tokens of both replicas reach every expert), and reduce-scatters the partial outputs
back to the sequence halves, as a row layer does.

What each rank of an mp group holds (H hidden, V vocab, E experts, tp = 2):

====================================  ============================================================
embedding  [V, H]                     rows (vocabulary) split: V / tp each (VocabParallelEmbedding)
attention qkv [3H, H]                 output rows split by head: the q, k, v of heads / tp heads
attention out [H, H]                  input columns split (the same heads); bias replicated
dense MLP fc1 [F, H] + bias           output rows split: F / tp each (ColumnParallelLinear)
dense MLP fc2 [H, F]                  input columns split; bias replicated (RowParallelLinear)
MoE experts [E, ...]                  ep: whole experts split: E / tp each (MoELayer over mp);
                                      ep-etp: see the table above
MoE router [E, H], RMSNorms [H]       replicated
LM head [V, H]                        output rows split (vocabulary); the logits are all-gathered
====================================  ============================================================

Activations between the TP layers are sequence-parallel: each rank of ``mp`` holds its half of the
sequence dim (``[S / tp, B, H]``); a column layer all-gathers its input, a row layer reduce-scatters
its output. So the norms, the residual stream and the MoE layer see only this rank's tokens, and
the MoE layer sends them to the experts' ranks (all-to-all over ``mp``) and back.

Gradients. ``loss`` on each rank is the cross-entropy summed over its replica's tokens divided by
the token count of the global batch, so summing gradients over the replicas gives the gradient of
the global mean. After ``backward()``:

* complete for this replica, summed over ``dp``: TP shards (each rank's shard sees every token of
  its replica: the column layers gather the sequence), the row layers' biases (the layer sums them
  over ``mp`` itself under sequence parallelism) and, in layout ep, the experts (every token of the
  replica routed to an expert arrives on its rank);
* complete for the global batch, not summed at all: in layout ep-etp, the expert shards (every
  token of both replicas routed to an expert reaches the ETP group that holds it, and each shard
  lives on one rank only: summing over ``dp`` would add up two different experts' gradients);
* a share of this rank's tokens only, summed over all 4 ranks (``mp`` then ``dp``, in one call
  over ``comm``): the replicated norms and router, which see only this rank's half of the sequence
  (in ep-etp each rank routes its ETP group's tokens, and its router gradient is its share of them).

Summing those over ``dp`` alone (the usual data-parallel all-reduce) would leave the norms and the
router each with half a gradient; the check below catches that.

Initialisation. Every layer draws its weights from a seed and its global shape alone, never from
the layout (``ColumnParallelLinear(..., seed=)``, ``MoELayer(..., seed=)``), so each rank builds
its shards of the very model that one process builds whole from the same seeds: no rank needs the
full model in memory, and the one-process reference starts from the same weights.

The check: in float64, the 5 optimizer steps (Adam) give the same losses and the same final
parameters, within 1e-9, as the same model (same seed) trained in one process on the concatenated
batch of both replicas. Rank 0 prints the loss per step; the launching process then trains the
one-process model, prints the largest differences and exits 1 if either is over 1e-9.

Run it as it is (about 10 s on 2 CPU cores, most of it starting processes; no GPU needed)::

    pip install -e .
    python examples/train_moe.py                  # --layout ep
    python examples/train_moe.py --layout ep-etp

The router's load-balancing loss is left at 0: it multiplies two batch means, so a data-parallel
run computes it per replica, which is not the one-process value on the concatenated batch (the
usual practice, but this example's check wants the exact same loss).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F
from torch import nn

import collectives
from collectives.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_from_tensor_parallel_region,
)
from moe import MoELayer, gather_state_dict

DP, MP = 2, 2                                 # 2 replicas x 2 model-parallel ranks = 4 ranks
VOCAB, HIDDEN, HEADS, FFN = 32, 16, 4, 32     # HEADS and FFN divisible by MP
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 16         # EXPERTS divisible by MP and DP, EXPERT_FFN by MP
LAYOUTS = ("ep", "ep-etp")                    # the MoE layer's: see the module docstring
SEQ, BATCH = 8, 4                             # the global batch: BATCH sequences of SEQ tokens
STEPS, LR, SEED, TOLERANCE = 5, 1e-2, 0, 1e-9


class Attention(nn.Module):
    """Causal self-attention; this rank computes HEADS / tp of the heads."""

    def __init__(self, mp: collectives.Communicator, seeds: itertools.count):
        super().__init__()
        self.heads = HEADS // mp.size
        # output features ordered (head, q/k/v, head_dim), so a rank's block holds whole heads
        self.qkv = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, mp, bias=False, sequence_parallel=True, seed=next(seeds))
        self.out = RowParallelLinear(HIDDEN, HIDDEN, mp, sequence_parallel=True, seed=next(seeds))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                             # [S / tp, B, H] -> [S, B, 3H / tp] (gathers the sequence)
        S, B, _ = qkv.shape
        q, k, v = qkv.view(S, B, self.heads, 3, HIDDEN // HEADS).permute(3, 1, 2, 0, 4)  # each [B, heads, S, hd]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.permute(2, 0, 1, 3).reshape(S, B, -1))  # [S, B, H / tp] -> [S / tp, B, H]


class MLP(nn.Module):
    """The dense feed-forward layer: fc1 split by output, fc2 by input features."""

    def __init__(self, mp: collectives.Communicator, seeds: itertools.count):
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, mp, sequence_parallel=True, seed=next(seeds))
        self.fc2 = RowParallelLinear(FFN, HIDDEN, mp, sequence_parallel=True, seed=next(seeds))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))          # [S / tp, B, H] -> [S / tp, B, H]


class Block(nn.Module):
    """Pre-norm transformer block; its feed-forward layer is the dense MLP or the MoE layer."""

    def __init__(self, mp: collectives.Communicator, seeds: itertools.count, *, moe: bool,
                 moe_group: collectives.Communicator | None = None, expert_tp_size: int = 1):
        super().__init__()
        self.moe = moe
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.attn = Attention(mp, seeds)
        group = mp if moe_group is None else moe_group
        self.ffn = (MoELayer(group, HIDDEN, EXPERT_FFN, EXPERTS, TOP_K, seed=next(seeds), expert_tp_size=expert_tp_size)
                    if moe else MLP(mp, seeds))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        if self.moe:
            y, _aux_loss = self.ffn(self.norm2(x))    # 0 here: see the module docstring
        else:
            y = self.ffn(self.norm2(x))
        return x + y


class TinyMoETransformer(nn.Module):
    """Embedding, a dense block, an MoE block, final norm, LM head; float64.

    Every layer draws its weights from ``seed`` and the global shapes alone, so the model is the
    same function whatever the size of ``mp`` (1: the one-process model) and the MoE layer's layout
    (``moe_group``: its group, default ``mp``; ``expert_tp_size``: its ETP size, see
    ``MoELayer``). Construction is collective.
    """

    def __init__(self, mp: collectives.Communicator, seed: int = SEED, *,
                 moe_group: collectives.Communicator | None = None, expert_tp_size: int = 1):
        super().__init__()
        self.mp = mp
        seeds = itertools.count(seed)  # one seed per layer, in construction order
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, mp, sequence_parallel=True, seed=next(seeds))
        self.blocks = nn.ModuleList([Block(mp, seeds, moe=False),
                                     Block(mp, seeds, moe=True, moe_group=moe_group, expert_tp_size=expert_tp_size)])
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = ColumnParallelLinear(HIDDEN, VOCAB, mp, bias=False, sequence_parallel=True, seed=next(seeds))
        self.to(torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S, B] int64, the same on every rank of mp -> logits [S, B, V], the same too."""
        x = self.embed(ids)                           # [S / tp, B, H]: this rank's block of the sequence
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))              # [S, B, V / tp]
        return gather_from_tensor_parallel_region(logits, self.mp)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s inputs and next-token targets, [SEQ, BATCH] int64 each: sequences counting
    up from a random token by a random stride (1-3) modulo VOCAB, so there is something to learn."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (BATCH,), generator=g)
    stride = torch.randint(1, 4, (BATCH,), generator=g)
    tokens = (start + stride * torch.arange(SEQ + 1)[:, None]) % VOCAB
    return tokens[:-1], tokens[1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over these tokens / the global batch's token count: the replicas' losses
    (and gradients) sum to the global batch's mean."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / (SEQ * BATCH)


def gradient_buckets(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(complete for the replica: sum over dp, this rank's tokens' share: sum over all ranks, complete for
    the global batch: no sum); see the docstring."""
    complete, partial, whole = [], [], []
    experts = set()
    for module in model.modules():
        if isinstance(module, MoELayer):  # its experts: over mp (EP), once per replica; over all ranks, once
            experts.add(module.experts)
            (whole if module.comm.size == DP * MP else complete).extend(module.experts.parameters())
    for module in model.modules():
        if module in experts:
            continue
        # (a RowParallelLinear's bias is complete only under sequence_parallel=True, as here)
        sharded = isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear))
        (complete if sharded else partial).extend(module.parameters(recurse=False))
    return complete, partial, whole


def all_reduce_gradients(params: list[nn.Parameter], group: collectives.Communicator) -> None:
    """Sum the gradients of ``params`` over ``group``, in place: one all_reduce for the whole bucket."""
    if not params:
        return
    grads = [p.grad for p in params]
    total = group.all_reduce(torch.cat([g.reshape(-1) for g in grads]), op="sum")
    for g, t in zip(grads, total.split([g.numel() for g in grads])):
        g.copy_(t.view_as(g))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters, as the one-process model names them (collective over mp)."""
    full = {}
    for name, module in model.named_modules():
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear)):
            part = module.to_dense().state_dict()     # an nn.Embedding / nn.Linear
        elif isinstance(module, MoELayer):
            part = gather_state_dict(module)          # all E experts, and the router
        else:
            continue
        full.update({f"{name}.{key}": t for key, t in part.items()})
    for name, p in model.named_parameters():          # the rest is replicated: this rank's copy
        full.setdefault(name, p.detach().clone())
    return full


def train(comm: collectives.Communicator, layout: str = "ep") -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train on 4 ranks (each runs this); returns the losses and the final unsharded parameters."""
    dp_rank, mp_rank = divmod(comm.rank, MP)
    mp = comm.split(color=dp_rank)   # {0, 1}, {2, 3}: one replica each (TP, and EP or ETP)
    dp = comm.split(color=mp_rank)   # {0, 2}, {1, 3}: the same TP shards in both replicas (EP in ep-etp)
    if layout == "ep-etp":           # the MoE layer over all 4 ranks: its ETP groups are mp, its EP groups dp
        model = TinyMoETransformer(mp, moe_group=comm, expert_tp_size=MP)
    else:
        model = TinyMoETransformer(mp)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    complete, partial, _whole = gradient_buckets(model)  # the whole ones need no communication
    mine = slice(dp_rank * BATCH // DP, (dp_rank + 1) * BATCH // DP)  # this replica's sequences (batch columns)

    losses = []
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        loss = loss_fn(model(inputs[:, mine]), targets[:, mine])
        optimizer.zero_grad()
        loss.backward()
        all_reduce_gradients(complete, dp)
        all_reduce_gradients(partial, comm)
        optimizer.step()
        losses.append(float(dp.all_reduce(loss.detach())))  # the global batch's mean
        if comm.rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.12f}", flush=True)

    state = full_state_dict(model)
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.close()           # its dispatcher's sub-groups, if any (across nodes), and its EP/ETP groups
    dp.close()
    mp.close()
    return losses, state


def train_one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the same model and optimizer in this process, on the whole global batch."""
    one = collectives.init()         # plain `python`: a group of one rank
    model = TinyMoETransformer(one)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    one.close()
    return losses, state


def main(layout: str = "ep") -> int:
    print(f"layout {layout}: " + ("MoE layer EP over mp" if layout == "ep" else
                                  "MoE layer EP over dp x ETP over mp (all 4 ranks)"), flush=True)
    results = collectives.launch(train, DP * MP, layout, device="cpu")  # train(comm, layout) on 4 local CPU ranks
    want_losses, want_state = train_one_process()
    loss_diff = max(abs(a - b) for losses, _ in results for a, b in zip(losses, want_losses))
    for _, state in results:
        assert state.keys() == want_state.keys(), sorted(state.keys() ^ want_state.keys())
    param_diff = max(float((state[k] - want).abs().max()) for _, state in results for k, want in want_state.items())
    ok = loss_diff <= TOLERANCE and param_diff <= TOLERANCE
    print(f"one process, same seed, concatenated batch: losses {' '.join(f'{x:.12f}' for x in want_losses)}")
    print(f"max loss difference: {loss_diff:.1e}")
    print(f"max parameter difference: {param_diff:.1e} ({len(want_state)} tensors, every rank)")
    print(f"{DP} x {MP} ranks agree with one process within {TOLERANCE:.0e}: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":  # required: launch's ranks import this module, and must not launch again
    # one option: --help shows the docstring above, anything else is refused, not ignored
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", choices=LAYOUTS, default="ep",
                        help="the MoE layer's layout: EP over mp (default), or EP over dp x ETP over mp")
    sys.exit(main(parser.parse_args().layout))
