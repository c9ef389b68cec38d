"""The benchmark suite as a product: nccl-tests' bus factors, peers side by side under both launch
modes, JSON/CSV round trip, plots and `moecomm report`, reduction ops and dtypes, the progress bar."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from benchmarks import common as cm
from benchmarks import sweep as sw
from benchmarks.cli import main
from benchmarks.output import load_run
from benchmarks.plot import series
from benchmarks.progress import Progress
from benchmarks.report import compare_runs, ratio_table
from transports.shm import ONE_SHOT_UNBOUNDED
from spmd import UNDER_MPI
from test_bench_cli import COLUMNS, header, parse_rows
from spmd import mpiexec_path, plot_lines_only
from test_launch_modes import _env

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own ranks")
OPS4 = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
SWEEP = ["-b", "1K", "-e", "64K", "-f", "8", "-n", "2", "-w", "1", "--compare"]


# ---- nccl-tests' definitions ------------------------------------------------------------------
# busbw / algbw per op for n ranks, from nccl-tests src/*.cu (doc/PERFORMANCE.md), written out
NCCL_TESTS_FACTORS = {
    2: {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0},
    3: {"all_reduce": 4 / 3, "all_gather": 2 / 3, "reduce_scatter": 2 / 3, "all_to_all": 2 / 3, "broadcast": 1.0},
    4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75, "broadcast": 1.0},
    8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875, "broadcast": 1.0},
}


def test_bus_factors_match_nccl_tests():
    for n, table in NCCL_TESTS_FACTORS.items():
        for op, f in table.items():
            assert cm.bus_factor(op, n) == pytest.approx(f), (op, n)
    assert cm.bus_factor("reduce", 4) == 1.0
    with pytest.raises(ValueError):
        cm.bus_factor("gossip", 2)


def test_sizes_counts_and_flags():
    assert cm.parse_size("64K") == 65536 and cm.parse_size("1M") == 1 << 20 and cm.parse_size("8") == 8
    assert cm.sizes(8, 1024, 4) == [8, 32, 128, 512]
    assert cm.sizes(1000, 4000, 1, step=1000) == [1000, 2000, 3000, 4000]
    # nccl-tests: count is per rank; all_gather/reduce_scatter/all_to_all blocks are size / n / itemsize
    assert cm.counts_for("all_reduce", 4096, 4, 4) == 1024 and cm.counts_for("all_gather", 4096, 4, 4) == 256
    assert cm.parse_dtypes("float,half,bfloat16,int") == ["float32", "float16", "bfloat16", "int32"]
    assert cm.parse_dtypes("all") == list(cm.DTYPES) and cm.parse_redops("all") == list(cm.REDOPS)
    with pytest.raises(ValueError):
        cm.parse_dtypes("float8")


def _numpy_reference(op, xs, rank, count, redop):
    """An independent reference (NumPy, float64) for count_wrong's own."""
    a = np.stack([x.double().numpy() for x in xs])
    red = {"sum": a.sum(0), "prod": a.prod(0), "max": a.max(0), "min": a.min(0), "avg": a.mean(0)}.get(redop)
    if op == "all_reduce":
        return red
    if op == "reduce_scatter":
        return red[rank * count:(rank + 1) * count]
    if op == "all_gather":
        return a.reshape(-1)
    if op == "all_to_all":
        return a[:, rank * count:(rank + 1) * count].reshape(-1)
    return a[1]  # broadcast from root 1


