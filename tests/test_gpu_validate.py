"""`moecomm validate-gpu` on a machine without a GPU: the no-GPU exit, the dry run's plan, the record
writer and exit codes, that every planned moecomm command parses, and the collectives check itself
(run on CPU through shm, where it must pass, and through a deliberately wrong communicator, where it
must name exactly the wrong cases). The GPU run itself needs a GPU (issue 12)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import collectives
from benchmarks import gpu_checks, gpu_validate as gv
from benchmarks.cli import main

ROOT = Path(__file__).resolve().parent.parent
GPU = "NVIDIA H100 80GB HBM3"
DATE = "2031-02-03"
STEPS = ["environment", "gpu-tests", "collectives-ws1", "collectives-ws2", "cuda-graphs", "timeout-abort",
         "bench-sweep", "bench-moe", "bench-tp"]


def _forbid(*_a, **_k):
    raise AssertionError("validate-gpu went on without a GPU")


def test_without_a_gpu_it_says_so_and_exits_3_before_anything_else(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gv, "plan", _forbid)
    monkeypatch.setattr(gv, "run_plan", _forbid)
    res = CliRunner().invoke(main, ["validate-gpu"])
    assert res.exit_code == gv.EXIT_NO_GPU == 3, res.output
    assert "needs a CUDA GPU" in res.stderr and "--dry-run" in res.stderr and res.stdout == ""


@pytest.mark.parametrize("has_gpu", [False, True])
def test_dry_run_prints_every_step_command_and_output_and_exits_0(monkeypatch, tmp_path, has_gpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_gpu)
    monkeypatch.setattr(gv, "run_plan", _forbid)
    res = CliRunner().invoke(main, ["validate-gpu", "--dry-run", "--gpu-name", GPU, "--date", DATE,
                                    "--results-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    steps, paths = gv.plan(GPU, DATE, tmp_path)
    assert [s.name for s in steps] == STEPS
    stem = tmp_path / f"gpu-nvidia-h100-80gb-hbm3-{DATE}"
    assert paths == {"txt": Path(f"{stem}.txt"), "json": Path(f"{stem}.json"), "png": Path(f"{stem}.png"),
                     "bench_json": Path(f"{stem}-bench.json")}
    out = res.output
    positions = [out.index(f"{i}. {name} (") for i, name in enumerate(STEPS, 1)]
    assert positions == sorted(positions), out  # in order
    for s in steps:
        assert shlex.join(s.argv) in out, s.name
        assert f"({s.budget_s} s)" in out
    for p in paths.values():
        assert str(p) in out
    assert sum(s.budget_s for s in steps) <= 25 * 60
    assert "exit codes: 0" in out and "3 no CUDA GPU" in out
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"


def test_plan_runs_what_issue_12_asks():
    steps = {s.name: s for s in gv.plan(GPU, DATE)[0]}
    sweep = steps["bench-sweep"].argv
    assert sweep[3] == "bench" and {"--compare", "--peers"} <= set(sweep)
    assert sweep[sweep.index("--device") + 1] == "cuda" and sweep[sweep.index("-b") + 1] == "8"
    assert sweep[sweep.index("-e") + 1] == "256M" and sweep[sweep.index("--nprocs") + 1] == "2"
    moe = steps["bench-moe"].argv
    for flag, value in (("--tokens", "4096"), ("--hidden", "7168"), ("-k", "8"), ("--experts", "256"),
                        ("-d", "bfloat16"), ("--nprocs", "2")):
        assert moe[moe.index(flag) + 1] == value
    for name in ("collectives-ws1", "collectives-ws2", "cuda-graphs", "timeout-abort", "bench-sweep", "gpu-tests"):
        assert steps[name].env.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1", name
    assert steps["collectives-ws1"].argv[-1] == "1" and steps["collectives-ws2"].argv[-1] == "2"
    for path in gv.GPU_TEST_FILES:
        assert (ROOT / path).exists() and path in steps["gpu-tests"].argv
    # a bench without --device is recorded as not run, not silently measured on CPU
    for name in ("bench-moe", "bench-tp"):
        has_device = "--device" in steps[name].argv
        assert has_device != bool(steps[name].skip), name


def test_every_planned_moecomm_command_parses_with_the_cli():
    failures = []
    planned = [s.argv for s in gv.plan(GPU, DATE)[0]]
    prefix = [sys.executable, "-m", "benchmarks.cli"]
    cli_lines = [argv[3:] for argv in planned if argv[:3] == prefix]
    assert len(cli_lines) == 8, planned  # all but pytest
    for args in cli_lines:
        try:
            with main.make_context("moecomm", [args[0]]) as ctx:
                main.commands[args[0]].make_context(args[0], list(args[1:]), parent=ctx).close()
        except BaseException as e:  # noqa: BLE001 - click raises UsageError / SystemExit
            failures.append(f"moecomm {shlex.join(args)}: {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


def _outcomes(**status):
    return [gv.Outcome(name, status.get(name.replace("-", "_"), "pass"), 1.5, 60, f"cmd {name}", 0,
                       f"output of {name}\n", {"device_name": GPU} if name == "environment" else {})
            for name in STEPS]


@pytest.mark.parametrize("status,code", [({}, 0), ({"bench_sweep": "fail"}, 1), ({"cuda_graphs": "timeout"}, 1),
                                         ({"gpu_tests": "error"}, 1), ({"bench_moe": "skipped"}, 4),
                                         ({"bench_moe": "skipped", "collectives_ws2": "fail"}, 1)])
def test_record_holds_every_step_and_the_exit_code_follows_the_worst(tmp_path, status, code):
    paths = gv.output_paths(GPU, DATE, tmp_path)
    outcomes = _outcomes(**status)
    assert gv.write_record(outcomes, paths, GPU, DATE) == code
    record = json.loads(paths["json"].read_text())
    assert record["exit_code"] == code and record["gpu"] == GPU and record["date"] == DATE
    assert record["environment"] == {"device_name": GPU}
    assert [(s["name"], s["status"]) for s in record["steps"]] == [(o.name, o.status) for o in outcomes]
    text = paths["txt"].read_text()
    assert text.startswith(f"# moecomm validate-gpu on {GPU}, {DATE}: exit code {code}")
    for o in outcomes:
        assert f"== {o.name}: {o.status.upper()}" in text and f"$ cmd {o.name}" in text and f"output of {o.name}" in text


def test_run_plan_records_each_step_and_never_stops_at_a_failure():
    """A runner that raises, fails, times out, and a pytest run whose GPU tests skipped: every step
    still runs, each with its own status."""
    steps, _ = gv.plan(GPU, DATE)
    calls = []

    def runner(argv, timeout_s, env):
        calls.append((argv, timeout_s))
        if argv[0] == "nvidia-smi":
            return 0, f"{GPU}, 550.54", 0.1
        if "topo" in argv:
            return 0, '{"gpus": []}', 0.1
        if "pytest" in argv:
            return 0, "SKIPPED [1] tests/test_nccl.py:38: needs a CUDA GPU with cupy and libnccl\n1 passed", 1.0
        if "graphs" in argv:
            raise OSError("cannot start")
        if "abort" in argv:
            return 0, gv.RESULT_PREFIX + json.dumps({"failures": []}), 5.0
        if "collectives" in argv and argv[-1] == "2":
            return 1, "WRONG: rank 0: ipc all_reduce(sum) bfloat16: wrong result\n" + gv.RESULT_PREFIX + \
                json.dumps({"failures": ["rank 0: ipc all_reduce(sum) bfloat16: wrong result"]}), 2.0
        if "bench" in argv:
            return None, "killed", 420.0
        return 0, gv.RESULT_PREFIX + json.dumps({"failures": []}), 1.0

    outcomes = gv.run_plan(steps, runner=runner, echo=lambda line: None)
    got = {o.name: o.status for o in outcomes}
    assert got == {"environment": "pass", "gpu-tests": "fail", "collectives-ws1": "pass", "collectives-ws2": "fail",
                   "cuda-graphs": "error", "timeout-abort": "pass", "bench-sweep": "timeout",
                   "bench-moe": "skipped" if steps[7].skip else "pass", "bench-tp": "skipped" if steps[8].skip else "pass"}
    env = outcomes[0].details
    assert env["nvidia_smi"] == f"{GPU}, 550.54" and env["topo"] == {"gpus": []} and "torch" in env and "nccl" in env
    assert outcomes[1].details["gpu_tests_skipped"] and outcomes[3].details["failures"]
    assert all(t <= s.budget_s for (argv, t) in calls for s in steps if s.argv == argv)
    assert gv.exit_code(outcomes) == 1


def test_run_plan_stops_starting_steps_when_the_total_budget_is_spent():
    steps, _ = gv.plan(GPU, DATE)
    outcomes = gv.run_plan(steps[1:3], runner=lambda *a: pytest.fail("started"), total_s=1.0, echo=lambda line: None)
    assert [o.status for o in outcomes] == ["timeout", "timeout"] and "spent" in outcomes[0].output


def test_run_command_kills_the_whole_process_group_at_the_timeout():
    # the child starts a grandchild that holds the output open; both must go at the timeout
    rc, text, seconds = gv.run_command([sys.executable, "-c", "import subprocess, sys, time; "
                                        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                                        "print('started', flush=True); time.sleep(60)"], 2.0)
    assert rc is None and "started" in text and seconds < 30


class _WrongMax:
    """A communicator whose all_reduce(max) is off by one: the check must catch exactly that."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def using(self, transport):
        return _WrongMax(self._comm.using(transport))

    def all_reduce(self, x, op="sum", **kwargs):
        y = self._comm.all_reduce(x, op, **kwargs)
        return y + 1 if op == "max" else y


