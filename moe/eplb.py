"""Expert-parallel load balancing (EPLB): redundant replicas of hot experts, packed onto ranks.

Notation:
    E: logical experts (what the router chooses), ids ``0 .. E-1``.
    R: redundant slots: extra physical copies of (hot) logical experts; ``E + R`` physical slots.
    P: ranks (expert-parallel world size); ``S = (E + R) // P`` slots per rank, slot ``s`` on
       rank ``s // S``.
    T, k: tokens and experts chosen per token.

The idea is DeepSeek-V3's (its open-source EPLB, https://github.com/deepseek-ai/EPLB, MIT):

1. Replicate: each of the R redundant slots goes to the expert whose load per replica is highest.
2. Pack: the E + R replicas (weight ``load / replica_count``) go heaviest first into the lightest
   rank with room (S slots each), never putting two replicas of one expert on one rank when that
   can be avoided; then swaps between the most loaded rank and the others lower the maximum while
   they can.
3. Hierarchical (``num_groups`` with ``num_nodes > 1``): pack the contiguous expert groups onto
   nodes first (same packing, group loads), then replicate and pack within each node, so that a
   group's replicas stay on its node (group-limited routing keeps a token's experts on few nodes).

Everything is float64 on the CPU with ties broken by index: equal loads give equal placements on
every rank (:meth:`Placement.digest` checks that). :func:`route` maps router choices to slots on
the device without a host synchronization.

    placement = balance(loads, num_ranks=P, num_redundant=R)   # loads: [E] tokens per expert
    slots = route(router_out.experts, placement)               # [T, k] logical -> physical
"""

from __future__ import annotations

import hashlib
import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

