"""Rendezvous: how the ranks of a job find each other before any data moves.

Three sources, tried in this order by :func:`detect_launch` (the ``launch`` setting,
``MOECOMM_LAUNCH``, overrides it):

- ``mpi``: launched by ``mpirun``/``mpiexec`` (MPI/PMI variables in the environment); the
  exchange rides on mpi4py, non-blocking and bounded by the timeout.
- ``torchrun``: ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; torch's ``TCPStore``
  (the elastic agent's store when torchrun provides one, else rank 0 hosts it, listening only
  on ``MASTER_ADDR``).
- ``launch``: :func:`collectives.launch` hosts a ``TCPStore`` bound to 127.0.0.1.
- otherwise a single process.

A store rendezvous can also grow: :meth:`StoreRendezvous.grow` (the members) meets :func:`join_group`
(a new process, given :meth:`StoreRendezvous.join_address`) in a bigger group (see ``Communicator.grow``).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import socket
import time
from typing import Sequence

from typing import Any, Mapping

import numpy as np

from transports._host import pid_alive
from transports.base import CollectiveTimeoutError, PeerFailedError, Rendezvous
from transports.mpi import wait_posted
from transports.settings import option_or_environment

log = logging.getLogger("collectives")

# Variables that MPI launchers (MPICH/Hydra, Open MPI, Intel MPI, MVAPICH, PMIx, Slurm's PMI) set.
_MPI_ENV = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",
            "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")


def detect_launch(options: Mapping[str, Any] | None = None) -> str:
    """How this process was started: the ``launch`` setting if set (``options["launch"]``, else
    ``MOECOMM_LAUNCH``), else detected from the launchers' own variables.

    Args:
        options: settings by option name; only ``"launch"`` is read (a bad value raises ValueError).

    Returns:
        "mpi", "torchrun" or "single".
    """
    forced = option_or_environment("launch", options, source="detect_launch")
    if forced is not None:
        return forced
    if launched_by_mpi():
        return "mpi"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "torchrun"
    return "single"


def launched_by_mpi() -> bool:
    """Whether an MPI launcher (mpiexec/mpirun/srun with PMI) started this process."""
    return any(v in os.environ for v in _MPI_ENV)


class LocalRendezvous(Rendezvous):
    """The trivial rendezvous of a one-rank group.

    Args:
        timeout: seconds (kept for the communicator; nothing here waits).
    """

    def __init__(self, timeout: float):
        self.rank, self.size, self.timeout = 0, 1, timeout

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Returns: [1] ``data`` itself."""
        return [bytes(data)]

    def split(self, color: int, key: int, new_rank: int, new_size: int, ranks: list[int]) -> "LocalRendezvous":
        """Returns: a new one-rank rendezvous (see :meth:`Rendezvous.split`)."""
        return LocalRendezvous(self.timeout)

    def shrink(self, survivors: list[int], *, error: str | None = None, key: str = "") -> "LocalRendezvous":
        """Returns: a new one-rank rendezvous (see :meth:`Rendezvous.shrink`)."""
        if error is not None:
            raise ValueError(error)
        return LocalRendezvous(self.timeout)


# Store waits poll ``check`` instead of blocking in the store's ``wait``: a blocked wait delivers no
# Ctrl-C until it returns and cannot see a peer that died, and every timeout of a short one logs two
# c10d warnings. The pause between polls doubles from _POLL_MIN_S up to _POLL_MAX_S (a check is ~0.1 ms).
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.01
# How often a waiting rank looks whether a missing peer left the group or died.
_PROBE_S = 0.2


@functools.lru_cache(maxsize=1)
def _this_node() -> str:
    from .topology.placement import node_identity

    return node_identity()


