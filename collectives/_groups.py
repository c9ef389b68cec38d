"""``Communicator.split`` (a mixin of the Communicator): MPI_Comm_split over the group's rendezvous,
arguments validated as part of the exchange so that a bad one on any rank stops every rank;
``Communicator.shrink``: the group of the survivors after a failure, made without the excluded ranks;
and ``Communicator.grow`` / ``join_address``: new processes (``collectives.init(join=...)``) join the group.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Sequence, TypeVar

from transports.settings import agreed_items, parse_options

from ._arrays import as_int
from .topology import Topology, local_facts

C = TypeVar("C")  # the Communicator (not imported: it imports this module)

log = logging.getLogger("collectives")


class GroupCalls:
    """split(), shrink(), grow() and join_address() of :class:`collectives.Communicator`."""

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

    def join_address(self: C) -> str:
        """Where a new process joins this group: pass it to ``collectives.init(join=...)`` there, then
        let the members call :meth:`grow`.

        The address is this group's rendezvous store (the one its ranks already use: 127.0.0.1 under
        ``collectives.launch``, MASTER_ADDR under torchrun) and its key prefix; nothing else listens
        for newcomers. Local: it writes what a newcomer needs into that store.

        Returns:
            ``"host:port/prefix"`` (``"[host]:port/prefix"`` for an IPv6 host), e.g.
            ``"127.0.0.1:41234/moecomm/launch"``. Raises NotImplementedError where a group cannot grow
            (see :meth:`grow`), RuntimeError when its store has no network address (a group of a
            torch.distributed process group), PeerFailedError when the store cannot be reached.
        """
        return self._growable()._rdv.join_address()

    def _growable(self: C) -> C:
        """This communicator if it can grow, else NotImplementedError saying why."""
        from .rendezvous import LocalRendezvous, StoreRendezvous

        if self._mpi_comm is not None or self._forced == "mpi":
            raise NotImplementedError("grow needs the store rendezvous (collectives.launch or torchrun); "
                                      "an MPI job cannot take in processes it did not start (no MPI_Comm_spawn "
                                      "or MPI_Comm_connect support here)")
        if isinstance(self._rdv, LocalRendezvous):
            raise NotImplementedError("grow: this is a single-process group (collectives.init without a launcher), "
                                      "which has no rendezvous store a new process could reach; start the job "
                                      "with collectives.launch or torchrun to let it grow")
        if not isinstance(self._rdv, StoreRendezvous):
            raise NotImplementedError(f"grow is not supported by {type(self._rdv).__name__}")
        return self

    def grow(self: C, count: int) -> C:
        """A new communicator of this group and ``count`` new processes: member i stays rank i, the
        newcomers become ranks size .. size+count-1 in the order they joined (each calls
        ``collectives.init(join=comm.join_address())``, before or after the members call this).

        Collective over the members, who must pass the same ``count``; it waits, bounded by the timeout,
        for the newcomers. The new communicator keeps this one's timeout, settings, forced transport and
        device on the members (the newcomers take the agreed settings and transport from the members),
        and has new transports and a topology of all its ranks. This communicator stays usable, as a
        split's parent does; close both when done. A newcomer's ``global_ranks`` entry is a world rank
        never used in this world before (the next one past the world's ranks), so a rank that died is
        never mistaken for it. After a failure, shrink first: a dead member makes the grow raise.

        Args:
            count: how many newcomers to take, >= 1.
        Returns:
            The grown :class:`Communicator` (size + count ranks). Raises ValueError on every member (and
            on the newcomers waiting) when a member passes a bad ``count`` or the counts differ, naming
            the ranks; CollectiveTimeoutError (a TimeoutError) saying how many newcomers joined when
            fewer than ``count`` did within the timeout; PeerFailedError naming a member or newcomer that
            died or left during the grow; NotImplementedError under MPI or in a single-process group;
            RuntimeError when the group's store has no network address; CommunicatorBrokenError when
            this communicator is closed.
        """
        # outside the one-call guard: a store without an address (RuntimeError) leaves this communicator as it is
        address = self._growable()._rdv.join_address()  # the same on every member: raises on all or none
        return self._guarded("grow", self._grow, count, address)

    def _grow(self: C, count: Any, address: str) -> C:
        me = self.global_ranks[self.rank]
        c, err = None, None
        try:
            c = as_int(count, f"grow: count on rank {me}")
            if c < 1:
                raise ValueError(f"grow: count on rank {me} must be >= 1, got {c}")
        except (TypeError, ValueError) as e:
            err = str(e)
        log.info("grow on rank %d: waiting for %s newcomer(s) at %s", me, c, address)
        # what the newcomers take from the members: the settings every rank must share, and the launch mode
        offer = {"settings": agreed_items(self.settings), "launch": self.topology.launch}
        rdv = self._rdv.grow(c if err is None else None, error=err, offer=offer)
        # as collectives._factory.build_communicator (not imported: it imports the Communicator): the
        # topology over every rank of the grown group, as the newcomers compute it too
        facts = rdv.allgather_bytes(local_facts())
        topo = Topology.from_facts(rdv.rank, facts, self.topology.launch)
        return type(self)(rdv, topo, timeout=self.timeout, transport=self._forced or "auto",
                          global_ranks=rdv.global_ranks, settings=self.settings, device=self.device)
