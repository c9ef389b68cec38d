"""tools.profile_small and tools.tune_wait_spin under mpiexec: they run and report what they time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd import UNDER_MPI, mpiexec_path

ROOT = Path(__file__).parent.parent
OPS = ("all_gather", "all_to_all")
# One mpiexec job runs every tool in turn (each tool's click command, as `python -m tools.X ARGS`
# runs it), rank 0 marking where each one's output starts: its 2 ranks import torch and mpi4py
# once (~7 CPU-s), not once per tool.
RUNS = [*((f"profile_small {op}", "profile_small", ["--op", op, "--bytes", "64", "--calls", "300", "--top", "5"])
          for op in OPS),
        ("tune_wait_spin", "tune_wait_spin", ["--sizes", "2M", "--budgets", "0,50", "--blocks", "2"])]
DRIVER = """
import importlib, sys
from mpi4py import MPI
for name, module, args in {runs!r}:
    if MPI.COMM_WORLD.rank == 0:
        print("=== " + name, flush=True)
    importlib.import_module("tools." + module).main(args, standalone_mode=False)
    sys.stdout.flush()
"""


@pytest.fixture(scope="module")
def outputs() -> dict[str, str]:
    """Each tool's stdout (rank 0 prints), by name."""
    mpiexec = mpiexec_path()
    if mpiexec is None or UNDER_MPI:
        pytest.skip("needs mpiexec, outside an mpiexec job")
    res = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", DRIVER.format(runs=RUNS)],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    parts = re.split(r"^=== (.+)\n", res.stdout, flags=re.M)
    out = dict(zip(parts[1::2], parts[2::2]))
    assert list(out) == [name for name, _, _ in RUNS], res.stdout
    return out


@pytest.mark.parametrize("op", OPS)
def test_profile_small_reports_plan_times_and_profile(op, outputs):
    out = outputs[f"profile_small {op}"]
    assert re.search(rf"^# {op} of 64 B per rank on 2 ranks: .* -> shm/", out, re.M), out
    times = re.search(r"moecomm ([0-9.]+) us, mpi4py ([0-9.]+) us", out)
    assert times and float(times.group(1)) > 0 and float(times.group(2)) > 0, out
    assert "function calls" in out and f"{op}" in out.split("Ordered by")[-1], out


def test_tune_wait_spin_reports_every_op_and_budget(outputs):
    """tools.tune_wait_spin under mpiexec: one row per op and size, a positive time per budget."""
    out = outputs["tune_wait_spin"]
    rows = [line for line in out.splitlines() if not line.startswith("#")]
    ops = [re.match(r"\s*(all_gather in place|all_gather|all_to_all)\s+2 MiB\s+0 us:\s+(\d+)\s+50 us:\s+(\d+)$", r)
           for r in rows]
    assert len(rows) == 3 and all(ops), out
    assert [m.group(1) for m in ops] == ["all_gather", "all_gather in place", "all_to_all"], out
    assert all(int(m.group(2)) > 0 and int(m.group(3)) > 0 for m in ops), out
