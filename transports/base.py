"""The transport interface every byte-moving backend implements.

A transport moves the data of one collective between the ranks of one group. It
receives contiguous torch tensors (CPU for the host transports, CUDA for the GPU
ones) that the communicator has already checked locally, plus a :class:`Signature`
(a small int64 vector and its digest) that describes the call. Before a transport touches
any peer's data it must exchange the signatures of all ranks and call
:func:`check_agreement`, so that a call whose shape, dtype or op differs across
ranks raises ``ValueError`` on every rank instead of hanging or corrupting data.
Host transports fold that exchange into their first synchronisation, so it costs
nothing extra on the latency path.
"""

from __future__ import annotations

import abc
import enum
import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Sequence

import numpy as np
import torch


class CollectiveTimeoutError(TimeoutError):
    """A wait ran past the communicator's timeout; ``missing_ranks`` names who never arrived."""

    def __init__(self, message: str, missing_ranks: Sequence[int] = ()):
        super().__init__(message)
        self.missing_ranks = list(missing_ranks)


class PeerFailedError(CollectiveTimeoutError):
    """A peer process died (or aborted its communicator) while this rank waited for it."""


class CommunicatorBrokenError(RuntimeError):
    """An earlier timeout or peer failure left this communicator unusable."""


class ReduceOp(enum.IntEnum):
    SUM = 1
    AVG = 2
    MAX = 3
    MIN = 4
    PROD = 5

    @classmethod
    def parse(cls, op: "str | ReduceOp") -> "ReduceOp":
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls[str(op).upper()]
        except KeyError:
            raise ValueError(
                f"unknown reduction op {op!r}; use one of {[o.name.lower() for o in cls]}"
            ) from None


class OpCode(enum.IntEnum):
    BARRIER = 1
    ALL_REDUCE = 2
    ALL_GATHER = 3
    REDUCE_SCATTER = 4
    ALL_TO_ALL = 5
    BROADCAST = 6
    REDUCE = 7  # only in a signature's F_VIEW: a caller's reduce that runs as an all_reduce (torch backend)
    # only in a signature's F_VIEW: Communicator.all_reduce_rmsnorm's all_reduce (its F_ROOT: the weight's dtype code)
    ALL_REDUCE_RMSNORM = 8
    LOCAL_ERROR = 99  # this rank rejected its own input; peers raise instead of waiting