def _check_bodies(comm):
    return (gpu_checks._collectives_body(comm, "cpu", ["shm"]), gpu_checks._collectives_body(_WrongMax(comm), "cpu", ["shm"]),
            gpu_checks._collectives_body(comm, "cpu", ["nccl"]))


def test_collectives_check_passes_on_cpu_and_names_exactly_the_wrong_cases():
    res = collectives.launch(_check_bodies, 2, transport="shm", device="cpu", timeout=120.0)
    ints = sum(not getattr(torch, d).is_floating_point for d in gpu_checks._DTYPES)
    per_transport = len(gpu_checks._DTYPES) * (2 * len(gpu_checks._OPS) + 3) - 2 * ints  # no avg for ints
    per_transport += 2 * 3  # sizes 0 and 1001 x all_reduce, all_gather, all_to_all
    for rank, (good, wrong, no_nccl) in enumerate(res):
        assert good["failures"] == [] and good["transports"] == ["shm", "auto"], (rank, good)
        assert good["cases"] == 2 * per_transport + 2  # + the two splits
        want = {f"{t} all_reduce(max) {d}: wrong result" for t in ("shm", "auto") for d in gpu_checks._DTYPES}
        assert {f.split(" (")[0] for f in wrong["failures"]} == want, (rank, wrong["failures"])
        assert len(no_nccl["failures"]) == 1 and "['nccl'] did not come up" in no_nccl["failures"][0]
    summary = gv.check_collectives(1, device="cpu", required=("shm",), transport="shm", timeout=60.0,
                                   large_numel=3 << 20)  # the large size, smaller here
    assert summary["failures"] == [] and summary["nprocs"] == 1
    assert summary["cases"] == 2 * (per_transport + 3) + 2


