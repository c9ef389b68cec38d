"""The Communicator: one object, every collective, a transport picked per call.

How a call is checked, cached and handed to its transport is in collectives/_calls.py (a mixin of
the Communicator); all_to_all's argument handling in collectives/_all_to_all.py, which uses the
Communicator through its ``AllToAllHost`` protocol only. Its other mixins, one concern each:
point-to-point (_p2p.py), the transport choice and ``plan()`` (_planning.py), all_reduce_rmsnorm
(_rmsnorm.py), symmetric_empty (_symmetric.py) and split (_groups.py).
"""

from __future__ import annotations

import atexit
import logging
from typing import Any, Callable, Mapping, NoReturn, Sequence

import torch

from transports.base import (
    GroupInfo,
    OpCode,
    Rendezvous,
    Signature,
    Transport,
    error_meta,
)
from transports.settings import SETTINGS, check_timeout
from transports.settings import resolve as resolve_settings

from ._arrays import Array, as_int, device_of
from ._all_to_all import all_to_all_checked, all_to_all_hot
from ._calls import CallPaths, _Entry
from ._p2p import PointToPoint
from ._groups import GroupCalls
from ._planning import Planning
from ._rmsnorm import RMSNormCalls
from ._creation import create_transports
from ._device import resolve_device
from ._shared import SharedState, leaves_out_of_step, live
from ._symmetric import SymmetricCalls
from .hierarchical import HierarchicalTransport, hierarchical_shape
from .prediction import transport_settings
from .topology import Topology

log = logging.getLogger("collectives")

@atexit.register
def _close_all() -> None:
    # Tell peers we are gone so they raise at once instead of waiting for their timeout.
    for comm in list(live):
        try:
            comm._close(wait=False)  # a thread still inside a call keeps its communicator
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


