"""Node-aware MoE dispatch/combine (moe/internode.py) against the flat path, and its row bookkeeping.

* ``node_rows`` on a hand-made routing with a fake placement (pure torch, one process);
* the whole path on one host with a fake topology (4 ranks as 2 "nodes", block and interleaved
  placement): tests/jobs/moe_internode_job.py's ``compare_paths``, one launch;
* the same job across 2 testbed nodes x 2 ranks under mpiexec (and torchrun), where the rail
  group crosses the network (skipped where network namespaces cannot be made).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import collectives
from benchmarks.testbed import node_env
from moe.internode import node_rows
from spmd import mpiexec_path
from testbed import make_testbed, start_job  # noqa: F401 - make_testbed: the fixture

JOB = Path(__file__).parent / "jobs" / "moe_internode_job.py"
sys.path.insert(0, str(JOB.parent))
from moe_internode_job import compare_paths  # noqa: E402


def test_node_rows_dedup_against_a_python_reference():
    g = torch.Generator().manual_seed(5)
    P, G, T, k = 6, 3, 40, 5
    node_of = torch.tensor([0, 1, 2, 0, 1, 2, G])          # interleaved placement; entry P: nowhere
    owner = torch.randint(0, P, (T, k), generator=g)
    owner[torch.rand(T, k, generator=g) < 0.3] = P          # unsent slots
    row_node, row_tok, row_slots = node_rows(owner, node_of, G)
    want = [(n, t) for n in range(G) for t in range(T) if any(int(node_of[o]) == n for o in owner[t].tolist())]
    assert list(zip(row_node.tolist(), row_tok.tolist())) == want
    for (n, t), slots in zip(want, row_slots.tolist()):
        assert slots == [int(node_of[o]) == n for o in owner[t].tolist()]
    # each token crosses to a node once, however many of its slots live there
    assert row_node.numel() < int((owner < P).sum())


FAKE_TOPOLOGIES = {"block": ((0, 1), (2, 3)), "interleaved": ((0, 2), (1, 3)), "one-per-node": ((0,), (1,), (2,), (3,))}


def _fake_topology_body(comm):
    from moe_internode_job import one_rank_bad

    out = {name: compare_paths(comm, nodes) for name, nodes in FAKE_TOPOLOGIES.items()}
    out["bad"] = one_rank_bad(comm, FAKE_TOPOLOGIES["block"])
    return out


@pytest.fixture(scope="module")
def fake_topology_results():
    """One launch of 4 ranks on this host for every fake topology and the bad-argument case (timeout 20 s:
    a hang in the bad-argument case raises the timeout instead of ValueError)."""
    return collectives.launch(_fake_topology_body, 4, timeout=20)


@pytest.mark.parametrize("name", list(FAKE_TOPOLOGIES))
def test_node_aware_matches_flat_with_a_fake_topology(fake_topology_results, name):
    nodes = FAKE_TOPOLOGIES[name]
    results = [res[name] for res in fake_topology_results]
    assert all(res["checks"] >= 30 for res in results), results
    if len(nodes[0]) > 1:   # dedup happened somewhere: fewer inter-node bytes than the flat path in some case
        assert any(t[0] < t[2] for res in results for t in res["traffic"]), results
    else:                   # one rank per node: a node is a rank, so both paths send the same
        assert all(t[0] == t[2] and t[1] == 0 for res in results for t in res["traffic"]), results


def test_a_bad_argument_on_one_rank_fails_every_rank(fake_topology_results):
    """Rank 3 passes x of another dtype to dispatch, then weights of another shape to combine. Every rank
    raises ValueError: rank 3 its own message, its peers in a sub-group naming it, and the others naming
    the peer that relayed it to them (their only news)."""
    per_rank = [res["bad"] for res in fake_topology_results]
    for case in ("dispatch", "combine"):
        kinds = [outcomes[case][0] for outcomes in per_rank]
        texts = [outcomes[case][1] for outcomes in per_rank]
        assert kinds == ["ValueError"] * 4, (case, per_rank)
        assert f"{case} on rank 3:" in texts[3], texts
        assert all(re.search(r"rank\(s\) \[[123]\] rejected", t) for t in texts[:3]), texts
        assert any("rank(s) [3] rejected" in t for t in texts[:3]), texts


@pytest.mark.parametrize("nodes,ppn", [(2, 2), (3, 1)], ids=["2x2", "3x1"])
@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_node_aware_across_testbed_nodes(make_testbed, tmp_path, launcher, nodes, ppn):  # noqa: F811 - fixture
    if launcher == "mpiexec" and mpiexec_path() is None:
        pytest.skip("no mpiexec (pip install mpich)")
    tb = make_testbed(nodes)
    out = tmp_path / "reports"
    out.mkdir()
    env = node_env({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    logs = [open(tmp_path / f"launcher{i}.log", "w") for i in range(nodes)]
    try:
        procs = start_job(tb, launcher, ppn, [str(JOB), "--out", str(out)], env, logs)
        for p in procs:
            p.wait(timeout=180)
    finally:
        for f in logs:
            f.close()
    log_text = "\n".join((tmp_path / f"launcher{i}.log").read_text()[-3000:] for i in range(nodes))
    reports = {int(f.stem): json.loads(f.read_text()) for f in out.glob("*.json")}
    assert sorted(reports) == list(range(nodes * ppn)), f"reports from {sorted(reports)}:\n{log_text}"
    for r, rep in sorted(reports.items()):
        assert rep["ok"], f"rank {r} failed:\n{rep.get('error')}\n{log_text}"
        assert rep["hostname"] == f"node{r // ppn}", rep
        assert rep["nodes"] == [list(range(i * ppn, (i + 1) * ppn)) for i in range(nodes)], rep
        assert rep["checks"] >= 30, rep
    if ppn > 1:  # dedup happened somewhere: fewer inter-node bytes than the flat path
        assert any(t[0] < t[2] for rep in reports.values() for t in rep["traffic"]), reports
    else:  # one rank per node: a token reaches a node's only rank once either way
        assert all(t[0] == t[2] for rep in reports.values() for t in rep["traffic"]), reports

