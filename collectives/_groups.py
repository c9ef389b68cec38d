"""``Communicator.split`` (a mixin of the Communicator): MPI_Comm_split over the group's rendezvous,
arguments validated as part of the exchange so that a bad one on any rank stops every rank; and
``Communicator.shrink``: the group of the survivors after a failure, made without the excluded ranks.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence, TypeVar

from transports.settings import parse_options

from ._arrays import as_int

C = TypeVar("C")  # the Communicator (not imported: it imports this module)


class GroupCalls:
    """split() and shrink() of :class:`collectives.Communicator`."""

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

    def shrink(self: C, exclude: Sequence[int], *, key: str = "") -> C:
        """A new communicator of the ranks not in ``exclude`` (survivor i becomes rank i), made
        without the excluded ranks' help: they take no part and may be dead.

        Collective over the survivors only. It works on a communicator that is closed or broken
        (e.g. its last call raised ``PeerFailedError`` because a peer died); the new communicator
        keeps the timeout, settings, device and forced transport, its ``global_ranks`` are the
        survivors' own, and its transports are new (close it, and this one, when done). Needs the
        store rendezvous (``collectives.launch`` or torchrun); a store hosted by an excluded rank
        (rank 0 under torchrun without an agent store, or ``collectives.init``) died with it.

        Args:
            exclude: ranks of this communicator to drop (ints, in range, unique, not this rank).
            key: a name for a series of shrinks. Shrinks of this communicator are matched by their
                count per key on each survivor, so survivors must make the same shrinks with a key in
                the same order; use a key per set of excluded ranks when different sets of survivors
                shrink it (masks of live ranks: ``moe.elastic``), "" (default) otherwise.
        Returns:
            The survivors' :class:`Communicator`. Raises ValueError on the rank that passed a bad
            ``exclude`` and on every survivor that hears of it, or when the survivors pass different
            ``exclude`` (naming the ranks); RuntimeError when the store lived in an excluded rank's
            process; NotImplementedError under MPI (no ULFM); PeerFailedError when a survivor dies.
        """
        me = self.global_ranks[self.rank]
        if self._mpi_comm is not None or self._forced == "mpi":
            raise NotImplementedError("shrink needs the store rendezvous (collectives.launch or torchrun); "
                                      "MPI cannot drop a dead rank without ULFM")
        err: str | None = None
        dropped: list[int] = []
        try:
            if isinstance(exclude, (str, bytes)) or not hasattr(exclude, "__iter__"):
                raise TypeError(f"a sequence of ranks, not {type(exclude).__name__}")
            for x in exclude:
                r = as_int(x, f"shrink: exclude on rank {me}")
                if not 0 <= r < self.size:
                    raise ValueError(f"rank {r} is out of range for a group of {self.size}")
                if r == self.rank:
                    raise ValueError(f"rank {me} excludes itself")
                if r in dropped:
                    raise ValueError(f"rank {r} is listed twice")
                dropped.append(r)
        except (TypeError, ValueError) as e:
            err = f"exclude={list(exclude) if hasattr(exclude, '__iter__') else exclude!r} on rank {me}: {e}"
        survivors = [r for r in range(self.size) if r not in dropped] if err is None else [self.rank]
        if not isinstance(key, str) or "/" in key:
            raise TypeError(f"shrink: key must be a str without '/', got {key!r}")
        rdv = self._rdv.shrink(survivors, error=err, key=key)
        new_rank = survivors.index(self.rank)
        topo = self.topology.subset(survivors, new_rank)
        return type(self)(rdv, topo, timeout=self.timeout, transport=self._forced or "auto",
                          global_ranks=[self.global_ranks[m] for m in survivors],
                          settings=self.settings, device=self.device)
