"""Low-latency expert-parallel dispatch and combine (DeepEP's low-latency mode) over the ipc transport.

Notation: P ranks of the communicator, E experts (L = E / P per rank, expert ``e`` on rank
``e // L``), M = ``max_tokens_per_rank``, T <= M this call's tokens, k top-k slots, H hidden.

Call path: :class:`LowLatencyDispatcher` -> ``transports.ipc_moe.IPCExpertExchange`` -> two Triton
kernels per dispatch and two per combine (``transports.kernels.moe_ll``) on the current stream.
Every buffer is allocated at construction inside a region every rank maps, shapes depend only on
(E, M, H, P), counts travel with the data, and the kernels never wait for the host: a decoding step
with dispatch and combine can be captured in a CUDA graph and replayed. Called eagerly, each call
waits for its kernels before it returns, so that a refused call raises on every rank in that call.
With ``return_recv_hook=True`` (DeepEP's receive hooks) a call launches its send kernel only and
returns at once; its hook launches the receive kernel and then waits and raises as the plain call
does (``IPCTransport.launch_exchange(..., finish=False)``, then ``finish_exchange``), so the
caller computes while the data travels. One call is in flight per dispatcher.

Compared with :class:`moe.ExpertDispatcher` (the normal mode: exact-size outputs, one host
synchronization per layout, any transport), this mode pays fixed [L, P*M, H] buffers for no
synchronization in CUDA graphs; it needs the ipc transport (one node; CUDA with triton and cupy, or
``MOECOMM_IPC_EMULATE=1`` on the CPU).

Masks (issue #55, :mod:`moe.elastic`), as in :class:`moe.ExpertDispatcher`: a call with
``masked_ranks`` (or after :meth:`LowLatencyDispatcher.mask`, or after a peer failure with
``on_peer_failure="mask"``) runs without those ranks (dead or stopped: no call waits for them) on an
inner dispatcher over the unmasked ranks' :class:`~moe.elastic.MaskedGroup` (A ranks, A * L experts,
the same M, H, dtype and max_topk; built on the first call with that set, collective over the
unmasked ranks, cached): slots routed to a masked rank's experts are dropped, and the other slots'
weights are used as they are (not renormalised). Its buffers are the group's: recv_x is
[L, A*M, H]. A call without masks takes the path above unchanged (one tuple check more).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from collectives.agreement import rank_label
from transports.base import PeerFailedError
from transports.ipc_moe import Dispatched, IPCExpertExchange, RecvHook

from .elastic import ON_PEER_FAILURE, MaskedGroup, MaskSet, mapped


@dataclass(frozen=True)
class LowLatencyHandle:
    """What :meth:`LowLatencyDispatcher.combine` needs from its dispatch.

    info: int32 [L, P*M], per received row ``src * M * max_topk + t * max_topk + k`` (its source
    rank, token and slot); recv_count: int32 [L], the valid rows per local expert; dispatched:
    the dispatch's call word (which the combine's peers compare with theirs) and the topk_idx it
    sent (which the combine's must equal); masked_ranks: the masks of the dispatch (ranks of the
    dispatcher's communicator, ascending; () for none): its combine runs on their group, and
    ``info``'s source ranks and P are the group's (A unmasked ranks).
    """

    info: torch.Tensor
    recv_count: torch.Tensor
    dispatched: Dispatched
    masked_ranks: tuple[int, ...] = ()


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 rows as ``dispatch(..., use_fp8=True)`` returns them back to float32: q float8_e4m3fn [..., H] times
    its scales float32 [..., H/128], each over its 128 channels. Returns float32 [..., H]."""
    return (q.float().unflatten(-1, (-1, 128)) * scales[..., None]).flatten(-2)


class LowLatencyDispatcher:
    """Fixed-buffer MoE dispatch/combine for decoding (DeepEP low-latency style), CUDA-graph capturable.

    Collective to construct: every rank of ``comm`` passes the same arguments.

    Args:
        comm: a :class:`collectives.Communicator` with the ipc transport (every rank on one node).
        num_experts: E, a multiple of ``comm.size``.
        max_tokens_per_rank: M, the most tokens one rank dispatches per call.
        hidden: H, a multiple of 128.
        dtype: tokens' and experts' outputs' dtype (bfloat16, float16 or float32).
        max_topk: the most top-k slots per token (the combine buffer holds M * max_topk rows).
        on_peer_failure: what a ``PeerFailedError`` (a peer died or left) in a call does.
            "raise" (default): it propagates; the survivors may then call :meth:`mask` and go on.
            "mask": in a :meth:`dispatch` without a receive hook the failed ranks (those the error
            names) join the permanent masks, the survivors build their group, agree that they were
            all in the same call of this dispatcher (else ``ValueError`` on every survivor, saying
            so), log a warning and run the dispatch again on the survivors, returning its result
            (its handle's ``masked_ranks`` name the new masks); in :meth:`combine` and in a call
            with ``return_recv_hook`` (its send or its hook) the ranks are masked and the group
            built alike, then ``PeerFailedError`` is raised again, saying that the step (dispatch
            and combine) must be run again. Every other error propagates as with "raise".

    Masks: see :meth:`dispatch` (``masked_ranks``), :meth:`mask`, :attr:`masked_ranks`,
    :attr:`active_comm` and the module docstring. :meth:`close` closes the masked groups.

    Raises:
        RuntimeError: the communicator has no ipc transport (several nodes, no CUDA/triton/cupy),
            with the reason.
        ValueError (every rank): invalid sizes or ``on_peer_failure``, or ranks that passed different ones.

    Example::

        disp = LowLatencyDispatcher(comm, num_experts=E, max_tokens_per_rank=M, hidden=H)
        recv_x, recv_count, handle = disp.dispatch(x, topk_idx)
        y = disp.combine(experts(recv_x, recv_count), topk_idx, topk_weights, handle)

        # overlapped: send, compute, then receive
        recv_x, recv_count, handle, hook = disp.dispatch(x, topk_idx, return_recv_hook=True)
        other_work()
        hook()  # recv_x, recv_count valid from here
    """

    def __init__(self, comm, num_experts: int, max_tokens_per_rank: int, hidden: int,
                 dtype: torch.dtype = torch.bfloat16, max_topk: int = 8, *, on_peer_failure: str = "raise"):
        if comm.closed:  # a closed communicator has no transports left: say it is closed, as every call does
            comm._state.raise_closed()
        transport = comm.transports.get("ipc")
        if transport is None:
            if not comm.topology.single_node:
                why = "its ranks span several nodes (ipc maps peers' memory within one node)"
            else:
                why = ("no ipc transport could be created here (it needs CUDA, triton and cupy, or "
                       "MOECOMM_IPC_EMULATE=1 to emulate it on the CPU)")
            raise RuntimeError(f"LowLatencyDispatcher needs the communicator's ipc transport: {why}; "
                               f"this communicator has {sorted(comm.transports)}. moe.ExpertDispatcher "
                               "works over any transport.")
        # on_peer_failure: checked and compared over the store (no kernel), before the exchange's own check
        ok = on_peer_failure in ON_PEER_FAILURE
        mine = ON_PEER_FAILURE.index(on_peer_failure) if ok else -1
        theirs = [int(np.frombuffer(b, dtype=np.int64)[0])
                  for b in transport.group.rendezvous.allgather_bytes(np.array([mine], dtype=np.int64).tobytes())]
        if not ok:
            raise ValueError(f"LowLatencyDispatcher on {rank_label(comm)}: on_peer_failure must be one of "
                             f"{ON_PEER_FAILURE}, got {on_peer_failure!r}")
        if any(t != mine for t in theirs):
            shown = ", ".join(f"rank {comm.global_ranks[r]}: " + (repr(ON_PEER_FAILURE[t]) if t >= 0 else "invalid")
                              for r, t in enumerate(theirs))
            raise ValueError(f"LowLatencyDispatcher on {rank_label(comm)}: the ranks' on_peer_failure differ "
                             f"({shown}); construct the dispatcher with the same one on every rank")
        self.comm = comm
        self._x = comm._guarded("LowLatencyDispatcher", IPCExpertExchange, transport, num_experts,
                                max_tokens_per_rank, hidden, dtype, max_topk)
        self.num_experts, self.max_tokens_per_rank, self.hidden = num_experts, max_tokens_per_rank, hidden
        self.dtype, self.max_topk = dtype, max_topk
        self.num_local_experts = num_experts // comm.size
        self.on_peer_failure = on_peer_failure
        # the permanent masks, each set's group and inner dispatcher; after a failure the survivors compare
        # their exchanges' dispatch counts (counted anyway: the unmasked path counts nothing more)
        self._masks = MaskSet(self, comm, num_experts, self._build_masked, name="LowLatencyDispatcher",
                              on_peer_failure=on_peer_failure, count=lambda d: d._x._next_call)

    def _build_masked(self, group: MaskedGroup) -> LowLatencyDispatcher:
        """The dispatcher over a masked group: A * L experts, the same M, H, dtype and max_topk."""
        return LowLatencyDispatcher(group.comm, group.num_active_experts, self.max_tokens_per_rank, self.hidden,
                                    dtype=self.dtype, max_topk=self.max_topk)

    # ---- masks ----------------------------------------------------------------------------------
    @property
    def masked_ranks(self) -> tuple[int, ...]:
        """The permanent masks: ranks of ``comm`` (ascending) that every call leaves out, from :meth:`mask`
        or a peer failure with ``on_peer_failure="mask"``."""
        return self._masks.masked

    @property
    def active_comm(self):
        """The communicator the next call without per-call masks runs on: ``comm``, or the permanent masks'
        group's (None only while that group is not built: after a failure in a call with more masks of
        its own; the next call without them builds it)."""
        return self._masks.active_comm

    def mask(self, ranks: Sequence[int]) -> None:
        """Add ``ranks`` (of ``comm``) to the permanent masks and build their group now (collective over the
        unmasked ranks; the masked ones take no part), e.g. after a ``PeerFailedError`` with
        ``on_peer_failure="raise"``. Raises ``ValueError`` naming this rank for an invalid rank (out of
        range, listed twice, this rank itself); the build raises as :class:`~moe.elastic.MaskedGroup` does.
        """
        self._masks.mask(ranks, "LowLatencyDispatcher.mask")

    def close(self) -> None:
        """Close the masked groups and their dispatchers (collective over each group's ranks: the unmasked
        ones). The exchange of ``comm`` keeps its regions: they stay mapped until the communicator's
        ipc transport closes."""
        self._masks.close()

    def __repr__(self) -> str:
        return (f"LowLatencyDispatcher(rank={self.comm.rank}, size={self.comm.size}, num_experts={self.num_experts}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, hidden={self.hidden}, dtype={self.dtype}"
                + (f", masked_ranks={list(self._masks.masked)}" if self._masks.masked else "") + ")")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool = False,
                 return_recv_hook: bool = False, masked_ranks: Sequence[int] | None = None):
        """Send each token to the ranks of its top-k experts.

        Args:
            x: [T, H] of the dispatcher's dtype, T <= M (T may change between calls).
            topk_idx: int64 [T, k] expert ids, -1 for an unused slot; k <= max_topk; no expert twice
                in one token.
            use_fp8: send float8 e4m3 with one float32 scale per 128 channels (amax / 448).
            return_recv_hook: launch only the send kernel and return at once, with a hook that
                receives (see below).
            masked_ranks: ranks of ``comm`` (ints, in range, unique, not this rank: ``ValueError``
                naming this rank otherwise) that this call leaves out, together with the permanent
                :attr:`masked_ranks`; None or empty: none but those. Every unmasked rank must pass
                the same set, and the masked ranks do not call. The call then runs on the unmasked
                ranks' group (built on the first call with that set, collective over them; cached)
                by an inner dispatcher over A * L experts (A unmasked ranks), topk_idx mapped by
                :meth:`moe.elastic.MaskedGroup.map_experts`: slots of the masked ranks' experts
                become -1 (dropped), the other slots keep their weights as they are (not
                renormalised). Unmasked ranks that pass different sets wait on different groups: a
                masked call raises ``ValueError`` after the communicator's timeout.

        Returns:
            (recv_x, recv_count, handle): recv_x [L, P*M, H] of the dtype, or with ``use_fp8`` the
            pair (q float8_e4m3fn [L, P*M, H], scales float32 [L, P*M, H/128]); recv_count int32
            [L] on the device, the valid rows of each local expert, which come first, ordered by
            source rank, then token (rows past the count are unspecified); handle for
            :meth:`combine`. New tensors per call. With ``return_recv_hook``: (recv_x, recv_count,
            handle, hook), the same outputs, valid (the handle's tensors too) once ``hook()`` has
            been called; bit for bit the plain call's. With masks, P is the group's A: recv_x is
            [L, A*M, H] (rows by source rank among the unmasked ranks, then token), local expert l
            is still this rank's expert l, and ``handle.masked_ranks`` names the masks (the handle's
            info counts source ranks in the group).

        Errors are raised on every rank in this call, naming the rank at fault (ValueError, or
        TypeError on the rank of a wrong dtype): T > M, a wrong shape or dtype, expert ids
        outside [-1, E) or twice in a token, and calls that do not pair (one rank skipped a call
        its peers made, or the ranks differ in ``use_fp8``); the next call works. Called eagerly,
        dispatch waits for its kernels to raise them. In a CUDA-graph replay nothing is checked
        by the host: what the kernels record raises at the communicator's next ipc call and
        closes its ipc transport.

        Receive hooks (DeepEP's ``return_recv_hook``): ``hook()`` launches the receive kernel, then
        does what the plain call does after its kernels (eagerly: waits, raises the errors above on
        every rank, from the hook). Every input error is raised from the hook, the rank's own
        refused inputs too (its peers learn of them only in their receive kernels), so that all
        ranks raise in the same call; the send raises only earlier failures of the communicator.
        The send kernel never waits for this call's receivers: it waits only until the peers have
        received the previous call (their previous hook; transports.kernels.moe_ll's D_ACK), so
        it holds no SMs while the caller computes between the send and the hook. One call is in
        flight per dispatcher: a dispatch or combine while a hook is pending raises RuntimeError
        on its rank before anything is launched (the skipped call does not pair), and a hook
        called twice raises RuntimeError; two overlapping micro-batches use two dispatchers.
        Under CUDA-graph capture the send and the hook are captured as the plain call's kernels
        are, nothing waited for. The rule holds across mask sets: a masked call's pending hook
        refuses every call of this dispatcher, masked or not. Receive hooks work with masks.

        Without masks (``masked_ranks`` None and no permanent ones) the call is the plain exchange's,
        CUDA-graph capturable as before; a masked call does host work (the mask check, the id map,
        the group's lookup) and runs the group's kernels, capturable too once its group is built.
        """
        if masked_ranks is None and not self._masks.masked:  # the plain exchange, as without masks
            try:
                res = self.comm._guarded("LowLatencyDispatcher.dispatch", self._x.dispatch, x, topk_idx, use_fp8,
                                         return_recv_hook)
            except PeerFailedError as e:
                if self.on_peer_failure != "mask":
                    raise
                return self._masks.run("dispatch", (), self._dispatch_on(x, topk_idx, use_fp8, return_recv_hook),
                                       failed=e, retry=not return_recv_hook)
            recv_x, scales, info, recv_count = res[:4]
            out = (recv_x, scales) if use_fp8 else recv_x
            handle = LowLatencyHandle(info, recv_count, self._x.last)
            if return_recv_hook:
                return out, recv_count, handle, self._guarded_hook("dispatch", res[4])
            return out, recv_count, handle
        mask = self._masks.call_mask(masked_ranks, "LowLatencyDispatcher.dispatch")
        self._x._refuse_if_pending("dispatch")  # a masked call's hook may be pending (it runs on another exchange)
        return self._masks.run("dispatch", mask, self._dispatch_on(x, topk_idx, use_fp8, return_recv_hook),
                               retry=not return_recv_hook)

    def _dispatch_on(self, x: Any, topk_idx: Any, use_fp8: bool, return_recv_hook: bool
                     ) -> Callable[[LowLatencyDispatcher, MaskedGroup | None], tuple]:
        """A dispatch as :meth:`MaskSet.run <moe.elastic.MaskSet.run>` runs it: on the owner (no group: no masks
        at all) or on a group's dispatcher (no masks of its own), topk_idx mapped into the group's layout."""
        def run(d: LowLatencyDispatcher, group: MaskedGroup | None) -> tuple:
            if group is None:
                return d.dispatch(x, topk_idx, use_fp8, return_recv_hook)
            res = d.dispatch(x, mapped(group, topk_idx), use_fp8, return_recv_hook)
            handle = replace(res[2], masked_ranks=group.masked)
            if return_recv_hook:
                return res[0], res[1], handle, self._masked_hook("dispatch", group.masked, res[3])
            return res[0], res[1], handle
        return run

    def _guarded_hook(self, op: str, hook: RecvHook) -> Callable[[], None]:
        """``hook`` as a call of the communicator (one call in flight, as every call is); a ``PeerFailedError``
        with ``on_peer_failure="mask"`` masks the failed ranks and is raised again."""
        def recv_hook() -> None:
            try:
                self.comm._guarded(f"LowLatencyDispatcher.{op}'s receive hook", hook)
            except PeerFailedError as e:
                if self.on_peer_failure != "mask":
                    raise
                self._masks.run(op, (), None, failed=e, retry=False)
        return recv_hook

    def _masked_hook(self, op: str, mask: tuple[int, ...], hook: Callable[[], None]) -> Callable[[], None]:
        """The hook of a masked call (its group's dispatcher's), with the masks' failure handling. Until it is
        called, this dispatcher's own exchange counts as having a hook pending (one call in flight)."""
        token = self._x._pending = f"{op} (masked_ranks={list(mask)})"

        def recv_hook() -> None:
            if self._x._pending is not token:  # called before: the inner hook raises, and no other call's flag goes
                return hook()
            try:
                self._masks.run(op, mask, lambda d, group: hook(), build=False, retry=False)
            finally:
                self._x._pending = None
        return recv_hook

    def combine(self, expert_out: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: LowLatencyHandle, return_recv_hook: bool = False):
        """Return the experts' outputs to their tokens and sum them, weighted.

        Args:
            expert_out: [L, P*M, H] of the dtype, row for row the dispatch's ``recv_x`` (rows past
                ``recv_count`` are not read); [L, A*M, H] for a masked dispatch's handle.
            topk_idx: int64 [T, k], the ids this rank dispatched (as given to dispatch: the full
                layout's, which a masked combine maps again).
            topk_weights: [T, k] (computed in float32).
            handle: the dispatch's handle; a masked dispatch's (``handle.masked_ranks``) runs combine
                on the same masked group, whose slots of masked ranks' experts contribute 0.
            return_recv_hook: launch only the send kernel and return at once, with a hook that
                receives, as :meth:`dispatch`'s.

        Returns:
            y: [T, H] of the dtype, ``y[t] = sum_k topk_weights[t, k] * expert_out row of (t, k)``
            over kept slots, accumulated in float32 in slot order and rounded once; a token with
            no kept slot gets zeros. With ``return_recv_hook``: (y, hook), y valid once ``hook()``
            has been called, bit for bit the plain call's.

        Raises ValueError (TypeError on the rank of a wrong type) on every rank in this call, naming
        the rank: a wrong shape, dtype or handle, topk_idx other than those the handle's dispatch
        sent (a stale handle), or ranks that combine different dispatches. Called eagerly, combine
        waits for its kernels, as dispatch does. With ``return_recv_hook`` every one of them is
        raised from the hook, and the rules of :meth:`dispatch`'s hooks hold (RuntimeError for a
        call while a hook is pending or a hook called twice; the send kernel waits only for the
        peers' receive of the previous combine).

        With ``on_peer_failure="mask"``, a ``PeerFailedError`` here or in the hook masks the failed
        ranks (building the survivors' group) and is raised again: this combine's dispatch must be
        redone on the survivors (run the step again). A masked handle whose group was closed
        (:meth:`close`, or it timed out) raises ``ValueError`` on this rank.
        """
        try:
            mask = handle.masked_ranks  # (an attribute load: the plain call's one added step)
        except AttributeError:  # not a handle: refused below, with the peers
            mask = ()
        if not mask:  # the plain exchange, as without masks
            try:
                # a handle of another kind is refused with the peers (as a non-tensor info), not here alone
                res = self.comm._guarded("LowLatencyDispatcher.combine", self._x.combine, expert_out,
                                         getattr(handle, "info", handle), getattr(handle, "recv_count", None),
                                         topk_idx, topk_weights, getattr(handle, "dispatched", None), return_recv_hook)
            except PeerFailedError as e:
                if self.on_peer_failure != "mask":
                    raise
                self._masks.run("combine", (), None, failed=e, retry=False)  # masks, then raises
                raise
            if return_recv_hook:
                return res[0], self._guarded_hook("combine", res[1])
            return res
        return self._masked_combine(expert_out, topk_idx, topk_weights, handle, return_recv_hook, tuple(mask))

    def _masked_combine(self, expert_out: Any, topk_idx: Any, topk_weights: Any, handle: Any, return_recv_hook: bool,
                        mask: tuple[int, ...]):
        """:meth:`combine` of a masked dispatch's handle, on its group (a method of its own: the closure's cells
        would cost the plain combine their creation)."""
        self._x._refuse_if_pending("combine")
        # the group's dispatcher takes the handle as its own (no masks); one of another kind is refused there
        inner = replace(handle, masked_ranks=()) if isinstance(handle, LowLatencyHandle) else None

        def run(d: LowLatencyDispatcher, group: MaskedGroup | None):
            res = d.combine(expert_out, mapped(group, topk_idx), topk_weights, inner, return_recv_hook)
            if return_recv_hook:
                return res[0], self._masked_hook("combine", mask, res[1])
            return res
        return self._masks.run("combine", mask, run, build=False, retry=False)
