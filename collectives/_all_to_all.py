"""The implementation of :meth:`Communicator.all_to_all`: its latency path for repeated calls, the
fully checked general path, and the checks of its counts.

Functions of a communicator, kept apart from communicator.py because uneven all-to-all has most of
the argument handling. What they need of the communicator is :class:`AllToAllHost` (the group, its
call machinery, two slots kept for this module); this module does not import communicator.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn, Protocol

import numpy as np
import torch

from transports.base import OpCode, Signature, Transport

from ._arrays import Array, as_int, dtype_device, overlaps, write_out


class CallEntry(Protocol):
    """What this module reads of a cached call (``collectives._calls._Entry`` is one)."""

    @property
    def transport(self) -> Transport: ...  # the transport that serves the call

    @property
    def sig(self) -> Signature: ...  # the call's signature, checked against the peers'

    @property
    def staged(self) -> bool: ...  # device tensors go through host memory (no latency path)

    @property
    def call(self) -> Callable[..., Any]: ...  # the transport's bound all_to_all


class AllToAllHost(Protocol):
    """What this module needs of its communicator; :class:`collectives.Communicator` is one.

    The group; the communicator's call machinery (collectives/_calls.py: the cached entry of a call,
    its checked input, ``out=`` view and collective error path); and two slots the communicator keeps
    for this module and empties whenever it drops its cached calls (``_forget_calls``), so that no
    plan outlives its entry. The latency path reads the slots and the group as plain attributes.
    Nothing else of the communicator is used here.
    """

    rank: int
    size: int

    @property
    def global_ranks(self) -> Sequence[int]: ...  # the world rank of each group rank, for messages

    # the latency path's plans of CPU calls, by (x.shape, x.dtype, recv_counts given: 0/1)
    _a2a_plans: dict[tuple[torch.Size, torch.dtype, int], _Plan]
    # an in-place call's kept host copy of x: (uint8 buffer, shape, dtype, view of that shape), or None
    _inplace_scratch: tuple[torch.Tensor, torch.Size, torch.dtype, torch.Tensor] | None

    def _a2a_entry(self, x: torch.Tensor, rest: torch.Size, recv_given: int) -> CallEntry | None:
        """The cached entry of an all_to_all of ``x`` (``rest``: its ``shape[1:]``; recv_counts given:
        1, else 0), or None; not validated (a miss takes :func:`all_to_all_checked`, which makes it)."""
        ...

    def _input(self, opcode: OpCode, x: Array) -> tuple[torch.Tensor, bool, torch.Tensor]:
        """``(tensor, was NumPy, original as a tensor)`` of the input, or a collective TypeError."""
        ...

    def _entry(self, opcode: OpCode, t: torch.Tensor, op: Any, src: int) -> CallEntry:
        """The validated, cached entry of the call (collective TypeError/ValueError)."""
        ...

    def _out_view(self, opcode: OpCode, out: Array, t: torch.Tensor) -> torch.Tensor | None:
        """A writable tensor view of ``out=`` (None: copied into), or a collective TypeError."""
        ...

    def _fail_locally(self, opcode: OpCode, device: str, err: Exception) -> NoReturn:
        """Tell the peers this rank rejected its input (they raise ValueError), then raise ``err``."""
        ...


class _Plan(NamedTuple):
    """What the latency path needs of a repeated all_to_all, from its cached entry and x's shape."""
    ent: CallEntry
    even: list[int] | None  # the send counts of an even split (None: rows not divisible by the group size)
    row_numel: int
    rest: torch.Size  # x.shape[1:]
    shaped: bool  # the transport takes [rows, *rest] tensors (else flat views)
    takes_into: bool
    # host calls of the even split: the transport's call by addresses (Transport.latency_all_to_all), or None
    even_by_address: Any
    # out=x on the host: the transport exchanges in place itself (Transport.takes_in_place_all_to_all)
    in_place_native: bool


