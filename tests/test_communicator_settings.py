"""Settings that must agree across ranks, set differently per rank by the launcher's environment.

`mpiexec -n 1 -env VAR a python job.py : -n 1 -env VAR b python job.py` gives each rank its own
environment, as a careless job script or a heterogeneous cluster would: every rank must stop at
creation with a ValueError naming the variable and each rank's value, not compute with different
tunables or wait in different transports until the timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd import UNDER_MPI, mpiexec_path

HERE = Path(__file__).parent
ROOT = HERE.parent
JOB = str(HERE / "jobs" / "collective_job.py")


pytestmark = [pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec"),
              pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra)")]


def _run_mpmd(var: str, values: tuple[str | None, str | None]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOECOMM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # -disable-auto-cleanup: a rank that fails first must not get the others killed before they report
    cmd = [mpiexec_path(), "-disable-auto-cleanup"]
    for i, value in enumerate(values):
        if i:
            cmd.append(":")
        cmd += ["-n", "1"] + (["-env", var, value] if value is not None else []) + [sys.executable, JOB]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("var,values,shown", [
    # rank 1 leaves it to the performance model (collectives/prediction.py), and the message says so
    ("MOECOMM_SHM_ONE_SHOT_MAX", ("1000", None), ("rank 0: 1000", "rank 1: unset, so ")),
    ("MOECOMM_TRANSPORT", ("mpi", "shm"), ("rank 0: 'mpi'", "rank 1: 'shm'")),
    ("MOECOMM_SHM_SLOT_BYTES", (None, "65536"), ("rank 0: 1048576", "rank 1: 65536")),
])
def test_setting_that_differs_across_ranks_stops_every_rank_at_creation(var, values, shown):
    p = _run_mpmd(var, values)
    assert p.returncode != 0, p.stdout + p.stderr
    # the ranks share one stderr and Python writes "ValueError" and ": message" separately, so the
    # two tracebacks can interleave between them: find the messages themselves
    errors = re.findall(r"ranks disagree on settings that must be equal on every rank: MOECOMM_[^\n]*", p.stderr)
    assert len(errors) == 2 and "ValueError" in p.stderr, p.stderr[-3000:]  # each rank says it
    assert all(var in e and all(s in e for s in shown) for e in errors), errors
    assert '"ok": true' not in p.stdout


def test_bad_setting_on_one_rank_stops_every_rank_at_creation():
    """A value that does not parse on one rank (its environment only) reaches the peers in the creation
    exchange: they raise naming that rank instead of waiting for it until the timeout."""
    p = _run_mpmd("MOECOMM_SHM_SLOT_BYTES", (None, "lots"))
    assert p.returncode != 0, p.stdout + p.stderr
    assert "MOECOMM_SHM_SLOT_BYTES='lots' is not an integer" in p.stderr, p.stderr[-3000:]  # rank 1's own error
    assert re.search(r"rank\(s\) \[1\] could not create their communicator \(rank 1: ValueError: [^\n]*"
                     r"MOECOMM_SHM_SLOT_BYTES", p.stderr), p.stderr[-3000:]  # what rank 0 is told
    assert "timed out" not in p.stderr and '"ok": true' not in p.stdout