def test_count_wrong_accepts_correct_and_counts_errors():
    n, count, seed = 3, 37, 5
    for dname in ("float32", "float16", "bfloat16", "int32"):
        dt = cm.DTYPES[dname]
        for op in cm.ALL_OPS:
            for redop in (cm.REDOPS if op in cm.REDUCING else ["none"]):
                if redop == "avg" and not dt.is_floating_point:
                    continue
                xs = [sw._inputs(op, count, n, r, dt, seed) for r in range(n)]
                for rank in range(n):
                    ref = _numpy_reference(op, xs, rank, count, redop)
                    # what a correct library returns: the exact result rounded once to the dtype
                    good = torch.from_numpy(ref).to(dt) if dt.is_floating_point else \
                        torch.from_numpy(np.asarray(ref, dtype=np.int64)).to(dt)
                    args = (count, n, rank, dt, seed, redop, 1)
                    assert sw.count_wrong(op, good, *args) == 0, (dname, op, redop)
                    bad = good.clone()
                    bad[[0, -1]] = bad[[0, -1]] + (3 if not dt.is_floating_point else 0.5 + bad[[0, -1]].abs())
                    assert sw.count_wrong(op, bad, *args) == 2, (dname, op, redop)
                    assert sw.count_wrong(op, good[:-1], *args) == good.numel()  # wrong shape: all wrong
                    if dt.is_floating_point:
                        nan = good.clone()
                        nan[3] = float("nan")
                        assert sw.count_wrong(op, nan, *args) == 1


class _OneRank:
    """The aggregating communicator of a one-rank sweep: its all_reduce returns what it is given."""

    size, rank = 1, 0

    @staticmethod
    def all_reduce(t, op="sum"):
        return t


class _NamedPeer:
    name, library, device = "shm", "moecomm", "cpu"


def test_cycles_pool_every_timed_call():
    rng = np.random.default_rng(3)
    cycles = [sw.Timing((list(rng.uniform(1e-6, 9e-6, 5)), list(rng.uniform(1e-6, 9e-6, 5))), wrong, algo)
              for wrong, algo in (((0, 2), "one_shot"), ((1, 0), "one_shot"), ((0, 0), "two_shot"))]
    # a slow phase during the second cycle: the pooled median stays with the other cycles
    cycles[1] = cycles[1]._replace(times=([t * 10 for t in cycles[1].times[0]], cycles[1].times[1]))
    row = sw.summarise(_NamedPeer(), _OneRank(), "all_reduce", "float32", "sum", 256, cycles)
    oop = np.concatenate([c.times[0] for c in cycles])
    ip = np.concatenate([c.times[1] for c in cycles])
    assert row.time_us == pytest.approx(oop.mean() * 1e6) and row.ip_time_us == pytest.approx(ip.mean() * 1e6)
    assert row.p50_us == pytest.approx(np.median(oop) * 1e6) and row.ip_p50_us == pytest.approx(np.median(ip) * 1e6)
    assert row.p99_us == pytest.approx(np.percentile(oop, 99) * 1e6)
    assert row.p50_us < np.median(cycles[1].times[0]) * 1e6 / 2
    assert (row.wrong, row.ip_wrong) == (1, 2)  # the worst cycle of each variant
    assert row.algorithm == "two_shot" and row.size == 1024
    assert row.algbw == pytest.approx(1024 / oop.mean() / 1e9)
    # one cycle is the plain measurement
    one = sw.summarise(_NamedPeer(), _OneRank(), "all_reduce", "float32", "sum", 256, cycles[:1])
    assert one.p50_us == pytest.approx(np.median(cycles[0].times[0]) * 1e6) and (one.wrong, one.ip_wrong) == (0, 2)


def test_best_algbw_counts_only_checked_variants():
    r = dict(algbw=1.0, busbw=0.5, wrong=0, ip_algbw=2.0, ip_busbw=1.0, ip_wrong=0)
    assert cm.best_algbw(r) == 2.0 and cm.best_algbw(r, bus=True) == 1.0
    assert cm.best_algbw({**r, "ip_wrong": -1}) == 1.0  # in-place all_to_all of torch.distributed: not checked
    assert cm.best_algbw({**r, "ip_wrong": 3}) == 1.0  # wrong results are not bandwidth
    assert cm.best_algbw({**r, "wrong": 1, "ip_wrong": 1}) is None
    assert cm.best_algbw({**r, "wrong": -1, "ip_wrong": -1}) == 1.0  # -c 0: out-of-place only


