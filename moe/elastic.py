"""Masks of ranks for the expert-parallel dispatchers (issue #55): the unmasked ranks as a group of their own.

A masked rank is one the others treat as gone (dead, or stopped): no call of the unmasked ranks
waits for it. :class:`MaskedGroup` is the unmasked ranks' communicator, made by
``comm.shrink`` without the masked ranks' help, and the map of expert ids from the full layout
to the group's (the masked ranks' experts have no place there).

Notation as in :mod:`moe.dispatcher`: P ranks of ``comm``, E experts, L = E / P per rank, rank i
owns experts ``[i*L, (i+1)*L)``; M = ``len(masked)``, A = P - M active ranks, which own experts
``[0, A*L)`` of the group's layout in their order.

:class:`MaskSet` is the part of a dispatcher's masks that does not depend on the dispatcher: the
permanent masks, the (group, inner dispatcher) of each set of masks, built on first use through the
dispatcher's factory, and the peer-failure handling (mask the dead ranks, regroup, agree that every
survivor was in the same call, run it again or raise). :class:`moe.ExpertDispatcher` and
:class:`moe.LowLatencyDispatcher` hold one each.
"""

from __future__ import annotations

import logging
import time
import zlib
from typing import Any, Callable, Sequence

import torch

from collectives.agreement import agree, rank_label
from collectives.protocols import CommunicatorLike
from transports.base import CollectiveTimeoutError, PeerFailedError

from .records import _to_device

log = logging.getLogger("moe")

ON_PEER_FAILURE = ("raise", "mask")
_STEPS = ("layout", "dispatch", "combine")


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

    def __init__(self, comm: CommunicatorLike, masked: Sequence[int], num_experts: int, *, key: str | None = None):
        self.masked = tuple(sorted(int(r) for r in masked))
        self.active = tuple(r for r in range(comm.size) if r not in self.masked)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // comm.size
        self.num_active_experts = len(self.active) * self.num_local_experts
        t0 = time.monotonic()
        self.comm = comm.shrink(exclude=list(self.masked), key=mask_key(self.masked) if key is None else key)
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


def mapped(group: MaskedGroup, experts: Any) -> Any:
    """The experts' ids in the group's layout (:meth:`MaskedGroup.map_experts`); an argument that is no integer
    tensor goes on as it is, so that the group's dispatcher rejects it on every rank."""
    if isinstance(experts, torch.Tensor) and experts.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return group.map_experts(experts)
    return experts


class MaskedPath:
    """One set of masked ranks: its group and the dispatcher over it (``A * L`` experts)."""

    __slots__ = ("group", "dispatcher")

    def __init__(self, group: MaskedGroup, dispatcher: Any):
        self.group, self.dispatcher = group, dispatcher