# dtype codes that travel in call signatures and argument agreements (stable numbers, never
# reorder; the one code table of the library). Collectives move SUPPORTED_DTYPES; the others have
# codes so that libraries (moe, tensor_parallel) can compare any dtype across ranks.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float64: 1,
    torch.float32: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.uint8: 7,
    torch.bool: 8,
    torch.int8: 9,
    torch.int16: 10,
    torch.complex64: 11,
    torch.complex128: 12,
    **{d: c for c, d in ((13, getattr(torch, "float8_e4m3fn", None)), (14, getattr(torch, "float8_e5m2", None)),
                         (15, getattr(torch, "uint16", None)), (16, getattr(torch, "uint32", None)),
                         (17, getattr(torch, "uint64", None)), (18, getattr(torch, "complex32", None)),
                         (19, getattr(torch, "float8_e4m3fnuz", None)), (20, getattr(torch, "float8_e5m2fnuz", None)))
       if d is not None},
}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                             torch.int64, torch.int32, torch.uint8, torch.bool)
UNKNOWN_DTYPE_CODE = 1000
DTYPE_BY_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The stable code of ``dtype`` (UNKNOWN_DTYPE_CODE for a dtype outside the table)."""
    return DTYPE_CODES.get(dtype, UNKNOWN_DTYPE_CODE)


def dtype_name(code: int) -> str:
    """``'bfloat16'`` for the code of torch.bfloat16; ``'<dtype N>'`` for an unknown code."""
    d = DTYPE_BY_CODE.get(int(code))
    return str(d).replace("torch.", "") if d is not None else f"<dtype {code}>"

# Layout of the int64 call signature.
META_LEN = 16
MAX_META_DIMS = 8
F_OPCODE, F_DTYPE, F_REDOP, F_ROOT, F_NDIM = 0, 1, 2, 3, 4
F_DIMS = 5  # F_DIMS .. F_DIMS + MAX_META_DIMS - 1
# Shapes of more than MAX_META_DIMS dims: the last dim slot holds the product of the trailing
# dims and F_TAIL a digest of them, so (.., 2, 3) and (.., 3, 2) still differ. 0 otherwise.
F_TAIL = F_DIMS + MAX_META_DIMS
# The caller's own call when it runs as another (0: none), compared like any field: bits 16+ the
# caller's collective (OpCode.REDUCE: the torch backend's reduce runs as an all_reduce, its dst in
# F_ROOT), the low 16 bits the dtype code of a tensor moved as uint8 bytes (the shape fields then
# hold its bytes' shape: the last dim times the element size). Without it, int16[4] and int8[8]
# look the same, and a reduce to rank 2 looks like a reduce to rank 0.
F_VIEW = F_TAIL + 1
_VIEW_OP_SHIFT = 16
F_ROWS = F_VIEW + 1  # all_to_all: this rank's row count (may differ across ranks); not compared
# all_to_all has no root: its root field is 1 when the caller passed recv_counts=, else 0. It is
# compared like any field, because transports move the data differently with known receive counts
# (nccl skips its count exchange): a mix across ranks would pair different messages.
F_RECV_COUNTS_GIVEN = F_ROOT
# all_reduce_rmsnorm (F_VIEW's collective OpCode.ALL_REDUCE_RMSNORM) has no root either: its root field
# holds the dtype code of its weight, which decides with the shape and dtype whether a transport runs
# the call fused (Transport.fuses_all_reduce_rmsnorm), so that every rank decides alike or raises.
F_WEIGHT_DTYPE = F_ROOT
_FIELD_NAMES = {F_OPCODE: "collective", F_DTYPE: "dtype", F_REDOP: "op", F_ROOT: "src", F_NDIM: "ndim",
                F_VIEW: "dtype"}


def _tail_digest(dims: Sequence[int]) -> int:
    """A positive 48-bit digest of ``dims`` that is the same in every process."""
    raw = np.asarray(dims, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=6).digest(), "little") or 1


def make_meta(
    opcode: OpCode,
    *,
    dtype: torch.dtype | None = None,
    shape: Sequence[int] = (),
    op: ReduceOp | None = None,
    root: int = 0,
    compare_first_dim: bool = True,
    rows: int = 0,
    view_op: OpCode | None = None,
    view_dtype: torch.dtype | None = None,
) -> np.ndarray:
    """Build the call signature; fields that may legitimately differ across ranks are left 0.

    shape: any number of dims; past ``MAX_META_DIMS`` the trailing ones are folded into their
    product plus a digest (see ``F_TAIL``), so every difference in any dim still shows.
    view_op, view_dtype: the caller's own collective and dtype when they differ from what moves
    (see ``F_VIEW``).
    Returns [META_LEN] int64.
    """
    meta = np.zeros(META_LEN, dtype=np.int64)
    meta[F_OPCODE] = int(opcode)
    meta[F_DTYPE] = DTYPE_CODES.get(dtype, -1) if dtype is not None else 0
    meta[F_REDOP] = int(op) if op is not None else 0
    meta[F_ROOT] = root
    dims = [int(d) for d in shape]
    meta[F_NDIM] = len(dims)
    if not compare_first_dim and dims:
        dims[0] = 0
    if len(dims) > MAX_META_DIMS:
        tail = dims[MAX_META_DIMS - 1 :]
        meta[F_TAIL] = _tail_digest(tail)
        dims = dims[: MAX_META_DIMS - 1] + [math.prod(tail)]
    for i, d in enumerate(dims):
        meta[F_DIMS + i] = d
    meta[F_ROWS] = rows
    meta[F_VIEW] = view_code(view_op, view_dtype)
    return meta


def view_code(view_op: OpCode | None = None, view_dtype: torch.dtype | None = None) -> int:
    """The ``F_VIEW`` word of a call made as ``view_op`` on ``view_dtype`` data (0: as it moves)."""
    return (int(view_op or 0) << _VIEW_OP_SHIFT) | (dtype_code(view_dtype) if view_dtype is not None else 0)


def error_meta() -> np.ndarray:
    meta = np.zeros(META_LEN, dtype=np.int64)
    meta[F_OPCODE] = int(OpCode.LOCAL_ERROR)
    return meta


class Signature:
    """A call signature prepared once and reused by every call with the same arguments.

    ``meta``: the [META_LEN] int64 vector; ``value``: a 63-bit digest of the fields that must
    agree, so a transport can compare one word per peer on the fast path and fall back to the
    full :func:`check_agreement` only when a digest differs; ``words``: ``meta`` as a 'q'
    memoryview for cheap copies into shared memory; ``addr``: the address of ``meta``'s words.
    """

    __slots__ = ("meta", "value", "words", "addr")

    def __init__(self, meta: np.ndarray):
        self.meta = np.ascontiguousarray(meta, dtype=np.int64)
        # a digest that is the same in every process (str/bytes hash() is salted per process)
        digest = hashlib.blake2b(self.meta[:F_ROWS].tobytes(), digest_size=8).digest()
        self.value = int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF
        self.words = memoryview(self.meta).cast("B").cast("q")
        self.addr = self.meta.ctypes.data  # for compiled helpers; ``meta`` lives as long as this object

    @classmethod
    def of(cls, opcode: OpCode, **kw) -> "Signature":
        return cls(make_meta(opcode, **kw))


def _call_name(meta: np.ndarray) -> str:
    """The collective the caller made: its F_VIEW collective, else the one that moves the data."""
    op = int(meta[F_VIEW]) >> _VIEW_OP_SHIFT
    return OpCode(op).name.lower() if op in OpCode._value2member_map_ else _describe(meta, F_OPCODE)


def _describe(meta: np.ndarray, field_idx: int) -> str:
    v = int(meta[field_idx])
    if field_idx == F_VIEW:
        code = v & ((1 << _VIEW_OP_SHIFT) - 1)
        return f"{dtype_name(code)} (moved as bytes)" if code else _describe(meta, F_DTYPE)
    if field_idx == F_RECV_COUNTS_GIVEN and meta[F_OPCODE] == OpCode.ALL_TO_ALL:
        return "given" if v else "not given"
    if field_idx == F_OPCODE:
        return OpCode(v).name.lower() if v in OpCode._value2member_map_ else str(v)
    if field_idx == F_DTYPE:
        return str(DTYPE_BY_CODE.get(v, v)).replace("torch.", "")
    if field_idx == F_REDOP:
        return ReduceOp(v).name.lower() if v in ReduceOp._value2member_map_ else "-"
    return str(v)


def _shape_of(meta: np.ndarray) -> str:
    ndim = int(meta[F_NDIM])
    dims = [int(d) for d in meta[F_DIMS : F_DIMS + min(ndim, MAX_META_DIMS)]]
    moved_as = DTYPE_BY_CODE.get(int(meta[F_VIEW]) & ((1 << _VIEW_OP_SHIFT) - 1))
    if moved_as is not None and dims and ndim <= MAX_META_DIMS:  # show the caller's shape, not its bytes'
        size = torch.empty((), dtype=moved_as).element_size()
        if dims[-1] % size == 0:
            dims[-1] //= size
    shown = ["*" if (i == 0 and d == 0 and meta[F_OPCODE] == OpCode.ALL_TO_ALL) else str(d)
             for i, d in enumerate(dims)]
    if ndim > MAX_META_DIMS:  # the folded trailing dims: how many, their product, their digest
        shown[-1] = f"<last {ndim - MAX_META_DIMS + 1} dims: {dims[-1]} elements, id {int(meta[F_TAIL]):012x}>"
    return "(" + ", ".join(shown) + ")"


def check_agreement(metas: np.ndarray, ranks: Sequence[int] | None = None) -> None:
    """Raise ``ValueError`` (identically on every rank) if the call signatures differ.

    ``metas``: [size, META_LEN] int64, row i from group rank i. ``ranks`` maps group
    ranks to the numbers shown in the message (global ranks for sub-groups).
    """
    names = list(ranks) if ranks is not None else list(range(len(metas)))
    failed = [names[i] for i in range(len(metas)) if metas[i, F_OPCODE] == OpCode.LOCAL_ERROR]
    if failed:
        raise ValueError(
            f"rank(s) {failed} rejected their input for this collective (see the error on those ranks); "
            "every rank aborted the call"
        )
    cmp = metas[:, :F_ROWS]
    if (cmp == cmp[0]).all():
        return
    diffs = []
    moved_as = metas[:, F_VIEW] & ((1 << _VIEW_OP_SHIFT) - 1)  # the callers' dtypes moved as bytes (0: none)
    calls = [_call_name(m) for m in metas]
    if len(set(calls)) > 1:
        per_rank = ", ".join(f"rank {names[i]}: {calls[i]}" for i in range(len(metas)))
        diffs.append(f"collective differs ({per_rank})")
    for f in (F_OPCODE, F_DTYPE, F_REDOP, F_ROOT):
        col = metas[:, f]
        if f == F_OPCODE and len(set(calls)) > 1:
            continue
        if f == F_WEIGHT_DTYPE and len(set(calls)) > 1 and "all_reduce_rmsnorm" in calls:
            continue  # its root field is the weight's dtype, which the collective's difference explains
        if f == F_DTYPE and not (moved_as == moved_as[0]).all():
            col = moved_as  # the callers' dtypes (moved as bytes, the dtype that moves is uint8 on every rank)
        if not (col == col[0]).all():
            per_rank = ", ".join(f"rank {names[i]}: {_describe(metas[i], F_VIEW if col is moved_as else f)}"
                                 for i in range(len(metas)))
            name = _FIELD_NAMES[f]
            if f == F_RECV_COUNTS_GIVEN and (metas[:, F_OPCODE] == OpCode.ALL_TO_ALL).all():
                name = "recv_counts"
            if f == F_ROOT and calls[0] == "reduce":
                name = "dst"
            if f == F_WEIGHT_DTYPE and calls[0] == "all_reduce_rmsnorm":
                name = "weight dtype"
                per_rank = ", ".join(f"rank {names[i]}: {dtype_name(int(col[i]))}" for i in range(len(metas)))
            diffs.append(f"{name} differs ({per_rank})")
    shape_cols = metas[:, F_NDIM:F_VIEW]
    if not (shape_cols == shape_cols[0]).all():
        per_rank = ", ".join(f"rank {names[i]}: {_shape_of(metas[i])}" for i in range(len(metas)))
        diffs.append(f"shape differs ({per_rank})")
    raise ValueError(
        f"{calls[0]} called with arguments that differ across ranks: "
        + "; ".join(diffs)
        + ". Every rank must pass the same shape, dtype and op (all_to_all: same trailing dims, and "
        "recv_counts on every rank or on none)."
    )


def check_recv_counts(send_counts: Sequence[Sequence[int]], recv_counts: Sequence[Sequence[int]],
                      ranks: Sequence[int] | None = None) -> None:
    """Raise ``ValueError`` (identically on every rank that has both matrices) unless every rank's
    declared receive counts are what its peers send.

    ``send_counts``: [size][size], row s: the rows rank s sends to each rank; ``recv_counts``:
    [size][size], row d: the rows rank d said (``recv_counts=``) it receives from each rank.
    ``ranks`` maps group ranks to the numbers shown in the message.
    """
    n = len(send_counts)
    names = list(ranks) if ranks is not None else list(range(n))
    wrong = []
    for d in range(n):
        actual = [int(send_counts[s][d]) for s in range(n)]
        declared = [int(c) for c in recv_counts[d]]
        if declared != actual:
            wrong.append(f"rank {names[d]} passed recv_counts {declared} but its peers send it {actual}")
    if wrong:
        shown = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more rank(s)" if len(wrong) > 8 else "")
        raise ValueError(
            f"all_to_all: recv_counts differ from what the peers send: {shown}. Every rank aborted the call; "
            "recv_counts[s] must be the send_counts[rank] of rank s, or leave "
            "recv_counts out to have the counts exchanged.")


def rendezvous_metas(rendezvous: "Rendezvous", sig: Signature, extra: bytes = b"") -> tuple[np.ndarray, list[bytes]]:
    """Every rank's call signature, exchanged over the host rendezvous (for transports whose data path
    cannot carry it, or before a call that may sit in another transport than its peers').

    extra: bytes sent after this rank's signature (e.g. all_to_all counts).
    Returns ([size, META_LEN] int64 signatures, every rank's raw bytes for reading its ``extra``).
    """
    raw = rendezvous.allgather_bytes(sig.meta.tobytes() + extra)
    return np.stack([np.frombuffer(b, dtype=np.int64, count=META_LEN) for b in raw]), raw


class Rendezvous(abc.ABC):
    """Out-of-band exchange of small byte strings between the ranks of a group (not the data path)."""

    rank: int
    size: int
    timeout: float

    @abc.abstractmethod
    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank contributes ``data``; returns all ranks' contributions in rank order."""

    @abc.abstractmethod
    def split(self, color: int, key: int, new_rank: int, new_size: int, ranks: list[int]) -> "Rendezvous":
        """The rendezvous of a sub-group (called collectively by every parent rank, with color < 0 for none)."""

    def shrink(self, survivors: list[int], *, error: str | None = None, key: str = "") -> "Rendezvous":
        """The rendezvous of the group's ``survivors`` (ranks of this group, in order), called by the
        survivors only: the other ranks take no part and may be dead. ``error``: this rank's own
        argument error, told to the survivors (then raised here as ValueError). ``key``: shrinks
        with the same key are matched by their count on each survivor (see ``Communicator.shrink``)."""
        raise NotImplementedError(f"shrink is not supported by {type(self).__name__}")

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


@dataclass
class GroupInfo:
    """What a transport needs to know about the group it serves."""

    rank: int
    size: int
    timeout: float
    rendezvous: Rendezvous
    global_ranks: list[int]  # group rank -> world rank, for messages
    pids: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)  # node identity of each rank
    mpi_comm: object | None = None  # mpi4py communicator of this group when launched by MPI
    oversubscribed: bool = False  # more ranks on this node than CPUs (Topology.oversubscribed)
    settings: dict = field(default_factory=dict)  # resolved transports.settings values (option name -> value)
    cuda_device: int | None = None  # the CUDA device this rank is bound to (None: the current device)

    @property
    def single_node(self) -> bool:
        return len(set(self.hosts)) <= 1