def test_ratio_table_geomean_and_best_peer():
    rows = []
    for size, auto, gloo, mpi4py in ((1024, 1.0, 0.5, 2.0), (4096, 4.0, 1.0, 1.0), (1 << 20, 8.0, 2.0, 4.0)):
        for peer, lib, bw in (("auto", "moecomm", auto), ("gloo", "torch", gloo), ("mpi4py", "mpi4py", mpi4py)):
            rows.append(cm.Row(op="all_reduce", transport=peer, size=size, count=size // 4, dtype="float32",
                               redop="sum", time_us=1.0, algbw=bw, busbw=bw, wrong=0, ip_wrong=-1,
                               library=lib).as_dict())
    lines = ratio_table(rows)
    small = next(line for line in lines if "<=64KiB" in line).split()
    # sizes 1K, 4K: best peer bw 2.0 (mpi4py) and 1.0 (tie: mpi4py/gloo): ratios 0.5 and 4 -> geomean 1.41
    assert small[2] == "2" and small[6] == f"{math.sqrt(0.5 * 4):.2f}"
    assert small[7] == f"{math.sqrt(2 * 4):.2f}" and small[8] == f"{math.sqrt(0.5 * 4):.2f}"  # vs gloo, vs mpi4py
    mid = next(line for line in lines if "64KiB-4MiB" in line).split()
    assert mid[4] == "mpi4py" and mid[6] == "2.00"
    assert not ratio_table([r for r in rows if r["library"] == "moecomm"])  # no peer, no table
    cross = compare_runs([("a", rows), ("b", [{**r, "algbw": r["algbw"] * 2} for r in rows])])
    assert any(line.split()[-3:] == ["2.00", "2.00", "2.00"] for line in cross if "<=64KiB" in line)


def test_progress_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = Progress(4, stream=tty)
    bar.update(1, "all_reduce 1 KiB shm")
    bar.print("a table line")
    bar.update(3, "all_to_all 4 MiB gloo")
    bar.finish()
    out = tty.getvalue()
    assert "\r[" in out and "1/4" in out and "3/4" in out and "all_to_all 4 MiB gloo" in out
    assert "a table line\n" in out and out.endswith("\r")
    for stream, enabled in ((io.StringIO(), True), (Tty(), False)):  # a pipe, or --quiet
        bar = Progress(4, stream=stream, enabled=enabled)
        bar.update(2, "x")
        bar.print("line")
        assert stream.getvalue() == "line\n"


# ---- real runs: self-launched and under mpiexec, peers side by side --------------------------
def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    import matplotlib.pyplot as plt

    assert plt.imread(path).ndim == 3  # decodes
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    out = {}
    p = subprocess.run([sys.executable, "-m", "benchmarks.cli", "bench", *SWEEP, "--json", "self.json",
                        "--csv", "self.csv", "--plot", "self.png"],
                       capture_output=True, text=True, timeout=300, env=_env(), cwd=d)
    assert p.returncode == 0, p.stdout + p.stderr
    out["self"] = p.stdout
    if mpiexec_path() is not None:
        p = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "benchmarks.cli", "bench", *SWEEP,
                            "--json", "mpi.json"], capture_output=True, text=True, timeout=300, env=_env(), cwd=d)
        assert p.returncode == 0, p.stdout + p.stderr
        out["mpi"] = p.stdout
    return d, out


