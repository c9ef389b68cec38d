"""`moecomm bench`: the nccl-tests-style table, self-launched and under mpiexec, every row checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spmd import UNDER_MPI
from spmd import mpiexec_path
from test_launch_modes import _env

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
    # every in-place variant is checked; nccl-tests skips all_to_all's, which moecomm and MPI define
    # (torch.distributed does not: its in-place all_to_all stays unchecked)
    assert all((r["ip_wrong"] == -1) == (r["op"] == "all_to_all" and r["peer"] in ("gloo", "nccl")) for r in rows)
    assert all(r["ip_wrong"] in (0, -1) for r in rows)
    assert all(r["time"] > 0 and r["ip_time"] > 0 and r["p99"] >= r["p50"] > 0 for r in rows)
    for t in transports:
        assert f"# {t}: Avg bus bandwidth" in out and f"# {t}: Out of bounds values : 0 OK" in out
    return rows


@pytest.fixture(scope="module")
def self_launched(tmp_path_factory):
    """One self-launched run (3 ranks, every op, --cycles 3, -vv) shared by the tests below: each starts an
    interpreter and a fork server (~6 CPU-s) that a run of its own would start again."""
    d = tmp_path_factory.mktemp("bench")
    cwd = d / "cwd"
    cwd.mkdir()
    p = subprocess.run([sys.executable, "-m", "benchmarks.cli", "-vv", "bench", "-b", "8", "-e", "1M", "-f", "8",
                        "--iters", "3", "--warmup", "1", "--cycles", "3", "--ops", ",".join(OPS), "--nprocs", "3",
                        "--no-save", "--json", str(d / "run.json")],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=cwd)
    return p, cwd, d / "run.json"


def test_bench_self_launched(self_launched):
    p, cwd, _ = self_launched
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _check_table(p.stdout, list(OPS), {"shm"})
    ar = [r for r in rows if r["op"] == "all_reduce"]
    assert [r["size"] for r in ar] == [8, 64, 512, 4096, 32768, 262144]
    # nccl-tests conventions: all_gather's size is the gathered output (rounded down to a multiple of
    # ranks * itemsize), count the per-rank elements
    ag = {r["size"]: r["count"] for r in rows if r["op"] == "all_gather"}
    assert ag[262140] == 262144 // 4 // 3 and all(s >= 12 for s in ag)
    assert all(r["root"] == (0 if r["op"] == "broadcast" else -1) for r in rows)
    assert list(cwd.iterdir()) == [], "--no-save wrote files"


def test_bench_cycles_print_each_row_once_and_record_the_option(self_launched):
    p, _, out = self_launched
    assert p.returncode == 0, p.stdout + p.stderr
    rows = _check_table(p.stdout, list(OPS), {"shm"})
    # one row per op and size, in sweep order, whatever the number of cycles; at 3 ranks the split ops
    # round a size down to a multiple of 3 float32s, and 8 bytes holds none
    want = [(op, size if op in ("all_reduce", "broadcast") else size // 12 * 12)
            for size in (8, 64, 512, 4096, 32768, 262144) for op in OPS
            if size >= 12 or op in ("all_reduce", "broadcast")]
    assert [(r["op"], r["size"]) for r in rows] == want
    assert "iters 3, warmup 1, cycles 3," in p.stdout
    run = json.loads(out.read_text())
    assert run["options"]["cycles"] == 3 and len(run["rows"]) == len(want)


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra)")
def test_bench_under_mpiexec_same_columns_both_transports(tmp_path):
    p = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "benchmarks.cli", "bench", "-b", "1K", "-e", "256K",
                        "-f", "16", "--iters", "3", "--warmup", "1", "--transport", "shm,mpi", "--no-save"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    _check_table(p.stdout, ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"], {"shm", "mpi"})
    assert "launched by mpi" in p.stdout


def test_bench_rejects_unknown_op():
    from click.testing import CliRunner

    from benchmarks.cli import main

    res = CliRunner().invoke(main, ["bench", "--ops", "all_reduce,gossip"])
    assert res.exit_code != 0 and "gossip" in res.stderr, (res.exit_code, res.output)


def test_bench_rejects_bad_flags():
    from click.testing import CliRunner

    from benchmarks.cli import main

    for args, word in ((["-d", "float8"], "float8"), (["-o", "xor"], "xor"), (["-b", "lots"], "lots"),
                       (["-f", "1"], "-f"), (["-r", "5"], "root 5")):
        res = CliRunner().invoke(main, ["bench", *args])
        assert res.exit_code == 2 and word in res.output, (args, res.output)


# ---- bad options: a one-line usage error (exit code 2) naming the option, before any rank starts ----
# Cases that the old code ran (an empty table, a traceback, or a full sweep) carry a tiny sweep, so
# that even there they end quickly.
TINY = ["-e", "8", "-n", "1", "-w", "0", "--no-save", "-q", "--ops", "all_reduce"]
BAD_BENCH = {
    "min above max": (["-b", "1G", "-e", "1K", "-n", "1", "-w", "0", "--no-save"], "-b/-e"),
    "negative min": (["-b", "-5", *TINY], "-b"),
    "fractional bytes": (["-b", "7.5", *TINY], "-b"),
    "no size runs": (["-b", "7", "-e", "7", "--ops", "reduce_scatter", "-n", "1", "-w", "0", "--no-save"], "-b/-e"),
    "negative checks": (["-c", "-1", "-b", "8", *TINY], "-c"),
    "no ranks": (["--nprocs", "0", *TINY], "--nprocs"),
    "no iterations": (["-n", "0", "-e", "8", "--no-save"], "-n"),
    "negative warmup": (["-w", "-1", "-e", "8", "--no-save"], "-w"),
    "no cycles": (["--cycles", "0", *TINY], "--cycles"),
    "zero timeout": (["--timeout", "0", *TINY], "--timeout"),
    "nan timeout": (["--timeout", "nan", *TINY], "--timeout"),
    "no ops": (["--ops", ",", "-e", "8", "--no-save"], "--ops"),
    "unknown transport": (["--transport", "gossip", *TINY], "--transport"),
    "peers without --compare": (["--peers", "gloo", *TINY], "--peers"),
    "figure format": (["--plot", "out.txt", "-b", "8", "-e", "8", "-n", "1", "-w", "0", "--ops", "all_reduce"],
                      "--plot"),
    "zero step factor": (["-f", "0", *TINY], "-f"),
    "negative seed": (["--seed", "-1", *TINY], "--seed"),
    "negative cuda graph": (["-G", "-1", *TINY], "--cuda-graph"),
    "cuda graph of cpu tensors": (["--cuda-graph", "4", "--device", "cpu", *TINY], "--cuda-graph"),
}


def _assert_usage_error(args: list[str], option: str) -> None:
    from click.testing import CliRunner

    from benchmarks.cli import main

    res = CliRunner().invoke(main, args)
    out = res.output
    assert res.exit_code == 2, (args, res.exit_code, out, res.exception)
    assert "Traceback" not in out and out.count("Error:") == 1, out
    error = out.strip().splitlines()[-1]
    assert error.startswith("Error: ") and option in error, (option, error)


@pytest.mark.parametrize("case", list(BAD_BENCH))
def test_bench_bad_option_is_a_usage_error(case):
    args, option = BAD_BENCH[case]
    _assert_usage_error(["bench", *args], option)


BAD_OTHERS = {
    "bench-moe negative tokens": (["bench-moe", "--tokens", "-5", "--experts", "8", "-k", "2", "-n", "1", "-w", "0"],
                                  "--tokens"),
    "bench-moe zero hidden": (["bench-moe", "--hidden", "0", "--tokens", "8", "--experts", "8", "-k", "2", "-n", "1",
                               "-w", "0", "--dtype", "float32"], "--hidden"),
    "bench-moe zero timeout": (["bench-moe", "--timeout", "0", "--tokens", "8", "--hidden", "8", "--experts", "8",
                                "-k", "2", "-n", "1", "-w", "0"], "--timeout"),
    "bench-tp zero tokens": (["bench-tp", "--tokens", "0", "--hidden", "8", "--ffn", "8", "--sizes", "1", "-n", "1",
                              "-w", "0"], "--tokens"),
    "bench-tp no sizes": (["bench-tp", "--sizes", ","], "--sizes"),
    "doctor no ranks": (["doctor", "--nprocs", "0", "--timeout", "5"], "--nprocs"),
    "doctor negative timeout": (["doctor", "--timeout", "-1"], "--timeout"),
}


@pytest.mark.parametrize("case", list(BAD_OTHERS))
def test_other_commands_bad_option_is_a_usage_error(case):
    args, option = BAD_OTHERS[case]
    _assert_usage_error(args, option)


def test_report_plot_to_a_format_matplotlib_cannot_write_is_a_usage_error(tmp_path):
    from benchmarks.output import make_run, save_json

    rows = [dict(op="all_reduce", transport="shm", size=1024, count=256, dtype="float32", redop="sum",
                 time_us=10.0, algbw=0.1, busbw=0.1, wrong=0)]
    run = tmp_path / "x.json"
    save_json(run, make_run(rows, {"nranks": 2}, {}))
    _assert_usage_error(["report", str(run), "--plot", str(tmp_path / "out.txt")], "--plot")
    assert not (tmp_path / "out.txt").exists()


def test_verbose_bench_logs_every_rank_transport_decisions(self_launched):
    """`moecomm -vv bench` self-launched: the ranks log at the CLI's level (DEBUG transport decisions)."""
    p, _, _ = self_launched
    assert p.returncode == 0, p.stdout + p.stderr
    for rank in (0, 1, 2):
        assert any(line.startswith("DEBUG collectives:") and f"rank {rank}: all_reduce of" in line
                   and "-> shm/" in line for line in p.stderr.splitlines()), (rank, p.stderr[-3000:])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU refusal")
