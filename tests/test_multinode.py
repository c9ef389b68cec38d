"""Jobs across several nodes: the testbed's network namespaces (benchmarks/testbed.py), under torchrun and mpiexec.

One launch per (launcher, layout) runs tests/jobs/multinode_job.py on every rank, which checks topology,
transport choice, every collective against a reference, sub-groups within and across nodes and a
mismatched shape, then kills its last rank: the ranks on the other nodes must raise naming it. The
fixture then checks that the testbed left nothing behind. Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks.testbed import node_env
from spmd import left_behind, mpiexec_path, shm_segments
from testbed import make_testbed, start_job  # noqa: F401 - make_testbed: the fixture

JOB = Path(__file__).parent / "jobs" / "multinode_job.py"
LAYOUTS = [(2, 2), (3, 1)]  # (nodes, ranks per node)


def _read_reports(out: Path) -> dict[int, dict]:
    reports = {}
    for f in out.glob("*.json"):
        try:
            reports[int(f.stem)] = json.loads(f.read_text())
        except (ValueError, OSError):
            pass  # being written
    return reports


def _wait_for_reports(out: Path, must: list[int], procs: list[subprocess.Popen], limit: float) -> dict:
    """Every rank's report once the ranks in ``must`` have written their kill result (or failed), or every
    launcher ended. torchrun's agents are not waited for: node 0's waits minutes for the failed node's."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        reports = _read_reports(out)
        if all(r in reports and ("kill" in reports[r] or not reports[r].get("ok", True)) for r in must):
            time.sleep(0.5)  # the victim's node mates, where their launcher let them finish
            return _read_reports(out)
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    return _read_reports(out)


@pytest.mark.parametrize("nodes,ppn", LAYOUTS, ids=[f"{n}x{p}" for n, p in LAYOUTS])
@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_job_across_nodes(make_testbed, tmp_path, launcher, nodes, ppn):  # noqa: F811 - fixture
    if launcher == "mpiexec" and mpiexec_path() is None:
        pytest.skip("no mpiexec (pip install mpich)")
    before = shm_segments()
    tb = make_testbed(nodes)
    size, victim = nodes * ppn, nodes * ppn - 1
    out = tmp_path / "reports"
    out.mkdir()
    args = ["--nodes", str(nodes), "--ppn", str(ppn), "--launcher", launcher, "--out", str(out)]
    env = node_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    # MPICH's UCX netmod segfaults a rank that sends to a dead process; OFI reports an error
                    "MPIR_CVAR_CH4_NETMOD": "ofi"})
    logs = [open(tmp_path / f"launcher{i}.log", "w") for i in range(nodes)]
    # -disable-auto-cleanup: Hydra would otherwise kill every rank when the victim dies
    procs = start_job(tb, launcher, ppn, [str(JOB), *args], env, logs, mpi_extra=["-disable-auto-cleanup"])
    try:
        off_victim_node = [r for r in range(size) if r // ppn != victim // ppn]
        reports = _wait_for_reports(out, off_victim_node, procs, limit=120.0)
    finally:
        for f in logs:
            f.close()
    log_text = "\n".join((tmp_path / f"launcher{i}.log").read_text()[-3000:] for i in range(nodes))
    assert sorted(reports) == list(range(size)), f"reports from ranks {sorted(reports)}; launcher output:\n{log_text}"
    for r, rep in sorted(reports.items()):
        assert rep["ok"], f"rank {r} failed:\n{rep.get('error')}\nlauncher output:\n{log_text}"
        assert rep["hostname"] == f"node{r // ppn}" and rep["checks"] >= 40, rep
    # the victim's death: every rank on another node raised, naming it
    assert not left_behind(before), "moecomm segments left in the host's /dev/shm"
    for r in off_victim_node:  # on the victim's node torchrun's agent may stop the others first
        kill = reports[r].get("kill")
        assert kill and kill["error"] in ("PeerFailedError", "CollectiveTimeoutError"), (r, kill, log_text)
        assert victim in kill["missing"] and re.search(rf"rank(\(s\))? \[?([0-9]+, )*{victim}\b", kill["message"]), \
            (r, kill)