def _check_compare(stdout: str, peers: set[str]) -> list[dict]:
    assert header(stdout) == COLUMNS
    rows = parse_rows(stdout)
    assert {r["peer"] for r in rows} == peers
    assert {(r["op"], r["peer"]) for r in rows} == {(op, p) for op in OPS4 for p in peers}
    # in-place all_to_all is checked where the library defines one (moecomm, MPI), not for torch's gloo
    assert all(r["wrong"] == 0 and r["ip_wrong"] == (-1 if (r["op"], r["peer"]) == ("all_to_all", "gloo") else 0)
               for r in rows), [r for r in rows if r["wrong"] or r["ip_wrong"] != 0]
    for p in peers:
        assert f"# {p}: Avg bus bandwidth" in stdout
    others = [p for p in sorted(peers) if p in ("gloo", "mpi4py")]
    table = stdout[stdout.index("# moecomm auto vs the best peer"):]
    assert table.splitlines()[1].split()[-len(others):] == others or \
        sorted(table.splitlines()[1].split()[-2 * len(others)::2]) == ["vs"] * len(others)
    for op in OPS4:
        assert any(line.split()[0] == op for line in table.splitlines()[2:])
    return rows


def test_compare_self_launched_prints_shm_auto_gloo_with_ratios(runs):
    _, out = runs
    rows = _check_compare(out["self"], {"shm", "auto", "gloo"})
    assert all(r["algorithm"].startswith("shm:") for r in rows if r["peer"] == "auto")


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra)")
def test_compare_under_mpiexec_adds_mpi_and_mpi4py_same_columns(runs):
    d, out = runs
    rows = _check_compare(out["mpi"], {"shm", "mpi", "auto", "mpi4py", "gloo"})
    assert {r["algorithm"] for r in rows if r["peer"] == "mpi4py"} == {
        "Allreduce", "Allgather", "Reduce_scatter_block", "Alltoall"}
    # same columns and the same row fields and environment keys as the self-launched run
    assert header(out["mpi"]) == header(out["self"])
    a, b = load_run(d / "self.json"), load_run(d / "mpi.json")
    assert [list(r) for r in a["rows"]][0] == [list(r) for r in b["rows"]][0]
    assert set(a["env"]) == set(b["env"]) and (a["env"]["launch"], b["env"]["launch"]) == ("launch", "mpi")
    assert set(b["env"]["peers"]) == {"shm", "mpi", "auto", "mpi4py", "gloo", "memcpy"}


def test_json_and_csv_hold_rows_and_environment(runs):
    d, out = runs
    raw = json.loads((d / "self.json").read_text())
    env = raw["env"]
    for key in ("hostname", "cpu_model", "python", "torch", "numpy", "mpi4py", "mpi_library", "moecomm",
                "launch", "nranks", "transports_available", "peers", "device"):
        assert key in env, key
    assert env["nranks"] == 2 and env["launch"] == "launch" and env["device"] == "cpu"
    assert "MPICH" in (env["mpi_library"] or "") or "Open MPI" in (env["mpi_library"] or "")
    assert raw["options"]["iters"] == 2 and raw["options"]["compare"] is True
    rows = [r for r in raw["rows"] if r["op"] != "memcpy"]  # the reference's rows: test_memcpy_*
    assert len(rows) == len(parse_rows(out["self"])) == 3 * 4 * 3  # sizes x ops x peers
    for r in rows:  # what the table printed is what was saved; bus factors as nccl-tests'
        n = r["nranks"]
        assert r["busbw"] == pytest.approx(r["algbw"] * NCCL_TESTS_FACTORS[n][r["op"]])
        assert r["size"] == r["count"] * 4 * (1 if r["op"] == "all_reduce" else n)
        assert r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
    # round trip: the CSV reads back to exactly the JSON
    a, b = load_run(d / "self.json"), load_run(d / "self.csv")
    assert a == b
    assert [cm.Row.from_dict(r).as_dict() for r in raw["rows"]] == a["rows"]


