"""Linux cross-memory attach: read or write another process's memory in one copy (``process_vm_readv``,
``process_vm_writev``).

The shm transport's large-message path reads its peers' tensors straight into its own output
(or into a small buffer it reduces from), or writes its own into theirs (all_gather), instead of
staging every byte through a shared slot, halving the copies. The kernel allows it between processes of one user unless ptrace is
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


def _load(name: str):
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return fn


_readv = _load("process_vm_readv")
_writev = _load("process_vm_writev")


def available() -> bool:
    """Whether this platform has ``process_vm_readv`` at all (it may still be refused: :func:`probe`)."""
    return _readv is not None


def read(pid: int, remote_addr: int, local_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``remote_addr`` of process ``pid`` to ``local_addr`` of this one.

    Raises OSError (errno ESRCH: the process is gone; EFAULT: the range is not mapped there;
    EPERM: not allowed) when the kernel refuses or stops early.
    """
    _move(_readv, "process_vm_readv", pid, local_addr, remote_addr, nbytes)


def write(pid: int, local_addr: int, remote_addr: int, nbytes: int) -> None:
    """Copy ``nbytes`` at ``local_addr`` of this process to address ``remote_addr`` of process ``pid``.

    Raises OSError as :func:`read` does.
    """
    _move(_writev, "process_vm_writev", pid, local_addr, remote_addr, nbytes)


def _move(fn, name: str, pid: int, local_addr: int, remote_addr: int, nbytes: int) -> None:
    """``nbytes`` through ``fn`` (process_vm_readv or _writev), looping over partial transfers."""
    if fn is None:
        raise OSError(errno.ENOSYS, f"{name} is not available on this platform")
    done = 0
    while done < nbytes:
        step = min(nbytes - done, _IOV_CHUNK)
        moved = fn(pid, _IoVec(local_addr + done, step), 1, _IoVec(remote_addr + done, step), 1, 0)
        if moved < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{name} with pid {pid}: {os.strerror(err)}")
        if moved == 0:
            raise OSError(errno.EFAULT, f"{name} with pid {pid} moved nothing at remote {remote_addr + done:#x}")
        done += moved


def probe(group: GroupInfo) -> tuple[str | None, str | None]:
    """Whether every rank of the group can read, and write, its peers' memory; collective over ``group``.

    Each rank publishes a random token and an inbox of one token per rank in its own (private)
    memory; every rank reads every peer's token with :func:`read` and writes its own token into
    every peer's inbox with :func:`write`; the ranks exchange their outcomes, then check their
    inboxes and exchange that too, so all of them return the same answer.

    Returns:
        (why reads are refused, why writes are refused): None where every rank managed with every
        peer; otherwise why not, naming the ranks (the same strings on every rank).
    """
    rdv, ranks, me, n = group.rendezvous, group.global_ranks, group.rank, group.size
    token = secrets.token_bytes(16)
    buf = ctypes.create_string_buffer(token + bytes(16 * n), 16 * (n + 1))  # token, then the inbox
    mine = f"{os.getpid()}:{ctypes.addressof(buf)}:{token.hex()}".encode()
    peers = [b.decode().split(":") for b in rdv.allgather_bytes(mine)]
    read_err = write_err = ""
    if not available():
        read_err = f"rank {ranks[me]}: process_vm_readv is not available on {sys.platform}"
    if _writev is None:
        write_err = f"rank {ranks[me]}: process_vm_writev is not available on {sys.platform}"
    got = ctypes.create_string_buffer(16)
    for r, (pid, addr, tok) in enumerate(peers):
        if r == me:
            continue
        if not read_err:
            try:
                read(int(pid), int(addr), ctypes.addressof(got), 16)
                if got.raw != bytes.fromhex(tok):
                    read_err = f"rank {ranks[me]} read wrong bytes from rank {ranks[r]} (pid namespaces differ?)"
            except OSError as e:
                read_err = f"rank {ranks[me]} cannot read rank {ranks[r]}'s memory ({e.strerror or e})"
        if not write_err:
            try:
                write(int(pid), ctypes.addressof(buf), int(addr) + 16 * (1 + me), 16)
            except OSError as e:
                write_err = f"rank {ranks[me]} cannot write rank {ranks[r]}'s memory ({e.strerror or e})"
    outcomes = [o.decode().split("\0") for o in rdv.allgather_bytes(f"{read_err}\0{write_err}".encode())]
    # every write has landed or failed now: each rank checks what its peers wrote into its inbox
    inbox = buf.raw[16:]
    wrong = [ranks[r] for r, (_, _, tok) in enumerate(peers)
             if r != me and not outcomes[r][1] and inbox[16 * r : 16 * (r + 1)] != bytes.fromhex(tok)]
    landed = f"rank(s) {wrong} wrote wrong bytes into rank {ranks[me]}'s memory" if wrong else ""
    checked = [o.decode() for o in rdv.allgather_bytes(landed.encode())]  # keeps buf alive until all are done
    del buf
    reads = [o[0] for o in outcomes if o[0]]
    writes = [o[1] for o in outcomes if o[1]] + [c for c in checked if c]
    return ("; ".join(reads) if reads else None), ("; ".join(writes) if writes else None)
