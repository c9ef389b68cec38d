"""Launch modes: torchrun and mpiexec (external launchers), and the MPI transport's own test run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd import UNDER_MPI, left_behind, mpiexec_path, shm_segments

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
    assert not left_behind(before)


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra: pip install '.[test]')")
def test_mpiexec_launch():
    p = subprocess.run([mpiexec_path(), "-n", "3", sys.executable, str(HERE / "jobs" / "collective_job.py")],
                       capture_output=True, text=True, timeout=180, env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    reps = _reports(p.stdout)
    assert [d["rank"] for d in reps] == [0, 1, 2] and all(d["ok"] for d in reps)
    assert all(d["launch"] == "mpi" and d["transports"] == ["mpi", "shm"] for d in reps)


# The mpi transport's run: pytest itself under mpiexec, one job per rank count (a job costs a fresh
# interpreter, torch import, collection and MPI start per rank, so the modules share it). Per module:
# the -k selection (None: all), and how many tests must pass on each rank (None: at least one; the
# collective and fault modules change often). Tests for the other rank count skip in a job.
MPI_JOBS = {
    2: {"test_collectives.py": (None, None),
        "test_faults.py": (None, None),
        "test_p2p.py": ("mismatch or silent", 3),
        "test_all_reduce_rmsnorm.py": ("values or bad_arguments", 2)},
    3: {"test_p2p.py": ("exchange or messages_of_every_kind", 1),
        "test_recv_counts.py": ("raises_everywhere", 2)},
}


def _keyword(modules: dict) -> str:
    # -k matches the module's name too: one expression that keeps each module's own selection
    return " or ".join(f"({Path(m).stem} and ({sel}))" if sel else Path(m).stem for m, (sel, _) in modules.items())


def _junit_counts(path: Path) -> dict[str, dict[str, int]]:
    """{module file: {"passed"/"failed"/"skipped": count}} from one rank's junit xml."""
    import xml.etree.ElementTree as ET

    counts: dict[str, dict[str, int]] = {}
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").split(".")[-1]
        if module.startswith("Test"):  # a class inside the module: tests.test_x.TestY
            module = case.get("classname", "").split(".")[-2]
        kinds = {child.tag for child in case}
        kind = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        c = counts.setdefault(module + ".py", {"passed": 0, "failed": 0, "skipped": 0})
        c[kind] += 1
    return counts


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra: pip install '.[test]')")
@pytest.mark.parametrize("nprocs", sorted(MPI_JOBS))
def test_collective_suite_under_mpiexec(nprocs, tmp_path):
    """test_collectives/test_faults (all), and the cases of test_p2p, test_recv_counts and
    test_all_reduce_rmsnorm that run at this rank count, as `mpiexec -n N python -m pytest`."""
    modules = MPI_JOBS[nprocs]
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    # one junit xml per rank (PMI_RANK: mpich's; OMPI_COMM_WORLD_RANK: Open MPI's)
    cmd = ('exec "$0" -m pytest -q -x -p no:cacheprovider -k "$1" '
           f'--junitxml="{tmp_path}/rank${{PMI_RANK:-$OMPI_COMM_WORLD_RANK}}.xml" "${{@:2}}"')
    p = subprocess.run([mpiexec_path(), "-n", str(nprocs), "bash", "-c", cmd, sys.executable, _keyword(modules),
                        *(str(HERE / m) for m in modules)],
                       capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    tail = p.stdout[-5000:] + p.stderr[-3000:]
    assert p.returncode == 0, tail
    for rank in range(nprocs):
        xml = tmp_path / f"rank{rank}.xml"
        assert xml.exists(), f"rank {rank} wrote no junit xml\n" + tail
        counts = _junit_counts(xml)
        for module, (sel, expected) in modules.items():
            c = counts.get(module, {"passed": 0, "failed": 0, "skipped": 0})
            assert c["failed"] == 0, f"rank {rank}: {module}: {c}\n" + tail
            if expected is None:
                assert c["passed"] > 0, f"rank {rank}: {module} (-k {sel!r}) passed nothing: {c}\n" + tail
            else:
                assert c["passed"] == expected, f"rank {rank}: {module} (-k {sel!r}): {c}, expected {expected} passed\n" + tail
        assert set(counts) <= set(modules), f"rank {rank}: unexpected modules {sorted(set(counts) - set(modules))}"
