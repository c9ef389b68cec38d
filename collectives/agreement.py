"""Argument checks that fail on every rank at once, for the libraries built on collectives (moe, tensor_parallel).

A rank that rejects its arguments must never leave its peers waiting in a collective until the
timeout. Two tools, one per situation:

- :func:`agree`, where every rank reaches the same point (a constructor, the count exchange of a
  dispatch): one all-gather carries each rank's arguments and its own verdict, and every rank
  raises the same error, naming the ranks and their values;
- :func:`reject` / ``with rejecting(comm):`` (over :meth:`collectives.Communicator.reject`) where
  the peers have already gone on into their next collective (a forward-time check, local work
  between collectives): the error is raised here and that collective raises on the peers.

Messages name ranks as :func:`rank_label` does: ``"<where> on rank 3: <problem>"``.
"""

from __future__ import annotations

import math
import numbers
import operator
import struct
from typing import Any, Callable, Mapping, NoReturn

import torch

from .protocols import CommunicatorLike

__all__ = ["agree", "reject", "rejecting", "rank_label"]

_MESSAGE_BYTES = 4000  # longest error text carried to the peers (longer ones are cut)
_OK, _VALUE_ERROR, _TYPE_ERROR = 0, 1, 2
# How a value travels: (kind, 64 bits). Integers (and integral floats below 2**53) travel exactly, so
# seeds and counts compare exactly; ints past int64 travel as their hash (stable across processes).
_NONE, _INT, _FLOAT, _BIG_INT, _INVALID = range(5)


def rank_label(comm: CommunicatorLike, group_rank: int | None = None) -> str:
    """``"rank 3"`` (the world rank), plus the group rank when ``comm`` is a sub-group that renumbers ranks."""
    r = comm.rank if group_rank is None else group_rank
    g = comm.global_ranks[r]
    return f"rank {g}" if g == r else f"rank {g} (rank {r} of {comm.size} in its group)"


def reject(comm: CommunicatorLike, error: Exception, *, on: Any = None) -> NoReturn:
    """Raise ``error`` here and make the peers' next collective on ``comm`` raise ``ValueError`` at once.

    Args:
        comm: the group whose peers are (or will be) in a collective this rank now skips.
        error: what to raise here (its message should name this rank: see :func:`rank_label`).
        on: the tensor the skipped collective would have moved; its device type picks the transport
            that carries the news (CPU when it is not a tensor).
    """
    error._moecomm_rejected = True  # so that an enclosing `rejecting` does not tell the peers twice
    comm.reject(error, device=on.device.type if isinstance(on, torch.Tensor) else "cpu")
    raise error  # a communicator's reject never returns; this keeps a stand-in honest


class rejecting:  # noqa: N801 - used like a function: ``with rejecting(comm, on=x):``
    """Around local work between collectives: an exception raised inside is :func:`reject`-ed (collective).

    For checks and computations that may fail on one rank only (a bad input, a dtype mismatch,
    out of memory): the error is raised here as it is, and the peers' next collective raises
    instead of waiting for this rank. Never put a collective inside: its errors already reach
    every rank, and a rank that lost a peer must not wait on it again.
    """

    __slots__ = ("comm", "on")

    def __init__(self, comm: CommunicatorLike, *, on: Any = None):
        self.comm, self.on = comm, on

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, tb: Any) -> bool:
        if isinstance(error, Exception) and not getattr(error, "_moecomm_rejected", False):
            reject(self.comm, error, on=self.on)
        return False


