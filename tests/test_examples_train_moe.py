"""examples/train_moe.py as a newcomer runs it (``python examples/train_moe.py``, see test_examples.py):
it must exit 0, print the loss of each of its 5 steps, and report that the 2 x 2-rank run (data x
tensor/expert parallel) agrees with the one-process run within 1e-9, losses and parameters alike.
The same with ``--layout ep-etp`` (the MoE layer EP over the data-parallel groups x expert tensor
parallel over the model-parallel ones).

The second test shows that this check has teeth: the same script with the usual data-parallel
mistake (every gradient summed over the data-parallel group only, so the replicated norms and router,
which see half the sequence on each model-parallel rank, keep half their gradient) must exit 1 and
say FAILED. It is in the slow tier (a second run of the example): `python -m pytest -m slow
tests/test_examples_train_moe.py` runs it.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from test_examples import run_example
from test_readme import ROOT, _env, _in_mpi_job

TRAIN_MOE = ROOT / "examples" / "train_moe.py"
STEPS, TOLERANCE = 5, 1e-9

# examples/train_moe.py, but reducing every gradient over dp alone. launch's fork server imports
# this script, so the ranks run the patched module too.
DP_ONLY = f"""
import sys

sys.path.insert(0, {str(TRAIN_MOE.parent)!r})
import train_moe

_buckets = train_moe.gradient_buckets


def dp_only(model):
    complete, partial, whole = _buckets(model)
    return complete + partial + whole, [], []


train_moe.gradient_buckets = dp_only

if __name__ == "__main__":
    sys.exit(train_moe.main())
"""


def _reported(out: str, label: str) -> float:
    """The number the example prints after ``label: ``."""
    m = re.search(rf"^{re.escape(label)}: (\S+)", out, re.MULTILINE)
    assert m, f"no '{label}:' line in:\n{out}"
    return float(m.group(1))


def _python(cwd, *args) -> subprocess.CompletedProcess:
    """``python ARGS`` from ``cwd`` with the repository on PYTHONPATH, its output captured."""
    return subprocess.run([sys.executable, *map(str, args)], check=False, capture_output=True, text=True, timeout=180,
                          env=_env(), cwd=cwd)


def _check_run(out: str) -> None:
    lines = out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == [f"step {i}" for i in range(1, STEPS + 1)], out
    losses = [float(s.split("loss ")[1]) for s in steps]
    assert all(0 < x < 10 for x in losses), out
    assert _reported(out, "max loss difference") <= TOLERANCE, out
    assert _reported(out, "max parameter difference") <= TOLERANCE, out
    assert lines[-1] == "2 x 2 ranks agree with one process within 1e-09: ok", out


@pytest.mark.skipif(_in_mpi_job(), reason="starts its own ranks")
def test_train_moe_example_matches_one_process(tmp_path):
    out = run_example(TRAIN_MOE, tmp_path, timeout=180)
    assert out.splitlines()[0] == "layout ep: MoE layer EP over mp", out
    _check_run(out)


@pytest.mark.skipif(_in_mpi_job(), reason="starts its own ranks")
def test_train_moe_example_with_expert_tensor_parallelism_matches_one_process(tmp_path):
    p = _python(tmp_path, TRAIN_MOE, "--layout", "ep-etp")
    assert p.returncode == 0, f"exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-5000:]}"
    assert p.stdout.splitlines()[0] == "layout ep-etp: MoE layer EP over dp x ETP over mp (all 4 ranks)", p.stdout
    _check_run(p.stdout)


@pytest.mark.slow  # a second run of the example (about 15 s): `pytest -m slow` runs it
@pytest.mark.skipif(_in_mpi_job(), reason="starts its own ranks")
def test_train_moe_check_fails_when_gradients_are_reduced_over_dp_only(tmp_path):
    script = tmp_path / "dp_only.py"
    script.write_text(DP_ONLY)
    p = _python(tmp_path, script)
    out = p.stdout
    assert p.returncode == 1, f"exited {p.returncode}:\n{out}{p.stderr[-5000:]}"
    assert out.splitlines()[-1] == "2 x 2 ranks agree with one process within 1e-09: FAILED", out
    assert _reported(out, "max loss difference") > 1e3 * TOLERANCE, out
    assert _reported(out, "max parameter difference") > 1e3 * TOLERANCE, out
