"""Which point-to-point channel a host transport has: shm makes its own at creation
(transports/_p2p_shm.py); mpi's and gloo's are made here on first use."""

from __future__ import annotations

from typing import Any

from ._p2p import Channel
from ._p2p_gloo import GlooChannel
from ._p2p_mpi import MPIChannel


def channel_of(transport: Any) -> Channel | None:
    """The point-to-point channel of a host transport (made on first use; shm makes its own at
    creation), or None for a transport without one."""
    ch = getattr(transport, "p2p", None)
    if ch is not None:
        return ch
    name = getattr(transport, "name", "")
    if name == "mpi" and getattr(transport, "comm", None) is not None:
        ch = MPIChannel(transport)
    elif name == "gloo" and getattr(transport, "pg", None) is not None:
        ch = GlooChannel(transport)
    else:
        return None
    transport.p2p = ch
    return ch
