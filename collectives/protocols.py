"""What the libraries above collectives (moe, collectives.tensor_parallel) need of a communicator.

:class:`collectives.Communicator` is one; so is any wrapper that forwards these members (e.g. the
timing wrapper of ``moecomm bench-tp``). The check is by attribute, not ``isinstance``, so a
wrapper that forwards through ``__getattr__`` qualifies on every Python version.
"""

from __future__ import annotations

from typing import Any, NoReturn, Protocol, Sequence

import torch


class CommunicatorLike(Protocol):
    """The members of :class:`collectives.Communicator` that moe and tensor_parallel call."""

    rank: int                    # this rank's index in the group, 0 <= rank < size
    size: int                    # number of ranks in the group
    global_ranks: Sequence[int]  # global_ranks[r]: the world rank of group rank r (for messages)

    def all_reduce(self, x: torch.Tensor, op: str = "sum", *, out: Any = None) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, *, out: Any = None) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor, op: str = "sum", *, out: Any = None) -> torch.Tensor: ...

    def all_to_all(self, x: torch.Tensor, send_counts: Sequence[int] | None = None, *, out: Any = None,
                   return_counts: bool = False, recv_counts: Sequence[int] | None = None) -> Any: ...

    def reject(self, error: Exception, *, device: str = "cpu") -> NoReturn: ...


COMMUNICATOR_MEMBERS: tuple[str, ...] = tuple(sorted(
    {*CommunicatorLike.__annotations__,
     *(name for name, v in vars(CommunicatorLike).items() if callable(v) and not name.startswith("_"))}))


def check_communicator(comm: Any, where: str) -> None:
    """Raise ``TypeError`` naming what is missing unless ``comm`` has every member of :class:`CommunicatorLike`.

    Local only (there is no communicator to tell the peers through); every rank that got the
    wrong object raises it.
    """
    missing = [m for m in COMMUNICATOR_MEMBERS if not hasattr(comm, m)]
    if missing:
        raise TypeError(f"{where}: comm must be a collectives.Communicator, got {type(comm).__name__} "
                        f"(it lacks {', '.join(missing)})")
