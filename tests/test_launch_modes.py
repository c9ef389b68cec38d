"""Launch modes: torchrun and mpiexec (external launchers), and the MPI transport's own test run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd import UNDER_MPI, mpiexec_path, shm_segments

HERE = Path(__file__).parent
ROOT = HERE.parent
pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own launchers")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("MOECOMM_TRANSPORT", None)
    return env


def _reports(out: str) -> list[dict]:
    # ranks share one pipe, so their lines can interleave: pick out the JSON objects themselves
    return sorted((json.loads(m) for m in re.findall(r'\{"rank"[^{}]*\}', out)), key=lambda d: d["rank"])


def test_torchrun_launch():
    before = shm_segments()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(HERE / "jobs" / "collective_job.py")], capture_output=True, text=True, timeout=180,
                       env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    reps = _reports(p.stdout)
    assert [d["rank"] for d in reps] == [0, 1] and all(d["ok"] for d in reps)
    assert all(d["launch"] == "torchrun" and d["size"] == 2 and d["transports"] == ["shm"] for d in reps)
    assert [d["local_rank"] for d in reps] == [0, 1]
    assert shm_segments() <= before


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra: pip install '.[test]')")
def test_mpiexec_launch():
    p = subprocess.run([mpiexec_path(), "-n", "3", sys.executable, str(HERE / "jobs" / "collective_job.py")],
                       capture_output=True, text=True, timeout=180, env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    reps = _reports(p.stdout)
    assert [d["rank"] for d in reps] == [0, 1, 2] and all(d["ok"] for d in reps)
    assert all(d["launch"] == "mpi" and d["transports"] == ["mpi", "shm"] for d in reps)


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra: pip install '.[test]')")
def test_collective_suite_under_mpiexec():
    """The collective and fault tests again, as `mpiexec -n 2 python -m pytest`: the mpi transport's run."""
    p = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        str(HERE / "test_collectives.py"), str(HERE / "test_faults.py")],
                       capture_output=True, text=True, timeout=900, env=_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    assert "failed" not in p.stdout and p.stdout.count(" passed") == 2, p.stdout[-2000:]