def test_bench_plot_and_report_from_two_saved_runs(runs, tmp_path, monkeypatch):
    d, _ = runs
    w, h = _png_size(d / "self.png")
    assert w > 500 and h > 500
    second = d / "mpi.json" if (d / "mpi.json").exists() else d / "self.csv"
    # the saved runs hold the series the figure draws: every op for every peer
    for f in (d / "self.json", second):
        s = series(load_run(f)["rows"])
        peers = {k[1] for k in s}
        assert {(op, p) for op in OPS4 for p in peers} == {k[:2] for k in s}
        assert all(len(v) == 3 for v in s.values())  # 1K, 8K, 64K
    res = CliRunner().invoke(main, ["report", str(d / "self.json"), str(second), "--plot", str(tmp_path / "r.png"),
                                    "--labels", "one,two"])
    assert res.exit_code == 0, res.output
    assert _png_size(tmp_path / "r.png")[0] > 500
    assert "# moecomm auto vs the best peer" in res.output and "# two vs one: algbw ratio" in res.output
    from benchmarks.plot import plot_runs

    plot_lines_only(monkeypatch)  # the report above drew this figure to a real file
    fig = plot_runs([("one", load_run(d / "self.json")["rows"]), ("two", load_run(second)["rows"])],
                    tmp_path / "again.png")
    assert set(fig.lines) == set(OPS4)
    assert {"one: shm", "one: auto", "one: gloo", "two: shm", "two: auto", "two: gloo"} <= set(fig.lines["all_reduce"])
    bad = CliRunner().invoke(main, ["report", str(d / "self.png")])
    assert bad.exit_code != 0 and "not a moecomm bench" in bad.output


