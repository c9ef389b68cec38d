"""``Communicator.split`` (a mixin of the Communicator): MPI_Comm_split over the group's rendezvous,
arguments validated as part of the exchange so that a bad one on any rank stops every rank.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, TypeVar

from transports.settings import parse_options

from ._arrays import as_int

C = TypeVar("C")  # the Communicator (not imported: it imports this module)


class GroupCalls:
    """split() of :class:`collectives.Communicator`."""

    # ---- groups -------------------------------------------------------------------------------
    def split(self: C, color: int | None, key: int | None = None, *,
              options: Mapping[str, Any] | None = None) -> C | None:
        """Sub-communicator of the ranks that pass the same ``color`` (MPI_Comm_split semantics).

        Collective over this group; a bad color, key or option on one rank makes every rank raise.

        Args:
            color: an int (or NumPy integer) of any size; None or negative: this rank joins no group.
            key: an int ordering the ranks inside the new group (default: the current rank); ties
                keep the current order.
            options: settings of the new communicator that differ from this one's, by option
                name of :mod:`transports.settings` (``{"shm_slot_bytes": 1 << 16}``); the ranks of
                a new group must agree on them.
        Returns:
            The new :class:`Communicator` (its own transports; close it when done), or None for
            a rank that joined no group.
        """
        return self._guarded("split", self._split, color, key, options)

    def _split(self: C, color: Any, key: Any, options: Mapping[str, Any] | None) -> C | None:
        me = self.global_ranks[self.rank]
        c, k, err = -1, self.rank, None
        settings = self.settings
        try:
            if color is not None:
                c = as_int(color, f"split: color on rank {me}")
            if key is not None:
                k = as_int(key, f"split: key on rank {me}")
            if options:
                settings = {**self.settings, **parse_options(options, source=f"split on rank {me}")}
        except (TypeError, ValueError) as e:
            err = e
        # the validation is part of the exchange, so a bad argument on one rank stops every rank
        mine = [-1, 0, str(err)] if err is not None else [max(c, -1), k, None]
        entries = [json.loads(b) for b in self._rdv.allgather_bytes(json.dumps(mine).encode())]
        bad = [(self.global_ranks[r], e[2]) for r, e in enumerate(entries) if e[2] is not None]
        if err is not None:
            raise err
        if bad:
            raise ValueError(f"split: rank(s) {[r for r, _ in bad]} passed an invalid color, key or option "
                             f"({bad[0][1]}); every rank aborted the split")
        c = max(c, -1)
        members = sorted((r for r in range(self.size) if entries[r][0] == c and c >= 0),
                         key=lambda r: (entries[r][1], r))
        new_rank = members.index(self.rank) if c >= 0 else -1
        # MPI takes colors and keys as C ints: pass the group's index among the agreed colors, and
        # the agreed order as the key, so any Python int works on every path.
        colors = sorted({e[0] for e in entries if e[0] >= 0})
        rdv = self._rdv.split(colors.index(c) if c >= 0 else -1, max(new_rank, 0), new_rank, len(members), members)
        mpi_sub = getattr(rdv, "comm", None) if self._mpi_comm is not None else None
        if c < 0:
            return None
        topo = self.topology.subset(members, new_rank)
        return type(self)(rdv, topo, timeout=self.timeout, transport=self._forced or "auto",
                            global_ranks=[self.global_ranks[m] for m in members], mpi_comm=mpi_sub,
                            settings=settings, device=self.device)
