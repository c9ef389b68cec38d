"""The Communicator: one object, every collective, a transport picked per call.

How a call is checked, cached and handed to its transport is in collectives/_calls.py (a mixin of
the Communicator); all_to_all's argument handling in collectives/_all_to_all.py, which uses the
Communicator through its ``AllToAllHost`` protocol only.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import math
from typing import Any, Callable, Mapping, NoReturn, Sequence

import torch

from transports.base import (
    GroupInfo,
    OpCode,
    Rendezvous,
    Signature,
    Transport,
    dtype_code,
    error_meta,
)
from transports.settings import SETTINGS, check_timeout, parse_options
from transports.settings import resolve as resolve_settings

from ._arrays import Array, as_int, as_tensor, device_of
from ._all_to_all import all_to_all_checked, all_to_all_hot
from ._calls import CallPaths, _Entry
from ._p2p import PointToPoint
from ._rmsnorm import FLOATS, RMSNORM_VIEW, check_rmsnorm_args, composed_rmsnorm, fused_rmsnorm
from ._creation import create_transports
from ._device import resolve_device
from ._shared import SharedState, leaves_out_of_step, live
from ._symmetric import agree_symmetric_args
from .hierarchical import HierarchicalTransport, hierarchical_shape
from .prediction import predict_plan, transport_settings
from .selection import Plan, choose_transport
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


class Communicator(CallPaths, PointToPoint):
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

    # ---- selection ----------------------------------------------------------------------------
    def _select(self, opcode: OpCode, device: str, nbytes: int, dtype: torch.dtype, name: str
                ) -> tuple[Transport, Plan]:
        if self._state.closed is not None:
            self._state.raise_closed()
        tname, reason = choose_transport(opcode, device, self.topology.single_node, self.transports, self._forced,
                                         nbytes=None if opcode == OpCode.ALL_TO_ALL else nbytes)
        t = self.transports[tname]
        staged = device not in t.devices
        plan = Plan(name, tname, t.algorithm(opcode, nbytes, dtype), nbytes, reason, staged)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: %s", self.global_ranks[self.rank], plan)
        if staged and not self._warned_staging:
            self._warned_staging = True
            log.warning("no transport for %s tensors is available; %s copies them through host memory "
                        "(slow). Install the GPU transports to avoid this.", device, tname)
        return t, plan

    def plan(self, collective: str, x: Array, *, op: str = "sum", send_counts: Sequence[int] | None = None,
             src: int = 0, weight_dtype: torch.dtype | None = None) -> Plan:
        """Which transport and algorithm ``getattr(comm, collective)(x, ...)`` would use on this rank.

        Local: no communication.

        Args:
            collective: "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                "barrier" or "all_reduce_rmsnorm" (its algorithm: the transport's fused one, or
                "all_reduce+rmsnorm" where the communicator composes all_reduce and torch ops).
            x: [*] the tensor or array that call would get (a supported dtype; all_reduce_rmsnorm:
                [*, H] of a float dtype).
            op, send_counts, src: as for that call (they do not change the choice today).
            weight_dtype: all_reduce_rmsnorm's weight dtype (None: x's dtype).
        Returns:
            A :class:`Plan`: transport, algorithm, bytes and the reason for the choice, with the
            performance model's predicted time of this plan and of the runner-up (the best other
            transport/algorithm of this communicator) where the model covers the call.
        """
        opcode = _OPCODE_BY_NAME.get(collective)
        if opcode is None:
            raise ValueError(f"unknown collective {collective!r}; one of {sorted(_OPCODE_BY_NAME)}")
        t, _, _ = as_tensor(x)
        if collective == "all_reduce_rmsnorm" and t.dtype not in FLOATS:
            raise TypeError(f"plan: all_reduce_rmsnorm takes x of a float dtype, got {t.dtype}")
        if collective == "all_reduce_rmsnorm" and t.dim() == 0:
            raise ValueError("plan: all_reduce_rmsnorm takes x of [*, H], got a 0-d x")
        tr, plan = self._select(opcode, t.device.type, t.numel() * t.element_size(), t.dtype, collective)
        if collective == "all_reduce_rmsnorm":
            fused = None if plan.staged_through_host else tr.fuses_all_reduce_rmsnorm(
                t.numel(), t.shape[-1], t.dtype, weight_dtype if weight_dtype is not None else t.dtype)
            plan = dataclasses.replace(
                plan, algorithm=fused or "all_reduce+rmsnorm",
                reason=f"{plan.reason}; " + (f"fused in {tr.name}" if fused else
                                              f"composed: all_reduce ({plan.algorithm}), then add and RMSNorm in torch"))
        note = tr.plan_note(opcode, plan.nbytes)
        if note:
            plan = dataclasses.replace(plan, reason=f"{plan.reason}; {note}")
        predicted = predict_plan(self.settings, op=collective, transport=plan.transport, algorithm=plan.algorithm,
                                 nbytes=plan.nbytes, ranks=self.size, nodes=len(self.topology.nodes), device=t.device,
                                 available=set(self.transports))
        return dataclasses.replace(plan, predicted_us=predicted.chosen_us, runner_up=predicted.runner_up,
                                   runner_up_us=predicted.runner_up_us)

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

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                           *, out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """All-reduce ``x``, add ``residual``, RMSNorm: what a tensor-parallel transformer block runs after
        its attention and after its MLP (TensorRT-LLM, FlashInfer and vLLM fuse it).

        Defined as the composition (``n`` = the new residual; the float32 below is float64 for float64 x)::

            a = comm.all_reduce(x)                        # sum, in x's dtype
            n = a + residual                              # torch, in x's dtype
            normed = (n.float() * torch.rsqrt(n.float().pow(2).mean(-1, keepdim=True) + eps)
                      * weight.float()).to(x.dtype)

        which the communicator runs unless the transport that serves the all-reduce fuses the call
        (``Transport.fuses_all_reduce_rmsnorm``; ``comm.plan("all_reduce_rmsnorm", x)`` says which): a
        fused transport computes the same up to float32 rounding of the mean. Every rank gets the same
        ``a``; ``residual``, ``weight`` and ``eps`` are this rank's own (replicated in tensor
        parallelism, then every rank's results are bitwise identical). Not differentiable.

        The call's signature marks it (``OpCode.ALL_REDUCE_RMSNORM`` in ``F_VIEW``, the weight's dtype in
        ``F_WEIGHT_DTYPE``), so a rank's all_reduce_rmsnorm against a peer's plain all_reduce of the same
        shape, or different weight dtypes, raise ``ValueError`` on every rank naming the ranks.

        Args:
            x: [*, H] (at least 1 dim) float64, float32, float16 or bfloat16 torch tensor, same shape and
                dtype on every rank, on a device this communicator serves.
            residual: x's shape, dtype and device.
            weight: [H], x's dtype or float32, x's device; the same dtype on every rank.
            eps: a finite float >= 0.
            out: optional tensor of x's shape, dtype and device for ``normed`` (may be x itself).
            residual_out: optional tensor of x's shape, dtype and device for the new residual (may be
                ``residual`` itself: in place, as vLLM's fused_add_rms_norm); it must not overlap ``out``.
        Returns:
            ``(normed, new_residual)``, both x's shape and dtype: new tensors, or ``out`` and ``residual_out``.
        Raises:
            TypeError, ValueError: a bad argument (not a tensor, a non-float dtype, a residual, weight or
                out of another shape, dtype or device, eps negative or not finite, a 0-d x) on this rank,
                naming it; its peers raise ``ValueError`` naming it.
        """
        return self._guarded("all_reduce_rmsnorm", self._all_reduce_rmsnorm, x, residual, weight, eps, out,
                             residual_out)

    def _all_reduce_rmsnorm(self, x: Any, residual: Any, weight: Any, eps: Any, out: Any, residual_out: Any
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._state.closed is not None:
            self._state.raise_closed()
        try:
            eps = check_rmsnorm_args(x, residual, weight, eps, out, residual_out, self.global_ranks[self.rank])
        except (TypeError, ValueError) as e:
            dense = isinstance(x, torch.Tensor) and x.layout is torch.strided
            self._fail_locally(OpCode.ALL_REDUCE, device_of(x), e, x.numel() * x.element_size() if dense else 0,
                               call=self._rmsnorm_call(x, weight) if dense else None)
        t, res, w = x.detach(), residual.detach(), weight.detach()
        code = dtype_code(w.dtype)
        ent = self._entry(OpCode.ALL_REDUCE, t, "sum", code, RMSNORM_VIEW)
        shape = tuple(t.shape)
        hidden, rows = shape[-1], math.prod(shape[:-1])
        fused = None if ent.staged else ent.transport.fuses_all_reduce_rmsnorm(t.numel(), hidden, t.dtype, w.dtype)
        if fused is not None:
            return fused_rmsnorm(ent.transport, ent.sig, t, res, w, eps, out, residual_out, rows, hidden)
        a = self._run(OpCode.ALL_REDUCE, t, None, "sum", code, RMSNORM_VIEW)  # a new tensor on x's device
        return composed_rmsnorm(a, res, w, eps, out, residual_out)

    def _rmsnorm_call(self, x: torch.Tensor, weight: Any) -> tuple[Any, torch.Tensor, tuple[int, int]] | None:
        """The all_reduce_rmsnorm call a rank rejected (another argument was wrong), for
        :meth:`_fail_locally`, where x and weight make the signature its peers use; else None."""
        t = x.detach()
        if not isinstance(weight, torch.Tensor) or t.dtype not in FLOATS or weight.dtype not in FLOATS \
                or t.dim() == 0 or t.device.type != self.device.type or (t.is_cuda and t.device != self.device):
            return None
        ent = self._entry(OpCode.ALL_REDUCE, t, "sum", dtype_code(weight.dtype), RMSNORM_VIEW)
        return ent, t, (t.numel() // t.shape[-1], t.shape[-1])

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

    def symmetric_empty(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized tensor in the ipc transport's symmetric heap (torch calls this
        ``symm_mem.empty``; vLLM registers its CUDA-graph buffers for the same reason).

        Collective: every rank calls it with the same shape and dtype, in the same order. An
        ``all_reduce`` of such a tensor reads it in place on every rank, without the copy into the
        staging buffer (``out=x`` all-reduces it in place). Freed when the tensor is garbage
        collected; free in the same order on every rank (allocations must land at one offset).

        Args:
            shape: the tensor's shape.
            dtype: its dtype.
        Returns:
            [shape] dtype on this communicator's ipc device (CUDA; CPU when ipc is emulated).
        Raises:
            CommunicatorBrokenError: this communicator is closed.
            RuntimeError: this communicator has no ipc transport.
            TypeError, ValueError (every rank; the communicator stays open): a bad shape or dtype
                on some rank (that rank raises its own error), the ranks' calls differ, or the heap
                (setting ``ipc_symmetric_bytes``) is full.
        """
        if self._state.closed is not None:
            self._state.raise_closed()
        t = self.transports.get("ipc")
        if t is None:
            raise RuntimeError("symmetric_empty needs the ipc transport (one node, CUDA and triton, or "
                               f"MOECOMM_IPC_EMULATE=1); this communicator has {sorted(self.transports)}")

        def allocate() -> torch.Tensor:  # arguments agreed first: the transport's exchange assumes valid ones
            dims, dt = agree_symmetric_args(self._rdv, self.global_ranks, shape, dtype,
                                            getattr(t, "symmetric_bytes", None))
            return t.symmetric_empty(dims, dt)

        return self._guarded("symmetric_empty", allocate)

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

    # ---- groups -------------------------------------------------------------------------------
    def split(self, color: int | None, key: int | None = None, *,
              options: Mapping[str, Any] | None = None) -> "Communicator | None":
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

    def _split(self, color: Any, key: Any, options: Mapping[str, Any] | None) -> "Communicator | None":
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
        return Communicator(rdv, topo, timeout=self.timeout, transport=self._forced or "auto",
                            global_ranks=[self.global_ranks[m] for m in members], mpi_comm=mpi_sub,
                            settings=settings, device=self.device)

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


_OPCODE_BY_NAME = {"all_reduce": OpCode.ALL_REDUCE, "all_gather": OpCode.ALL_GATHER,
                   "reduce_scatter": OpCode.REDUCE_SCATTER, "all_to_all": OpCode.ALL_TO_ALL,
                   "broadcast": OpCode.BROADCAST, "barrier": OpCode.BARRIER,
                   "all_reduce_rmsnorm": OpCode.ALL_REDUCE}  # its all_reduce picks the transport