class StoreRendezvous(Rendezvous):
    """Exchange through a torch.distributed Store (TCPStore/FileStore), keys under a private prefix.

    A wait raises ``PeerFailedError`` naming the peer within about :data:`_PROBE_S` when that peer
    left the group (its rendezvous was interrupted or its communicator closed: it writes a ``gone``
    key, which also counts in the sub-groups split off at or after the round it left in) or, on this
    node, its process died (its pid, registered under ``root`` at its first exchange); a peer on
    another node that dies without a word is seen only at the timeout. Ctrl-C reaches a wait within
    :data:`_POLL_MAX_S`, and the interrupted rank leaves the group so its peers raise at once.

    Args:
        store: a ``torch.distributed.Store`` every rank of the group reaches.
        rank: this rank in the group.
        size: ranks in the group.
        timeout: seconds an exchange may wait for the other ranks.
        prefix: key prefix every rank of the group uses and no other group does.
        global_ranks: [size] world rank of each group rank, for messages.
        root: the prefix of the world group, under which each process registers its pid once (default:
            ``prefix``; :meth:`split` passes its own, whose ranks have registered already).
        host_rank: the world rank whose process hosts the store server, if a rank does (an unreachable
            store is then reported as that rank's failure); None: a launcher or agent hosts it.
        world_base: the first world rank a newcomer of this world may take (:meth:`grow`); default: one
            past the highest of ``global_ranks``, right for the world group (sub-groups pass their world's).
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: float, prefix: str,
                 global_ranks: Sequence[int], *, root: str | None = None, host_rank: int | None = None,
                 world_base: int | None = None,
                 _peers: dict[int, tuple[str, int]] | None = None, _lineage: Sequence[tuple[str, int]] = ()):
        self.store, self.rank, self.size, self.timeout = store, rank, size, timeout
        self.prefix = prefix
        self.global_ranks = list(global_ranks)
        self.root = prefix if root is None else root
        self.host_rank = host_rank
        self._registered = root is not None
        self._peers: dict[int, tuple[str, int]] = {} if _peers is None else _peers  # world rank -> (node, pid)
        self._left = False
        # (prefix, round of the split's exchange) of each ancestor group: a rank that left one of them
        # at or before that round never joined this group
        self._lineage = list(_lineage)
        self._round = 0
        self._splits = 0
        self._shrinks: dict[str, int] = {}  # shrinks so far, by key
        # newcomers take world ranks from world_base on (a counter under root), so that no newcomer is
        # ever mistaken for a rank of this world that died (its pid stays registered under root)
        self.world_base = max(self.global_ranks, default=-1) + 1 if world_base is None else world_base
        self._grows = 0  # grows of this group so far (each one writes its record {prefix}/grow/n{k})
        self._taken = 0  # newcomers of the join queue the records so far have taken (or turned away)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank contributes ``data``.

        Returns:
            [size] every rank's bytes in rank order. Raises CollectiveTimeoutError naming the
            ranks that did not arrive within the timeout, PeerFailedError naming a rank that left
            or died (or the store's host, when the store cannot be reached).
        """
        import torch.distributed as dist

        k = self._round
        self._round += 1
        keys = [f"{self.prefix}/ag{k}/{r}" for r in range(self.size)]
        try:
            if not self._registered:
                self.store.set(f"{self.root}/who/{self.global_ranks[self.rank]}", f"{_this_node()} {os.getpid()}")
                self._registered = True
            self.store.set(keys[self.rank], data)
            self._await(keys)
            values = [bytes(self.store.get(key)) for key in keys]
        except CollectiveTimeoutError:
            raise
        except dist.DistError as e:  # torch's DistNetworkError/DistStoreError: the store's server is gone
            raise self._unreachable(e) from e
        except BaseException as e:  # Ctrl-C, an exception from a signal handler: this rank is out of step
            self.leave(f"{type(e).__name__} interrupted its rendezvous", k)
            raise
        if k >= 2:  # every rank has finished round k-1, hence read round k-2
            try:
                self.store.delete_key(f"{self.prefix}/ag{k - 2}/{self.rank}")
            except Exception:  # noqa: BLE001 - best-effort cleanup; FileStore lacks delete on old torch
                pass
        return values

    def _await(self, keys: list[str]) -> None:
        """Return once every key is set; raise when a missing rank left or died, or at the timeout."""
        now = time.monotonic()
        deadline, probe_at, pause = now + self.timeout, now + _PROBE_S, _POLL_MIN_S
        while not self.store.check(keys):
            now = time.monotonic()
            if now >= probe_at or now >= deadline:
                missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
                if not missing:
                    return
                self._check_peers(missing, keys)
                if now >= deadline:
                    ranks = [self.global_ranks[r] for r in missing]
                    raise CollectiveTimeoutError(
                        f"rendezvous timed out on rank {self.global_ranks[self.rank]} after the timeout of "
                        f"{self.timeout:.1f}s: rank(s) {ranks} never arrived", ranks)
                probe_at = now + _PROBE_S
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(2 * pause, _POLL_MAX_S)

    def _check_peers(self, missing: list[int], keys: list[str]) -> None:
        """PeerFailedError when a missing rank left the group or its process (on this node) died."""
        me = self.global_ranks[self.rank]
        for r in missing:
            world = self.global_ranks[r]
            what = self._failure(world)
            if what is None or self.store.check([keys[r]]):
                continue  # alive, or it arrived before it left (its contribution stands)
            raise PeerFailedError(f"rank {world} {what} while rank {me} waited for it in a rendezvous", [world])

    def _failure(self, world: int) -> str | None:
        """How rank ``world`` failed ("left the group (why)", "(pid N) died": its process, on this node,
        is gone), or None while it may still come."""
        why = self._gone(world)
        if why is not None:
            return f"left the group ({why})"
        who = self._identity(world)
        if who is not None and who[0] == _this_node() and not pid_alive(who[1]):
            return f"(pid {who[1]}) died"
        return None

    def _gone(self, world: int) -> str | None:
        """Why rank ``world`` left this group or the ancestor it was split from, or None."""
        for prefix, before in [(self.prefix, None), *self._lineage]:
            key = f"{prefix}/gone/{world}"
            if self.store.check([key]):
                at, why = self.store.get(key).decode(errors="replace").split(" ", 1)
                if before is None or int(at) <= before:
                    return why
        return None

    def _identity(self, world: int) -> tuple[str, int] | None:
        """(node, pid) that rank ``world`` registered, or None before it has."""
        if world not in self._peers:
            key = f"{self.root}/who/{world}"
            if not self.store.check([key]):
                return None
            node, pid = self.store.get(key).decode().rsplit(" ", 1)
            self._peers[world] = (node, int(pid))
        return self._peers[world]

    def _unreachable(self, e: Exception, who: str | None = None) -> PeerFailedError:
        """The PeerFailedError of a store that cannot be reached (``who``: whose wait, for the message)."""
        host = (f"rank {self.host_rank} hosts it: it has probably died" if self.host_rank is not None
                else "its host (the launcher, or torchrun's agent) has probably exited")
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        who = f"rendezvous on rank {self.global_ranks[self.rank]}" if who is None else who
        return PeerFailedError(f"{who}: the store cannot be reached "
                               f"({detail}); {host}", [] if self.host_rank is None else [self.host_rank])

    def leave(self, why: str, at: int | None = None) -> None:
        """Tell the peers that this rank takes no part in this group's exchanges from round ``at`` on
        (default: the next; best effort)."""
        if self._left:
            return
        self._left = True
        try:
            self.store.set(f"{self.prefix}/gone/{self.global_ranks[self.rank]}",
                           f"{self._round if at is None else at} {why}")
        except Exception:  # noqa: BLE001 - an unreachable store: the peers learn it from the store too
            pass

    def close(self) -> None:
        """Called when this group's communicator closes: waiting peers raise instead of timing out."""
        self.leave("its communicator was closed")

    def split(self, color: int, key: int, new_rank: int, new_size: int, ranks: list[int]) -> "StoreRendezvous":
        """Returns: the sub-group's rendezvous on the same store, under a prefix per split and color."""
        self._splits += 1
        return StoreRendezvous(self.store, new_rank, new_size, self.timeout,
                               f"{self.prefix}/s{self._splits}/c{color}",
                               [self.global_ranks[r] for r in ranks], root=self.root if self._registered else None,
                               host_rank=self.host_rank, world_base=self.world_base, _peers=self._peers,
                               _lineage=[*self._lineage, (self.prefix, self._round - 1)])

    def shrink(self, survivors: list[int], *, error: str | None = None, key: str = "") -> "StoreRendezvous":
        """The rendezvous of the ``survivors`` (ranks of this group, ascending; survivor i becomes rank i),
        met through the store without the other ranks, which may be dead.

        Called by every survivor (each call with a given ``key`` takes that key's next shrink prefix, so
        the survivors must shrink it with that key equally often). The survivors first tell each other
        their lists under ``{prefix}/x{key}.{n}/ex/{world rank}`` (``x{n}`` for the default key); lists
        that differ, or a survivor's ``error``, make every survivor that sees them raise ValueError naming
        the ranks. The new group has its own prefix (with its
        members) and no lineage: its members all left this group (closed its communicator), which does
        not count against them there; a member that dies is seen by its pid as in any group.

        Args:
            survivors: the surviving ranks of this group, ascending, this rank among them.
            error: this rank's own argument error (told to the survivors, then raised here as ValueError).
            key: names a series of shrinks (e.g. masks of one set of ranks); "" is the default series.
        Returns:
            The new rendezvous. Raises RuntimeError when the store's server lived in an excluded rank's
            process (it died with it), PeerFailedError when a survivor died or left, ValueError as above.
        """
        import json

        import torch.distributed as dist

        n = self._shrinks[key] = self._shrinks.get(key, 0) + 1
        me = self.global_ranks[self.rank]
        base = f"{self.prefix}/x{key}.{n}" if key else f"{self.prefix}/x{n}"  # the dot: "a1"+"2" is not "a"+"12"
        members = [self.global_ranks[r] for r in survivors]
        if error is None and self.host_rank is not None and self.host_rank not in members:
            raise RuntimeError(
                f"shrink on rank {me}: the rendezvous store lived in rank {self.host_rank}'s process (rank "
                f"{self.host_rank} hosts it under torchrun without an agent store or collectives.init), so it is "
                f"gone with rank {self.host_rank} and the survivors cannot meet; a group that must survive rank "
                f"{self.host_rank} needs a store hosted outside the ranks (collectives.launch, or torchrun's "
                "elastic agent)")
        mine = json.dumps({"survivors": members, "error": error})
        try:
            self.store.set(f"{base}/ex/{me}", mine)
        except dist.DistError as e:
            raise self._unreachable(e) from e
        if error is not None:
            raise ValueError(error)
        new = StoreRendezvous(self.store, survivors.index(self.rank), len(survivors), self.timeout,
                              f"{base}-{'.'.join(str(m) for m in members)}", members, root=self.root,
                              host_rank=self.host_rank, world_base=self.world_base, _peers=self._peers)
        new._registered = self._registered  # registers its pid under root at its first exchange if not yet
        keys = [f"{base}/ex/{m}" for m in members]
        try:
            new._await(keys)
            entries = [json.loads(bytes(self.store.get(key)).decode()) for key in keys]
        except dist.DistError as e:
            raise new._unreachable(e) from e
        except BaseException as e:
            new.leave(f"{type(e).__name__} interrupted its shrink", 0)
            raise
        errors = [(m, e["error"]) for m, e in zip(members, entries) if e["error"] is not None]
        differ = {m: e["survivors"] for m, e in zip(members, entries) if e["survivors"] != members}
        if errors or differ:
            if errors:
                why = (f"shrink on rank {me}: rank(s) {[m for m, _ in errors]} passed an invalid exclude "
                       f"({errors[0][1]}); every survivor aborted the shrink")
            else:
                why = (f"shrink on rank {me}: the survivors disagree on exclude: rank {me} keeps ranks {members}, "
                       + ", ".join(f"rank {m} keeps {s}" for m, s in differ.items()))
            new.leave("its shrink was aborted", 0)
            raise ValueError(why)
        return new

    # ---- growing: members meet newcomers ------------------------------------------------------
    # Keys under {prefix}/grow/: "info" (what a newcomer needs before a grow: root, world_base, members),
    # "queue" (the join counter) and "q{i}" (the i-th newcomer's world rank; "q{i}/left" once it gave
    # up), "n{k}" (the record of the k-th grow: which newcomers it took, or why it was aborted, and up
    # to which place of the queue; set once by compare_set, so every member and newcomer reads the same
    # outcome) and "g{k}/..." (the grown group's own keys).

    def join_address(self) -> str:
        """The address a newcomer passes to ``collectives.init(join=...)``: ``host:port/prefix``
        (``[host]:port/prefix`` for IPv6), the store this group already uses and its key prefix.

        Also publishes, in the store, what a newcomer needs to queue up before the members' grow.

        Returns:
            The address. Raises RuntimeError when the store has no network address (a FileStore,
            HashStore or PrefixStore: a torch.distributed group's), PeerFailedError when it cannot be reached.
        """
        import torch.distributed as dist

        host, port = getattr(self.store, "host", None), getattr(self.store, "port", None)
        if not host or not port:
            raise RuntimeError(f"rank {self.global_ranks[self.rank]}: this group's rendezvous store "
                               f"({type(self.store).__name__}) has no network address a new process could "
                               "join through; groups of collectives.launch and torchrun (collectives.init) have one")
        try:
            self.store.set(f"{self.prefix}/grow/info", self._grow_info())
        except dist.DistError as e:
            raise self._unreachable(e) from e
        return f"[{host}]:{port}/{self.prefix}" if ":" in host else f"{host}:{port}/{self.prefix}"

    def _grow_info(self) -> str:
        return json.dumps({"root": self.root, "world_base": self.world_base, "members": self.global_ranks,
                           "host_rank": self.host_rank})

    def grow(self, count: int | None, *, error: str | None = None,
             offer: Mapping[str, Any] | None = None) -> "StoreRendezvous":
        """The rendezvous of this group and ``count`` newcomers (:func:`join_group`): member i stays rank
        i, newcomers follow in the order they joined (took their world rank).

        Called by every member. The members first tell each other their ``count`` (or ``error``)
        through this group's rendezvous; then they wait, bounded by the timeout, for the next
        ``count`` places of the join queue, and agree on the outcome through the grow's record, which
        the newcomers read too: a newcomer whose place a record took joins, or raises that record's error.

        Args:
            count: newcomers to take (>= 1, the same on every member); None with ``error``.
            error: this rank's own argument error (told to the members, then raised here as ValueError).
            offer: what the newcomers need of the group (JSON; the Communicator's settings and launch
                mode), handed to them with the record.
        Returns:
            The grown group's rendezvous (its own prefix, no lineage). Raises ValueError on every member
            (and the queued newcomers) when a count is bad or they differ, naming the ranks;
            CollectiveTimeoutError saying how many newcomers joined within the timeout; PeerFailedError
            naming a member or newcomer that died or left meanwhile.
        """
        import torch.distributed as dist

        self._grows += 1
        base, first = f"{self.prefix}/grow", self._taken + 1
        key = f"{base}/n{self._grows}"
        me = self.global_ranks[self.rank]
        record: dict | None = None
        try:
            self.store.set(f"{base}/info", self._grow_info())
            mine = json.dumps({"count": None if error is not None else count, "error": error})
            entries = [json.loads(b) for b in self.allgather_bytes(mine.encode())]
            bad = [(self.global_ranks[r], e["error"]) for r, e in enumerate(entries) if e["error"] is not None]
            counts = {self.global_ranks[r]: e["count"] for r, e in enumerate(entries)}
            why = None
            if bad:
                why = (f"grow: rank(s) {[m for m, _ in bad]} passed an invalid count ({bad[0][1]}); "
                       "every member aborted the grow")
            elif len(set(counts.values())) > 1:
                why = ("grow: the members disagree on count: "
                       + ", ".join(f"rank {m} asks for {c}" for m, c in counts.items())
                       + "; every member aborted the grow")
            if why is not None:
                record = self._settle(key, self._aborted(base, first, ValueError(why)))
                raise ValueError(error if error is not None else why)
            assert count is not None
            worlds = self._await_newcomers(base, first, count, key)
            record = self._settle(key, None if worlds is None else {
                "error": None, "first": first, "last": first + count - 1, "prefix": f"{base}/g{self._grows}",
                "members": self.global_ranks, "newcomers": worlds, "root": self.root, "world_base": self.world_base,
                "host_rank": self.host_rank, "offer": dict(offer or {})})
        except BaseException as e:
            if record is None:  # tell the newcomers (and the members still waiting) why
                try:
                    record = self._settle(key, self._aborted(base, first, e))
                except Exception:  # noqa: BLE001 - the store is gone: the raise below says so
                    pass
                if record is not None and record["error"] is None:  # decided without this rank: leave it
                    self._leave_grown(record, f"{type(e).__name__} interrupted its grow")
            if record is not None:
                self._taken = record["last"]
            if isinstance(e, dist.DistError):
                raise self._unreachable(e) from e
            raise
        self._taken = record["last"]
        if record["error"] is not None:
            raise _record_error(record, "")
        worlds = record["members"] + record["newcomers"]
        new = StoreRendezvous(self.store, self.rank, len(worlds), self.timeout, record["prefix"], worlds,
                              root=self.root, host_rank=self.host_rank, world_base=self.world_base,
                              _peers=self._peers)
        new._registered = self._registered
        log.info("grow on rank %d: newcomer(s) %s joined; the group is now ranks %s", me, record["newcomers"], worlds)
        return new

    def _await_newcomers(self, base: str, first: int, count: int, key: str) -> list[int] | None:
        """The world ranks of the newcomers at places first .. first+count-1 of the join queue, once all
        are there, ascending; None when another member settled the grow's record first."""
        me = self.global_ranks[self.rank]
        places = [f"{base}/q{first + i}" for i in range(count)]
        now = time.monotonic()
        deadline, probe_at, pause = now + self.timeout, now + _PROBE_S, _POLL_MIN_S
        while not self.store.check(places):
            if self.store.check([key]):
                return None
            now = time.monotonic()
            if now >= probe_at or now >= deadline:
                for w in self.global_ranks:
                    what = None if w == me else self._failure(w)
                    if what is not None:
                        if self.store.check([key]):
                            return None  # another member settled the grow meanwhile: its record stands
                        raise PeerFailedError(f"grow on rank {me}: rank {w} {what} while rank {me} waited for "
                                              "newcomers", [w])
                joined = [p for p in places if self.store.check([p])]
                for p in joined:
                    w = json.loads(self.store.get(p))["world"]
                    what = (f"gave up ({self.store.get(p + '/left').decode(errors='replace')})"
                            if self.store.check([p + "/left"]) else self._failure(w))
                    if what is not None:
                        if self.store.check([key]):
                            return None
                        raise PeerFailedError(f"grow on rank {me}: newcomer rank {w} {what} before the group "
                                              "took it", [w])
                if now >= deadline:
                    raise CollectiveTimeoutError(
                        f"grow on rank {me}: {len(joined)} of {count} newcomer(s) joined within the timeout of "
                        f"{self.timeout:.1f}s (a newcomer calls collectives.init(join=comm.join_address()))")
                probe_at = now + _PROBE_S
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(2 * pause, _POLL_MAX_S)
        return sorted(json.loads(self.store.get(p))["world"] for p in places)

    def _aborted(self, base: str, first: int, e: BaseException) -> dict:
        """The record of an aborted grow: it turns away every newcomer queued so far."""
        return {"error": str(e) or type(e).__name__, "kind": type(e).__name__,
                "ranks": list(getattr(e, "missing_ranks", [])), "first": first,
                "last": max(first - 1, self.store.add(f"{base}/queue", 0))}

    def _settle(self, key: str, proposal: dict | None) -> dict:
        """The grow's record: ``proposal`` if no one set it first (None: someone did)."""
        if proposal is None:
            return json.loads(bytes(self.store.get(key)).decode())
        return json.loads(bytes(self.store.compare_set(key, "", json.dumps(proposal))).decode())

    def _leave_grown(self, record: dict, why: str) -> None:
        try:
            self.store.set(f"{record['prefix']}/gone/{self.global_ranks[self.rank]}", f"0 {why}")
        except Exception:  # noqa: BLE001 - best effort: the peers then wait for their timeout
            pass


