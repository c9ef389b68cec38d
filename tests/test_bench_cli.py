"""`moecomm bench`: the nccl-tests-style table, self-launched and under mpiexec, every row checked."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from spmd import UNDER_MPI
from test_launch_modes import ROOT, _env, mpiexec

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own ranks")
COLUMNS = ["size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"]
ROW = re.compile(r"^\s*(all_reduce|all_gather|reduce_scatter|all_to_all|broadcast)\s+(\d+)\s+(\d+)\s+(\w+)\s+(\w+)"
                 r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\w+)/(\w+)$")


def _rows(out: str) -> list[tuple]:
    return [m.groups() for m in map(ROW.match, out.splitlines()) if m]


def _check_table(out: str, ops: list[str], transports: set[str]) -> list[tuple]:
    header = next(line for line in out.splitlines() if line.startswith("#") and "size" in line)
    assert header.split()[1:9] == COLUMNS, header
    rows = _rows(out)
    assert {r[0] for r in rows} == set(ops)
    assert {r[9] for r in rows} == transports
    assert all(r[8] == "0" for r in rows), "a row has wrong results"
    assert all(float(r[5]) > 0 for r in rows)
    for t in transports:
        assert f"# {t}: Avg bus bandwidth" in out and f"# {t}: Out of bounds values : 0 OK" in out
    return rows


def test_bench_self_launched():
    ops = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
    p = subprocess.run([sys.executable, "-m", "benchmarks.cli", "bench", "-b", "8", "-e", "1M", "-f", "8",
                        "--iters", "3", "--warmup", "1", "--ops", ",".join(ops), "--nprocs", "3"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _check_table(p.stdout, ops, {"shm"})
    ar = [r for r in rows if r[0] == "all_reduce"]
    assert [int(r[1]) for r in ar] == [8, 64, 512, 4096, 32768, 262144]
    # nccl-tests conventions: all_gather's size is the gathered output (rounded down to a multiple of
    # ranks * itemsize), count the per-rank elements
    ag = {int(r[1]): int(r[2]) for r in rows if r[0] == "all_gather"}
    assert ag[262140] == 262144 // 4 // 3 and all(s >= 12 for s in ag)


@pytest.mark.skipif(mpiexec() is None, reason="no mpiexec (install the test extra)")
def test_bench_under_mpiexec_same_columns_both_transports():
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "benchmarks.cli", "bench", "-b", "1K", "-e", "256K",
                        "-f", "16", "--iters", "3", "--warmup", "1", "--transport", "shm,mpi"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_table(p.stdout, ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"], {"shm", "mpi"})
    assert "launched by mpi" in p.stdout


def test_bench_rejects_unknown_op():
    p = subprocess.run([sys.executable, "-m", "benchmarks.cli", "bench", "--ops", "all_reduce,gossip"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert p.returncode != 0 and "gossip" in p.stderr