def test_bench_cuda_graph_without_a_gpu_is_refused_before_any_rank_starts():
    _assert_usage_error(["bench", "--cuda-graph", "10", *TINY], "--cuda-graph")
    _assert_usage_error(["bench", "-G", "10", "--device", "cuda", *TINY], "needs a CUDA GPU")


def test_cuda_graph_sweeps_leave_out_what_a_peer_cannot_capture():
    from benchmarks.common import Row
    from benchmarks.peers import MemcpyPeer, MoecommPeer, Peer
    from benchmarks.sweep import plan_sweep
    from benchmarks.table import format_row

    class Comm:
        rank, size = 0, 2

    gpu = [MoecommPeer(Comm(), "ipc", device="cuda:0"), MemcpyPeer(0, 2, "cuda:0")]
    torch_nccl = Peer(0, 2)
    torch_nccl.name, torch_nccl.device = "nccl", "cuda:0"
    ops = ["all_reduce", "all_to_all"]
    eager, _ = plan_sweep([*gpu, torch_nccl], ops, ["float32"], ["sum"], [64], 2)
    graph, notes = plan_sweep([*gpu, torch_nccl], ops, ["float32"], ["sum"], [64], 2, graph=True)
    assert ("all_to_all", "ipc") in {(s.op, s.peer.name) for s in eager}
    assert {(s.op, s.peer.name) for s in graph} == {("memcpy", "memcpy"), ("all_reduce", "ipc"),
                                                    ("all_reduce", "nccl"), ("all_to_all", "nccl")}
    assert any("ipc skips all_to_all" in n and "host" in n for n in notes), notes
    cpu, notes = plan_sweep([MoecommPeer(Comm(), "shm"), MemcpyPeer(0, 2)], ops, ["float32"], ["sum"], [64], 2,
                            graph=True)
    assert cpu == [] and any("CUDA graphs need CUDA tensors" in n for n in notes), notes
    # a graph row: one more word-free suffix in the last cell, in-place cells N/A, the mode in the JSON
    row = Row(op="all_reduce", transport="ipc", size=64, count=16, dtype="float32", redop="sum", time_us=9.5,
              algbw=0.1, busbw=0.1, wrong=0, algorithm="one_shot", mode="graph", graph_calls=10)
    fields = format_row(row).split()
    assert len(fields) == len(COLUMNS) and fields[-1] == "ipc/one_shot[graph:10]" and fields[10:14] == ["N/A"] * 4
    assert Row.from_dict(row.as_dict()) == row and row.as_dict()["mode"] == "graph"
    assert Row.from_dict({k: v for k, v in row.as_dict().items() if k not in ("mode", "graph_calls")}).mode == "eager"
