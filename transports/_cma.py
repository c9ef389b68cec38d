"""Linux cross-memory attach: read another process's memory in one copy (``process_vm_readv``).

The shm transport's large-message path reads its peers' tensors straight into its own output
(or into a small buffer it reduces from) instead of staging every byte through a shared slot,
halving the copies. The kernel allows it between processes of one user unless ptrace is
restricted (Yama ``ptrace_scope`` >= 2, seccomp filters in some containers, a peer that made
itself non-dumpable): :func:`probe` finds out once per group, every rank agrees on the answer,
and the transport keeps its staged path where any rank was refused.

Called through ctypes: a call costs ~1 us, nothing next to the megabytes it moves.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import sys

from .base import GroupInfo

_IOV_CHUNK = 1 << 30  # bytes per call: well below the kernel's ssize_t limit; partial reads loop anyway


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load()


def available() -> bool:
    """Whether this platform has ``process_vm_readv`` at all (it may still be refused: :func:`probe`)."""
    return _readv is not None


def read(pid: int, remote_addr: int, local_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote_addr`` of process ``pid`` to ``local_addr`` of this one.

    Raises OSError (errno ESRCH: the process is gone; EFAULT: the range is not mapped there;
    EPERM: not allowed) when the kernel refuses or stops early.
    """
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this platform")
    done = 0
    while done < nbytes:
        step = min(nbytes - done, _IOV_CHUNK)
        got = _readv(pid, _IoVec(local_addr + done, step), 1, _IoVec(remote_addr + done, step), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid} read nothing at {remote_addr + done:#x}")
        done += got


def probe(group: GroupInfo) -> str | None:
    """Whether every rank of the group can read its peers' memory; collective over ``group``.

    Each rank publishes a random token in its own (private) memory; every rank reads every peer's
    token with :func:`read` and compares it; then the ranks exchange their outcomes, so all of
    them return the same answer.

    Returns:
        None when every rank read every peer; otherwise why not, naming the ranks (the same
        string on every rank).
    """
    rdv, ranks = group.rendezvous, group.global_ranks
    token = secrets.token_bytes(16)
    buf = ctypes.create_string_buffer(token, len(token))
    mine = f"{os.getpid()}:{ctypes.addressof(buf)}:{token.hex()}".encode()
    peers = [b.decode().split(":") for b in rdv.allgather_bytes(mine)]
    err = ""
    if not available():
        err = f"rank {ranks[group.rank]}: process_vm_readv is not available on {sys.platform}"
    else:
        got = ctypes.create_string_buffer(len(token))
        for r, (pid, addr, tok) in enumerate(peers):
            if r == group.rank:
                continue
            try:
                read(int(pid), int(addr), ctypes.addressof(got), len(token))
            except OSError as e:
                err = f"rank {ranks[group.rank]} cannot read rank {ranks[r]}'s memory ({e.strerror or e})"
                break
            if got.raw != bytes.fromhex(tok):
                err = f"rank {ranks[group.rank]} read wrong bytes from rank {ranks[r]} (pid namespaces differ?)"
                break
    outcomes = [o.decode() for o in rdv.allgather_bytes(err.encode())]  # keeps buf alive until all have read
    del buf
    failed = [o for o in outcomes if o]
    return "; ".join(failed) if failed else None
