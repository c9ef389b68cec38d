"""Smoke test of `moecomm bench-moe` at toy sizes (no timing asserts: timings belong to benchmarks)."""

from __future__ import annotations

from click.testing import CliRunner

from benchmarks.cli import main


def test_bench_moe_smoke():
    res = CliRunner().invoke(main, ["bench-moe", "--tokens", "48", "--hidden", "32", "--experts", "8", "-k", "3",
                                    "--nprocs", "2", "--iters", "2", "--warmup", "1", "--dtype", "float32"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    lines = res.output.splitlines()
    assert lines[0].startswith("# moecomm bench-moe: 2 ranks, 48 tokens/rank, hidden 32, top-3 of 8 experts")
    rows = [ln.split() for ln in lines if ln.split() and ln.split()[0] in ("0", "1")]
    assert sorted((r[0], r[1]) for r in rows) == [("0", "moecomm"), ("0", "torch-gloo"),
                                                  ("1", "moecomm"), ("1", "torch-gloo")]
    assert all(r[-1] == "ok" for r in rows)
    # both implementations deliver the same number of (token, rank) rows to each rank
    assert {r[0]: r[7] for r in rows if r[1] == "moecomm"} == {r[0]: r[7] for r in rows if r[1] == "torch-gloo"}


def test_bench_moe_rejects_bad_options():
    res = CliRunner().invoke(main, ["bench-moe", "--experts", "9", "-k", "2", "--nprocs", "2", "--cpu-scale"])
    assert res.exit_code != 0 and "not divisible" in res.output