class MaskSet:
    """The masks of one dispatcher: permanent masks, a cached :class:`MaskedPath` per set, peer-failure handling.

    Args:
        owner: the dispatcher over ``comm``, which runs the calls without masks.
        comm: its group (P ranks). num_experts: E, divisible by P.
        build: ``build(group)``: a dispatcher of the owner's kind over ``group.comm`` with
            ``group.num_active_experts`` experts (collective over the unmasked ranks; called once per set).
        name: the owner's class name, for the messages.
        on_peer_failure: "raise" or "mask" (already validated): what :meth:`run` does with a ``PeerFailedError``.
        count: None: :meth:`run` counts the calls on each set itself (:attr:`calls`); else ``count(dispatcher)``
            is the number of calls that dispatcher has made so far (read after a failure), for dispatchers that
            count their calls anyway.

    Attributes:
        masked: the permanent masks, ascending. paths: mask set -> :class:`MaskedPath`, built on first use.
        calls: calls run per mask set (``()``: ``comm``), with ``count=None``.
    """

    def __init__(self, owner: Any, comm: CommunicatorLike, num_experts: int, build: Callable[[MaskedGroup], Any], *,
                 name: str, on_peer_failure: str, count: Callable[[Any], int] | None = None):
        self.owner, self.comm, self.num_experts, self.build = owner, comm, num_experts, build
        self.name, self.on_peer_failure, self.count = name, on_peer_failure, count
        self.masked: tuple[int, ...] = ()
        self.paths: dict[tuple[int, ...], MaskedPath] = {}
        self.calls: dict[tuple[int, ...], int] = {(): 0}

    @property
    def active_comm(self) -> CommunicatorLike | None:
        """``comm``, or the permanent masks' group's communicator (None while that group is not built)."""
        if not self.masked:
            return self.comm
        m = self.paths.get(self.masked)
        return None if m is None else m.group.comm

    def mask(self, ranks: Sequence[int], where: str) -> None:
        """Add ``ranks`` to the permanent masks and build their group now (collective over the unmasked ranks).

        The group is made by a shrink of the one series ``"masked"`` (not the set's own), so that survivors
        that pass different ranks meet in it and all raise ``ValueError`` naming the lists, instead of
        waiting on different groups until the timeout. The group of the previous permanent set is closed.
        """
        err = None
        try:
            new = check_masked_ranks(self.comm, ranks, where=where)
            full = tuple(sorted(set(self.masked) | set(new)))
        except (TypeError, ValueError) as e:
            err, full = e, self.masked
        if err is not None or (full and full not in self.paths):
            # the shrink compares the survivors' lists (a bad one on this rank is told to the others)
            self.path(full, key="masked", error=err)
        old, self.masked = self.masked, full
        if old and old != full:
            self.drop(old)

    def call_mask(self, masked_ranks: Sequence[int] | None, where: str) -> tuple[int, ...]:
        """The masks of one call: ``masked_ranks`` (checked) and the permanent ones, ascending."""
        mine = check_masked_ranks(self.comm, masked_ranks, where=where)
        return tuple(sorted(set(mine) | set(self.masked))) if mine else self.masked

    def path(self, mask: tuple[int, ...], *, key: str | None = None, error: Exception | None = None) -> MaskedPath:
        """The group and dispatcher of ``mask``; built on first use (collective over the unmasked ranks).
        ``key``: the shrink series (default: the set's own); ``error``: this rank's argument error, told to
        the others through the shrink (which then raises ValueError on every one of them)."""
        if error is not None:
            try:
                self.comm.shrink(exclude=[-1], key=key or mask_key(mask))  # an exclude every survivor refuses
            except ValueError:
                pass
            raise error
        m = self.paths.get(mask)
        if m is None:
            group = MaskedGroup(self.comm, mask, self.num_experts, key=key)
            try:
                inner = self.build(group)
            except BaseException:
                group.close()
                raise
            m = self.paths[mask] = MaskedPath(group, inner)
        return m

    @staticmethod
    def _close_path(m: MaskedPath) -> None:
        try:
            m.dispatcher.close()
        finally:
            m.group.close()

    def drop(self, mask: tuple[int, ...]) -> None:
        """Close and forget the group of ``mask`` (its communicator broke); the next use builds another."""
        m = self.paths.pop(mask, None)
        if m is not None:
            try:
                self._close_path(m)
            except Exception:  # noqa: BLE001 - a broken group may fail to close cleanly; it is gone either way
                log.debug("closing the broken group of masks %s failed", list(mask), exc_info=True)

    def close(self) -> None:
        """Close every group and its dispatcher, each one even after another failed to close (the first error
        is raised after the others)."""
        paths, self.paths = self.paths, {}
        first: Exception | None = None
        for m in paths.values():
            try:
                self._close_path(m)
            except Exception as e:  # noqa: BLE001 - raised below, after the others
                first = first or e
        if first is not None:
            raise first

    def world(self, ranks: Sequence[int]) -> list[int]:
        """Ranks of ``comm`` as world ranks."""
        return [self.comm.global_ranks[r] for r in ranks]

    def run(self, step: str, mask: tuple[int, ...], fn: Callable[[Any, MaskedGroup | None], Any], *,
            rerun: Callable[[Any, MaskedGroup | None], Any] | None = None, build: bool = True, retry: bool = True,
            failed: PeerFailedError | None = None) -> Any:
        """``fn(dispatcher, group)`` on the communicator of ``mask`` (the owner and None for no masks), with the
        peer-failure handling of ``on_peer_failure``.

        Args:
            step: "layout", "dispatch" or "combine" (compared by the survivors after a failure).
            rerun: what to run on the survivors after a failure (default ``fn``).
            build: whether a missing group may be built (False for a combine: its dispatch built it).
            retry: after a failure, run the call again on the survivors (True), or mask the failed ranks and raise
                ``PeerFailedError`` saying the step must be run again (False: a combine, a receive hook).
            failed: the call already ran (on ``mask``'s dispatcher) and raised this: recover from it first.

        A ``CollectiveTimeoutError`` of a masked call drops its group and raises ``ValueError`` (the unmasked
        ranks passed different masks, or one stopped responding); unmasked, it propagates.
        """
        while True:
            if failed is None:
                self.calls[mask] = self.calls.get(mask, 0) + 1
                try:
                    if not mask:
                        return fn(self.owner, None)
                    m = self.paths.get(mask)
                    if m is None:
                        if not build:
                            raise ValueError(f"{step} on {rank_label(self.comm)}: the group of the handle's masks "
                                             f"{list(mask)} is closed (dispatcher closed, or the group broke); "
                                             "dispatch again")
                        m = self.path(mask)
                    return fn(m.dispatcher, m.group)
                except PeerFailedError as e:
                    if self.on_peer_failure != "mask":
                        raise
                    failed = e
                except CollectiveTimeoutError as e:
                    if not mask:
                        raise
                    # the group waited for an unmasked rank that never came; its communicator is broken
                    self.drop(mask)
                    missing = list(getattr(e, "missing_ranks", []))
                    raise ValueError(
                        f"{step} on {rank_label(self.comm)} with masked_ranks={list(mask)}: rank(s) {missing} did not "
                        f"join the masked call within the timeout ({self.comm.timeout:g} s). Every unmasked rank "
                        "must pass the same masked_ranks (a rank that passed other masks, or none, waits on another "
                        "group), and a rank that stopped responding must be masked too") from e
            if self.count is None:  # the call that failed, as counted here
                calls = self.calls.get(mask, 0)
            else:  # as counted by the dispatcher it ran on
                m = self.paths.get(mask)
                calls = self.count(self.owner if m is None else m.dispatcher)
            error, failed = failed, None
            mask = self.recover(error, step, mask, calls, retry=retry)
            if not retry:
                raise PeerFailedError(
                    f"{error}; {self.name}: rank(s) {self.world(self.masked)} are masked now, and this {step} cannot "
                    f"be completed{' without its dispatch' if step == 'combine' else ''}: run the step (dispatch and "
                    "combine) again", error.missing_ranks) from error
            fn = rerun or fn

    def recover(self, error: PeerFailedError, step: str, mask: tuple[int, ...], calls: int, *,
                retry: bool = True) -> tuple[int, ...]:
        """After ``error`` in the ``calls``-th call on the group of ``mask``: mask the failed ranks for good,
        build the survivors' group and agree there that every survivor was in this very call.

        Returns: the new masks of the call. Raises ``error`` when it names no rank to mask, ``ValueError``
        (every survivor) when the survivors were in different calls.
        """
        g = self.comm.global_ranks
        me = self.comm.rank

        def failed(e: PeerFailedError, mask: tuple[int, ...]) -> set[int]:
            return {g.index(w) for w in getattr(e, "missing_ranks", []) if w in g} - set(mask) - {me}

        dead = failed(error, mask)
        if not dead:
            raise error
        t0 = time.monotonic()
        if mask:  # its group holds a dead rank: it can never complete a call again
            self.drop(mask)
        for _ in range(self.comm.size):
            new = tuple(sorted(set(mask) | dead))
            try:
                m = self.path(new)
                # with the survivors' group built (masked ranks always have one: active_comm), mask them for good
                old, self.masked = self.masked, tuple(sorted(set(self.masked) | dead))
                if old and old not in (self.masked, mask, new):
                    self.drop(old)  # it holds a dead rank
                agree(m.group.comm, f"{self.name} after the failure of rank(s) {self.world(sorted(dead))}",
                      {"calls on the failed group": calls, "step (0: layout, 1: dispatch, 2: combine)":
                       _STEPS.index(step), "masks before the failure (crc32)": zlib.crc32(repr(mask).encode())},
                      hint="The survivors were not all in the same call of this dispatcher when the failure came "
                           "(one had gone on to a later call, or not reached this one), so the call cannot be "
                           "run again on them; the failed ranks stay masked.")
                break
            except PeerFailedError as e:  # another rank died while the survivors regrouped
                more = failed(e, new)
                if not more:
                    raise
                self.drop(new)
                dead |= more
        log.warning("%s on %s: rank(s) %s failed in %s (%s); masked for good, the %d survivors regrouped in %.3f s "
                    "and %s", self.name, rank_label(self.comm), self.world(sorted(dead)), step, error,
                    len(m.group.active), time.monotonic() - t0,
                    "run the call again" if retry else "raise the error again (the dispatch must be redone)")
        return new
