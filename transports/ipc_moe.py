"""The ipc transport's low-latency MoE exchange: dispatch and combine by our own kernels over a
region every rank maps (:mod:`transports.kernels.moe_ll` has the protocol).

Call path: ``moe.LowLatencyDispatcher`` -> :class:`IPCExpertExchange` (checks, outputs, launch
arguments, call words) -> ``IPCTransport.launch_exchange`` (failure checks, the watchdog's count,
the pre-bound launch; eagerly, the wait for the kernels) -> two kernels per dispatch and two per
combine. With ``return_recv_hook``, ``launch_exchange(send, finish=False)`` launches the send
kernel alone and the call's :class:`RecvHook` later ``IPCTransport.finish_exchange(recv)``: the
receive kernel, then the wait and the checks of a plain call.

Every rank raises a refused call in that same call, so the ranks never leave the exchange at
different calls. Inputs the kernels can judge only from the data (expert ids out of range or
twice in a token) go out as the sender's error word; inputs the host refuses (too many tokens, a
wrong shape or dtype) raise on their rank after its kernels have told the peers. Each receiver's
kernel records the first source's error in its status block, which ``launch_exchange`` reads
after waiting for the call's kernels: a ``ValueError`` naming the sender on every rank.

Calls pair by the kernels' counters, which count launches. A rank that skipped one (it raised
before launching) would pair its next call with its peers' last, so every call also carries a
*call word* (this exchange's call number * 2 + FP8; a combine, its handle's dispatch word) that
the receivers compare before they read any row: a difference raises on every rank, and the call
numbers jump to one past the largest, so the next call pairs again.

Receive hooks (DeepEP's ``return_recv_hook``): the send kernels never wait for this call's
receivers. ``ll_dispatch_send`` / ``ll_combine_send`` wait only for D_ACK / C_ACK of the *previous*
call (the peers' receive kernels of it, which every rank launches before its next call's send),
then write, arrive and end; so between a send and its hook the caller's work has the SMs (a send
still waits while a peer has not called the previous call's hook, as a plain call waits for a late
peer). One call is in flight per exchange: a dispatch or combine while a hook is pending raises
RuntimeError on its rank before anything is launched (it counts as a skipped call: the next pairs
by its call word); two overlapping micro-batches use two exchanges. A hooked call raises every
error of the plain call from its hook, the host's refusal of its own inputs included, since the
peers learn of it only from their receive kernels.

Under CUDA-graph capture nothing is waited for; what replays record raises at the transport's next
check and closes it (the ranks could no longer raise at one call). A send and its hook are captured
as the plain call's two kernels are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .ipc import IPCTransport, _align, input_error, pairing_error
from .kernels import layout as L

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_REGION_ALIGN = 256
_COPY_WORDS = 1024  # int32 words a program copies per step
_COUNT_CHUNK = 32  # local experts whose counts a receiving program loads at once ([MAX_RANKS, 32] int32)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def region_layout(ranks: int, num_experts: int, max_tokens: int, hidden: int, itemsize: int, max_topk: int
                  ) -> tuple[int, int, int, int, int, int]:
    """Where an exchange region holds what (:mod:`transports.kernels.moe_ll`'s layout), in bytes.

    Returns:
        (row_bytes, off_cnt, off_info, off_rows, off_comb, region_bytes): a staged row (the data, or
        FP8 bytes then scales), the offsets of the counts, info words, staged rows and combine rows,
        and the region's size.
    """
    P, M, H, KM, local = ranks, max_tokens, hidden, max_topk, num_experts // ranks
    row_bytes = _align(max(H * itemsize, H + H // 32), 16)
    off_cnt = L.LL_WORDS * 8
    off_info = off_cnt + _align(L.MAX_RANKS * local * 4, _REGION_ALIGN)
    off_rows = off_info + _align(local * P * M * 4, _REGION_ALIGN)
    off_comb = off_rows + _align(local * P * M * row_bytes, _REGION_ALIGN)
    return row_bytes, off_cnt, off_info, off_rows, off_comb, off_comb + M * KM * H * itemsize


def _usage_error(message: str) -> RuntimeError:
    """A RuntimeError raised before anything was launched: it leaves the ranks in step, so the
    communicator stays open (``collectives._shared.leaves_out_of_step`` reads ``in_step``)."""
    e = RuntimeError(message)
    e.in_step = True  # type: ignore[attr-defined]
    return e


class RecvHook:
    """The receive half of a call launched with ``return_recv_hook=True``: calling it (once) launches
    the receive kernel, then waits and raises as the plain call does; the exchange takes calls
    again once it has been called, whether it returned or raised."""

    def __init__(self, exchange: "IPCExpertExchange", op: str, finish: Callable[[], None]):
        self._exchange, self._op, self._finish = exchange, op, finish
        self.called = False

    def __call__(self) -> None:
        ex = self._exchange
        if self.called:
            raise _usage_error(f"LowLatencyDispatcher.{self._op}'s receive hook on rank "
                               f"{ex._ranks[ex.t.rank]} was called twice; a hook runs once")
        self.called = True
        try:
            self._finish()
        finally:
            ex._pending = None


@dataclass(frozen=True)
class Dispatched:
    """What a combine needs of its dispatch besides the handle's tensors: the call word, and
    topk_idx as the dispatch sent them (int64 [T, k], copied by its kernel), which the combine's
    must equal."""

    call: int
    topk_idx: torch.Tensor


class IPCExpertExchange:
    """Fixed buffers and kernels of a low-latency MoE exchange over ``transport`` (collective to
    construct: every rank passes the same sizes).

    Args:
        transport: the group's ipc transport.
        num_experts: E, a multiple of the group size (expert ``e`` lives on rank ``e // (E / P)``).
        max_tokens: M, the most tokens a rank dispatches in one call.
        hidden: H, a multiple of 128 (FP8 scales cover 128 channels).
        dtype: the tokens' and the experts' outputs' dtype (bfloat16, float16, float32).
        max_topk: the most top-k slots per token.

    Raises:
        ValueError (every rank): a size is invalid or the ranks passed different ones.
    """

    def __init__(self, transport: IPCTransport, num_experts: int, max_tokens: int, hidden: int,
                 dtype: torch.dtype = torch.bfloat16, max_topk: int = 8):
        self.t = transport
        self._k = transport._k.moe_ll
        P, me = transport.size, transport.rank
        ranks = transport.group.global_ranks
        E, M, H, KM = int(num_experts), int(max_tokens), int(hidden), int(max_topk)
        problem = ""
        if dtype not in DTYPES:
            problem = f"dtype {dtype} is not one of {[str(d) for d in DTYPES]}"
        elif E < P or E % P:
            problem = f"num_experts {E} is not a positive multiple of the group size {P}"
        elif M < 1 or KM < 1:
            problem = f"max_tokens_per_rank {M} and max_topk {KM} must be at least 1"
        elif H < 128 or H % 128:
            problem = f"hidden {H} is not a positive multiple of 128"
        mine = np.array([E, M, H, KM, DTYPES.index(dtype) if dtype in DTYPES else -1], dtype=np.int64)
        everyone = [np.frombuffer(b, dtype=np.int64)
                    for b in transport.group.rendezvous.allgather_bytes(mine.tobytes())]
        if problem:
            raise ValueError(f"LowLatencyDispatcher on rank {ranks[me]}: {problem}")
        if any((e != mine).any() for e in everyone):
            names = ("num_experts", "max_tokens_per_rank", "hidden", "max_topk", "dtype index")
            desc = "; ".join(f"rank {ranks[r]}: " + ", ".join(f"{n}={int(v)}" for n, v in zip(names, e))
                             for r, e in enumerate(everyone))
            raise ValueError(f"LowLatencyDispatcher: the ranks' arguments differ ({desc})")
        self.num_experts, self.max_tokens, self.hidden, self.dtype, self.max_topk = E, M, H, dtype, KM
        self.local = E // P
        item = dtype.itemsize
        self.row_bytes, off_cnt, off_info, off_rows, off_comb, self.region_bytes = region_layout(P, E, M, H, item, KM)
        self.table = transport.peer_region(self.region_bytes)
        self.device = transport._device
        cb = math.gcd(H, 1024)  # channels per step: a power of two >= 128 that divides H
        rows = {"E": E, "M": M, "RB": self.row_bytes, "OFF_CNT": off_cnt, "OFF_INFO": off_info, "OFF_ROWS": off_rows}
        self._send_const = {**rows, "KM": KM, "H": H, "TB": _pow2(M), "KB": _pow2(KM), "NB": _pow2(M * KM),
                            "CB": cb, "ITEM": item}
        self._recv_const = {**rows, "WB": _COPY_WORDS}
        self._csend_const = {"E": E, "M": M, "KM": KM, "W": H * item // 4, "OFF_COMB": off_comb, "WB": _COPY_WORDS,
                             "NB": _pow2(M * KM)}
        self._crecv_const = {"KM": KM, "H": H, "OFF_COMB": off_comb, "CB": cb, "OUT_BF16": dtype == torch.bfloat16}
        lc = min(_pow2(self.local), _COUNT_CHUNK)
        self._recv_const["LC"] = self._csend_const["LC"] = lc
        self._next_call = 0  # this exchange's dispatch calls so far (the call words' number)
        self.last: Dispatched | None = None  # the last dispatch, for a combine given none
        self._pending: str | None = None  # the op whose receive hook is not called yet
        self._dummy_x = torch.zeros(1, H, dtype=dtype, device=self.device)
        self._dummy_idx = torch.full((1, 1), -1, dtype=torch.int64, device=self.device)
        self._no_words = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._no_count = torch.zeros(1, dtype=torch.int32, device=self.device)  # a refused combine reads none
        self._no_weights = torch.zeros(1, 1, dtype=torch.float32, device=self.device)

    @property
    def _ranks(self) -> list[int]:
        return self.t.group.global_ranks

    def _refuse_if_pending(self, op: str) -> None:
        """RuntimeError (this rank, nothing launched) while a call's receive hook is pending."""
        if self._pending is not None:
            raise _usage_error(
                f"LowLatencyDispatcher.{op} on rank {self._ranks[self.t.rank]}: the {self._pending} launched "
                "with return_recv_hook=True has not had its hook called; one call is in flight per dispatcher: "
                "call the hook first (two overlapping micro-batches use two dispatchers)")

    def _hook(self, op: str, finish: Callable[[], None]) -> RecvHook:
        self._pending = op
        return RecvHook(self, op, finish)

    # ---- dispatch ------------------------------------------------------------------------------
    def _refusal(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[int, str, type]:
        """(error word, message, exception type) for inputs the host refuses; (0, "", None) if none."""
        me = self._ranks[self.t.rank]
        where = f"LowLatencyDispatcher.dispatch on rank {me}"
        if not isinstance(x, torch.Tensor) or not isinstance(topk_idx, torch.Tensor):
            return L.INPUT_BAD_SHAPE, f"{where}: x and topk_idx must be tensors", TypeError
        if x.dtype != self.dtype:
            return L.INPUT_BAD_SHAPE, f"{where}: x is {x.dtype}, the dispatcher's dtype is {self.dtype}", TypeError
        if topk_idx.dtype not in (torch.int64, torch.int32):
            return L.INPUT_BAD_SHAPE, f"{where}: topk_idx must be int64 (or int32), not {topk_idx.dtype}", TypeError
        if x.dim() != 2 or x.shape[1] != self.hidden:
            return L.INPUT_BAD_SHAPE, f"{where}: x must be [T, {self.hidden}], got {list(x.shape)}", ValueError
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or not 1 <= topk_idx.shape[1] <= self.max_topk:
            return (L.INPUT_BAD_SHAPE, (f"{where}: topk_idx must be [T={x.shape[0]}, k] with 1 <= k <= "
                                        f"max_topk {self.max_topk}, got {list(topk_idx.shape)}"), ValueError)
        if x.device != self.device or topk_idx.device != self.device:
            return L.INPUT_BAD_SHAPE, f"{where}: tensors must be on {self.device}", ValueError
        if x.shape[0] > self.max_tokens:
            return (L.INPUT_TOO_MANY_TOKENS + 256 * x.shape[0], (f"{where}: {x.shape[0]} tokens, "
                    f"more than max_tokens_per_rank {self.max_tokens}"), ValueError)
        return 0, "", None

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool = False,
                 return_recv_hook: bool = False) -> tuple:
        """Send every token to its top-k experts' ranks; see ``moe.LowLatencyDispatcher.dispatch``.

        Returns:
            (recv_x, scales, info, recv_count): recv_x [L, P*M, H] of the dtype (float8_e4m3fn
            with ``use_fp8``), scales float32 [L, P*M, H/128] with ``use_fp8`` else None, info
            int32 [L, P*M] (``src*M*max_topk + t*max_topk + k`` of each row), recv_count int32 [L].
            :attr:`last` is then this call's :class:`Dispatched` (for :meth:`combine`). With
            ``return_recv_hook``: the same and a :class:`RecvHook` after them, the send kernel
            alone launched; the tensors are written once the hook has been called.

        Raises:
            ValueError / TypeError (every rank, in this call; from the hook with
                ``return_recv_hook``): a rank's inputs were refused, or the ranks' calls do not
                pair (see the module docstring).
            RuntimeError (this rank, nothing launched): a receive hook is pending.
        """
        t = self.t
        call = self._next_call * 2 + int(bool(use_fp8))
        self._next_call += 1  # also when the launch raises: a skipped call must not pair
        self._refuse_if_pending("dispatch")
        P, M, H, Lc = t.size, self.max_tokens, self.hidden, self.local
        err, message, exc = self._refusal(x, topk_idx)
        if err:
            x, topk_idx = self._dummy_x, self._dummy_idx
            T = K = 0
        else:
            x = x.contiguous()
            topk_idx = topk_idx.to(torch.int64).contiguous()
            T, K = topk_idx.shape
        rows = (Lc, P * M)
        if use_fp8:
            recv_x = torch.empty(*rows, H, dtype=torch.float8_e4m3fn, device=self.device)
            scales = torch.empty(*rows, H // 128, dtype=torch.float32, device=self.device)
            out, out2, w1, w2 = recv_x.view(torch.int32), scales.view(torch.int32), H // 4, H // 128
        else:
            recv_x, scales = torch.empty(*rows, H, dtype=self.dtype, device=self.device), None
            out, out2, w1, w2 = recv_x.view(torch.int32), self._no_words, H * self.dtype.itemsize // 4, 0
        info = torch.empty(rows, dtype=torch.int32, device=self.device)
        recv_count = torch.empty(Lc, dtype=torch.int32, device=self.device)
        saved = torch.empty(T, K, dtype=torch.int64, device=self.device) if not err else self._dummy_idx
        send = (self._k.ll_dispatch_send, (x, topk_idx, saved, T, K, err, self.table, t.rank, P, call),
                {**self._send_const, "FP8": bool(use_fp8)})
        recv = (self._k.ll_dispatch_recv, (out, out2, info, recv_count, self.table, t.rank, P, call),
                {**self._recv_const, "W1": w1, "W2": w2})
        own = exc(message) if err else None
        if return_recv_hook:
            t.launch_exchange(send, finish=False)
            self.last = Dispatched(call, saved) if not err else None
            hook = self._hook("dispatch", lambda: self._raise_recorded(t.finish_exchange(recv), "dispatch", call, own))
            return recv_x, scales, info, recv_count, hook
        recorded = t.launch_exchange(send, recv)
        self.last = Dispatched(call, saved) if not err else None
        self._raise_recorded(recorded, "dispatch", call, own)
        return recv_x, scales, info, recv_count

    def _raise_recorded(self, recorded: tuple[int, int, int, int] | None, op: str, call: int,
                        own: Exception | None = None) -> None:
        """Raise this call's error: ``own`` (the host refused our inputs), else what the kernels
        recorded (``launch_exchange``'s words: a source's refused input, a source whose call word
        differs). After a difference the call numbers move past every rank's, so the next pairs."""
        t = self.t
        if recorded is None:  # captured: nothing was waited for
            if own is not None:
                raise own
            return
        bad_input, pairing, their_word, top = recorded
        if pairing and op == "dispatch":
            self._next_call = max(self._next_call, (top >> 1) + 1)
        if own is not None:
            raise own
        if pairing:
            raise ValueError(pairing_error(op, pairing - 1, their_word, call, self._ranks, t.rank))
        if bad_input:
            raise ValueError(input_error(bad_input, self._ranks, self._ranks[t.rank], self.max_tokens, op))

    # ---- combine -------------------------------------------------------------------------------
    def _combine_refusal(self, expert_out: Any, info: Any, recv_count: Any, topk_idx: Any, topk_weights: Any,
                         dispatched: Dispatched | None) -> tuple[int, str, type]:
        """(error word, message, exception type) for combine inputs the host refuses; (0, "", None)."""
        P, M, H, Lc = self.t.size, self.max_tokens, self.hidden, self.local
        where = f"LowLatencyDispatcher.combine on rank {self._ranks[self.t.rank]}"
        bad = L.INPUT_BAD_SHAPE
        if dispatched is None:
            return bad, f"{where}: no dispatch to combine (none yet, or the last one raised)", ValueError
        if not all(isinstance(a, torch.Tensor) for a in (expert_out, info, recv_count, topk_idx, topk_weights)):
            return bad, f"{where}: expert_out, the handle's tensors, topk_idx and topk_weights must be tensors", TypeError
        if expert_out.dtype != self.dtype:
            return bad, f"{where}: expert_out is {expert_out.dtype}, the dispatcher's dtype is {self.dtype}", TypeError
        if tuple(expert_out.shape) != (Lc, P * M, H):
            return bad, f"{where}: expert_out must be [{Lc}, {P * M}, {H}], got {list(expert_out.shape)}", ValueError
        if topk_idx.dtype not in (torch.int64, torch.int32) or not topk_weights.dtype.is_floating_point:
            return (bad, f"{where}: topk_idx must be int64 (or int32) and topk_weights floating, got "
                         f"{topk_idx.dtype} and {topk_weights.dtype}", TypeError)
        if tuple(topk_idx.shape) != tuple(dispatched.topk_idx.shape) or topk_weights.shape != topk_idx.shape:
            return (bad, f"{where}: topk_idx and topk_weights must be {list(dispatched.topk_idx.shape)} as the "
                         f"handle's dispatch's topk_idx, got {list(topk_idx.shape)} and {list(topk_weights.shape)}",
                    ValueError)
        if tuple(info.shape) != (Lc, P * M) or tuple(recv_count.shape) != (Lc,) or \
                info.dtype != torch.int32 or recv_count.dtype != torch.int32:
            return bad, f"{where}: the handle's info / recv_count are not this dispatcher's", ValueError
        if any(a.device != self.device for a in (expert_out, info, recv_count, topk_idx, topk_weights)):
            return bad, f"{where}: tensors must be on {self.device}", ValueError
        return 0, "", None

    def combine(self, expert_out: torch.Tensor, info: torch.Tensor, recv_count: torch.Tensor,
                topk_idx: torch.Tensor, topk_weights: torch.Tensor, dispatched: Dispatched | None = None,
                return_recv_hook: bool = False) -> torch.Tensor | tuple[torch.Tensor, RecvHook]:
        """Return each expert's rows to their tokens and sum them; see ``moe.LowLatencyDispatcher.combine``.

        dispatched: the dispatch whose ``info``/``recv_count`` these are (default :attr:`last`);
        every rank must combine the same dispatch's, with the ``topk_idx`` it sent.

        Returns:
            [T, H] of the dtype; with ``return_recv_hook`` (y, :class:`RecvHook`), the send kernel
            alone launched, y written once the hook has been called.

        Raises:
            ValueError / TypeError (every rank, in this call; from the hook with
                ``return_recv_hook``): a rank's inputs were refused (by its host, or by its kernel:
                topk_idx that differ from the dispatch's, a stale handle), or the ranks combined
                different dispatches.
            RuntimeError (this rank, nothing launched): a receive hook is pending.
        """
        self._refuse_if_pending("combine")
        t = self.t
        P, H = t.size, self.hidden
        dispatched = self.last if dispatched is None else dispatched
        err, message, exc = self._combine_refusal(expert_out, info, recv_count, topk_idx, topk_weights, dispatched)
        if err:
            # nothing of ours goes out but the error word: the peers raise with us, in this call
            call = dispatched.call if dispatched is not None else -2
            y, info, recv_count = self._no_words, self._no_count, self._no_count
            idx = saved = self._dummy_idx
            w, T, K = self._no_weights, 0, 0
            out = self._dummy_x
        else:
            call, saved = dispatched.call, dispatched.topk_idx
            T, K = topk_idx.shape
            y = expert_out.contiguous().view(torch.int32)
            idx = topk_idx.to(torch.int64).contiguous()
            w = topk_weights.to(torch.float32).contiguous()
            out = torch.empty(T, H, dtype=self.dtype, device=self.device)
        send = (self._k.ll_combine_send, (y, info, recv_count, idx, saved, T, K, err, self.table, t.rank, P, call),
                self._csend_const)
        recv = (self._k.ll_combine_recv, (out, idx, w, T, K, self.table, t.rank, P, call), self._crecv_const)
        own = exc(message) if err else None
        if return_recv_hook:
            t.launch_exchange(send, finish=False)
            hook = self._hook("combine", lambda: self._raise_recorded(t.finish_exchange(recv), "combine", call, own))
            return out, hook
        self._raise_recorded(t.launch_exchange(send, recv), "combine", call, own)
        return out
