"""Settings that must agree across ranks, set differently per rank by the launcher's environment.

`mpiexec -n 1 -env VAR a python job.py : -n 1 -env VAR b python job.py` gives each rank its own
environment, as a careless job script or a heterogeneous cluster would: every rank must stop at
creation with a ValueError naming the variable and each rank's value, not compute with different
tunables or wait in different transports until the timeout.

One MPMD job runs every case in turn (tests/jobs/settings_job.py): the launcher gives each rank its
values of every case, and for each case a rank sets only that case's variables in its environment
and creates a communicator (which reads the environment at each creation). Its last case sets
nothing: the ranks, still in step after the failed creations, must then create one and compute.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd import UNDER_MPI, mpiexec_path

HERE = Path(__file__).parent
ROOT = HERE.parent
JOB = str(HERE / "jobs" / "settings_job.py")


pytestmark = [pytest.mark.skipif(UNDER_MPI, reason="starts its own mpiexec"),
              pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra)")]

# case: (variable, (rank 0's value, rank 1's value)); None: not set on that rank
DIFFERING = {
    # rank 1 leaves it to the performance model (collectives/prediction.py), and the message says so
    "one_shot_max": ("MOECOMM_SHM_ONE_SHOT_MAX", ("1000", None), ("rank 0: 1000", "rank 1: unset, so ")),
    "transport": ("MOECOMM_TRANSPORT", ("mpi", "shm"), ("rank 0: 'mpi'", "rank 1: 'shm'")),
    "slot_bytes": ("MOECOMM_SHM_SLOT_BYTES", (None, "65536"), ("rank 0: 1048576", "rank 1: 65536")),
}
CASES: dict[str, tuple[str | None, tuple[str | None, str | None]]] = {
    **{name: (var, values) for name, (var, values, _) in DIFFERING.items()},
    "bad_on_one_rank": ("MOECOMM_SHM_SLOT_BYTES", (None, "lots")),
    "all_equal": (None, (None, None)),  # last: the ranks are still in step and can compute
}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    """Run every case in one 2-rank MPMD job: {"cases": {case: {rank: report}}, "returncode", "output"}."""
    out = tmp_path_factory.mktemp("settings")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOECOMM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["SETTINGS_JOB_CASES"] = ",".join(CASES)
    # -disable-auto-cleanup: a rank that fails first must not get the others killed before they report
    cmd = [mpiexec_path(), "-disable-auto-cleanup"]
    for rank in range(2):
        if rank:
            cmd.append(":")
        cmd += ["-n", "1"]
        for i, (var, values) in enumerate(CASES.values()):
            if var is not None and values[rank] is not None:
                cmd += ["-env", f"SETTINGS_JOB_CASE{i}_{var}", values[rank]]
        cmd += [sys.executable, JOB, str(out)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
        returncode, output = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:  # the cases that finished have reported
        returncode = None
        output = "job timed out after 150 s\n" + "".join(
            s.decode(errors="replace") if isinstance(s, bytes) else s for s in (e.stdout, e.stderr) if s)
    cases: dict[str, dict[int, dict]] = {}
    for f in out.glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            rep = json.loads(line)
            cases.setdefault(rep["case"], {})[rep["rank"]] = rep
    return {"cases": cases, "returncode": returncode, "output": output}


def _reports(job: dict, case: str) -> list[dict]:
    """Both ranks' reports of ``case``, failing with the job's output if a rank did not report it."""
    got = job["cases"].get(case, {})
    assert sorted(got) == [0, 1], f"case {case}: reports from ranks {sorted(got)} only\n{job['output'][-4000:]}"
    return [got[0], got[1]]


@pytest.mark.parametrize("case", list(DIFFERING))
def test_setting_that_differs_across_ranks_stops_every_rank_at_creation(job, case):
    var, _, shown = DIFFERING[case]
    reports = _reports(job, case)
    # each rank says it, naming the variable and every rank's value
    assert all(rep["error"] == "ValueError" and rep["ok"] is None for rep in reports), reports
    for rep in reports:
        msg = rep["message"]
        assert re.match(r"ranks disagree on settings that must be equal on every rank: MOECOMM_", msg), rep
        assert var in msg and all(s in msg for s in shown), rep


def test_bad_setting_on_one_rank_stops_every_rank_at_creation(job):
    """A value that does not parse on one rank (its environment only) reaches the peers in the creation
    exchange: they raise naming that rank instead of waiting for it until the timeout."""
    rank0, rank1 = _reports(job, "bad_on_one_rank")
    assert rank1["error"] == "ValueError" and "MOECOMM_SHM_SLOT_BYTES='lots' is not an integer" in rank1["message"], \
        rank1  # rank 1's own error
    assert rank0["error"] == "ValueError" and re.search(  # what rank 0 is told
        r"rank\(s\) \[1\] could not create their communicator \(rank 1: ValueError: [^\n]*MOECOMM_SHM_SLOT_BYTES",
        rank0["message"]), rank0
    assert all("timed out" not in rep["message"] and rep["ok"] is None for rep in (rank0, rank1))


def test_ranks_that_agree_create_their_communicator_after_those_failures(job):
    """The control case: nothing set, so the same settings on both ranks; creation and an all-reduce
    work (so the failures above come from the settings, and they left the ranks in step)."""
    reports = _reports(job, "all_equal")
    assert all(rep["error"] is None and rep["ok"] is True for rep in reports), reports
    assert job["returncode"] == 0, job["output"][-4000:]
