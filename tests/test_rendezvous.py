"""Rendezvous: an exchange abandoned at a timeout keeps its buffers (MPI may still write into them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spmd import mpiexec_path

HERE = Path(__file__).parent


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec")
def test_mpi_rendezvous_keeps_buffers_of_an_abandoned_exchange():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    p = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(HERE / "jobs" / "rendezvous_job.py")],
                       capture_output=True, text=True, timeout=120, env=env)
    reports = {r["rank"]: r for r in (json.loads(line) for line in p.stdout.splitlines() if line.startswith("{"))}
    assert p.returncode == 0 and set(reports) == {0, 1}, p.stdout + p.stderr
    assert "timed out" in reports[0]["timeout"] and reports[0]["kept"] == 1, reports
    assert reports[0]["alive"] and reports[1]["alive"], reports