__all__ = ["Placement", "balance", "fold_replicas", "logical_loads", "route"]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, eq=False)
class Placement:
    """Where every physical expert slot lives and which logical expert it holds.

    Attributes:
        physical_to_logical: ``[E + R]`` int64 (CPU): the logical expert of each slot; slot ``s``
            lives on rank ``s // slots_per_rank``. Copied on construction.
        num_ranks: P.
        num_logical: E.
        logical_to_physical: ``[E, max_replicas]`` int64 (CPU), derived: the slots of each logical
            expert's replicas, ascending, padded with -1.
        replica_count: ``[E]`` int64 (CPU), derived: replicas per logical expert (>= 1 each).

    Equality and hashing compare the three given fields. Raises ``ValueError`` on an invalid
    placement (dtype, shape, divisibility, ids out of range, an expert without a replica).
    """

    physical_to_logical: torch.Tensor
    num_ranks: int
    num_logical: int
    logical_to_physical: torch.Tensor = field(init=False, repr=False)
    replica_count: torch.Tensor = field(init=False, repr=False)
    _tables: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p2l = self.physical_to_logical
        if not isinstance(p2l, torch.Tensor):
            raise ValueError(f"physical_to_logical must be a torch.Tensor, got {type(p2l).__name__}")
        if p2l.dtype != torch.int64 or p2l.dim() != 1 or p2l.device.type != "cpu":
            raise ValueError("physical_to_logical must be a 1-D int64 CPU tensor, got "
                             f"{p2l.dtype} shape {tuple(p2l.shape)} on {p2l.device}")
        if not _is_int(self.num_ranks) or self.num_ranks <= 0:
            raise ValueError(f"num_ranks must be a positive int, got {self.num_ranks!r}")
        if not _is_int(self.num_logical) or self.num_logical <= 0:
            raise ValueError(f"num_logical must be a positive int, got {self.num_logical!r}")
        n = p2l.numel()
        if n == 0 or n % self.num_ranks:
            raise ValueError(f"{n} physical slots do not divide evenly over num_ranks={self.num_ranks}")
        p2l = p2l.detach().clone().contiguous()
        lo, hi = int(p2l.min()), int(p2l.max())
        if lo < 0 or hi >= self.num_logical:
            raise ValueError(f"physical_to_logical holds logical ids in [{lo}, {hi}], "
                             f"outside [0, {self.num_logical - 1}] (num_logical={self.num_logical})")
        count = torch.bincount(p2l, minlength=self.num_logical)
        missing = (count == 0).nonzero().flatten().tolist()
        if missing:
            raise ValueError(f"logical experts without a replica: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        order = torch.argsort(p2l, stable=True)              # slots grouped by expert, ascending within
        start = torch.cumsum(count, 0) - count
        col = torch.arange(n) - start[p2l[order]]
        l2p = torch.full((self.num_logical, int(count.max())), -1, dtype=torch.int64)
        l2p[p2l[order], col] = order
        object.__setattr__(self, "physical_to_logical", p2l)
        object.__setattr__(self, "logical_to_physical", l2p)
        object.__setattr__(self, "replica_count", count)
        object.__setattr__(self, "_tables", {})

    @property
    def num_physical(self) -> int:
        """E + R."""
        return self.physical_to_logical.numel()

    @property
    def slots_per_rank(self) -> int:
        """S = (E + R) // P."""
        return self.num_physical // self.num_ranks

    def rank_of(self, slot: int) -> int:
        """The rank that holds physical ``slot``."""
        if not 0 <= slot < self.num_physical:
            raise ValueError(f"slot {slot} outside [0, {self.num_physical})")
        return slot // self.slots_per_rank

    def slots_of(self, rank: int) -> range:
        """The physical slots of ``rank`` (contiguous)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} outside [0, {self.num_ranks})")
        s = self.slots_per_rank
        return range(rank * s, (rank + 1) * s)

    def rank_loads(self, loads: torch.Tensor | Sequence[float]) -> torch.Tensor:
        """Load of every rank; each replica takes an equal share of its expert's load.

        Args:
            loads: ``[E]`` float or int, >= 0 (any device; copied to the CPU).

        Returns:
            ``[P]`` float64 (CPU).
        """
        w = _loads(loads, self.num_logical)
        per_slot = w[self.physical_to_logical] / self.replica_count[self.physical_to_logical].double()
        return per_slot.view(self.num_ranks, self.slots_per_rank).sum(1)

    def imbalance(self, loads: torch.Tensor | Sequence[float]) -> float:
        """Max rank load / mean rank load (1.0 is perfect; 1.0 also when all loads are zero)."""
        r = self.rank_loads(loads)
        mean = float(r.mean())
        return float(r.max()) / mean if mean > 0 else 1.0

    def digest(self) -> str:
        """sha256 hex of the slot table (little-endian int64) and num_ranks: equal on ranks that agree."""
        h = hashlib.sha256(self.physical_to_logical.numpy().astype("<i8").tobytes())
        h.update(self.num_ranks.to_bytes(8, "little"))
        return h.hexdigest()

    def tables(self, device: torch.device | str, masked_ranks: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logical_to_physical, replica_count)`` on ``device``, copied once and cached.

        With ``masked_ranks`` (ranks treated as gone: dead, or masked in a dispatch) only the replicas
        on the other ranks are listed (ascending, padded with -1), and an expert none of whose replicas
        survives has a count of 0. Call it (or :func:`route`) once before CUDA-graph capture: the
        first call copies.
        """
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        masked = tuple(sorted({int(r) for r in masked_ranks})) if masked_ranks else ()
        t = self._tables.get((device, masked))
        if t is None:
            l2p, count = self.logical_to_physical, self.replica_count
            if masked:
                gone = torch.tensor(masked, dtype=torch.int64)
                keep = (l2p >= 0) & ~torch.isin(torch.div(l2p, self.slots_per_rank, rounding_mode="floor"), gone)
                count = keep.sum(1)
                # surviving slots first (a stable sort on "gone"), the rest padded with -1
                order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
                l2p = torch.where(torch.gather(keep, 1, order), torch.gather(l2p, 1, order), -1)
            t = (l2p.to(device), count.to(device))
            self._tables[(device, masked)] = t
        return t

    @classmethod
    def default(cls, num_experts: int, num_ranks: int, num_redundant: int = 0) -> Placement:
        """What a layer starts with: :func:`balance` of uniform loads (deterministic).

        With ``num_redundant=0`` and E divisible by P this is the identity (expert i in slot i).
        """
        if not _is_int(num_experts) or num_experts <= 0:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        return balance(torch.ones(num_experts, dtype=torch.float64), num_ranks, num_redundant)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (self.num_ranks == other.num_ranks and self.num_logical == other.num_logical
                and torch.equal(self.physical_to_logical, other.physical_to_logical))

    def __hash__(self) -> int:
        return hash(self.digest())

    def __repr__(self) -> str:
        return (f"Placement(num_logical={self.num_logical}, num_physical={self.num_physical}, "
                f"num_ranks={self.num_ranks}, max_replicas={self.logical_to_physical.shape[1]}, "
                f"digest={self.digest()[:12]})")


def _loads(loads: torch.Tensor | Sequence[float], num_experts: int | None = None) -> torch.Tensor:
    """``[E]`` float64 CPU copy of ``loads``; ValueError if not 1-D, wrong length, negative or not finite."""
    if isinstance(loads, torch.Tensor):
        w = loads.detach().to("cpu", torch.float64)
    else:
        try:
            w = torch.tensor(list(loads), dtype=torch.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"loads must be a 1-D tensor or a sequence of numbers: {e}") from None
    if w.dim() != 1 or w.numel() == 0:
        raise ValueError(f"loads must be 1-D and non-empty, got shape {tuple(w.shape)}")
    if num_experts is not None and w.numel() != num_experts:
        raise ValueError(f"loads has {w.numel()} entries, expected one per logical expert ({num_experts})")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("loads must be finite (found nan or inf)")
    if bool((w < 0).any()):
        raise ValueError(f"loads must be >= 0, got minimum {float(w.min())}")
    return w


def _replicate(loads: list[float], extra: int) -> list[int]:
    """Replica count of each expert: each extra slot to the highest load per replica.

    Ties: fewer replicas, then lowest id (so all-zero loads spread the extras round-robin).
    """
    count = [1] * len(loads)
    heap = [(-w, 1, e) for e, w in enumerate(loads)]
    heapq.heapify(heap)
    for _ in range(extra):
        _, c, e = heapq.heappop(heap)
        count[e] = c + 1
        heapq.heappush(heap, (-loads[e] / (c + 1), c + 1, e))
    return count


def _pack(weights: list[float], keys: list[int], bins: int, capacity: int) -> list[int]:
    """Bin of every item: exactly ``capacity`` items per bin, the heaviest bin as light as we can.

    Greedy (heaviest item first into the lightest bin with room; ties: fewer items, lower bin),
    avoiding two items of one key in a bin where possible, then best-improvement swaps between the
    heaviest bin and the others while one lowers that bin without raising a duplicate count.

    Args:
        weights: ``[N]`` item weights (N = bins * capacity).
        keys: ``[N]`` ints in ``[0, max(keys)]``: items of one key should not share a bin.
        bins, capacity: bins and items per bin.

    Returns:
        ``[N]`` bin index of each item.
    """
    n = len(weights)
    order = sorted(range(n), key=lambda i: (-weights[i], keys[i], i))
    load = [0.0] * bins
    used = [0] * bins
    held: list[set[int]] = [set() for _ in range(bins)]
    where = [0] * n
    for i in order:
        best = None
        for clash_ok in (False, True):
            for b in range(bins):
                if used[b] < capacity and (clash_ok or keys[i] not in held[b]):
                    cand = (load[b], used[b], b)
                    if best is None or cand < best:
                        best = cand
            if best is not None:
                break
        b = best[2]
        where[i] = b
        load[b] += weights[i]
        used[b] += 1
        held[b].add(keys[i])
    if bins == 1 or n == bins:  # nothing to swap: one bin, or one item per bin (swaps permute loads)
        return where

    w = np.asarray(weights, dtype=np.float64)
    key = np.asarray(keys, dtype=np.int64)
    pos = np.asarray(where, dtype=np.int64)
    bin_load = np.asarray(load, dtype=np.float64)
    cnt = np.zeros((bins, int(key.max()) + 1), dtype=np.int64)
    np.add.at(cnt, (pos, key), 1)
    for _ in range(4 * n * capacity):  # each swap lowers the sorted load vector: finite anyway
        m = int(np.argmax(bin_load))
        top = bin_load[m]
        if top <= 0:
            break
        a = np.flatnonzero(pos == m)
        b = np.flatnonzero(pos != m)
        rb = pos[b]
        wa, wb = w[a][:, None], w[b][None, :]
        ka, kb = key[a][:, None], key[b][None, :]
        new_m = top - wa + wb
        new_r = bin_load[rb][None, :] - wb + wa
        pair_max = np.maximum(new_m, new_r)
        # duplicates after minus before: a joins rb, b joins m, a leaves m, b leaves rb
        dup = ((cnt[rb[None, :], ka] > 0).astype(np.int64) + (cnt[m, kb] > 0)
               - (cnt[m, ka] > 1) - (cnt[rb[None, :], kb] > 1))
        ok = (ka != kb) & (dup <= 0) & (pair_max < top * (1 - 1e-12))
        if not ok.any():
            break
        flat = int(np.argmin(np.where(ok, pair_max, np.inf)))
        i, j = a[flat // b.size], b[flat % b.size]
        r = pos[j]
        bin_load[m] = new_m.flat[flat]
        bin_load[r] = new_r.flat[flat]
        cnt[m, key[i]] -= 1
        cnt[r, key[j]] -= 1
        cnt[m, key[j]] += 1
        cnt[r, key[i]] += 1
        pos[i], pos[j] = r, m
    return pos.tolist()


def _flat(loads: list[float], num_ranks: int, num_redundant: int) -> list[int]:
    """physical_to_logical (local ids) of a flat placement: replicate, pack, sort each rank by id."""
    count = _replicate(loads, num_redundant)
    keys = [e for e, c in enumerate(count) for _ in range(c)]
    weights = [loads[e] / count[e] for e in keys]
    cap = len(keys) // num_ranks
    where = _pack(weights, keys, num_ranks, cap)
    # Canonical form, loads unchanged: experts of one replica and equal load are interchangeable, so
    # they fill the ranks their class occupies in ascending id order (uniform loads with R = 0 give
    # the identity: expert e on rank e // S, the layout of a layer without EPLB).
    classes: dict[float, list[int]] = {}
    for i, e in enumerate(keys):
        if count[e] == 1:
            classes.setdefault(weights[i], []).append(i)
    for items in classes.values():
        for i, b in zip(items, sorted(where[i] for i in items)):
            where[i] = b
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for i, b in enumerate(where):  # items are in id order already: each rank's list ends up sorted
        per_rank[b].append(keys[i])
    return [e for rank in per_rank for e in rank]


def balance(loads: torch.Tensor | Sequence[float], num_ranks: int, num_redundant: int, *, num_nodes: int = 1,
            num_groups: int | None = None) -> Placement:
    """A placement of E + R slots on P ranks that balances ``loads`` (deterministic; CPU, float64).

    Args:
        loads: ``[E]`` float or int >= 0: load per logical expert (e.g. :func:`logical_loads`
            summed over steps); any device.
        num_ranks: P; ``(E + R) % P == 0``.
        num_redundant: R >= 0.
        num_nodes: nodes, each with P / num_nodes consecutive ranks (hierarchical mode only).
        num_groups: contiguous expert groups (DeepSeek-V3's group-limited routing). With
            ``num_nodes > 1`` the groups are packed onto nodes first and every replica of a group's
            experts stays on its node; needs E % num_groups, num_groups % num_nodes and
            P % num_nodes to be 0 (R % num_nodes follows), else ValueError.

    Returns:
        A :class:`Placement`. Raises ``ValueError`` on invalid arguments.
    """
    w = _loads(loads)
    e_count = w.numel()
    if not _is_int(num_ranks) or num_ranks <= 0:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    if not _is_int(num_redundant) or num_redundant < 0:
        raise ValueError(f"num_redundant must be an int >= 0, got {num_redundant!r}")
    if (e_count + num_redundant) % num_ranks:
        raise ValueError(f"E + R = {e_count} + {num_redundant} = {e_count + num_redundant} physical slots "
                         f"do not divide evenly over num_ranks={num_ranks}")
    if not _is_int(num_nodes) or num_nodes <= 0:
        raise ValueError(f"num_nodes must be a positive int, got {num_nodes!r}")
    if num_groups is not None:
        if not _is_int(num_groups) or num_groups <= 0:
            raise ValueError(f"num_groups must be a positive int or None, got {num_groups!r}")
        if e_count % num_groups:
            raise ValueError(f"E={e_count} experts do not split into num_groups={num_groups} equal groups")
    values = w.tolist()
    if num_groups is None or num_nodes == 1:
        return Placement(torch.tensor(_flat(values, num_ranks, num_redundant), dtype=torch.int64),
                         num_ranks, e_count)

    for what, v in (("num_groups", num_groups), ("num_ranks", num_ranks)):  # then E and R divide too
        if v % num_nodes:
            raise ValueError(f"hierarchical placement needs {what}={v} divisible by num_nodes={num_nodes} "
                             "(pass num_groups=None for the flat placement)")
    size = e_count // num_groups
    group_load = [math.fsum(values[g * size:(g + 1) * size]) for g in range(num_groups)]
    node_of = _pack(group_load, list(range(num_groups)), num_nodes, num_groups // num_nodes)
    p2l: list[int] = []
    for node in range(num_nodes):
        experts = [g * size + i for g in range(num_groups) if node_of[g] == node for i in range(size)]
        local = _flat([values[e] for e in experts], num_ranks // num_nodes, num_redundant // num_nodes)
        p2l += [experts[i] for i in local]
    return Placement(torch.tensor(p2l, dtype=torch.int64), num_ranks, e_count)


def route(experts: torch.Tensor, placement: Placement, *, offset: int | torch.Tensor = 0,
          masked_ranks: Sequence[int] = ()) -> torch.Tensor:
    """Physical slot of every routed choice (gathers on the experts' device; no host synchronization).

    Token t's choice j of expert e goes to replica ``(offset + t + j) % replica_count[e]`` of e
    (its slots ascending): a replicated expert's tokens spread evenly and deterministically over its
    replicas; an expert with one replica keeps its only slot.

    Args:
        experts: ``[T, k]`` (or ``[T]``, j = 0) integer logical ids in ``[0, E)``, any device.
        placement: the :class:`Placement`; its tables are copied to the device once and cached.
        offset: int, or an integer tensor of one element (e.g. a step counter on the device) that
            rotates the replica choice.
        masked_ranks: ranks treated as gone (elastic EP, :mod:`moe.elastic`): choices go to the
            replicas on the other ranks only (the same rule over the surviving replicas), and a
            choice of an expert with no surviving replica gets -1 (its slot is dropped).

    Returns:
        ``[T, k]`` int64 physical slot ids (or -1), same shape and device.
    """
    if not isinstance(experts, torch.Tensor) or experts.dim() not in (1, 2):
        raise ValueError(f"experts must be a [T, k] or [T] tensor, got {getattr(experts, 'shape', type(experts))}")
    if experts.dtype.is_floating_point or experts.dtype.is_complex or experts.dtype == torch.bool:
        raise ValueError(f"experts must hold integer ids, got {experts.dtype}")
    l2p, count = placement.tables(experts.device, masked_ranks)
    ids = experts.long()
    t = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)
    pos = t if ids.dim() == 1 else t[:, None] + torch.arange(ids.shape[1], device=ids.device, dtype=torch.int64)
    if isinstance(offset, torch.Tensor):
        if offset.numel() != 1 or offset.dtype.is_floating_point:
            raise ValueError(f"offset must be an int or an integer tensor of one element, got {offset.dtype} "
                             f"shape {tuple(offset.shape)}")
        # a CPU tensor is read on the host (no device copy); a device one stays there
        offset = int(offset) if offset.device.type == "cpu" else offset.to(ids.device, torch.int64).reshape(())
    if not masked_ranks:
        replica = (pos + offset) % count[ids]
        return l2p.view(-1)[ids * l2p.shape[1] + replica]
    n = count[ids]
    replica = (pos + offset) % n.clamp(min=1)
    return torch.where(n > 0, l2p.view(-1)[ids * l2p.shape[1] + replica], -1)


def logical_loads(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each logical expert (no host synchronization, unlike ``torch.bincount`` on CUDA).

    Args:
        experts: integer logical ids in ``[0, E)``, any shape (e.g. ``[T, k]``), any device.
        num_experts: E.

    Returns:
        ``[E]`` int64 counts on the experts' device.
    """
    if not _is_int(num_experts) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if experts.dtype.is_floating_point or experts.dtype.is_complex or experts.dtype == torch.bool:
        raise ValueError(f"experts must hold integer ids, got {experts.dtype}")
    flat = experts.reshape(-1).long()
    out = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return out.index_add_(0, flat, torch.ones_like(flat))


def fold_replicas(per_slot: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Per-slot values summed into their logical experts (e.g. a dispatch layout's tokens per slot).

    Args:
        per_slot: ``[E + R]`` numbers, one per physical slot, any device.
        placement: the :class:`Placement` whose slots they are.

    Returns:
        ``[E]`` of per_slot's dtype and device: entry e is the sum over e's replicas.
    """
    p2l = placement.physical_to_logical.to(per_slot.device)
    return torch.zeros(placement.num_logical, dtype=per_slot.dtype, device=per_slot.device).index_add_(0, p2l, per_slot)
