"""One POSIX shared-memory segment per group, mapped by every rank of one node.

Used by the host transports (``shm``) and by the host provider of ``ipc``. Group rank 0 creates
the segment under a 128-bit random name with mode 0600 and every rank maps it; the name is
unlinked as soon as every rank holds a mapping, so nothing stays in /dev/shm even when all ranks
are SIGKILLed afterwards. A crash inside that short window leaves a segment whose creator is
gone; the next creator on the node removes it (:func:`remove_stale_segments`).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets

from ._host import pid_alive
from .base import GroupInfo

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "moecomm"

_SEGMENT_RE = re.compile(rf"^{SEGMENT_PREFIX}-(\d+)-(\d+)-[0-9a-f]+$")


def remove_stale_segments() -> list[str]:
    """Unlink this user's segments whose creating process is gone (left by a crash).

    Returns the names removed.
    """
    removed = []
    uid = os.getuid()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        m = _SEGMENT_RE.match(name)
        if not m or int(m.group(1)) != uid or pid_alive(int(m.group(2))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d stale shared-memory segment(s) left by crashed runs: %s", len(removed), removed)
    return removed


def create_and_map(group: GroupInfo, total: int, *, what: str = "shared memory") -> tuple[mmap.mmap, str]:
    """Collectively create (rank 0) and map (every rank) a private segment of ``total`` bytes.

    Called by every rank of ``group``; uses two ``allgather_bytes`` of the group's rendezvous.
    what: how errors name the user of the segment (``"shared memory"``, ``"ipc host provider"``).
    Returns (the writable mapping, the segment's name, already unlinked). Raises RuntimeError on
    every rank, naming the ranks and reasons, when any rank could not create or map it.
    """
    rdv = group.rendezvous
    ranks = group.global_ranks
    name, path, err = "", "", ""
    mm = None
    if group.rank == 0:
        remove_stale_segments()
        name = f"{SEGMENT_PREFIX}-{os.getuid()}-{os.getpid()}-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.ftruncate(fd, total)
                mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        except OSError as e:
            err = f"rank {ranks[0]} could not create {path}: {e}"
    names = rdv.allgather_bytes((err or name).encode() if group.rank == 0 else b"")
    leader = names[0].decode()
    if not leader.startswith(SEGMENT_PREFIX):
        raise RuntimeError(f"{what} unavailable: {leader}")
    if group.rank != 0:
        name, path = leader, os.path.join(SHM_DIR, leader)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if st.st_uid != os.getuid() or (st.st_mode & 0o077):
                    raise PermissionError(f"{path} is not private to this user (mode {oct(st.st_mode)})")
                if st.st_size != total:
                    raise OSError(f"{path} has size {st.st_size}, expected {total}")
                mm = mmap.mmap(fd, total)
            finally:
                os.close(fd)
        except OSError as e:
            err = f"rank {ranks[group.rank]} could not map {path}: {e}"
    status = rdv.allgather_bytes(err.encode())
    if group.rank == 0:
        try:
            os.unlink(path)  # every rank holds a mapping now; the name is no longer needed
        except OSError:
            pass
    errors = [s.decode() for s in status if s]
    if errors:
        if mm is not None:
            mm.close()
        raise RuntimeError(f"{what} unavailable: " + "; ".join(errors))
    assert mm is not None
    return mm, name