class MPIRendezvous(Rendezvous):
    """Exchange through mpi4py, posted non-blocking and polled so it is bounded by the timeout.

    Args:
        comm: the group's mpi4py communicator.
        timeout: seconds an exchange may wait.
        global_ranks: [size] world rank of each group rank (default 0..size-1).
    """

    def __init__(self, comm: Any, timeout: float, global_ranks: Sequence[int] | None = None):
        self.comm = comm
        self.rank, self.size, self.timeout = comm.Get_rank(), comm.Get_size(), timeout
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(self.size))

    def _wait(self, req: Any, what: str, *buffers: Any) -> None:
        """Poll ``req`` until done or the timeout (:func:`transports.mpi.wait_posted`: on a timeout
        ``buffers`` are kept alive for good, as a late peer may still write into them)."""
        wait_posted(req, self.timeout, f"MPI rendezvous ({what})", self.global_ranks[self.rank], *buffers)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank contributes ``data``.

        Returns:
            [size] every rank's bytes in rank order (CollectiveTimeoutError after the timeout).
        """
        lens = np.zeros(self.size, dtype=np.int64)
        mine = np.array([len(data)], dtype=np.int64)
        self._wait(self.comm.Iallgather(mine, lens), "lengths", mine, lens)
        buf = np.empty(int(lens.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(lens)[:-1]])
        from mpi4py import MPI

        send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, dtype=np.uint8)
        self._wait(self.comm.Iallgatherv([send, MPI.BYTE], [buf, (lens.tolist(), displs.tolist()), MPI.BYTE]),
                   "data", send, buf, data)
        return [buf[d : d + n].tobytes() for d, n in zip(displs, lens)]

    def split(self, color: int, key: int, new_rank: int, new_size: int,
              ranks: list[int]) -> "MPIRendezvous | None":
        """Returns: the sub-group's rendezvous over ``MPI_Comm_split``; None where color < 0."""
        from mpi4py import MPI

        sub = self.comm.Split(color if color >= 0 else MPI.UNDEFINED, key)
        if color < 0:
            return None
        return MPIRendezvous(sub, self.timeout, [self.global_ranks[r] for r in ranks])

    def shrink(self, survivors: list[int], *, error: str | None = None, key: str = "") -> "MPIRendezvous":
        """Not possible: raises NotImplementedError (see :meth:`Rendezvous.shrink`)."""
        raise NotImplementedError("shrink needs the store rendezvous (collectives.launch or torchrun); "
                                  "MPI cannot drop a dead rank without ULFM")

    def close(self) -> None:
        """Free the sub-communicator (never COMM_WORLD/COMM_SELF)."""
        from mpi4py import MPI

        if self.comm not in (MPI.COMM_WORLD, MPI.COMM_SELF) and not MPI.Is_finalized():
            try:
                self.comm.Free()
            except Exception:  # noqa: BLE001
                pass


