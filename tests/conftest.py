"""Session-wide hygiene of the test suite."""

from __future__ import annotations

import glob
import os
import time
from typing import Iterator

import pytest

MPICH_SEGMENTS = "/dev/shm/mpich_shm_*"


def _mapped(paths: set[str]) -> set[str]:
    """The ``paths`` that some process still maps (read from /proc/*/maps)."""
    in_use: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:  # the process ended, or is not ours to read
            continue
        in_use |= {p for p in paths if p in text}
    return in_use


@pytest.fixture(scope="session", autouse=True)
def remove_mpich_segments_of_killed_ranks() -> Iterator[None]:
    """MPICH unlinks its shared-memory segment in MPI_Finalize, so a rank that the fault tests kill (or
    that exits after a creation error) leaves ``/dev/shm/mpich_shm_*`` behind: several MB of RAM per
    job on every run. At the end of the session, remove the ones created during it that no process
    maps any more (a job still running, such as the mpiexec that runs this pytest, keeps its own)."""
    before = set(glob.glob(MPICH_SEGMENTS))
    yield
    new = set(glob.glob(MPICH_SEGMENTS)) - before
    try:  # this session's own job (pytest run by mpiexec) keeps its segment: MPI_Finalize removes it
        with open("/proc/self/maps") as f:
            mine = f.read()
        new = {p for p in new if p not in mine}
    except OSError:
        pass
    deadline = time.monotonic() + 5.0  # a killed job's last processes may still be exiting
    while new:
        for path in new - _mapped(new):
            try:
                os.unlink(path)
            except OSError:  # another session removed it
                pass
        new = {p for p in new if os.path.exists(p)}
        if not new or time.monotonic() > deadline:
            break
        time.sleep(0.5)
