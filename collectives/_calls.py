"""How the Communicator turns a call into a transport call: the validated and cached description of a
call (:class:`_Entry`), the latency path of repeated calls, and the general path.

A mixin of :class:`collectives.communicator.Communicator` (it uses the communicator's caches, its
transport selection and its collective error path); split out because it is one responsibility:
checking a call once, remembering what was decided, and taking the shortest safe way on the next.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch

from transports.base import F_VIEW, SUPPORTED_DTYPES, OpCode, ReduceOp, Signature, Transport, view_code

from ._arrays import SUPPORTED_NAMES, Array, as_tensor, device_of, dtype_device, overlaps, write_out, writable_view

_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class _Entry(NamedTuple):
    transport: Transport
    sig: Signature
    rop: ReduceOp | None
    out_shape: tuple[int, ...]  # a plain tuple: torch.empty/new_empty parse one ~0.4 us faster than a torch.Size
    staged: bool  # device tensors copied through host memory (no transport for that device)
    call: Callable[..., Any]  # the transport's bound method for the collective (the hot path's dispatch)
    # x.data_ptr() - out.data_ptr() at which the transport takes an aliased out directly (nccl-tests'
    # in-place layouts: all_gather's x is this rank's block of out; reduce_scatter's out is this
    # rank's block of x); None: any overlap goes through a temporary
    alias_offset: int | None
    x_nbytes: int
    out_nbytes: int
    # host calls: the transport's call(x_addr, out_addr) for this argument set (Transport.latency_call),
    # or None (then `call` on tensors)
    by_address: Callable[[int, int], None] | None


class CallPaths:
    """Call preparation of the Communicator (see the module docstring)."""

    def _entry(self, opcode: OpCode, t: torch.Tensor, op: Any, src: int, view: int = 0) -> _Entry:
        """Validated, cached description of a call (transport, signature, output shape).

        view: the signature's ``F_VIEW`` word (:meth:`call_as`); 0 for the Communicator's own calls.
        """
        shape = t.shape[1:] if opcode == OpCode.ALL_TO_ALL else t.shape
        key = (opcode, shape, t.dtype, t.device, op, src) if not view else (opcode, shape, t.dtype, t.device, op, src,
                                                                              view)
        ent = self._cache.get(key)
        if ent is not None:
            return ent
        name = opcode.name.lower()
        device = t.device.type
        me = self.global_ranks[self.rank]
        rop = None
        try:
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{name}: dtype {t.dtype} is not supported; use one of {SUPPORTED_NAMES}")
            if opcode in (OpCode.ALL_REDUCE, OpCode.REDUCE_SCATTER):
                rop = ReduceOp.parse(op)
                if t.dtype == torch.bool and rop not in (ReduceOp.MAX, ReduceOp.MIN):
                    raise TypeError(f"{name}: op {op!r} is not defined for bool; use 'max' (any) or 'min' (all)")
                if rop == ReduceOp.AVG and t.dtype not in _FLOATS:
                    raise TypeError(f"{name}: op 'avg' needs a floating dtype, got {t.dtype}; use op='sum' and divide")
            if opcode in (OpCode.REDUCE_SCATTER, OpCode.ALL_TO_ALL) and t.dim() == 0:
                raise ValueError(f"{name}: x needs at least 1 dim (rows); rank {me} passed a 0-d tensor")
            if opcode == OpCode.REDUCE_SCATTER and t.shape[0] % self.size:
                raise ValueError(f"reduce_scatter: x.shape[0] must be divisible by the group size {self.size}; "
                                 f"rank {me} passed shape {tuple(t.shape)}")
            if opcode == OpCode.BROADCAST and not 0 <= src < self.size:
                raise ValueError(f"broadcast: src={src} is not a rank of this group of size {self.size}")
            if device == "cuda" and self.device.type == "cuda" and t.device != self.device:
                raise ValueError(f"{name}: rank {me} passed a tensor on {t.device}, but its communicator is bound "
                                 f"to {self.device}; move it there (x.to(comm.device)) or create the "
                                 f"communicator with device={str(t.device)!r}")
        except (TypeError, ValueError) as e:
            self._fail_locally(opcode, device, e)
        nbytes = t.numel() * t.element_size()
        tr, plan = self._select(opcode, device, nbytes, t.dtype, name)
        if opcode == OpCode.ALL_GATHER:
            out_shape = (self.size * (t.shape[0] if t.dim() else 1), *t.shape[1:])
        elif opcode == OpCode.REDUCE_SCATTER:
            out_shape = (t.shape[0] // self.size, *t.shape[1:])
        else:
            out_shape = tuple(t.shape)
        sig = Signature.of(opcode, dtype=t.dtype, shape=t.shape if t.dim() or opcode != OpCode.ALL_GATHER else (1,),
                           op=rop, root=src if opcode in (OpCode.BROADCAST, OpCode.ALL_TO_ALL, OpCode.ALL_REDUCE) else 0,
                           compare_first_dim=opcode != OpCode.ALL_TO_ALL)
        if view:
            sig.meta[F_VIEW] = view
            sig = Signature(sig.meta)
        call = {OpCode.ALL_REDUCE: tr.all_reduce, OpCode.ALL_GATHER: tr.all_gather,
                OpCode.REDUCE_SCATTER: tr.reduce_scatter, OpCode.BROADCAST: tr.broadcast,
                OpCode.ALL_TO_ALL: tr.all_to_all}[opcode]
        alias = None
        if tr.takes_rank_block_alias and opcode in (OpCode.ALL_GATHER, OpCode.REDUCE_SCATTER):
            block = nbytes if opcode == OpCode.ALL_GATHER else nbytes // self.size
            alias = self.rank * block * (1 if opcode == OpCode.ALL_GATHER else -1)
        staged = device not in tr.devices
        out_nbytes = math.prod(out_shape) * t.element_size()
        by_address = tr.latency_call(opcode, t.numel(), t.dtype, rop, sig) if not staged and not view and \
            opcode in (OpCode.ALL_REDUCE, OpCode.ALL_GATHER, OpCode.REDUCE_SCATTER) else None
        ent = _Entry(tr, sig, rop, out_shape, staged, call, alias, nbytes, out_nbytes, by_address)
        if len(self._cache) > 512:
            self._forget_calls()
        self._cache[key] = ent
        if device == "cpu" and not ent.staged and not view:  # the latency path serves plain calls only
            self._cpu_cache[(opcode, shape, t.dtype, op, src)] = ent
        return ent

    def _forget_calls(self) -> None:
        """Drop every cached call: the entries and the latency paths' views of them."""
        self._cache.clear()
        self._cpu_cache.clear()
        self._a2a_plans.clear()
        self._inplace_scratch = None

    def _input(self, opcode: OpCode, x: Array) -> tuple[torch.Tensor, bool, torch.Tensor]:
        try:
            return as_tensor(x)
        except TypeError as e:
            self._fail_locally(opcode, device_of(x), TypeError(f"{opcode.name.lower()}: {e}"))

    def _out_view(self, opcode: OpCode, out: Array, t: torch.Tensor, ent: _Entry | None = None
                  ) -> torch.Tensor | None:
        """A tensor view of ``out=`` for the transport to write (None: a NumPy array torch cannot
        view, e.g. with negative strides; the result is copied into it), or a collective TypeError.
        ent: the call's entry, where known (the peers' call is then met where it meets)."""
        try:
            return writable_view(out, f"{opcode.name.lower()}: out")
        except TypeError as e:
            self._fail_locally(opcode, t.device.type, e, call=(ent, t, None) if ent is not None else None)

    def _check_out(self, opcode: OpCode, out: Array, t: torch.Tensor, shape: Sequence[int], ent: _Entry | None = None
                   ) -> torch.Tensor | None:
        """:meth:`_out_view` after checking ``out``'s shape, dtype and device (collective errors)."""
        out_t = self._out_view(opcode, out, t, ent)
        name = opcode.name.lower()
        dtype, device = dtype_device(out, out_t)
        call = (ent, t, None) if ent is not None else None
        if tuple(out.shape) != tuple(shape) or dtype != t.dtype:
            self._fail_locally(opcode, t.device.type, ValueError(
                f"{name}: out has shape {tuple(out.shape)} and dtype {dtype}; "
                f"expected shape {tuple(shape)} and dtype {t.dtype}"), call=call)
        if device != t.device:
            self._fail_locally(opcode, t.device.type, ValueError(
                f"{name}: out is on {device} but the input is on {t.device}; put both on one device"), call=call)
        return out_t

    def _hot(self, opcode: OpCode, x: Array, op: Any, out: Array | None, in_place_ok: bool
             ) -> tuple[_Entry, torch.Tensor, int, int] | None:
        """(entry, tensor to write, x's address, its address) for a repeated call on a plain
        contiguous tensor, else None (the addresses are 0 off the host unless the entry has a
        ``by_address`` call: the ipc transport's pre-bound launch).

        The latency path: a cache hit skips validation (done when the entry was made) and every
        conversion; anything unusual (NumPy, strides, grads, sparse, odd ``out``) takes :meth:`_run`.
        ``out`` is written directly when it is a plain contiguous tensor of the output's shape, dtype
        and device that does not overlap ``x``, or is ``x`` itself (``in_place_ok``), or aliases it as
        the transport allows (``alias_offset``). The checks are inline: each call and attribute
        costs ~50-100 ns, against ~2 us for a whole small collective.
        """
        try:
            if type(x) is not torch.Tensor or x.requires_grad or not x.is_contiguous():
                return None
            if x.is_cpu:  # no torch.device objects on the host path (~0.2 us of the ~2 us of a call)
                ent = self._cpu_cache.get((opcode, x.shape, x.dtype, op, 0))
                if ent is None:
                    return None
                if out is None:  # empty_like: ~0.6 us, against ~1 us for new_empty and ~1.5 for torch.empty
                    res = torch.empty_like(x) if opcode is OpCode.ALL_REDUCE else x.new_empty(ent.out_shape)
                    return ent, res, x.data_ptr(), res.data_ptr()
                if type(out) is not torch.Tensor or out.dtype is not x.dtype or out.shape != ent.out_shape \
                        or out.requires_grad or not out.is_contiguous() or not out.is_cpu:
                    return None
            else:
                device = x.device
                ent = self._cache.get((opcode, x.shape, x.dtype, device, op, 0))
                if ent is None or ent.staged:
                    return None
                if out is None:
                    res = torch.empty_like(x) if opcode is OpCode.ALL_REDUCE else x.new_empty(ent.out_shape)
                    if ent.by_address is None:
                        return ent, res, 0, 0
                    return ent, res, x.data_ptr(), res.data_ptr()
                if type(out) is not torch.Tensor or out.dtype is not x.dtype or out.shape != ent.out_shape \
                        or out.requires_grad or not out.is_contiguous() or out.device != device:
                    return None
            o0, x0 = out.data_ptr(), x.data_ptr()
            if (in_place_ok and o0 == x0) or o0 + ent.out_nbytes <= x0 or x0 + ent.x_nbytes <= o0 \
                    or (ent.alias_offset is not None and x0 - o0 == ent.alias_offset):
                return ent, out, x0, o0
        except RuntimeError:  # e.g. is_contiguous() of a sparse CSR tensor; _run says what is wrong
            pass
        return None

    def call_as(self, collective: str, x: torch.Tensor, *, op: str = "sum", root: int = 0, dtype: torch.dtype | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """all_reduce, reduce_scatter, all_gather or broadcast of ``x`` for a caller whose own call is
        another:
        ``collective="reduce"`` (an all_reduce whose result only ``root`` keeps: ``root`` joins the
        signature, so ranks that pass different roots raise ``ValueError`` naming them), and
        ``dtype=`` the caller's dtype when ``x`` is its bytes (uint8), so that ranks whose tensors
        only look alike as bytes (int16[4], int8[8]) raise too. For the torch backend.

        Args:
            collective: "reduce" (x reduced with ``op``), "all_reduce", "reduce_scatter", "all_gather"
                or "broadcast" (from group rank ``root``).
            x: the tensor that moves, as for that Communicator call.
            dtype: the caller's dtype of which ``x`` holds the bytes (its shape's last dim is the
                caller's times the element size), or None.
            out: as for the Communicator call.

        Returns:
            What the Communicator call returns (``out`` when given).
        """
        opcode = {"reduce": OpCode.ALL_REDUCE, "all_reduce": OpCode.ALL_REDUCE,
                  "reduce_scatter": OpCode.REDUCE_SCATTER, "all_gather": OpCode.ALL_GATHER,
                  "broadcast": OpCode.BROADCAST}[collective]
        view = view_code(OpCode.REDUCE if collective == "reduce" else None, dtype)
        reduces = opcode in (OpCode.ALL_REDUCE, OpCode.REDUCE_SCATTER)
        if reduces and collective != "reduce":
            root = 0
        return self._guarded(collective, self._run, opcode, x, out, op if reduces else None,
                             root if opcode != OpCode.ALL_GATHER else 0, view)

    def _run(self, opcode: OpCode, x: Array, out: Array | None, op: Any = None, src: int = 0, view: int = 0) -> Array:
        """General path: any input kind, out= of any layout, host staging. Same semantics as the fast paths."""
        if self._state.closed is not None:
            self._state.raise_closed()
        t, was_numpy, orig = self._input(opcode, x)
        ent = self._entry(opcode, t, op, src, view)
        out_t = self._check_out(opcode, out, t, ent.out_shape, ent) if out is not None else None
        s = t.cpu() if ent.staged else t
        if t.dim() == 0 and opcode == OpCode.ALL_GATHER:
            s = s.reshape(1)
        in_place_ok = opcode in (OpCode.ALL_REDUCE, OpCode.BROADCAST)
        if out_t is not None and not ent.staged and out_t.is_contiguous() and (
                not overlaps(out_t, orig) or (in_place_ok and out_t.data_ptr() == s.data_ptr()
                                               and out_t.shape == s.shape)
                or (ent.alias_offset is not None and s.is_contiguous() and orig.data_ptr() == s.data_ptr()
                    and s.data_ptr() - out_t.data_ptr() == ent.alias_offset)):
            res = out_t
        else:
            res = torch.empty(ent.out_shape, dtype=t.dtype, device=s.device)
        tr = ent.transport
        if opcode == OpCode.ALL_REDUCE:
            tr.all_reduce(s, res, ent.rop, ent.sig)
        elif opcode == OpCode.ALL_GATHER:
            tr.all_gather(s, res, ent.sig)
        elif opcode == OpCode.REDUCE_SCATTER:
            tr.reduce_scatter(s, res, ent.rop, ent.sig)
        elif opcode == OpCode.BROADCAST:
            tr.broadcast(s, res, src, ent.sig)
        if res.device != t.device:
            res = res.to(t.device)
        if out is not None:
            write_out(out, out_t, res)
            return out
        return res.numpy() if was_numpy else res