def _plan(comm: AllToAllHost, x: torch.Tensor, recv_given: int) -> _Plan | None:
    rest = x.shape[1:]
    ent = comm._a2a_entry(x, rest, recv_given)
    if ent is None or ent.staged:
        return None
    n, rows = comm.size, x.shape[0]
    tr = ent.transport
    even = None if rows % n else [rows // n] * n
    row_numel = math.prod(rest)
    by_address = tr.latency_all_to_all(even, row_numel * x.element_size(), x.nbytes, ent.sig) \
        if x.is_cpu and even is not None and tr.takes_into else None
    in_place_native = x.is_cpu and tr.takes_into and tr.takes_in_place_all_to_all(x.nbytes)
    return _Plan(ent, even, row_numel, rest, tr.takes_shaped_rows, tr.takes_into, by_address, in_place_native)


# In-place all_to_all (out is x) sends from a copy of x while out is overwritten (MPI_IN_PLACE does the
# same), unless the transport exchanges in place itself (shm with single copy: a swap of blocks). On
# the host that copy lives in a buffer kept between calls up to this many bytes: a fresh
# allocation faults its pages in on every call (32 MiB: 18-22 ms a call against MPICH's 3.7-4.6 ms,
# benchmarks/results/issue16-acceptance.md). Larger copies are made afresh rather than held for good.
INPLACE_SCRATCH_MAX_BYTES = 256 << 20


def _inplace_copy(comm: AllToAllHost, x: torch.Tensor) -> torch.Tensor:
    """A copy of the CPU tensor x (same shape and dtype) in ``comm``'s kept scratch buffer; the view of
    the last shape is kept too (two dtype/shape views cost ~2 us, a whole small exchange ~3)."""
    kept = comm._inplace_scratch  # (uint8 buffer, shape, dtype, view of that shape) or None
    if kept is not None and kept[1] == x.shape and kept[2] is x.dtype:
        copy = kept[3]
    else:
        nbytes = x.nbytes
        if nbytes > INPLACE_SCRATCH_MAX_BYTES:
            return x.clone()
        buf = kept[0] if kept is not None and kept[0].numel() >= nbytes else \
            torch.empty(max(nbytes, 1), dtype=torch.uint8)
        copy = buf[:nbytes].view(x.dtype).view(x.shape)
        comm._inplace_scratch = (buf, x.shape, x.dtype, copy)
    copy.copy_(x)
    return copy


def all_to_all_hot(comm: AllToAllHost, x: Array, send_counts: Any, out: Array | None,
                   recv_counts: Any = None) -> torch.Tensor | None:
    """:meth:`all_to_all` of a plain contiguous tensor whose call was seen before (cached entry),
    with counts as a list of ints or None, ``recv_counts`` None or a list of ints (then ``out``, if
    given, has their rows), and ``out`` None or a plain non-overlapping tensor (or x itself); None for
    anything else (then :func:`all_to_all_checked` validates everything).

    Every step counts here (a small exchange is ~1 us of transport work): CPU calls find their
    plan by x's shape alone, and ``out`` (or, for an even split, a guess of x's shape) is handed
    to transports that fill it without an allocation callback (``takes_into``)."""
    if type(x) is not torch.Tensor or x.requires_grad or not x.is_contiguous():
        return None
    shape = x.shape
    if not shape:
        return None
    is_cpu = x.is_cpu
    if is_cpu and send_counts is None and recv_counts is None:  # the even split on the host: by address
        plan = comm._a2a_plans.get((shape, x.dtype, 0))
        if plan is not None and plan.even_by_address is not None and (out is not x or plan.in_place_native):
            res = _even_by_address(comm, x, out, shape, plan)
            if res is not None:
                return res
    recv_given = 0 if recv_counts is None else 1  # the signature's root field says whether they were given
    if is_cpu:
        plan = comm._a2a_plans.get((shape, x.dtype, recv_given))
        if plan is None:
            plan = _plan(comm, x, recv_given)
            if plan is None:
                return None
            comm._a2a_plans[(shape, x.dtype, recv_given)] = plan
    else:
        plan = _plan(comm, x, recv_given)
        if plan is None:
            return None
    ent, even, row_numel, rest, shaped, takes_into, even_by_address, in_place_native = plan
    if send_counts is None:
        if even is None:
            return None
        counts = even
    elif type(send_counts) is list and len(send_counts) == comm.size and sum(send_counts) == shape[0] and \
            all(type(c) is int and c >= 0 for c in send_counts):
        counts = send_counts
    else:
        return None
    if recv_given:
        if type(recv_counts) is not list or len(recv_counts) != comm.size or \
                not all(type(c) is int and c >= 0 for c in recv_counts):
            return None
        rows_in = sum(recv_counts)
        if out is not None and (type(out) is not torch.Tensor or out.dim() == 0 or out.shape[0] != rows_in):
            return None  # the checked path raises, naming the rows
    if out is not None:
        if type(out) is not torch.Tensor or out.dtype is not x.dtype or out.requires_grad \
                or not out.is_contiguous() or (out.dim() != 1 if not rest else out.shape[1:] != rest) \
                or (not out.is_cpu if is_cpu else out.device != x.device):
            return None
        o0, x0 = out.data_ptr(), x.data_ptr()
        if o0 < x0 + x.nbytes and x0 < o0 + out.nbytes:
            if o0 != x0 or out.nbytes != x.nbytes:
                return None
            if not in_place_native:
                x = _inplace_copy(comm, x) if is_cpu else x.clone()
        into = out
    elif recv_given:
        into = torch.empty((rows_in, *rest), dtype=x.dtype, device=x.device)
    elif send_counts is None:  # even split: every rank receives as many rows as it sends when all have as many
        into = torch.empty_like(x)  # ~0.6 us; torch.empty(shape, dtype=...) takes ~1.6 us
    else:
        into = None
    if into is not None and not shaped:
        into = into.view(-1)
    got: list[int] = []

    def alloc(recv_counts: list[int]) -> torch.Tensor:
        got.extend(recv_counts)
        rows_out = sum(recv_counts)
        if into is not None and into.shape[0] == rows_out * (1 if shaped else row_numel):
            return into
        return torch.empty((rows_out, *rest) if shaped else (rows_out * row_numel,), dtype=x.dtype,
                           device=x.device)

    send = x if shaped else x.view(-1)
    if takes_into:
        if even_by_address is not None and into is not None and not recv_given and \
                (counts is even or counts == even):  # by address
            res = even_by_address(x.data_ptr(), into, alloc)
        else:
            res = ent.call(send, counts, row_numel, alloc, ent.sig, recv_counts, into)
        if not got:  # filled `into` without asking: its rows were right
            if out is not None or shaped:
                return out if out is not None else res
            return res.view(rows_in, *rest) if recv_given else res.view(shape)
    elif recv_given:
        res = ent.transport.all_to_all_with_recv_counts(send, counts, recv_counts, row_numel, alloc, ent.sig)
    else:
        res = ent.call(send, counts, row_numel, alloc, ent.sig)
    if out is None:
        return res if shaped else res.view(sum(got), *rest)
    if out.shape[0] != sum(got):
        raise_out_rows(comm, out, got)
    return out

def _even_by_address(comm: AllToAllHost, x: torch.Tensor, out: Array | None, shape: torch.Size, plan: _Plan
                     ) -> torch.Tensor | None:
    """:func:`all_to_all_hot` of an even split on the host whose transport exchanges it by address, with
    ``out`` None, x itself (the transport exchanges in place), or a plain tensor of x's shape apart from
    it; None for anything else. The fewest steps of all: the exchange itself is ~0.5 us of a ~2 us
    call, and each check here ~50 ns."""
    x0 = x.data_ptr()
    if out is x:  # in place: x's checks were out's
        into = x
    elif out is None:
        into = torch.empty_like(x)
    elif type(out) is torch.Tensor and out.shape == shape and out.dtype is x.dtype and not out.requires_grad \
            and out.is_contiguous() and out.is_cpu:
        o0 = out.data_ptr()
        if o0 == x0:
            if not plan.in_place_native:
                return None
        elif o0 < x0 + x.nbytes and x0 < o0 + x.nbytes:
            return None
        into = out
    else:
        return None
    got: list[int] = []

    def alloc(recv_counts: list[int]) -> torch.Tensor:  # called by a rank that arrives before its peers
        got.extend(recv_counts)
        rows = sum(recv_counts)
        return into if rows == shape[0] else torch.empty((rows, *shape[1:]), dtype=x.dtype)

    res = plan.even_by_address(x0, into, alloc)
    if res is not into and out is not None:
        raise_out_rows(comm, out, got)
    return res


def raise_out_rows(comm: AllToAllHost, out: Array, recv_counts: list[int]) -> NoReturn:
    """The ValueError for an ``out=`` whose row count is not what this rank received."""
    raise ValueError(f"all_to_all: out has {out.shape[0]} rows but rank "
                     f"{comm.global_ranks[comm.rank]} received {sum(recv_counts)} (recv_counts {recv_counts})")

def all_to_all_checked(comm: AllToAllHost, x: Array, send_counts: Any, out: Array | None, return_counts: bool,
                       recv_given: Any = None) -> Any:
    """:meth:`Communicator.all_to_all` for any input: every argument checked (collective errors),
    NumPy in and out, host staging, any ``out=`` layout."""
    opcode = OpCode.ALL_TO_ALL
    t, was_numpy, orig = comm._input(opcode, x)
    # the signature says whether recv_counts were given (its root field): a mix across ranks raises
    ent = comm._entry(opcode, t, None, 0 if recv_given is None else 1)
    n, rows_in = comm.size, (t.shape[0] if t.dim() else 0)
    if send_counts is None and rows_in % n == 0:
        counts = [rows_in // n] * n
    elif type(send_counts) in (list, tuple) and len(send_counts) == n and \
            all(type(c) is int and c >= 0 for c in send_counts) and sum(send_counts) == rows_in:
        counts = list(send_counts)
    else:
        counts = checked_counts(comm, t, send_counts)
    expected = None
    if recv_given is not None:
        expected = checked_counts(comm, t, recv_given, "recv_counts")
    rest = tuple(t.shape[1:])
    out_t = None
    if out is not None:
        out_t = comm._out_view(opcode, out, t)
        dtype, device = dtype_device(out, out_t)
        if tuple(out.shape[1:]) != rest or len(out.shape) != t.dim() or dtype != t.dtype or device != t.device:
            comm._fail_locally(opcode, t.device.type, ValueError(
                f"all_to_all: out has shape {tuple(out.shape)}, dtype {dtype} on {device}; expected "
                f"(rows, {', '.join(map(str, rest))}) {t.dtype} on {t.device}".replace(", )", ")")))
        if expected is not None and out.shape[0] != sum(expected):  # known before the exchange here
            comm._fail_locally(opcode, t.device.type, ValueError(
                f"all_to_all: out has {out.shape[0]} rows but rank {comm.global_ranks[comm.rank]} "
                f"receives {sum(expected)} (recv_counts {expected})"))
    row_numel = math.prod(rest)
    s = t.cpu() if ent.staged else t
    holder: list[list[int]] = []

    def alloc(recv_counts: list[int]) -> torch.Tensor:
        holder.append(recv_counts)
        rows = sum(recv_counts)
        if out_t is not None and out_t.shape == (rows, *rest) and out_t.is_contiguous() and \
                out_t.device == s.device and not overlaps(out_t, orig):
            return out_t.view(-1)
        return torch.empty(rows * row_numel, dtype=t.dtype, device=s.device)

    if expected is None:
        flat = ent.transport.all_to_all(s.view(-1), counts, row_numel, alloc, ent.sig)
    else:
        flat = ent.transport.all_to_all_with_recv_counts(s.view(-1), counts, expected, row_numel, alloc, ent.sig)
    recv_counts = holder[0]
    rows = sum(recv_counts)
    res = flat.view(rows, *rest)
    if res.device != t.device:
        res = res.to(t.device)
    if out is not None:
        if tuple(out.shape) != (rows, *rest):  # known only now; the peers have their data
            raise_out_rows(comm, out, recv_counts)
        write_out(out, out_t, res)
        result = out
    else:
        result = res.numpy() if was_numpy else res
    if return_counts:
        rc = np.array(recv_counts, dtype=np.int64)
        return result, (rc if was_numpy else torch.from_numpy(rc))
    return result

def checked_counts(comm: AllToAllHost, t: torch.Tensor, given: Any, what: str = "send_counts") -> list[int]:
    """send_counts (or, with ``what="recv_counts"``, recv_counts) of any accepted kind as a list of
    ints, or a collective TypeError/ValueError."""
    me = comm.global_ranks[comm.rank]
    try:
        if t.dim() == 0:
            raise ValueError("all_to_all: x needs at least 1 dim (rows)")
        if given is None:
            raise ValueError(f"all_to_all: rank {me} has {t.shape[0]} rows, not divisible by the group "
                             f"size {comm.size}; pass send_counts for an uneven split")
        if isinstance(given, (torch.Tensor, np.ndarray)):
            if isinstance(given, torch.Tensor):
                if given.layout is not torch.strided or given.is_floating_point() or \
                        given.is_complex() or given.dtype == torch.bool:
                    raise TypeError(f"all_to_all: rank {me} passed {what} of dtype {given.dtype} "
                                    f"({given.layout}); need a dense integer tensor")
                arr = given.detach().cpu().numpy()
            else:
                arr = given
            if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"all_to_all: rank {me} passed {what} of dtype {arr.dtype}; need integers")
            counts = [int(c) for c in arr.reshape(-1)]
        elif isinstance(given, (list, tuple)):
            counts = [as_int(c, f"all_to_all: {what}[{i}] on rank {me}") for i, c in enumerate(given)]
        else:
            raise TypeError(f"all_to_all: {what} must be a list/tuple of ints or an integer tensor/array, "
                            f"got {type(given).__name__} on rank {me}")
        if len(counts) != comm.size:
            raise ValueError(f"all_to_all: rank {me} passed {what} {counts}; need {comm.size} "
                             "integers, one per rank")
        if what == "recv_counts":
            if min(counts) < 0:
                raise ValueError(f"all_to_all: rank {me} recv_counts {counts} must be >= 0")
        elif min(counts) < 0 or sum(counts) != t.shape[0]:
            raise ValueError(f"all_to_all: rank {me} send_counts {counts} must be >= 0 and sum to "
                             f"x.shape[0] = {t.shape[0]}")
    except (TypeError, ValueError) as e:
        comm._fail_locally(OpCode.ALL_TO_ALL, t.device.type, e)
    return counts
