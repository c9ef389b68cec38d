"""Live expert-parallel load balancing of a :class:`moe.MoELayer`: replica gradients, moving experts, a balancer.

A layer built with ``num_redundant_experts=R`` (:mod:`moe.eplb`) holds E logical experts in E + R
physical slots, ``(E + R) / P`` per rank. This module keeps such a layer trainable and balanced:

* :func:`reduce_replica_grads` (``layer.reduce_replica_grads()``): every replica gets the sum of its
  expert's replica gradients, so replicas stay identical under any optimizer;
* :func:`rebalance` (``layer.rebalance(placement, optimizer)``): moves the weights (and optimizer
  state) to a new placement in bounded rounds of all-to-alls, in place;
* :class:`Balancer`: every ``every`` steps, sums ``layer.expert_load`` over ranks and rebalances to
  :func:`moe.eplb.balance` of it when the current placement's imbalance exceeds a threshold.

With expert tensor parallelism (``expert_tp_size`` T > 1, :mod:`moe.expert_tp`) the placement is
over the P / T ranks of ``layer.ep_comm``, and every rank of an ETP group holds its shard of the
same slots: gradients are reduced and experts moved over ``ep_comm``, each ETP rank its own shards
(the same slots move in every EP group, so the shards stay together); the agreements run over the
whole ``layer.comm``.

    balancer = Balancer(layer, every=100, threshold=1.1, optimizer=opt)
    for batch in data:
        y, aux = layer(x); loss(y, aux).backward()
        layer.reduce_replica_grads(); opt.step(); opt.zero_grad()
        balancer.step()
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, NamedTuple

import torch

from collectives.agreement import agree, rank_label, rejecting

from .eplb import Placement, balance

# moe.layer imports this module, so the layer is typed as a Module here (it is a moe.MoELayer)
MoELayer = torch.nn.Module

__all__ = ["Balancer", "Moved", "rebalance", "reduce_replica_grads"]

MAX_EXPERTS_PER_ROUND = 8  # default bound on the experts a rank receives (or copies locally) per round

# Test hook: when set, called on every rank as ``_after_round(layer, round_index)`` after each round of a
# rebalance's move (the round's writes done). tests/test_moe_eplb.py kills a rank there to check that the
# survivors raise and their layer then refuses to run. Never set outside tests.
_after_round: Callable[[Any, int], None] | None = None


class Moved(NamedTuple):
    """What :func:`rebalance` did on this rank: ``rounds`` of all-to-alls (the same on every rank),
    slots it ``received`` from other ranks and slots it ``copied`` from its own old slots."""

    rounds: int
    received: int
    copied: int


def digest_int(placement: Placement) -> int:
    """60 bits of ``placement.digest()`` as an int (what :func:`collectives.agreement.agree` compares)."""
    return int(placement.digest()[:15], 16)


def reduce_replica_grads(layer: MoELayer) -> None:
    """``layer.reduce_replica_grads()``: every replica's fc1/fc2 gradient becomes the sum over all ranks of
    its logical expert's replica gradients (collective: one all-reduce over ``layer.ep_comm``; with
    ETP, of this rank's shards, which its EP group's ranks all hold alike).

    Simple first: the local slots' gradients are scatter-added into a zero [E, ...] buffer (fc1 and
    fc2 flattened side by side), all-reduced and gathered back, so it moves all E experts'
    gradients whatever R is (a variant that moves only the replicated experts' can come later). A
    missing gradient counts as zeros (and is set).
    """
    ex = layer.experts
    params = (ex.fc1, ex.fc2)
    n = ex.fc1.shape[0]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    ids = torch.tensor(ex.expert_ids, dtype=torch.int64, device=grads[0].device)
    flat = torch.cat([g.reshape(n, -1) for g in grads], 1)
    total = layer.ep_comm.all_reduce(flat.new_zeros((layer.num_experts, flat.shape[1])).index_add_(0, ids, flat))
    mine, col = total[ids], 0
    for p, g in zip(params, grads):
        part = mine[:, col: col + g[0].numel()].reshape(g.shape)
        col += g[0].numel()
        if p.grad is None:
            p.grad = part.to(p.dtype)
        else:
            p.grad.copy_(part)


def _moved_tensors(layer: MoELayer, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor [L, ...]) of everything a slot carries: fc1, fc2, and with an optimizer its state
    tensors of the parameter's shape (e.g. Adam's exp_avg, exp_avg_sq; not ``step``), by key."""
    ex = layer.experts
    out = [("fc1", ex.fc1.data), ("fc2", ex.fc2.data)]
    if optimizer is not None:
        for name, p in (("fc1", ex.fc1), ("fc2", ex.fc2)):
            state = optimizer.state.get(p, {})
            out += [(f"{name}.{k}", state[k]) for k in sorted(state, key=str)
                    if isinstance(state[k], torch.Tensor) and state[k].shape == p.shape]
    return out


def _plan(old: list[int], new: list[int], slots_per_rank: int, num_ranks: int, per_round: int
          ) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """The moves from ``old`` to ``new`` (physical_to_logical lists), the same on every rank.

    Returns ``(source, round_of, hold_until)``: for every slot d whose expert changes, the old slot
    it copies from (on d's rank when that rank held the expert, else on the rank holding it with the
    fewest sends so far; slots that keep their expert first, as they are never overwritten) and its
    round; for every overwritten slot whose old content a later round still reads, that round (its
    rank keeps a copy until then: only to break a cycle of moves).
    """
    S = slots_per_rank
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        holders.setdefault(e, []).append(s)
    sends = [0] * num_ranks
    source: dict[int, int] = {}
    for d, e in enumerate(new):
        if old[d] == e:
            continue
        local = [s for s in holders[e] if s // S == d // S]
        src = min(local or holders[e], key=lambda s: (old[s] != new[s], sends[s // S], s))
        sends[src // S] += src // S != d // S
        source[d] = src
    readers: dict[int, list[int]] = {d: [] for d in source}  # the moves that read slot d's old rows
    for d, src in source.items():
        if src in readers:
            readers[src].append(d)
    # A cycle of moves (each reads the next one's old rows) cannot be ordered: one move of each (its lowest
    # slot) is written regardless of its readers, its rank keeping the old rows aside until they are read.
    free: set[int] = set()
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    for start in source:
        path, d = [], start
        while d in source and d not in state:
            state[d] = 1
            path.append(d)
            d = source[d]
        if state.get(d) == 1:  # the path came back to itself: the cycle is path[path.index(d):]
            free.add(min(path[path.index(d):]))
        state.update((x, 2) for x in path)
    # Rounds: a slot is overwritten no earlier than the last round that reads its old rows (reads come first
    # within a round), at most per_round moves into each rank per round; every round places at least one
    # move (without the free moves' waits, who waits for whom has no cycle). The longest chains of waiting
    # moves go first: writing d lets the move that overwrites d's source go, and so on.
    def chain(d: int) -> int:
        n = 0
        while source.get(d) in source and source[d] not in free and n < len(source):
            d, n = source[d], n + 1
        return n

    round_of: dict[int, int] = {}
    left = sorted(source, key=lambda d: (-chain(d), d))
    i = 0
    while left:
        room = [per_round] * num_ranks
        progress = True
        while progress:
            progress = False
            for d in left:
                if d not in round_of and room[d // S] and (d in free or all(x in round_of for x in readers[d])):
                    round_of[d] = i
                    room[d // S] -= 1
                    progress = True
        left = [d for d in left if d not in round_of]
        i += 1
    hold_until: dict[int, int] = {}
    for d, s in source.items():
        if s in round_of and round_of[d] > round_of[s]:
            hold_until[s] = max(hold_until.get(s, 0), round_of[d])
    return source, round_of, hold_until


def rebalance(layer: MoELayer, placement: Placement, optimizer: Any = None, *,
              max_experts_per_round: int = MAX_EXPERTS_PER_ROUND) -> Moved:
    """Move ``layer``'s experts to ``placement`` (collective; ``layer.rebalance`` calls it).

    1. Every rank checks its arguments and they agree: a placement for another E, P or E + R, or
       one that differs from the other ranks' (by digest), raises ``ValueError`` on every rank,
       naming the rank(s), before anything moves (so do a bad ``max_experts_per_round`` and
       optimizers whose state differs in kind).
    2. The layer is marked as moving: its forward raises ``RuntimeError`` until step 4.
    3. Each slot whose logical expert changes gets that expert's weights from a slot that holds it
       in the old placement: a local copy when this rank held it, else over ``comm.all_to_all`` of
       the stacked rows (uneven counts; every rank takes part in every round), in rounds where each
       rank receives or copies at most ``max_experts_per_round`` experts (memory: that many rows
       received and as many sent per round). A slot is overwritten no earlier than the round that
       reads its old rows, except in a cycle of moves (A takes B's expert, B takes A's), where one
       slot per cycle keeps its old rows aside until they are read. With an ``optimizer`` its
       state tensors of fc1's / fc2's shape move
       along (Adam's ``exp_avg``, ``exp_avg_sq``; scalars like ``step`` stay). Everything is
       written in place into the existing tensors (``index_copy_``), so the optimizer keeps them.
    4. A final agreement that every rank finished; then the mark is cleared and ``layer.placement``
       set. A failure in step 3 (a dead peer: ``PeerFailedError``; a local error, which every rank
       raises) leaves the layer refusing to run (and to rebalance: ``RuntimeError``), saying the
       rebalance was interrupted.

    The layer computes the same function afterwards. Gradients are not moved: the experts' are
    cleared (set to None); call it between an optimizer step and the next backward.

    With ETP (T > 1) the placement is over the P / T ranks of ``layer.ep_comm``; steps 1 and 4 run
    over ``layer.comm``, step 3 over ``ep_comm``, each ETP rank moving its own shards (every EP group
    makes the same moves). A failure in step 3 is also relayed to the other EP groups, whose final
    agreement then raises.

    Args:
        layer: the :class:`moe.MoELayer` (every rank of its communicator calls this).
        placement: the new :class:`moe.eplb.Placement`, the same on every rank (e.g. from
            :func:`moe.eplb.balance` of all-reduced loads).
        optimizer: a ``torch.optim.Optimizer`` over the layer's parameters, or None (on every rank alike).
        max_experts_per_round: a positive int, the same on every rank.

    Returns:
        :class:`Moved` (rounds, received, copied) for this rank.
    """
    comm = layer.comm
    if layer._moving is not None:  # an interrupted one (every rank of it has the mark): the old placement is gone
        raise RuntimeError(f"MoELayer.rebalance on {rank_label(comm)}: {layer._moving}")
    err, tensors, sig = None, [], 0
    try:
        if not isinstance(placement, Placement):
            raise ValueError(f"placement must be a moe.eplb.Placement, got {type(placement).__name__}")
        E, R, P = layer.num_experts, layer.num_redundant_experts, layer.ep_comm.size
        if (placement.num_logical, placement.num_physical, placement.num_ranks) != (E, E + R, P):
            raise ValueError(f"placement has {placement.num_logical} experts in {placement.num_physical} slots on "
                             f"{placement.num_ranks} ranks; this layer has {E} in {E + R} slots on {P} ranks")
        m = max_experts_per_round
        if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
            raise ValueError(f"max_experts_per_round must be a positive int, got {m!r}")
        if optimizer is not None and not isinstance(getattr(optimizer, "state", None), dict):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        tensors = _moved_tensors(layer, optimizer)
        sig = zlib.crc32(repr([(n, str(t.dtype), tuple(t.shape)) for n, t in tensors]).encode())
    except ValueError as e:
        err = e
    digest = digest_int(placement) if err is None else -1
    rows = agree(comm, "MoELayer.rebalance", {"max_experts_per_round": max_experts_per_round if err is None else None,
                                              "optimizer": optimizer is not None, "moved tensors (signature)": sig},
                 error=err, extra=torch.tensor([digest]),
                 hint="Pass the same max_experts_per_round and an optimizer (or None) with the same kind of state "
                      "on every rank.")
    _check_same_placement(comm, rows[:, 0].tolist())
    old, new = layer.placement.physical_to_logical.tolist(), placement.physical_to_logical.tolist()
    layer._moving = f"a rebalance to placement {placement.digest()[:12]} is under way"
    try:
        moved = _move_relayed(layer, tensors, old, new, max_experts_per_round)
        agree(comm, "MoELayer.rebalance (finished)", {"finished": 1})
    except BaseException as e:
        layer._moving = (f"a rebalance to placement {placement.digest()[:12]} was interrupted "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the experts' weights "
                         "are partly moved, so this layer cannot run: build a new one and load a checkpoint")
        raise
    mine = placement.slots_of(layer.ep_comm.rank)
    layer.placement = placement
    layer._identity = layer.num_redundant_experts == 0 and new == list(range(layer.num_experts))
    layer.experts.expert_ids = new[mine.start: mine.stop]
    layer.experts.fc1.grad = layer.experts.fc2.grad = None
    layer._moving = None
    return moved


def _check_same_placement(comm: Any, digests: list[int]) -> None:
    """ValueError on every rank when the ranks' placement digests differ, naming those that differ from the
    most common one (ties: the lowest rank's)."""
    if len(set(digests)) == 1:
        return
    ref = max(digests, key=lambda d: (digests.count(d), -digests.index(d)))
    odd = [r for r, d in enumerate(digests) if d != ref]
    same = [r for r, d in enumerate(digests) if d == ref]
    raise ValueError("MoELayer.rebalance: the placement on " + ", ".join(rank_label(comm, r) for r in odd)
                     + f" differs from the one on {', '.join(rank_label(comm, r) for r in same)} (digests "
                     + ", ".join(f"rank {comm.global_ranks[r]}: {d:015x}" for r, d in enumerate(digests))
                     + "); nothing was moved. Pass the same placement on every rank (balance() of the same "
                       "all-reduced loads gives it).")


def _move_relayed(layer: MoELayer, tensors: list[tuple[str, torch.Tensor]], old: list[int], new: list[int],
                  per_round: int) -> Moved:
    """:func:`_move`; with ETP, a failure is also rejected on ``layer.comm``: the other EP groups learn of it
    at their final agreement (this EP group's peers raise in ``_move``'s own collectives)."""
    try:
        return _move(layer, tensors, old, new, per_round)
    except Exception as e:
        if layer.ep_comm is not layer.comm:
            relayed = ValueError(f"MoELayer.rebalance on {rank_label(layer.comm)} failed in its EP group: "
                                 f"{type(e).__name__}: {e}")
            try:
                layer.comm.reject(relayed)  # on the CPU: the final agreement's all-gather moves CPU tensors
            except Exception:  # noqa: BLE001 - reject raises `relayed` by design; the original error is raised
                pass
        raise


def _move(layer: MoELayer, tensors: list[tuple[str, torch.Tensor]], old: list[int], new: list[int],
          per_round: int) -> Moved:
    """Step 3 of :func:`rebalance`: the rounds of copies and all-to-alls (collective over ``layer.ep_comm``)."""
    comm = layer.ep_comm
    me, P = comm.rank, comm.size
    S = len(new) // P
    base = me * S
    source, round_of, hold_until = _plan(old, new, S, P, per_round)
    rounds = max(round_of.values(), default=-1) + 1
    ts = [t for _, t in tensors]
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}  # one all-to-all per dtype and device
    for j, t in enumerate(ts):
        groups.setdefault((t.dtype, t.device), []).append(j)
    held: dict[int, list[torch.Tensor]] = {}  # overwritten slots' old rows a later round still reads
    received = copied = 0

    def rows_of(s: int) -> list[torch.Tensor]:
        return held[s] if s in held else [t[s - base] for t in ts]

    for i in range(rounds):
        now = sorted(d for d, r in round_of.items() if r == i)
        send = sorted((d for d in now if source[d] // S == me and d // S != me), key=lambda d: (d // S, d))
        recv = sorted((d for d in now if d // S == me and source[d] // S != me), key=lambda d: (source[d] // S, d))
        local = [d for d in now if d // S == me and source[d] // S == me]
        send_counts = [sum(1 for d in send if d // S == q) for q in range(P)]
        recv_counts = [sum(1 for d in recv if source[d] // S == q) for q in range(P)]
        got: dict[int, torch.Tensor] = {}
        for (dtype, device), js in groups.items():
            width = sum(ts[j][0].numel() for j in js)
            with rejecting(comm, on=ts[js[0]]):  # the peers are in this all-to-all
                buf = torch.stack([torch.cat([rows_of(source[d])[j].reshape(-1) for j in js]) for d in send]) \
                    if send else torch.empty((0, width), dtype=dtype, device=device)
            got[js[0]] = comm.all_to_all(buf, send_counts, recv_counts=recv_counts)
        with rejecting(comm, on=ts[0]):  # the peers go on to the next round (or the final agreement)
            local_rows = [[rows_of(source[d])[j].clone() for j in range(len(ts))] for d in local]
            for d in now:  # old rows of this round's targets that later rounds still read
                if d // S == me and hold_until.get(d, -1) > i:
                    held[d] = [t[d - base].clone() for t in ts]
            with torch.no_grad():
                for js in groups.values():
                    rows, col = got[js[0]], 0
                    for j in js:
                        n, t = ts[j][0].numel(), ts[j]
                        if recv:
                            idx = torch.tensor([d - base for d in recv], dtype=torch.int64, device=t.device)
                            t.index_copy_(0, idx, rows[:, col: col + n].reshape(len(recv), *t.shape[1:]))
                        if local:
                            idx = torch.tensor([d - base for d in local], dtype=torch.int64, device=t.device)
                            t.index_copy_(0, idx, torch.stack([r[j] for r in local_rows]))
                        col += n
            for s in [s for s in held if hold_until[s] <= i]:
                del held[s]
        received += len(recv)
        copied += len(local)
        if _after_round is not None:
            _after_round(layer, i)
    return Moved(rounds, received, copied)


class Balancer:
    """Rebalances a layer from its measured loads every ``every`` steps (EPLB at run time).

    Args:
        layer: the :class:`moe.MoELayer` (any R; with R = 0 it can only permute experts over ranks).
        every: a positive int: :meth:`step` looks at the loads every ``every``-th call.
        threshold: a finite number >= 1: rebalance when the placement's imbalance (max / mean rank
            load, :meth:`moe.eplb.Placement.imbalance`) over the period exceeds it.
        optimizer: moved along (see :func:`rebalance`), or None.
        max_experts_per_round: passed to :func:`rebalance`.
    """

    def __init__(self, layer: MoELayer, *, every: int = 100, threshold: float = 1.1, optimizer: Any = None,
                 max_experts_per_round: int = MAX_EXPERTS_PER_ROUND):
        if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
            raise ValueError(f"Balancer: every must be a positive int, got {every!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                math.isfinite(threshold) and threshold >= 1):
            raise ValueError(f"Balancer: threshold must be a finite number >= 1, got {threshold!r}")
        self.layer, self.every, self.threshold = layer, every, float(threshold)
        self.optimizer, self.max_experts_per_round = optimizer, max_experts_per_round
        self.steps = 0
        self.last_imbalance: float | None = None  # the imbalance seen at the last check

    def step(self) -> bool:
        """Count a step; every ``every``-th: sum ``layer.expert_load`` over the ranks (collective), reset it,
        and when the imbalance exceeds the threshold and :func:`moe.eplb.balance` of the loads
        improves on it, :func:`rebalance` there. Returns whether experts moved."""
        self.steps += 1
        if self.steps % self.every:
            return False
        layer = self.layer
        loads = layer.comm.all_reduce(layer.expert_load.detach().clone()).cpu()
        layer.reset_expert_load()
        self.last_imbalance = layer.placement.imbalance(loads)
        if self.last_imbalance <= self.threshold:
            return False
        new = balance(loads, layer.ep_comm.size, layer.num_redundant_experts)
        if new == layer.placement or new.imbalance(loads) >= self.last_imbalance:
            return False
        layer.rebalance(new, self.optimizer, max_experts_per_round=self.max_experts_per_round)
        return True