def test_abort_check_passes_when_the_late_rank_is_named_and_fails_when_nobody_waits():
    """On CPU through shm: the waiting rank raises CollectiveTimeoutError naming rank 1 (pass); a
    transport that is not there is a failure, not a silent pass."""
    ok = gv.check_abort(2, device="cpu", transports=("shm",), timeout=1.0)
    assert ok["failures"] == [], ok
    missing = gv.check_abort(2, device="cpu", transports=("nccl",), timeout=1.0)
    assert len(missing["failures"]) == 1 and "nccl: did not come up" in missing["failures"][0], missing


def test_steps_selects_a_subset_in_plan_order_and_rejects_unknown_names(monkeypatch, tmp_path):
    monkeypatch.setattr(gv, "run_plan", _forbid)
    args = ["validate-gpu", "--dry-run", "--gpu-name", GPU, "--date", DATE, "--results-dir", str(tmp_path)]
    res = CliRunner().invoke(main, [*args, "--steps", "bench-sweep,environment"])
    assert res.exit_code == 0, res.output
    assert "2 steps" in res.output and "1. environment (" in res.output and "2. bench-sweep (" in res.output
    assert "gpu-tests" not in res.output
    res = CliRunner().invoke(main, [*args, "--steps", "environment,bench-swep"])
    assert res.exit_code == 2 and "bench-swep" in res.output and "bench-sweep" in res.output, res.output


def test_a_dot_in_the_date_tag_stays_in_the_file_names(tmp_path):
    paths = gv.output_paths(GPU, "2026-11-23-nccl2.30.7", tmp_path)
    assert paths["txt"].name == "gpu-nvidia-h100-80gb-hbm3-2026-11-23-nccl2.30.7.txt"
    assert paths["bench_json"].name == "gpu-nvidia-h100-80gb-hbm3-2026-11-23-nccl2.30.7-bench.json"


@pytest.mark.parametrize("version, nprocs, want", [
    ((2, 28, 9), 2, (("ipc",), "ipc", True)),   # NCCL < 2.30 refuses two ranks on one GPU: ipc alone, said so
    (None, 2, (("ipc",), "ipc", True)),
    ((2, 30, 7), 2, (("nccl", "ipc"), "auto", False)),
    ((2, 28, 9), 1, (("nccl", "ipc"), "auto", False)),  # one rank: any NCCL
])
def test_gpu_checks_run_nccl_at_two_ranks_on_one_gpu_only_where_nccl_allows_it(monkeypatch, version, nprocs, want):
    import transports.nccl

    monkeypatch.setattr(transports.nccl, "nccl_version", lambda: version)
    transports_, forced, not_run = gpu_checks.gpu_transports(nprocs)
    assert (transports_, forced, bool(not_run)) == want
    if not_run:
        assert "older than 2.30" in not_run[0] and (".".join(map(str, version)) if version else "none") in not_run[0]


def test_the_collectives_check_takes_its_largest_size_from_the_command_line(monkeypatch):
    """--large-mib (the quick check's 32 MiB) reaches check_collectives as float32 elements; 256 MiB by default."""
    seen = []

    def fake(nprocs, **kw):
        seen.append((nprocs, kw))
        return {"failures": []}

    monkeypatch.setattr(gv, "check_collectives", fake)
    for extra, numel in (([], gpu_checks.LARGE_NUMEL), (["--large-mib", "32"], 32 << 18), (["--large-mib", "0"], 0)):
        res = CliRunner().invoke(main, ["validate-gpu", "--check", "collectives", "--nprocs", "2", *extra])
        assert res.exit_code == 0 and res.output.startswith(gv.RESULT_PREFIX), res.output
        assert seen.pop() == (2, {"large_numel": numel})
    assert gpu_checks.LARGE_NUMEL == 256 << 18
