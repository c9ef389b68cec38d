"""tools.profile_small and tools.tune_wait_spin under mpiexec: they run and report what they time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd import UNDER_MPI, mpiexec_path

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("op", ["all_gather", "all_to_all"])
def test_profile_small_reports_plan_times_and_profile(op):
    mpiexec = mpiexec_path()
    if mpiexec is None or UNDER_MPI:
        pytest.skip("needs mpiexec, outside an mpiexec job")
    res = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "tools.profile_small", "--op", op,
                          "--bytes", "64", "--calls", "300", "--top", "5"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert re.search(rf"^# {op} of 64 B per rank on 2 ranks: .* -> shm/", out, re.M), out
    times = re.search(r"moecomm ([0-9.]+) us, mpi4py ([0-9.]+) us", out)
    assert times and float(times.group(1)) > 0 and float(times.group(2)) > 0, out
    assert "function calls" in out and f"{op}" in out.split("Ordered by")[-1], out


def test_tune_wait_spin_reports_every_op_and_budget():
    """tools.tune_wait_spin under mpiexec: one row per op and size, a positive time per budget."""
    mpiexec = mpiexec_path()
    if mpiexec is None or UNDER_MPI:
        pytest.skip("needs mpiexec, outside an mpiexec job")
    res = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "tools.tune_wait_spin", "--sizes", "2M",
                          "--budgets", "0,50", "--blocks", "2"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if not line.startswith("#")]
    ops = [re.match(r"\s*(all_gather in place|all_gather|all_to_all)\s+2 MiB\s+0 us:\s+(\d+)\s+50 us:\s+(\d+)$", r)
           for r in rows]
    assert len(rows) == 3 and all(ops), res.stdout
    assert [m.group(1) for m in ops] == ["all_gather", "all_gather in place", "all_to_all"], res.stdout
    assert all(int(m.group(2)) > 0 and int(m.group(3)) > 0 for m in ops), res.stdout