def loopback_store_server(timeout: float) -> tuple[Any, int]:
    """A TCPStore server that listens on 127.0.0.1 only (torch's own binds every interface).

    Args:
        timeout: seconds the store's operations may wait.

    Returns:
        (store, port): the server-side ``TCPStore`` and the port it listens on.
    """
    return bound_store_server("127.0.0.1", 0, timeout)


def bound_store_server(addr: str, port: int, timeout: float) -> tuple[Any, int]:
    """A TCPStore server listening on ``addr`` only.

    Args:
        addr: the address to listen on (IPv4, IPv6 or a name).
        port: the port, or 0 to let the system pick.
        timeout: seconds the store's operations may wait.

    Returns:
        (store, port): the server-side ``TCPStore`` and the port it listens on.
    """
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(512)
    port = sock.getsockname()[1]
    store = dist.TCPStore(addr, port, None, True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def store_client(addr: str, port: int, timeout: float) -> Any:
    """A TCPStore client of the server at ``addr:port``.

    Args:
        addr: the server's address.
        port: the server's port.
        timeout: seconds to connect and for the store's operations.

    Returns:
        The client ``TCPStore``.
    """
    import torch.distributed as dist

    return dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=timeout))


def parse_join_address(address: Any) -> tuple[str, int, str]:
    """(host, port, key prefix) of a join address (``host:port/prefix``, ``[v6 host]:port/prefix``).

    Raises ValueError naming it when it is not one.
    """
    where = f"collectives.init(join={address!r})"
    if not isinstance(address, str):
        raise ValueError(f"{where}: a join address is a str, as comm.join_address() returns it")
    hostport, _, prefix = address.partition("/")
    host, _, port = hostport.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not prefix or not port.isdigit() or not 0 < int(port) < 65536 or "[" in host:
        raise ValueError(f"{where}: not a join address; expected 'host:port/prefix' (the group's store and key "
                         "prefix), as a member's comm.join_address() returns it")
    return host, int(port), prefix


