"""``bench-moe --skew``: Zipf routing, with and without EPLB, in one run (benchmarks/bench_moe_skew.py).

Only what the run must get right is checked here (the routing, the balance, the results); its timings are a
measurement (benchmarks/results/cpu-bench-moe-skew-*.txt), never a test.
"""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from benchmarks.bench_moe_skew import default_redundant, zipf_routing
from benchmarks.cli import main


def test_zipf_routing_is_skewed_distinct_and_seeded():
    r = zipf_routing(4000, 16, 4, 1.2, seed=3)
    assert r.shape == (4000, 4) and r.dtype == torch.int64
    assert all(len(set(row)) == 4 for row in r.tolist())  # k distinct experts per token
    counts = torch.bincount(r.reshape(-1), minlength=16)
    assert counts[0] > counts[7] > counts[15] > 0  # expert 0 the hottest, the tail still chosen
    assert torch.equal(r, zipf_routing(4000, 16, 4, 1.2, seed=3))
    uniform = torch.bincount(zipf_routing(4000, 16, 4, 0.0, seed=3).reshape(-1), minlength=16).double()
    assert uniform.max() / uniform.mean() < 1.15
    assert zipf_routing(0, 16, 4, 1.2, seed=0).shape == (0, 4)
    assert default_redundant(256, 8) == 64 and default_redundant(8, 4) == 4


def test_bench_moe_skew_balances_the_ranks(tmp_path):
    out = tmp_path / "skew.json"
    res = CliRunner().invoke(main, ["bench-moe", "--skew", "1.2", "--nprocs", "4", "--tokens", "64", "--hidden", "32",
                                    "--experts", "16", "-k", "2", "-n", "1", "-w", "0", "-J", str(out)])
    assert res.exit_code == 0, res.output
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["no-eplb"]["ok"] and rows["eplb"]["ok"]
    assert rows["no-eplb"]["max_over_mean"] > 1.8  # rank 0 holds the hot experts 0-3
    assert rows["eplb"]["max_over_mean"] < 1.2
    assert len(rows["eplb"]["placement"]) == 16 + default_redundant(16, 4)
    assert sum(rows["eplb"]["pairs_per_rank"]) == sum(rows["no-eplb"]["pairs_per_rank"]) == 4 * 64 * 2
    res = CliRunner().invoke(main, ["bench-moe", "--redundant", "4"])
    assert res.exit_code == 2 and "--skew" in res.output