def test_default_outputs_of_the_readme_command(tmp_path, monkeypatch):
    """`moecomm bench` with no output flags writes ./moecomm-bench.json and .png and says where.

    In-process (CliRunner): the launching process writes the files and prints where (its ranks come
    from the test session's warm fork server); the runs fixture above is the fresh-process run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOECOMM_TRANSPORT", raising=False)  # as _env() for the subprocesses
    res = CliRunner().invoke(main, ["bench", "-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1",
                                    "--ops", "all_reduce,broadcast", "-r", "1", "-o", "sum,max",
                                    "-d", "float,bfloat16,int32"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert f"# wrote {tmp_path / 'moecomm-bench.json'}" in res.stdout
    assert f"# wrote {tmp_path / 'moecomm-bench.png'}" in res.stdout
    _png_size(tmp_path / "moecomm-bench.png")
    rows = load_run(tmp_path / "moecomm-bench.json")["rows"]
    # sizes x (all_reduce: dtypes x redops + broadcast: dtypes), all checked correct
    assert len(rows) == 2 * (3 * 2 + 3)
    assert all(r["wrong"] == 0 and r["ip_wrong"] == 0 for r in rows)
    assert {r["root"] for r in rows if r["op"] == "broadcast"} == {1}


def test_tune_shm_passes_settings_as_launch_options_not_environment(monkeypatch):
    """Each configuration is one launch with options= (slot size, one-shot limit); os.environ is
    never edited, so no setting leaks into later communicators of the process."""
    import collectives
    from tools import tune_shm

    calls = []

    def fake_launch(fn, nprocs, *args, **kwargs):
        calls.append((nprocs, args, kwargs, {k: v for k, v in os.environ.items() if k.startswith("MOECOMM_")}))
        return [{size: (1e-3, 1e-3) for size in args[0]}] * nprocs

    monkeypatch.setattr(collectives, "launch", fake_launch)
    before = {k: v for k, v in os.environ.items() if k.startswith("MOECOMM_")}
    res = CliRunner().invoke(tune_shm.main, ["--nprocs", "3", "--sizes", "8K,1M", "--slots", "64K,1M", "--reps", "2"])
    assert res.exit_code == 0, res.output
    want = [{"shm_slot_bytes": slot, "shm_one_shot_max": limit}
            for slot in (64 << 10, 1 << 20) for limit in (ONE_SHOT_UNBOUNDED, 0)] * 2
    assert [c[2].get("options") for c in calls] == want
    assert all(c[0] == 3 and c[1] == ([8 << 10, 1 << 20],) and c[3] == before for c in calls)
    assert {k: v for k, v in os.environ.items() if k.startswith("MOECOMM_")} == before
    assert "two_shot/slot 64KiB" in res.output


def test_gpu_peers_allow_ranks_sharing_a_gpu_only_where_nccl_does(monkeypatch):
    """Two ranks on one GPU (the GPU validation run): allowed with NCCL_MULTI_RANK_GPU_ENABLE=1 only."""
    import torch

    from benchmarks.peers import gpus_per_rank_available

    class _Comm:
        local_size = 2

        def all_reduce(self, t, op="sum"):
            return t

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    assert not gpus_per_rank_available(_Comm())
    monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    assert gpus_per_rank_available(_Comm())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not gpus_per_rank_available(_Comm())


# ---- the memcpy reference of --compare ----------------------------------------------------------
# size ranges of the summaries (benchmarks.report.RANGES), written out
RANGES = {"<=64KiB": (0, 64 << 10), "64KiB-4MiB": ((64 << 10) + 1, 4 << 20), ">4MiB": ((4 << 20) + 1, 1 << 62)}


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _fraction_table(stdout: str) -> tuple[list[str], dict[tuple[str, str], list[str]]]:
    """The printed memcpy-fraction table: its peers (column order) and (op, range) -> cells."""
    lines = stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# busbw as % of the memcpy reference"))
    head = lines[at + 1].split()[1:]  # op sizes n memcpy GB/s <peer> % <peer> % ...
    assert head[:5] == ["op", "sizes", "n", "memcpy", "GB/s"] and head[6::2] == ["%"] * len(head[5::2])
    cells = {}
    for line in lines[at + 2:]:
        if not line.strip() or line.startswith("#"):
            break
        f = line.split()
        cells[f[0], f[1]] = f[2:]
    return head[5::2], cells


def _expected_fractions(rows) -> dict[tuple[str, str], dict[str, object]]:
    """The fraction table recomputed from saved rows: per (op, range) the number of sizes, the
    reference's GB/s and each peer's % (the better checked variant's busbw / memcpy busbw)."""
    ref = {r["size"]: r["busbw"] for r in rows if r["op"] == "memcpy"}
    out: dict = {}
    for r in rows:
        if r["op"] == "memcpy":
            continue
        assert r["memcpy_busbw"] == ref[r["size"]], r  # each row carries its size's reference
        best = max([r["busbw"]] * (r["wrong"] <= 0) + [r["ip_busbw"]] * (r["ip_wrong"] == 0))
        rname = next(k for k, (lo, hi) in RANGES.items() if lo <= r["size"] <= hi)
        cell = out.setdefault((r["op"], rname), {"sizes": set()})
        cell["sizes"].add(r["size"])
        cell.setdefault(r["transport"], []).append(100 * best / ref[r["size"]])
    return {k: {"n": len(v["sizes"]), "memcpy": _geomean(ref[s] for s in v["sizes"]),
                **{p: _geomean(x) for p, x in v.items() if p != "sizes"}} for k, v in out.items()}


def test_memcpy_reference_rows_in_the_table_and_the_json(runs):
    d, out = runs
    for name in [k for k in ("self", "mpi") if k in out]:
        stdout = out[name]
        printed = [line.split() for line in stdout.splitlines() if line.split()[:1] == ["memcpy"]]
        rows = json.loads((d / f"{name}.json").read_text())["rows"]
        ref = [r for r in rows if r["op"] == "memcpy"]
        assert [int(f[1]) for f in printed] == [r["size"] for r in ref] == [1024, 8192, 65536]  # one per size
        for f, r in zip(printed, ref):
            # uint8, count = size, checked bitwise (#wrong 0), no in-place variant (N/A), numpy.copyto
            assert f[2:6] == [f[1], "uint8", "none", "-1"] and f[9] == "0" and f[10:14] == ["N/A"] * 4
            assert f[16] == "memcpy/numpy.copyto"
            assert (r["library"], r["transport"], r["wrong"], r["ip_wrong"], r["ip_busbw"]) == (
                "reference", "memcpy", 0, -1, 0.0)
            assert r["busbw"] == r["algbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
            assert r["memcpy_busbw"] == r["busbw"] and float(f[8]) == pytest.approx(r["busbw"], abs=6e-4)
        # the footer averages the reference's out-of-place busbw only (no in-place zeros)
        assert f"# memcpy: Avg bus bandwidth    : {np.mean([r['busbw'] for r in ref]):.4f}" in stdout
        # the ratio tables never take the reference for a peer
        ratio = stdout[stdout.index("# moecomm auto vs the best peer"):stdout.index("# busbw as % of the memcpy")]
        assert "memcpy" not in ratio


def test_memcpy_fraction_table_is_busbw_over_the_reference_from_the_json(runs):
    d, out = runs
    for name in [k for k in ("self", "mpi") if k in out]:
        peers, cells = _fraction_table(out[name])
        want = _expected_fractions(json.loads((d / f"{name}.json").read_text())["rows"])
        assert peers[0] == "auto" and set(peers) == {r for v in want.values() for r in v} - {"n", "memcpy"}
        assert set(cells) == set(want) == {(op, "<=64KiB") for op in OPS4}
        for key, got in cells.items():
            assert int(got[0]) == want[key]["n"] == 3
            assert float(got[1]) == pytest.approx(want[key]["memcpy"], abs=6e-4)
            for p, cell in zip(peers, got[2:]):
                assert float(cell) == pytest.approx(want[key][p], abs=0.051), (key, p)


def test_report_rebuilds_the_memcpy_table_and_old_runs_report_without_it(runs, tmp_path, monkeypatch):
    from benchmarks.plot import plot_runs
    from benchmarks.report import memcpy_table

    d, out = runs
    printed = out["self"].splitlines()
    at = printed.index(next(line for line in printed if line.startswith("# busbw as % of the memcpy reference")))
    table = printed[at : at + 2 + len(OPS4)]
    for saved in ("self.json", "self.csv"):  # the same lines from the saved run, JSON or CSV
        res = CliRunner().invoke(main, ["report", str(d / saved)])
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        assert lines[lines.index(table[0]) : lines.index(table[0]) + len(table)] == table
    rows = load_run(d / "self.json")["rows"]
    plot_lines_only(monkeypatch)  # the runs fixture's --plot drew this run to a real file
    fig = plot_runs([("", rows)], tmp_path / "ref.png")
    assert "memcpy" not in fig.lines and all(fig.lines[op][-1] == "memcpy reference" for op in OPS4)
    # a run saved before the reference existed: no memcpy rows, no memcpy_busbw field
    old = json.loads((d / "self.json").read_text())
    old["rows"] = [{k: v for k, v in r.items() if k != "memcpy_busbw"} for r in old["rows"] if r["op"] != "memcpy"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    res = CliRunner().invoke(main, ["report", str(tmp_path / "old.json"), str(d / "self.json")])
    assert res.exit_code == 0, res.output
    assert res.output.count("# moecomm auto vs the best peer") == 2 and res.output.count("memcpy reference") == 1
    old_rows = load_run(tmp_path / "old.json")["rows"]
    assert memcpy_table(old_rows) == [] and all(r["memcpy_busbw"] == 0.0 for r in old_rows)
    assert "memcpy reference" not in plot_runs([("", old_rows)], tmp_path / "old.png").lines["all_reduce"]


def test_memcpy_table_from_known_rows_and_never_a_best_peer():
    from benchmarks.report import memcpy_table

    def row(op, peer, lib, size, bw, ip_bw=0.0, ip_wrong=-1, dtype="float32"):
        return cm.Row(op=op, transport=peer, size=size, count=1, dtype=dtype, redop="none", time_us=1.0,
                      algbw=bw, busbw=bw, wrong=0, ip_busbw=ip_bw, ip_wrong=ip_wrong, library=lib).as_dict()

    big = 8 << 20
    rows = [row("memcpy", "memcpy", "reference", 1024, 10.0, dtype="uint8"),
            row("memcpy", "memcpy", "reference", 4096, 40.0, dtype="uint8"),
            row("memcpy", "memcpy", "reference", big, 8.0, dtype="uint8"),
            # auto's in-place is better at 1 KiB (checked): 5/10 and 10/40 -> sqrt(50 * 25) %
            row("all_gather", "auto", "moecomm", 1024, 2.0, ip_bw=5.0, ip_wrong=0),
            row("all_gather", "auto", "moecomm", 4096, 10.0, ip_bw=99.0, ip_wrong=3),  # wrong in-place: not counted
            row("all_gather", "auto", "moecomm", big, 6.0),
            row("all_gather", "gloo", "torch", 1024, 1.0), row("all_gather", "gloo", "torch", 4096, 4.0),
            row("all_gather", "gloo", "torch", big, 16.0)]
    lines = memcpy_table(rows)
    assert lines[1].split()[1:] == ["op", "sizes", "n", "memcpy", "GB/s", "auto", "%", "gloo", "%"]
    small = next(line for line in lines if "<=64KiB" in line).split()
    assert small == ["all_gather", "<=64KiB", "2", f"{math.sqrt(10 * 40):.3f}", f"{math.sqrt(50 * 25):.1f}", "10.0"]
    large = next(line for line in lines if ">4MiB" in line).split()
    assert large == ["all_gather", ">4MiB", "1", "8.000", "75.0", "200.0"]
    # the reference changes no ratio table: same lines with and without it, no "memcpy" column
    ops = [r for r in rows if r["op"] != "memcpy"]
    assert ratio_table(rows) == ratio_table(ops) and "memcpy" not in "".join(ratio_table(rows))
    assert memcpy_table(ops) == []


def test_memcpy_reference_runs_once_per_size_first_and_is_checked_bitwise():
    from benchmarks.bench import _sweep_options
    from benchmarks.peers import MemcpyPeer, Peer

    class Other(Peer):
        name, library = "other", "other"

    ref, other = MemcpyPeer(0, 2), Other(0, 2)
    steps, notes = sw.plan_sweep([other, ref], ["all_reduce", "all_gather"], ["float32", "bfloat16"], ["sum"],
                                 [1024, 4096], 2)
    assert [(s.size, s.op, s.dtype, s.count, s.peer.name) for s in steps if s.op == "memcpy"] == [
        (1024, "memcpy", "uint8", 1024, "memcpy"), (4096, "memcpy", "uint8", 4096, "memcpy")]
    assert [s.op for s in steps][::5] == ["memcpy", "memcpy"] and len(steps) == 2 * (1 + 2 * 2) and not notes
    x = sw._inputs("memcpy", 1000, 2, 1, torch.uint8, 3)
    assert x.unique().numel() > 50  # random bytes, not a constant
    assert sw.count_wrong("memcpy", x.clone(), 1000, 2, 1, torch.uint8, 3) == 0
    bad = x.clone()
    bad[7] ^= 1  # one bit
    assert sw.count_wrong("memcpy", bad, 1000, 2, 1, torch.uint8, 3) == 1
    assert cm.bus_factor("memcpy", 4) == 1.0 and not cm.has_in_place("memcpy")
    base = (8, 1024, None, 0, "all_reduce", "sum", "float32", None)
    assert [_sweep_options(*base, compare, None, memcpy)["memcpy"]
            for compare, memcpy in ((True, None), (True, False), (False, None), (False, True))] == [True, False, False, True]