def join_group(address: str, timeout: float) -> tuple[StoreRendezvous, dict]:
    """A new process's side of a grow: queue up at the group behind ``address``, wait (bounded by
    ``timeout``) for the members' :meth:`StoreRendezvous.grow` that takes it, and return its rendezvous
    in the grown group.

    It connects to the store of the address only. On arrival it takes the next world rank of the
    group's world (never used there before: the counter starts past the world's ranks) and registers
    its pid under the world's prefix, so that members waiting for it see it die, then takes its place
    in the group's join queue.

    Args:
        address: a member's ``comm.join_address()``.
        timeout: seconds to wait for the store and for the members' grow.
    Returns:
        (rendezvous, offer): this process's rendezvous in the grown group, and what the members
        handed over (``settings``: the group's agreed settings, ``launch``: its launch mode). Raises
        ValueError for a malformed address or one whose group the store does not know, RuntimeError when
        the store cannot be reached, CollectiveTimeoutError when no grow took this process within the
        timeout, PeerFailedError naming a member that died or left meanwhile, and the error of a grow
        the members aborted (ValueError for a bad count, ...).
    """
    import torch.distributed as dist

    host, port, prefix = parse_join_address(address)
    where = f"collectives.init(join={address!r})"
    try:  # a refused connection is known at once; torch's client would retry it until the timeout
        socket.create_connection((host, port), timeout=min(timeout, 10.0)).close()
        store = store_client(host, port, timeout)
    except (OSError, dist.DistError) as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"{where}: the group's store at {host}:{port} cannot be reached ({detail}); is the "
                           "group still running, and is the address the one its comm.join_address() gave?") from e
    base = f"{prefix}/grow"
    try:
        if not store.check([f"{base}/info"]):
            raise ValueError(f"{where}: the store at {host}:{port} knows no group with the key prefix {prefix!r} "
                             "(a join address comes from a member's comm.join_address())")
        info = json.loads(bytes(store.get(f"{base}/info")).decode())
        root = info["root"]
        world = info["world_base"] + store.add(f"{root}/grown", 1) - 1
        store.set(f"{root}/who/{world}", f"{_this_node()} {os.getpid()}")
        place = store.add(f"{base}/queue", 1)
        store.set(f"{base}/q{place}", json.dumps({"world": world}))
    except dist.DistError as e:
        raise RuntimeError(f"{where}: the group's store at {host}:{port} failed ({e})") from e
    log.info("%s: queued as world rank %d (place %d)", where, world, place)
    members = info["members"]
    # the group as it was, for its members' liveness (its prefix's "gone" keys, their registered pids)
    old = StoreRendezvous(store, 0, len(members), timeout, prefix, members, root=root, host_rank=info["host_rank"],
                          world_base=info["world_base"])
    try:
        record = _await_record(old, base, place, world, where)
    except BaseException as e:
        try:  # members waiting for this place raise at once instead of at their timeout
            store.set(f"{base}/q{place}/left", f"{type(e).__name__} on its side")
        except Exception:  # noqa: BLE001 - best effort
            pass
        if isinstance(e, dist.DistError):
            raise old._unreachable(e, where) from e
        raise
    if record["error"] is not None:
        raise _record_error(record, f"{where}: the members' grow was aborted: ")
    worlds = record["members"] + record["newcomers"]
    rdv = StoreRendezvous(store, worlds.index(world), len(worlds), timeout, record["prefix"], worlds, root=root,
                          host_rank=record["host_rank"], world_base=record["world_base"])
    rdv._registered = True
    log.info("%s: rank %d of the grown group (world ranks %s)", where, rdv.rank, worlds)
    return rdv, record["offer"]