def agree(comm: CommunicatorLike, where: str, values: Mapping[str, Any], *, error: Exception | None = None,
          extra: torch.Tensor | None = None, hint: str = "",
          formats: Mapping[str, Callable[[Any], str]] | None = None) -> torch.Tensor:
    """Check that every rank passed the same ``values`` and that no rank rejected its input (collective).

    One all-gather (two when some rank erred: the second carries the error texts). On failure
    every rank raises the same message; a rank that erred raises its own error's type, the
    others ``ValueError`` (``TypeError`` when the first rank that erred raised one).

    Args:
        comm: the group; every rank calls ``agree`` at the same point with the same keys in ``values``.
        where: the caller, e.g. ``"MoELayer"``; every message starts with it.
        values: name -> int, float, bool or None; must be equal on every rank (ints compare exactly).
            A value of another type counts as invalid (pass it only together with an ``error``).
        error: this rank's own verdict on its arguments: ``ValueError``/``TypeError`` or None.
        extra: optional 1-D integer tensor of per-rank data gathered along (same length on every rank).
        hint: what to do about a disagreement, appended to that message.
        formats: name -> how to show a value in a disagreement (e.g. ``transports.base.dtype_name``).

    Returns:
        ``[size, len(extra)]`` int64 (CPU): every rank's ``extra`` in group-rank order
        (``[size, 0]`` without ``extra``).
    """
    kinds_bits = [_encode(v) for v in values.values()]
    message = b""
    status = _OK
    if error is not None:
        status = _TYPE_ERROR if isinstance(error, TypeError) else _VALUE_ERROR
        message = str(error).encode("utf-8", "replace")[:_MESSAGE_BYTES]
    header = torch.tensor([status, len(message), *(x for kb in kinds_bits for x in kb)], dtype=torch.int64)
    mine = header if extra is None else torch.cat([header, extra.reshape(-1).to(torch.int64).cpu()])
    rows = comm.all_gather(mine.reshape(1, -1)) if comm.size > 1 else mine.reshape(1, -1)
    heads = rows[:, : header.numel()]
    if bool(heads[:, 0].any()):
        _raise_rejections(comm, where, heads, message, error)
    body = heads[:, 2:]
    if not bool((body == body[0]).all()):
        _raise_disagreement(comm, where, list(values), body, hint, formats or {})
    return rows[:, header.numel():]


def _encode(v: Any) -> tuple[int, int]:
    if v is None:
        return _NONE, 0
    try:
        i = operator.index(v)  # int, bool, NumPy integers
    except TypeError:
        pass
    else:
        return (_INT, i) if -(1 << 63) <= i < (1 << 63) else (_BIG_INT, hash(i))
    if isinstance(v, numbers.Real):
        f = float(v)
        if f.is_integer() and abs(f) < 2.0 ** 53:
            return _INT, int(f)  # 1.0 and 1 are the same argument
        return _FLOAT, struct.unpack("<q", struct.pack("<d", f))[0]
    return _INVALID, 0


def _decode(kind: int, bits: int) -> Any:
    if kind == _NONE:
        return None
    if kind == _INT:
        return bits
    if kind == _FLOAT:
        return struct.unpack("<d", struct.pack("<q", bits))[0]
    return {_BIG_INT: "an int past 64 bits"}.get(kind, "invalid")


def _show(v: Any) -> str:
    if isinstance(v, float) and not math.isnan(v):
        return repr(v)
    return str(v)


def _raise_rejections(comm: CommunicatorLike, where: str, heads: torch.Tensor, message: bytes,
                      error: Exception | None) -> None:
    """Every rank raises one message listing each rank's error (ranks with the same text grouped)."""
    lengths = heads[:, 1].tolist()
    mine = torch.zeros((1, max(1, *lengths)), dtype=torch.uint8)
    if message:
        mine[0, : len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    texts = comm.all_gather(mine) if comm.size > 1 else mine
    by_text: dict[str, list[int]] = {}
    first_status = None
    for r, (status, n) in enumerate(zip(heads[:, 0].tolist(), lengths)):
        if status != _OK:
            first_status = first_status or status
            text = bytes(texts[r, :n].tolist()).decode("utf-8", "replace")
            by_text.setdefault(text, []).append(r)
    parts = []
    for text, ranks in by_text.items():
        who = (rank_label(comm, ranks[0]) if len(ranks) == 1
               else "ranks " + ", ".join(str(comm.global_ranks[r]) for r in ranks))
        parts.append(f"{where} on {who}: {text}")
    own_status = heads[comm.rank, 0].item()
    exc_type = TypeError if (own_status or first_status) == _TYPE_ERROR else ValueError
    raise exc_type("; ".join(parts)) from error


def _raise_disagreement(comm: CommunicatorLike, where: str, names: list[str], body: torch.Tensor, hint: str,
                        formats: Mapping[str, Callable[[Any], str]]) -> None:
    diffs = []
    for i, name in enumerate(names):
        col = body[:, 2 * i: 2 * i + 2]
        if bool((col == col[0]).all()):
            continue
        fmt = formats.get(name, _show)
        decoded = [_decode(*col[r].tolist()) for r in range(comm.size)]
        shown = ", ".join(f"{rank_label(comm, r)}: {fmt(v) if isinstance(v, (int, float)) else _show(v)}"
                          for r, v in enumerate(decoded))
        diffs.append(f"{name} ({shown})")
    raise ValueError(f"{where}: ranks disagree on {'; '.join(diffs)}. {hint}".rstrip())
