"""Hierarchical (node-aware) host collectives across the testbed's nodes (collectives/hierarchical.py).

One launch per launcher of tests/jobs/hierarchical_job.py on 2 nodes x 2 ranks: plan() names the
hierarchical path and its stages, all_reduce / all_gather / reduce_scatter equal the flat transport's for
several dtypes, ops, odd sizes and empty tensors, all_reduce bits agree across ranks, and a shape that
differs on one rank makes every rank raise naming it, and a failure in one node's intra-node stage makes
every rank raise without waiting out the timeout. Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.testbed import node_env
from spmd import mpiexec_path
from testbed import make_testbed, start_job  # noqa: F401 - make_testbed: the fixture

JOB = Path(__file__).parent / "jobs" / "hierarchical_job.py"
NODES, PPN = 2, 2


@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_hierarchical_equals_flat(make_testbed, tmp_path, launcher):  # noqa: F811 - fixture
    if launcher == "mpiexec" and mpiexec_path() is None:
        pytest.skip("no mpiexec (pip install mpich)")
    tb = make_testbed(NODES)
    out = tmp_path / "reports"
    out.mkdir()
    args = ["--nodes", str(NODES), "--ppn", str(PPN), "--launcher", launcher, "--out", str(out)]
    env = node_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MPIR_CVAR_CH4_NETMOD": "ofi"})
    log = tmp_path / "launcher.log"
    with open(log, "w") as f:
        procs = start_job(tb, launcher, PPN, [str(JOB), *args], env, [f])
        try:
            for p in procs:
                p.wait(timeout=150)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    text = log.read_text()[-4000:]
    reports = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(reports) == list(range(NODES * PPN)), f"reports from ranks {sorted(reports)}; launcher output:\n{text}"
    failed = "".join(f"rank {r} failed:\n{rep.get('error')}\n" for r, rep in sorted(reports.items()) if not rep["ok"])
    assert not failed, f"{failed}launcher output:\n{text}"
    for r, rep in sorted(reports.items()):
        assert rep["hostname"] == f"node{r // PPN}" and rep["checks"] >= 40, rep
        assert "hierarchical/" in rep["plan"] and "(2 nodes x 2 rails)" in rep["plan"], rep["plan"]
        # a failure in node 0's intra-node stage: every rank raised, told by the closed sub-groups, not by
        # the 30 s timeout (PeerFailedError; rank 1, whose group was closed, CommunicatorBrokenError)
        fail = rep["failure"]
        want = "CommunicatorBrokenError" if r == 1 else "PeerFailedError"
        assert fail["error"] == want and fail["seconds"] < 25, (r, fail)
