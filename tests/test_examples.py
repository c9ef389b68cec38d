"""examples/quickstart.py as a newcomer runs it: `python examples/quickstart.py`, in a fresh interpreter
from another directory with the repository on PYTHONPATH (as tests/test_readme.py runs the README's
blocks). It must exit 0 and print "ok" for every step of the tour (each checked against torch on every
rank inside the example), in order, and the plan of an all_reduce.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_readme import ROOT, _env, _in_mpi_job

QUICKSTART = ROOT / "examples" / "quickstart.py"
STEPS = ["all_reduce sum", "all_reduce max", "all_gather", "reduce_scatter", "all_to_all (uneven)",
         "all_to_all recv_counts", "broadcast from rank 2", "split + all_reduce in each half", "barrier"]


def run_example(path, cwd, timeout: float) -> str:
    """Run an example as a user does (``python examples/X.py`` from ``cwd``, the repository on
    PYTHONPATH); assert it exits 0 (showing its output if not) and return its stdout."""
    p = subprocess.run([sys.executable, str(path)], check=False, capture_output=True, text=True, timeout=timeout,
                       env=_env(), cwd=cwd)
    assert p.returncode == 0, f"{path.name} exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-5000:]}"
    return p.stdout


@pytest.mark.skipif(_in_mpi_job(), reason="starts its own ranks")
def test_quickstart_example_runs(tmp_path):
    out = run_example(QUICKSTART, tmp_path, timeout=120)
    lines = out.splitlines()
    assert [line for line in lines if line.endswith(": ok")] == [f"{step}: ok" for step in STEPS], out
    plans = [line for line in lines if line.startswith("plan: ")]
    assert len(plans) == 1 and plans[0].startswith("plan: all_reduce of 96 B -> "), out  # [8, 3] float32