def _await_record(old: StoreRendezvous, base: str, place: int, world: int, where: str) -> dict:
    """The record of the grow that took (or turned away) the newcomer at ``place`` of the join queue."""
    store, k = old.store, 1
    now = time.monotonic()
    deadline, probe_at, pause = now + old.timeout, now + _PROBE_S, _POLL_MIN_S
    while True:
        key = f"{base}/n{k}"
        if store.check([key]):
            record = json.loads(bytes(store.get(key)).decode())
            if place <= record["last"]:
                return record
            k += 1  # an earlier grow: its newcomers were queued before this one
            continue
        now = time.monotonic()
        if now >= probe_at or now >= deadline:
            failed = next(((w, what) for w in old.global_ranks if (what := old._failure(w)) is not None), None)
            if store.check([key]):
                continue  # the grow's record came meanwhile: it says what happened
            if failed is not None:
                raise PeerFailedError(f"{where}: member rank {failed[0]} {failed[1]} while newcomer rank {world} "
                                      "waited for the group's grow", [failed[0]])
            if now >= deadline:
                raise CollectiveTimeoutError(
                    f"{where}: no grow of the group took newcomer rank {world} within the timeout of "
                    f"{old.timeout:.1f}s (place {place} of its join queue, after {k - 1} grow(s) of the group); "
                    "its members call comm.grow(count) to take newcomers", old.global_ranks)
            probe_at = now + _PROBE_S
        time.sleep(min(pause, max(0.0, deadline - now)))
        pause = min(2 * pause, _POLL_MAX_S)


def _record_error(record: dict, context: str) -> Exception:
    """The error an aborted grow's record describes, as its class (ValueError, PeerFailedError, ...; else
    RuntimeError). Every member raises it at the same point, so it leaves their communicator usable."""
    msg = context + record["error"]
    ranks = record.get("ranks", [])
    kind = record.get("kind", "")
    err: Exception
    if kind == "PeerFailedError":
        err = PeerFailedError(msg, ranks)
    elif kind == "CollectiveTimeoutError":
        err = CollectiveTimeoutError(msg, ranks)
    else:
        err = ValueError(msg) if kind in ("ValueError", "TypeError") else RuntimeError(msg)
    err.in_step = True  # type: ignore[attr-defined] - see collectives._shared.leaves_out_of_step
    return err