class Communicator(CallPaths, PointToPoint, Planning, RMSNormCalls, SymmetricCalls, GroupCalls):
    """A group of ranks and the collectives between them.

    Create one with :func:`collectives.init` (or receive one from :func:`collectives.launch`);
    sub-groups come from :meth:`split`. Every collective is called by all ranks of the group in
    the same order, takes a torch tensor (any device with a transport, else staged through host
    memory) or NumPy array, returns a new tensor (NumPy in, NumPy out) or writes ``out=``, and
    raises instead of hanging: ``ValueError`` when ranks pass different shapes/dtypes/ops or a
    rank rejects its input (the bad rank raises the specific ``TypeError``/``ValueError``),
    ``TimeoutError`` naming the ranks that never arrived, ``PeerFailedError`` when a peer died
    or closed its communicator. A call interrupted on a rank (``KeyboardInterrupt``, an exception
    raised by a signal handler) closes the communicator there, so its later calls raise
    ``CommunicatorBrokenError`` and its peers raise ``PeerFailedError`` instead of pairing calls
    one step apart.

    Threads: a communicator (with its :meth:`using` views) serves one thread at a time. A call
    made while another thread is inside a call of the same communicator raises ``RuntimeError``,
    the call in flight raises it too instead of returning, and the communicator closes so that
    its peers raise instead of waiting (their calls can no longer be matched reliably). For
    collectives from several threads give each thread its own communicator (every rank calls
    ``comm.split(0)`` once per thread, in the same order), or serialize the calls with a lock
    and issue them in the same order on every rank.

    Args:
        rendezvous: the group's out-of-band exchange (built by ``init``/``launch``/``split``).
        topology: where every rank runs (node, local rank, GPUs).
        timeout: seconds any wait may take before it raises; positive and finite.
        transport: "auto" (pick per call) or a transport name every call must use; overrides
            ``settings["transport"]``.
        global_ranks: [size] world rank of each group rank, for messages (default 0..size-1).
        mpi_comm: the mpi4py communicator of this group when launched by MPI, else None.
        settings: resolved :mod:`transports.settings` values (default: resolved here from
            ``options`` and the environment). Every rank must agree on the shared ones; otherwise
            every rank raises ``ValueError`` naming each rank's value.
        options: settings by option name overriding the environment, used when ``settings`` is
            None. A bad value or unknown name on one rank makes every rank raise at creation.
        device: the device this rank binds to (``comm.device``): None for ``cuda:local_rank``
            (modulo the GPUs this process sees; cpu without a GPU), an int N, "cuda:N", a
            torch.device, or "cpu" for no GPU (no NCCL; CUDA tensors go through host memory).
            A CUDA device becomes the current device; CUDA tensors passed to a collective must
            be on it. If NCCL cannot start on a rank (e.g. two ranks on one GPU: NCCL's
            "Duplicate GPU"), every rank raises RuntimeError, unless ``transport`` forces a
            host transport ("shm", "mpi").
    """

    def __init__(self, rendezvous: Rendezvous, topology: Topology, *, timeout: float, transport: str = "auto",
                 global_ranks: Sequence[int] | None = None, mpi_comm: Any = None,
                 settings: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None,
                 device: Any = None):
        self._rdv = rendezvous
        self.topology = topology
        self.rank = topology.rank
        self.size = topology.size
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(self.size))
        self._mpi_comm = mpi_comm
        self._forced: str | None = None
        self._warned_staging = False
        self._cache: dict = {}
        self._cpu_cache: dict = {}  # the hot paths' view of _cache for CPU tensors: no device in the key
        # kept for collectives/_all_to_all.py (its AllToAllHost protocol), emptied by _forget_calls:
        self._a2a_plans: dict = {}  # all_to_all's latency path: (x.shape, dtype, recv given) -> plan of a CPU call
        self._inplace_scratch: tuple | None = None  # in-place all_to_all's kept copy of x (CPU)
        self._barrier_entry: tuple[Transport, Signature] | None = None
        self.transports: dict[str, Transport] = {}
        self._state = SharedState(self.transports, rendezvous)
        self._state.members.add(self)
        # Argument errors are exchanged with the peers before anything else, so that a bad value
        # on one rank makes every rank raise instead of leaving the others in the exchange.
        local_error: Exception | None = None
        self.timeout = 0.0  # set below once checked
        self.settings: dict[str, Any] = {}
        self._transport_settings: dict[str, Any] = {}
        self.device = torch.device("cpu")  # set below once checked
        try:
            self.timeout = check_timeout(timeout, source="Communicator: timeout")
            self.device = self._bind(device)
            # resolved transports.settings values; transport= overrides MOECOMM_TRANSPORT
            self.settings = dict(settings) if settings is not None else resolve_settings(options, source="Communicator")
            if transport not in (None, "auto"):
                self.settings["transport"] = SETTINGS["transport"].parse(transport, source="transport=")
            # with the performance model's switch points for this group (agreed at creation)
            self._transport_settings = transport_settings(self.settings, ranks=self.size,
                                                          single_node=self.topology.single_node)
        except (TypeError, ValueError) as e:
            local_error = e
        forced = self.settings.get("transport", "auto")
        self._forced = None if forced == "auto" else forced
        self._make_transports(local_error)
        self._add_hierarchical()
        if self._forced and self._forced not in self.transports:
            available = sorted(self.transports)
            self._state.shut("its creation failed")
            raise ValueError(
                f"transport {self._forced!r} is not available here (available: {available}): "
                "shm needs all ranks on one node; mpi needs a launch by mpirun/mpiexec; gloo needs torch with gloo "
                "and a store rendezvous (torchrun or collectives.launch)")
        live.add(self)

    def _make_transports(self, local_error: Exception | None) -> None:
        group = GroupInfo(rank=self.rank, size=self.size, timeout=self.timeout, rendezvous=self._rdv,
                          global_ranks=self.global_ranks, pids=list(self.topology.pids),
                          hosts=list(self.topology.node_ids), mpi_comm=self._mpi_comm,
                          oversubscribed=self.topology.oversubscribed, settings=self._transport_settings,
                          cuda_device=self.device.index if self.device.type == "cuda" else None)
        try:
            self.transports.update(create_transports(group, self.topology, self.device, self._forced, local_error))
        except BaseException as e:  # Ctrl-C too: closing tells the peers waiting in the next exchange
            self._state.shut("its creation failed" if isinstance(e, Exception)
                             else f"{type(e).__name__} interrupted its creation")
            raise

    def _add_hierarchical(self) -> None:
        """The hierarchical transport (collectives/hierarchical.py) for a group on several nodes with equal
        ranks (>1) per node and mpi or gloo between them. Local: its sub-groups are made at its first call."""
        flat = next((self.transports[n] for n in ("mpi", "gloo") if n in self.transports), None)
        if flat is None or hierarchical_shape(self.topology) is None:
            return
        group = GroupInfo(rank=self.rank, size=self.size, timeout=self.timeout, rendezvous=self._rdv,
                          global_ranks=self.global_ranks)
        self.transports["hierarchical"] = HierarchicalTransport(group, self.topology, flat, self._split)

    def _bind(self, device: Any) -> torch.device:
        """The checked ``device=`` (see the class docstring), made the current CUDA device."""
        dev = resolve_device(device, self.topology.local_rank)
        if dev.type == "cuda":
            try:
                torch.cuda.set_device(dev)
            except RuntimeError as e:  # a broken driver: a creation error every rank hears of
                raise ValueError(f"device {dev}: {e}") from e
        return dev

    # ---- properties -------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks of its node."""
        return self.topology.local_rank

    @property
    def local_size(self) -> int:
        """How many ranks of the group run on this rank's node."""
        return self.topology.local_size

    @property
    def closed(self) -> bool:
        """Whether this communicator (or, for a :meth:`using` view, its parent) is closed."""
        return self._state.closed is not None

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, transports={sorted(self.transports)}, "
                f"forced={self._forced})")

    # ---- one thread at a time -----------------------------------------------------------------
    def _guarded(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` as the only call in flight on this communicator (see the class docstring)."""
        state = self._state
        if not state.busy.acquire(False):
            self._state.refuse(self.global_ranks[self.rank], self.timeout, what)
        try:
            if state.closed is not None:
                self._state.raise_closed()
            return fn(*args)
        except BaseException as e:
            # reject() raises the caller's error on purpose, after the peers heard of it
            if leaves_out_of_step(e) and not (what == "reject" and e is args[-1]):
                state.interrupted(e, self.global_ranks[self.rank], what)
            raise
        finally:
            if state.conflict is not None:
                self._state.end_after_conflict()
            state.busy.release()

    # ---- shared call machinery --------------------------------------------------------------
    def _fail_locally(self, opcode: OpCode, device: str, err: Exception, nbytes: int = 0,
                      call: tuple[Any, torch.Tensor, tuple[int, int] | None] | None = None) -> NoReturn:
        """Tell the peers this rank rejected its input (so they raise too), then raise ``err``.

        nbytes: the call's bytes where the rejected call would be routed by size (0: unknown).
        call: (its cache entry, x, (rows, hidden) of an all_reduce_rmsnorm or None) where the call
        itself was valid: its transport meets the peers where that call meets
        (``Transport.reject_call``; a Lamport all_reduce has no barrier for exchange_meta's)."""
        try:
            if call is not None and not call[0].staged:
                ent, x, fused = call
                ent.transport.reject_call(ent.sig, x, fused)
            else:
                t, _ = self._select(opcode, device, nbytes, torch.float32, opcode.name.lower())
                t.exchange_meta(Signature(error_meta()))
        except Exception:  # noqa: BLE001 - the local error is what the caller needs to see
            pass
        raise err

    def reject(self, error: Exception, *, device: str = "cpu") -> NoReturn:
        """Raise ``error`` here and make the peers' matching collective raise ``ValueError`` at once.

        For libraries that validate their own arguments on one rank while the other ranks go
        on into the next collective (on tensors of ``device``): instead of leaving them to wait
        for the timeout, they learn that this rank rejected its input.

        Args:
            error: the exception to raise on this rank.
            device: device type of the tensors the peers' next collective moves ("cpu", "cuda"),
                so that this rank meets them in the same transport.
        Returns:
            Never; raises ``error``.
        """
        self._guarded("reject", self._fail_locally, OpCode.ALL_TO_ALL, device, error)
        raise AssertionError("unreachable")  # pragma: no cover - _fail_locally always raises

    # ---- collectives --------------------------------------------------------------------------
    # all_reduce, all_gather and reduce_scatter inline _guarded: they are the latency path.
    def all_reduce(self, x: Array, op: str = "sum", *, out: Array | None = None) -> Array:
        """Reduce ``x`` elementwise over all ranks; every rank gets the result.

        16-bit floats accumulate in float32; every rank gets bitwise-identical results.

        Args:
            x: [*] any shape, same shape and dtype on every rank; float64/32/16, bfloat16, int64/32,
                uint8 or bool (a torch tensor or NumPy array).
            op: "sum", "avg" (floating dtypes), "prod", "max" or "min" (bool: max = any, min = all).
            out: optional tensor/array of x's shape and dtype to write (may be x itself).
        Returns:
            [*] x's shape and dtype: a new tensor (NumPy for NumPy input), or ``out``.
        """
        state = self._state
        if not state.busy.acquire(False):
            self._state.refuse(self.global_ranks[self.rank], self.timeout, "all_reduce")
        try:
            hot = self._hot(OpCode.ALL_REDUCE, x, op, out, True)
            if hot is not None:
                ent, res, x0, o0 = hot
                if ent.by_address is not None:
                    ent.by_address(x0, o0)
                else:
                    ent.call(x, res, ent.rop, ent.sig)
                return res
            return self._run(OpCode.ALL_REDUCE, x, out, op)
        except BaseException as e:
            if leaves_out_of_step(e):
                state.interrupted(e, self.global_ranks[self.rank], "all_reduce")
            raise
        finally:
            if state.conflict is not None:
                self._state.end_after_conflict()
            state.busy.release()

    def all_gather(self, x: Array, *, out: Array | None = None) -> Array:
        """Concatenate every rank's ``x`` along dim 0 in rank order.

        Args:
            x: [n, *rest] (a 0-d x counts as [1]), same shape and dtype on every rank; any
                supported dtype.
            out: optional [size * n, *rest] tensor/array of x's dtype to write.
        Returns:
            [size * n, *rest] x's dtype: rows [r * n, (r + 1) * n) are rank r's x.
        """
        state = self._state
        if not state.busy.acquire(False):
            self._state.refuse(self.global_ranks[self.rank], self.timeout, "all_gather")
        try:
            hot = self._hot(OpCode.ALL_GATHER, x, None, out, False)
            if hot is not None:
                ent, res, x0, o0 = hot
                if ent.by_address is not None:
                    ent.by_address(x0, o0)
                else:
                    ent.call(x, res, ent.sig)
                return res
            return self._run(OpCode.ALL_GATHER, x, out)
        except BaseException as e:
            if leaves_out_of_step(e):
                state.interrupted(e, self.global_ranks[self.rank], "all_gather")
            raise
        finally:
            if state.conflict is not None:
                self._state.end_after_conflict()
            state.busy.release()

    def reduce_scatter(self, x: Array, op: str = "sum", *, out: Array | None = None) -> Array:
        """Reduce ``x`` over all ranks and keep this rank's block of dim 0.

        Args:
            x: [size * n, *rest], same shape and dtype on every rank (dtypes and ops as
                :meth:`all_reduce`).
            op: "sum", "avg", "prod", "max" or "min".
            out: optional [n, *rest] tensor/array of x's dtype to write.
        Returns:
            [n, *rest] x's dtype: rows [rank * n, (rank + 1) * n) of the reduction.
        """
        state = self._state
        if not state.busy.acquire(False):
            self._state.refuse(self.global_ranks[self.rank], self.timeout, "reduce_scatter")
        try:
            hot = self._hot(OpCode.REDUCE_SCATTER, x, op, out, False)
            if hot is not None:
                ent, res, x0, o0 = hot
                if ent.by_address is not None:
                    ent.by_address(x0, o0)
                else:
                    ent.call(x, res, ent.rop, ent.sig)
                return res
            return self._run(OpCode.REDUCE_SCATTER, x, out, op)
        except BaseException as e:
            if leaves_out_of_step(e):
                state.interrupted(e, self.global_ranks[self.rank], "reduce_scatter")
            raise
        finally:
            if state.conflict is not None:
                self._state.end_after_conflict()
            state.busy.release()

    def broadcast(self, x: Array, src: int = 0, *, out: Array | None = None) -> Array:
        """Every rank gets rank ``src``'s ``x``.

        Args:
            x: [*] same shape and dtype on every rank (its values matter only on ``src``).
            src: the group rank whose x is sent: an int (or NumPy integer) in [0, size).
            out: optional tensor/array of x's shape and dtype to write (may be x itself).
        Returns:
            [*] x's shape and dtype holding src's x: a new tensor (NumPy for NumPy input), or ``out``.
        """
        return self._guarded("broadcast", self._broadcast, x, src, out)

    def _broadcast(self, x: Array, src: Any, out: Array | None) -> Array:
        # checked before the call cache: True == 1 and 1.0 == 1 would find the entry of src=1
        if type(src) is not int:
            try:
                src = as_int(src, "broadcast: src")
            except TypeError as e:
                self._fail_locally(OpCode.BROADCAST, device_of(x), e)
        return self._run(OpCode.BROADCAST, x, out, None, src)

    def all_to_all(self, x: Array, send_counts: Sequence[int] | None = None, *, out: Array | None = None,
                   return_counts: bool = False, recv_counts: Sequence[int] | None = None
                   ) -> Array | tuple[Array, Array]:
        """Exchange rows: ``send_counts[i]`` rows of ``x`` (in rank order) go to rank i.

        The receiver needs no prior knowledge: counts are exchanged here, unless the caller
        already knows them and passes ``recv_counts`` (on every rank, or on none): then a
        transport that would exchange counts first may skip that (nccl: no count exchange and no
        host synchronisation). The values are checked against what the peers send: a wrong one
        makes every rank raise ``ValueError`` naming the ranks and their counts (shm, mpi: every
        call; nccl: the first call of each signature, or every call with MOECOMM_NCCL_CHECK=always,
        see :meth:`transports.nccl.NCCLTransport.all_to_all`).

        Args:
            x: [sum(send_counts), *rest]; rest and dtype agree across ranks, row counts need not.
            send_counts: [size] ints (a list/tuple of int or NumPy integers, or an integer tensor
                or array); None splits x.shape[0] evenly.
            out: optional [sum(recv_counts), *rest] tensor/array of x's dtype to write; its dtype
                and trailing dims are checked before the exchange, its row count after. It may be x
                itself (in place, as MPI_IN_PLACE: this rank then receives as many rows as it sends).
            return_counts: also return the received counts.
            recv_counts: [size] ints (same kinds as send_counts), the rows this rank receives from
                each rank, i.e. ``send_counts[rank]`` of every rank; None: exchanged here.
        Returns:
            [sum(recv_counts), *rest] x's dtype, rows in source-rank order (or ``out``); with
            ``return_counts=True`` a tuple ``(result, recv_counts)``, recv_counts: [size] int64
            (a tensor, or NumPy for NumPy input).
        """
        state = self._state
        if not state.busy.acquire(False):
            self._state.refuse(self.global_ranks[self.rank], self.timeout, "all_to_all")
        try:
            if not return_counts:
                res = all_to_all_hot(self, x, send_counts, out, recv_counts)
                if res is not None:
                    return res
            if state.closed is not None:
                self._state.raise_closed()
            return all_to_all_checked(self, x, send_counts, out, return_counts, recv_counts)
        except BaseException as e:
            if leaves_out_of_step(e):
                state.interrupted(e, self.global_ranks[self.rank], "all_to_all")
            raise
        finally:
            if state.conflict is not None:
                self._state.end_after_conflict()
            state.busy.release()

    def _a2a_entry(self, x: torch.Tensor, rest: torch.Size, recv_given: int) -> _Entry | None:
        """The cached entry (collectives/_calls.py) of an all_to_all of the tensor ``x`` (``rest``:
        its ``shape[1:]``) whose recv_counts were given (1) or not (0), or None; not validated.
        For collectives/_all_to_all.py (per call on CUDA tensors: the lookup only)."""
        if x.is_cpu:
            return self._cpu_cache.get((OpCode.ALL_TO_ALL, rest, x.dtype, None, recv_given))
        return self._cache.get((OpCode.ALL_TO_ALL, rest, x.dtype, x.device, None, recv_given))

    def barrier(self) -> None:
        """Return once every rank of the group has called barrier (bounded by the timeout).

        Returns:
            None.
        """
        self._guarded("barrier", self._barrier)

    def synchronize(self) -> None:
        """Wait for this rank's collectives queued on the device, and raise their failures.

        Our ``ipc`` kernels report errors asynchronously, as NCCL does: a call returns once its
        kernel is queued, and a failure (a dead or late peer: ``PeerFailedError``,
        ``CollectiveTimeoutError``; a signature difference: ``ValueError``) raises at this rank's
        next call or here, naming the rank. Other transports finish their calls before returning.

        Returns:
            None.
        """
        self._guarded("synchronize", self._synchronize)

    def _synchronize(self) -> None:
        for t in dict.fromkeys(self.transports.values()):
            t.synchronize()

    def _barrier(self) -> None:
        ent = self._barrier_entry
        if ent is None:
            tr, _ = self._select(OpCode.BARRIER, "cpu", 0, torch.uint8, "barrier")
            ent = self._barrier_entry = (tr, Signature.of(OpCode.BARRIER))
        ent[0].barrier(ent[1])

    def using(self, transport: str) -> "Communicator":
        """A view of this communicator that routes every call to ``transport``.

        Local (no communication). The view shares this communicator's transports, its closed
        state and its one-call-at-a-time rule; closing the view does nothing. Collective calls on
        a view and on its parent interleave like calls on one communicator.

        Args:
            transport: "auto" or the name of one of ``comm.transports`` ("shm", "mpi", "nccl", "ipc").
        Returns:
            A :class:`Communicator` view.
        """
        if self._state.closed is not None:
            self._state.raise_closed()
        if transport != "auto" and transport not in self.transports:
            raise ValueError(f"transport {transport!r} is not available here (available: {sorted(self.transports)})")
        view = object.__new__(Communicator)
        view.__dict__.update(self.__dict__)
        view._forced = None if transport == "auto" else transport
        view._is_view = True
        view._cache = {}
        view._cpu_cache = {}
        view._a2a_plans = {}
        view._inplace_scratch = None
        view._barrier_entry = None
        self._state.members.add(view)
        return view

    def close(self) -> None:
        """Release transports and shared memory; peers still waiting on this rank raise at once.

        Waits for a call in flight in another thread to end. Later calls on this communicator and
        its views raise ``CommunicatorBrokenError``; closing a view or a closed communicator does
        nothing.

        Returns:
            None.
        """
        if getattr(self, "_is_view", False):
            return
        self._close(wait=True)

    def _close(self, *, wait: bool) -> None:
        state = self._state
        if state.closed is not None:
            return
        # a call in flight in another thread ends within the timeout; its transport must outlive it
        acquired = state.busy.acquire(True, self.timeout + 1.0) if wait else state.busy.acquire(False)
        if not acquired:
            if wait:
                raise RuntimeError("close(): a call in another thread did not end within the timeout")
            return
        try:
            state.shut("close() was called")
        finally:
            state.busy.release()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
