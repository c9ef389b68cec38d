"""`moecomm bench`: the nccl-tests-style table, self-launched and under mpiexec, every row checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spmd import UNDER_MPI
from test_launch_modes import ROOT, _env, mpiexec

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own ranks")
# nccl-tests' columns (out-of-place, then in-place), with the op first and p50/p99 + peer/algorithm last
COLUMNS = ["op", "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong",
           "time", "algbw", "busbw", "#wrong", "p50", "p99", "peer/algorithm"]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def parse_rows(out: str) -> list[dict]:
    """Table lines of `moecomm bench` output as dicts (numbers converted; #wrong N/A -> -1)."""
    rows = []
    for line in out.splitlines():
        f = line.split()
        if len(f) != len(COLUMNS) or f[0] not in OPS:
            continue
        peer, _, algo = f[16].partition("/")
        wrong = [-1 if w == "N/A" else int(w) for w in (f[9], f[13])]
        rows.append(dict(op=f[0], size=int(f[1]), count=int(f[2]), type=f[3], redop=f[4], root=int(f[5]),
                         time=float(f[6]), algbw=float(f[7]), busbw=float(f[8]), wrong=wrong[0],
                         ip_time=float(f[10]), ip_algbw=float(f[11]), ip_busbw=float(f[12]), ip_wrong=wrong[1],
                         p50=float(f[14]), p99=float(f[15]), peer=peer, algorithm=algo))
    return rows


def header(out: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith("#") and " size " in line)
    return line.split()[1:]


def _check_table(out: str, ops: list[str], transports: set[str]) -> list[dict]:
    assert header(out) == COLUMNS, header(out)
    rows = parse_rows(out)
    assert {r["op"] for r in rows} == set(ops)
    assert {r["peer"] for r in rows} == transports
    assert all(r["wrong"] == 0 for r in rows), "a row has wrong results"
    # nccl-tests checks every in-place variant except all_to_all's
    assert all((r["ip_wrong"] == -1) == (r["op"] == "all_to_all") for r in rows)
    assert all(r["ip_wrong"] in (0, -1) for r in rows)
    assert all(r["time"] > 0 and r["ip_time"] > 0 and r["p99"] >= r["p50"] > 0 for r in rows)
    for t in transports:
        assert f"# {t}: Avg bus bandwidth" in out and f"# {t}: Out of bounds values : 0 OK" in out
    return rows


def test_bench_self_launched(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.cli", "bench", "-b", "8", "-e", "1M", "-f", "8",
                        "--iters", "3", "--warmup", "1", "--ops", ",".join(OPS), "--nprocs", "3", "--no-save"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _check_table(p.stdout, list(OPS), {"shm"})
    ar = [r for r in rows if r["op"] == "all_reduce"]
    assert [r["size"] for r in ar] == [8, 64, 512, 4096, 32768, 262144]
    # nccl-tests conventions: all_gather's size is the gathered output (rounded down to a multiple of
    # ranks * itemsize), count the per-rank elements
    ag = {r["size"]: r["count"] for r in rows if r["op"] == "all_gather"}
    assert ag[262140] == 262144 // 4 // 3 and all(s >= 12 for s in ag)
    assert all(r["root"] == (0 if r["op"] == "broadcast" else -1) for r in rows)
    assert list(tmp_path.iterdir()) == [], "--no-save wrote files"


@pytest.mark.skipif(mpiexec() is None, reason="no mpiexec (install the test extra)")
def test_bench_under_mpiexec_same_columns_both_transports(tmp_path):
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "benchmarks.cli", "bench", "-b", "1K", "-e", "256K",
                        "-f", "16", "--iters", "3", "--warmup", "1", "--transport", "shm,mpi", "--no-save"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_table(p.stdout, ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"], {"shm", "mpi"})
    assert "launched by mpi" in p.stdout


def test_bench_rejects_unknown_op():
    p = subprocess.run([sys.executable, "-m", "benchmarks.cli", "bench", "--ops", "all_reduce,gossip"],
                       capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert p.returncode != 0 and "gossip" in p.stderr


def test_bench_rejects_bad_flags():
    from click.testing import CliRunner

    from benchmarks.cli import main

    for args, word in ((["-d", "float8"], "float8"), (["-o", "xor"], "xor"), (["-b", "lots"], "lots"),
                       (["-f", "1"], "-f"), (["-r", "5"], "root 5")):
        res = CliRunner().invoke(main, ["bench", *args])
        assert res.exit_code == 2 and word in res.output, (args, res.output)
