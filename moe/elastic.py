"""Masks of ranks for the expert-parallel dispatchers (issue #55): the unmasked ranks as a group of their own.

A masked rank is one the others treat as gone (dead, or stopped): no call of the unmasked ranks
waits for it. :class:`MaskedGroup` is the unmasked ranks' communicator, made by
``comm.shrink`` without the masked ranks' help, and the map of expert ids from the full layout
to the group's (the masked ranks' experts have no place there).

Notation as in :mod:`moe.dispatcher`: P ranks of ``comm``, E experts, L = E / P per rank, rank i
owns experts ``[i*L, (i+1)*L)``; M = ``len(masked)``, A = P - M active ranks, which own experts
``[0, A*L)`` of the group's layout in their order.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

from collectives.protocols import CommunicatorLike

from .records import _to_device

log = logging.getLogger("moe")


def check_masked_ranks(comm: CommunicatorLike, masked_ranks: Any, *, where: str) -> tuple[int, ...]:
    """A ``masked_ranks`` argument as a sorted tuple of ranks of ``comm`` (local, no communication).

    Args:
        comm: the group whose ranks are named. masked_ranks: a sequence of ints (None: none).
        where: the caller, for the message (``"dispatch"``).
    Returns:
        The ranks, ascending. Raises ``ValueError`` naming this rank (its world rank) when an entry
        is not an int, is out of ``range(comm.size)``, is listed twice, or is this rank itself (a rank
        never masks itself: the unmasked ranks make the call, the masked ones do not); ``TypeError``
        when ``masked_ranks`` is not a sequence.
    """
    if masked_ranks is None:
        return ()
    me = comm.global_ranks[comm.rank]
    if isinstance(masked_ranks, (str, bytes)) or not hasattr(masked_ranks, "__iter__"):
        raise TypeError(f"{where} on rank {me}: masked_ranks must be a sequence of ranks or None, "
                        f"got {type(masked_ranks).__name__}")
    seen: list[int] = []
    for r in list(masked_ranks):
        if isinstance(r, bool) or not hasattr(r, "__index__"):
            raise ValueError(f"{where} on rank {me}: masked_ranks must hold ints, got {r!r}")
        r = int(r)
        if not 0 <= r < comm.size:
            raise ValueError(f"{where} on rank {me}: masked rank {r} is out of range for a group of {comm.size}")
        if r in seen:
            raise ValueError(f"{where} on rank {me}: masked rank {r} is listed twice")
        if r == comm.rank:
            raise ValueError(f"{where} on rank {me}: rank {me} masks itself (masked_ranks={list(masked_ranks)}); a "
                             "masked rank takes no part in the call, the unmasked ranks make it")
        seen.append(r)
    return tuple(sorted(seen))


def mask_key(masked: Sequence[int]) -> str:
    """The shrink key of one set of masked ranks: ``"mask1-3"`` (each set is its own series of shrinks)."""
    return "mask" + "-".join(map(str, sorted(masked)))


class MaskedGroup:
    """The unmasked ranks of ``comm`` as a communicator of their own, and the expert-id map into it.

    Construction is collective over the unmasked ranks only (``comm.shrink``; the masked ranks take
    no part and may be dead or stopped), works on a broken ``comm`` (after a ``PeerFailedError``),
    and costs one store exchange plus the new communicator's transports (~40 ms on one host).
    Every unmasked rank must build the groups of its mask sets in the same order (shrinks are
    matched by their count per set: :meth:`collectives.Communicator.shrink`'s ``key``).

    Args:
        comm: the full group (P ranks). masked: ranks of ``comm`` to leave out (valid: see
            :func:`check_masked_ranks`). num_experts: E, divisible by P.

    Attributes:
        comm: the shrunk communicator (A ranks; rank i is ``active[i]``; ``global_ranks`` kept).
        masked: tuple of the masked ranks of the original comm, ascending.
        active: tuple of the unmasked ranks, ascending: ``active[i]`` is the original rank of new rank i.
        num_experts: E. num_local_experts: L. num_active_experts: A * L, the group's E.
        build_s: seconds the shrink took on this rank.
    """

    def __init__(self, comm: CommunicatorLike, masked: Sequence[int], num_experts: int):
        self.masked = tuple(sorted(int(r) for r in masked))
        self.active = tuple(r for r in range(comm.size) if r not in self.masked)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // comm.size
        self.num_active_experts = len(self.active) * self.num_local_experts
        t0 = time.monotonic()
        self.comm = comm.shrink(exclude=list(self.masked), key=mask_key(self.masked))
        self.build_s = time.monotonic() - t0
        # [E + 1] int64: entry e + 1 is expert e's id in the group (-1: on a masked rank); entry 0 is -1's
        L = self.num_local_experts
        table = torch.full((num_experts + 1,), -1, dtype=torch.int64)
        for new, old in enumerate(self.active):
            table[1 + old * L: 1 + (old + 1) * L] = torch.arange(new * L, (new + 1) * L)
        self._table = table
        self._tables: dict[torch.device, torch.Tensor] = {table.device: table}
        log.debug("rank %d: masked group without ranks %s (%d of %d ranks) in %.3f s",
                  comm.global_ranks[comm.rank], list(self.masked), len(self.active), comm.size, self.build_s)

    def __repr__(self) -> str:
        return f"MaskedGroup(masked={list(self.masked)}, active={list(self.active)}, E={self.num_experts})"

    def map_experts(self, experts: torch.Tensor) -> torch.Tensor:
        """Expert ids of the full layout -> the same experts' ids in the group's layout (no host sync).

        Args:
            experts: [*] integer tensor of expert ids (-1: unused slot), any shape and device.
        Returns:
            [*] int64, same shape and device: expert e on active rank ``active[i]`` becomes
            ``i * L + e % L``; ids of masked ranks' experts and -1 become -1. Ids outside [-1, E) are
            passed through unchanged, so the group's range check (ids in [0, A*L)) still rejects them.
        """
        e = experts.to(torch.int64)
        table = self._tables.get(e.device)
        if table is None:
            table = self._tables[e.device] = _to_device(self._table, e.device)
        ok = (e >= -1) & (e < self.num_experts)
        return torch.where(ok, table[torch.where(ok, e + 1, 0)], e)

    def close(self) -> None:
        """Close the shrunk communicator (its transports and shared memory)."""
        if hasattr(self.comm, "close"):
            self.comm.close()
