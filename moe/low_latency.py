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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from transports.ipc_moe import Dispatched, IPCExpertExchange, RecvHook


@dataclass(frozen=True)
class LowLatencyHandle:
    """What :meth:`LowLatencyDispatcher.combine` needs from its dispatch.

    info: int32 [L, P*M], per received row ``src * M * max_topk + t * max_topk + k`` (its source
    rank, token and slot); recv_count: int32 [L], the valid rows per local expert; dispatched:
    the dispatch's call word (which the combine's peers compare with theirs) and the topk_idx it
    sent (which the combine's must equal).
    """

    info: torch.Tensor
    recv_count: torch.Tensor
    dispatched: Dispatched


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

    Raises:
        RuntimeError: the communicator has no ipc transport (several nodes, no CUDA/triton/cupy),
            with the reason.
        ValueError (every rank): invalid sizes, or ranks that passed different ones.

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
                 dtype: torch.dtype = torch.bfloat16, max_topk: int = 8):
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
        self.comm = comm
        self._x = comm._guarded("LowLatencyDispatcher", IPCExpertExchange, transport, num_experts,
                                max_tokens_per_rank, hidden, dtype, max_topk)
        self.num_experts, self.max_tokens_per_rank, self.hidden = num_experts, max_tokens_per_rank, hidden
        self.dtype, self.max_topk = dtype, max_topk
        self.num_local_experts = num_experts // comm.size

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool = False,
                 return_recv_hook: bool = False):
        """Send each token to the ranks of its top-k experts.

        Args:
            x: [T, H] of the dispatcher's dtype, T <= M (T may change between calls).
            topk_idx: int64 [T, k] expert ids, -1 for an unused slot; k <= max_topk; no expert twice
                in one token.
            use_fp8: send float8 e4m3 with one float32 scale per 128 channels (amax / 448).
            return_recv_hook: launch only the send kernel and return at once, with a hook that
                receives (see below).

        Returns:
            (recv_x, recv_count, handle): recv_x [L, P*M, H] of the dtype, or with ``use_fp8`` the
            pair (q float8_e4m3fn [L, P*M, H], scales float32 [L, P*M, H/128]); recv_count int32
            [L] on the device, the valid rows of each local expert, which come first, ordered by
            source rank, then token (rows past the count are unspecified); handle for
            :meth:`combine`. New tensors per call. With ``return_recv_hook``: (recv_x, recv_count,
            handle, hook), the same outputs, valid (the handle's tensors too) once ``hook()`` has
            been called; bit for bit the plain call's.

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
        are, nothing waited for.
        """
        res = self.comm._guarded("LowLatencyDispatcher.dispatch", self._x.dispatch, x, topk_idx, use_fp8,
                                 return_recv_hook)
        recv_x, scales, info, recv_count = res[:4]
        out = (recv_x, scales) if use_fp8 else recv_x
        handle = LowLatencyHandle(info, recv_count, self._x.last)
        if return_recv_hook:
            return out, recv_count, handle, self._guarded_hook("dispatch", res[4])
        return out, recv_count, handle

    def _guarded_hook(self, op: str, hook: RecvHook) -> Callable[[], None]:
        """``hook`` as a call of the communicator (one call in flight, as every call is)."""
        def recv_hook() -> None:
            self.comm._guarded(f"LowLatencyDispatcher.{op}'s receive hook", hook)
        return recv_hook

    def combine(self, expert_out: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                handle: LowLatencyHandle, return_recv_hook: bool = False):
        """Return the experts' outputs to their tokens and sum them, weighted.

        Args:
            expert_out: [L, P*M, H] of the dtype, row for row the dispatch's ``recv_x`` (rows past
                ``recv_count`` are not read).
            topk_idx: int64 [T, k], the ids this rank dispatched.
            topk_weights: [T, k] (computed in float32).
            handle: the dispatch's handle.
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
        """
        # a handle of another kind is refused with the peers (as a non-tensor info), not here alone
        res = self.comm._guarded("LowLatencyDispatcher.combine", self._x.combine, expert_out,
                                 getattr(handle, "info", handle), getattr(handle, "recv_count", None), topk_idx,
                                 topk_weights, getattr(handle, "dispatched", None), return_recv_hook)
        if return_recv_hook:
            return res[0], self._guarded_hook("combine", res[1])
        return res