# The signature of all_to_all's output allocator: recv_counts (rows from each rank) -> output tensor.
Allocator = Callable[[list], torch.Tensor]


class Transport(abc.ABC):
    """One way of moving bytes between the ranks of a group.

    All tensor arguments are contiguous and already validated locally. Every method
    is collective: all ranks of the group call it in the same order.
    """

    name: ClassVar[str]
    #: devices whose tensors this transport moves ("cpu", "cuda")
    devices: ClassVar[tuple[str, ...]]

    def __init__(self, group: GroupInfo):
        self.group = group
        self.rank = group.rank
        self.size = group.size

    @abc.abstractmethod
    def algorithm(self, opcode: OpCode, nbytes: int, dtype: torch.dtype) -> str:
        """Name of the algorithm this transport would use for the call (for plans and logs)."""

    def plan_note(self, opcode: OpCode, nbytes: int) -> str:
        """What else ``comm.plan()`` should say about how this transport runs the call ("" if nothing)."""
        return ""

    # ---- collectives --------------------------------------------------------------------
    @abc.abstractmethod
    def exchange_meta(self, sig: Signature) -> np.ndarray:
        """Barrier that also gathers every rank's call signature: -> [size, META_LEN] int64."""

    def reject_call(self, sig: Signature, x: torch.Tensor, fused: tuple[int, int] | None = None) -> None:
        """This rank rejected its input for the call of signature ``sig`` on ``x`` (``fused``: an
        all_reduce_rmsnorm of (rows, hidden)) that its peers are making: meet them where that call
        meets, with an error signature, so that they raise ValueError instead of waiting. Here
        :meth:`exchange_meta`, which every call of these transports meets."""
        self.exchange_meta(Signature(error_meta()))

    @abc.abstractmethod
    def all_reduce(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        """out = reduction over ranks of send (same shape)."""

    @abc.abstractmethod
    def all_gather(self, send: torch.Tensor, out: torch.Tensor, sig: Signature) -> None:
        """out ([size * n] flat) = concatenation of every rank's send ([n] flat) in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, op: ReduceOp, sig: Signature) -> None:
        """out ([n] flat) = this rank's block of the reduction of send ([size * n] flat)."""

    #: whether :meth:`all_gather` accepts ``send`` being exactly this rank's block of ``out``, and
    #: :meth:`reduce_scatter` ``out`` being exactly this rank's block of ``send`` (nccl-tests'
    #: in-place layouts); otherwise the communicator passes a temporary for any overlap
    takes_rank_block_alias: ClassVar[bool] = False

    #: whether :meth:`all_to_all` takes ``send`` (and ``alloc`` may return the output) as contiguous
    #: [rows, *rest] tensors instead of flat views; transports that only read addresses say True
    takes_shaped_rows: ClassVar[bool] = False

    #: whether :meth:`all_to_all` takes ``recv_counts=`` and checks it against what the peers send;
    #: for the others :meth:`all_to_all_with_recv_counts` checks it after the exchange (one barrier more)
    takes_recv_counts: ClassVar[bool] = False

    #: whether :meth:`all_to_all` takes ``into`` (its 7th argument, after ``recv_counts``): a contiguous
    #: output (shaped as ``alloc``'s would be) it fills without calling ``alloc`` when the rows received
    #: fill it exactly, so a repeated exchange of known shape needs no allocation callback between
    #: its count exchange and its copies
    takes_into: ClassVar[bool] = False

    def takes_in_place_all_to_all(self, nbytes: int) -> bool:
        """Whether :meth:`all_to_all` (with ``takes_into``) may be given ``into`` that is ``send`` itself
        (an in-place exchange, out is x) for a CPU send of ``nbytes``: the transport then reads every
        peer's rows before it overwrites the rows they read. False (this default): the communicator
        sends from a copy of x, as MPI_IN_PLACE implementations do."""
        return False

    def latency_call(self, opcode: OpCode, numel: int, dtype: torch.dtype, op: ReduceOp | None, sig: Signature
                     ) -> Callable[[int, int], None] | None:
        """One repeated host call, by addresses: ``call(x_addr, out_addr)`` does what :meth:`all_reduce`,
        :meth:`all_gather` or :meth:`reduce_scatter` (``opcode``) does for contiguous CPU tensors of this
        argument set (x: ``numel`` elements of ``dtype``; ``op`` for the reductions; ``sig`` the call's
        signature), without reading tensor attributes on every call. The communicator makes it once per
        cached call and uses it on its latency path. None (this default): use the tensor methods.
        """
        return None

    def latency_all_to_all(self, send_counts: list[int], row_bytes: int, total: int, sig: Signature
                           ) -> Callable[[int, torch.Tensor | None, Allocator], torch.Tensor] | None:
        """One repeated host all_to_all of fixed counts, by address (for transports with ``takes_into``):
        ``call(x_addr, into, alloc)`` does what :meth:`all_to_all` does with ``into`` for a contiguous CPU
        send of ``total`` bytes at ``x_addr`` in rows of ``row_bytes``, sent ``send_counts`` rows to each
        rank, and returns the output (``into`` when the rows received fill it exactly, else what
        ``alloc`` gave). None (this default): use :meth:`all_to_all`.
        """
        return None

    @abc.abstractmethod
    def all_to_all(
        self, send: torch.Tensor, send_counts: list[int], row_numel: int, alloc: Allocator, sig: Signature,
        recv_counts: list[int] | None = None,
    ) -> torch.Tensor:
        """Uneven all-to-all of rows.

        send: [sum(send_counts) * row_numel] flat, rows ordered by destination rank;
        send_counts: [size] ints. The transport exchanges the counts, calls
        ``alloc(recv_counts)`` for the output ([sum(recv_counts) * row_numel] flat) and
        fills it with the received rows in source-rank order.

        recv_counts: [size] ints, the rows this rank receives from each rank, when the caller
        knows them (then ``sig`` says so on every rank: see ``F_RECV_COUNTS_GIVEN``). Only
        transports with ``takes_recv_counts`` get it; they may skip their count exchange, and
        must raise the ``ValueError`` of :func:`check_recv_counts` on every rank when a rank's
        value is not what its peers send, before any data lands.
        """

    def all_to_all_with_recv_counts(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], row_numel: int,
        alloc: Allocator, sig: Signature,
    ) -> torch.Tensor:
        """:meth:`all_to_all` for a caller that knows its receive counts ([size] ints).

        Transports with ``takes_recv_counts`` get them directly. For the others (this default) the
        counts are exchanged as usual, each rank compares what arrived with what it declared, and
        one more :meth:`exchange_meta` tells every rank whether all matched; on a mismatch the
        ranks swap their counts over the rendezvous (the error path only) and every rank raises
        the ``ValueError`` of :func:`check_recv_counts`. The rows moved by the counts the peers
        really sent, so nothing is misplaced, but the output ``alloc`` gave may hold them when
        it raises.
        """
        if self.takes_recv_counts:
            return self.all_to_all(send, send_counts, row_numel, alloc, sig, recv_counts=recv_counts)
        arrived: list[list[int]] = []

        def checked_alloc(counts: list) -> torch.Tensor:
            arrived.append([int(c) for c in counts])
            return alloc(counts)

        out = self.all_to_all(send, send_counts, row_numel, checked_alloc, sig)
        ok = arrived and arrived[0] == [int(c) for c in recv_counts]
        metas = self.exchange_meta(sig if ok else Signature(error_meta()))
        if (metas[:, F_OPCODE] == OpCode.LOCAL_ERROR).any():
            mine = np.asarray([send_counts, recv_counts], dtype=np.int64)
            both = [np.frombuffer(b, dtype=np.int64).reshape(2, -1)
                    for b in self.group.rendezvous.allgather_bytes(mine.tobytes())]
            check_recv_counts([b[0] for b in both], [b[1] for b in both], self.group.global_ranks)
        return out

    @abc.abstractmethod
    def broadcast(self, send: torch.Tensor, out: torch.Tensor, src: int, sig: Signature) -> None:
        """out = send of rank ``src`` (every rank passes tensors of the same shape)."""

    def barrier(self, sig: Signature) -> None:
        check_agreement(self.exchange_meta(sig), self.group.global_ranks)

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def synchronize(self) -> None:
        """Wait for this rank's work queued on the device and raise what it failed with (transports
        whose errors surface asynchronously: ipc). This default has nothing queued."""

    # ---- fused all_reduce + RMSNorm (Communicator.all_reduce_rmsnorm) ------------------------------
    def fuses_all_reduce_rmsnorm(self, numel: int, hidden: int, dtype: torch.dtype, weight_dtype: torch.dtype
                                 ) -> str | None:
        """The algorithm name when all_reduce_rmsnorm(...) of such a call runs fused in this transport, else None
        (the communicator composes all_reduce + torch ops). Decided from the arguments only, so every rank decides
        alike (they agree on all four: the shape and dtype are in the call's signature, the weight's dtype in its
        ``F_WEIGHT_DTYPE`` field).

        numel: elements of x (rows * hidden); hidden: x's last dim; dtype: x's dtype (a float dtype);
        weight_dtype: the weight's dtype (x's dtype or float32). This default: None (never fused).
        """
        return None

    def all_reduce_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           out: torch.Tensor, residual_out: torch.Tensor, sig: Signature) -> None:
        """Fused: out = rmsnorm(all_reduce(x) + residual) * weight, residual_out = all_reduce(x) + residual (see
        Communicator.all_reduce_rmsnorm). Called only when :meth:`fuses_all_reduce_rmsnorm` named an algorithm.

        x, residual, out, residual_out: contiguous [rows, H] of one float dtype on this transport's device; weight:
        [H] contiguous (x's dtype or float32); eps: a finite float >= 0; sig: the call's signature (F_VIEW marks
        the fused op; compare it with the peers' as :meth:`all_reduce` does, so that a peer's plain all_reduce or
        its rejected input raises ``ValueError`` here). ``out`` may be ``x`` itself and ``residual_out`` may be
        ``residual`` itself (in place); otherwise no two of them overlap.
        """
        raise NotImplementedError

    def abort(self, why: str) -> None:
        """A call was interrupted on this rank (``KeyboardInterrupt``, an exception raised by a signal
        handler) and may have left it out of step with its peers: mark this rank failed where the
        peers read it (they raise instead of pairing its next call with the wrong one of theirs),
        then :meth:`close`, keeping whatever an unfinished transfer may still write into.
        This default closes: peers waiting on this rank raise."""
        self.close()
