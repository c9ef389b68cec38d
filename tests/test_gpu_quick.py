"""`moecomm validate-gpu --quick` without a GPU: the plan fits 8 minutes and runs what issue 38 asks
in order, every command parses, the no-GPU exit, the setup step (MPS, the carried NCCL, the code
that ran) and the record's run facts. The run itself needs a GPU; tools/gpu/quick.sh makes it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from benchmarks import gpu_quick as gq
from benchmarks import gpu_steps
from benchmarks import gpu_validate as gv
from benchmarks.cli import main

ROOT = Path(__file__).resolve().parent.parent
GPU = "NVIDIA H200"
QUICK = ["environment", "gpu-tests", "collectives-ws2", "cuda-graphs", "moe-low-latency", "sweep-eager",
         "sweep-graph", "bench-moe", "bench-moe-ll", "bench-tp", "bench-tp-sp"]


def _forbid(*_a, **_k):
    raise AssertionError("validate-gpu --quick went on")


def _dry(tmp_path, *extra):
    res = CliRunner().invoke(main, ["validate-gpu", "--quick", "--dry-run", "--gpu-name", GPU, "--date", "D",
                                    "--results-dir", str(tmp_path), *extra])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("with_lib", [False, True])
def test_the_quick_plan_fits_eight_minutes_and_runs_the_steps_in_order(monkeypatch, tmp_path, with_lib):
    monkeypatch.setattr(gv, "run_plan", _forbid)
    monkeypatch.setattr(gv, "setup", _forbid)
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\0")
    out = _dry(tmp_path, *(["--nccl-lib", str(lib)] if with_lib else []))
    total, budget = map(int, re.search(r"plan: 12 steps, (\d+) s of (\d+) s budget", out).groups())
    assert total <= budget == gq.QUICK_BUDGET_S == 8 * 60
    assert total == sum(gq.QUICK_BUDGETS.values())
    positions = [out.index(f"{i}. {name} (") for i, name in enumerate(["setup", *QUICK])]
    assert positions == sorted(positions), out
    paths = gq.quick_paths("nvidia-h200", "D", tmp_path)
    steps = gq.quick_plan(paths, str(lib.resolve()) if with_lib else None, multi_rank=with_lib)
    assert [s.name for s in steps] == QUICK
    for s in steps:
        assert f"({s.budget_s} s)" in out and s.budget_s == gq.QUICK_BUDGETS[s.name]
        assert s.env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
        assert s.env.get("LD_PRELOAD") == (str(lib.resolve()) if with_lib else None), s.name
    for p in paths.values():
        assert str(p) in out
    assert not [p for p in tmp_path.iterdir() if p != lib], "a dry run writes nothing"
    by = {s.name: s.argv for s in steps}
    sweep, graph = by["sweep-eager"], by["sweep-graph"]
    assert sweep[sweep.index("-b") + 1] == "8" and sweep[sweep.index("-e") + 1] == "64M" and "-f" in sweep
    assert "--cuda-graph" not in sweep and graph[graph.index("--cuda-graph") + 1] == str(gq.GRAPH_CALLS)
    assert by["bench-tp-sp"][-1] == "--sequence-parallel" and "--sequence-parallel" not in by["bench-tp"]
    assert by["bench-moe-ll"][by["bench-moe-ll"].index("--mode") + 1] == "low_latency"
    assert {"--fp8", "--cuda-graph"} <= set(by["bench-moe-ll"])
    for name in ("bench-moe", "bench-moe-ll", "bench-tp", "bench-tp-sp", "sweep-eager", "sweep-graph"):
        assert by[name][by[name].index("--device") + 1] == "cuda", name
    if with_lib:  # NCCL at 2 ranks: moecomm's nccl and ipc against torch.distributed NCCL
        assert {"--compare", "--peers"} <= set(sweep) and sweep[sweep.index("--transport") + 1] == "nccl,ipc"
        assert "--transport" not in by["bench-moe"]
    else:  # the image's NCCL refuses two ranks on one GPU: ipc alone, and the titles say why
        assert "--compare" not in sweep and sweep[sweep.index("--transport") + 1] == "ipc"
        assert by["bench-moe"][-3:] == ["--transport", "ipc", "--no-baseline"]
        assert all(s.env["MOECOMM_TRANSPORT"] == "ipc" for s in steps if s.name.startswith(("sweep", "bench")))
        assert "refuses two ranks on one GPU" in out


def test_every_quick_command_parses_with_the_cli(tmp_path):
    paths = gq.quick_paths("gpu", "D", tmp_path)
    for multi_rank in (False, True):
        for s in gq.quick_plan(paths, None, multi_rank):
            if s.argv[:3] != [sys.executable, "-m", "benchmarks.cli"]:
                assert s.argv[:3] == [sys.executable, "-m", "pytest"] and s.name in ("gpu-tests", "moe-low-latency")
                assert all((ROOT / f).exists() for f in s.argv if f.startswith("tests/"))
                continue
            args = s.argv[3:]
            with main.make_context("moecomm", [args[0]]) as ctx:
                main.commands[args[0]].make_context(args[0], list(args[1:]), parent=ctx).close()


def test_quick_without_a_gpu_exits_3_before_anything_else(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gv, "setup", _forbid)
    monkeypatch.setattr(gv, "run_plan", _forbid)
    res = CliRunner().invoke(main, ["validate-gpu", "--quick"])
    assert res.exit_code == gv.EXIT_NO_GPU == 3 and "needs a CUDA GPU" in res.stderr, res.output
    res = CliRunner().invoke(main, ["validate-gpu", "--quick", "--nccl-lib", "/nonexistent/libnccl.so"])
    assert res.exit_code == 2 and "--nccl-lib" in res.output


def test_the_default_record_names_carry_the_code(monkeypatch, tmp_path):
    monkeypatch.setattr(gv, "source_identity", lambda: {"commit": "0123456789abcdef", "dirty": True})
    res = CliRunner().invoke(main, ["validate-gpu", "--quick", "--dry-run", "--gpu-name", GPU,
                                    "--results-dir", str(tmp_path)])
    assert res.exit_code == 0 and "-0123456-dirty-quick.txt" in res.output, res.output


def test_a_run_records_setup_wall_time_code_and_nccl_and_stops_mps(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gv, "_gpu_name", lambda: GPU)
    info = {"mps": "MPS control daemon started", "nccl_lib": "/x/libnccl.so.2", "nccl_version": "2.30.7",
            "multi_rank": True, "source": {"commit": "abc", "dirty": False, "from": "git"}}
    first = gpu_steps.Outcome("setup", "pass", 0.5, 20, None, None, "ok", dict(info))
    monkeypatch.setattr(gv, "setup", lambda lib: (first, dict(info), True))
    stopped = []
    monkeypatch.setattr(gv, "stop_mps", lambda: stopped.append(1))
    seen = {}

    def run_plan(steps, total_s):
        seen["steps"], seen["total_s"] = steps, total_s
        return [gpu_steps.Outcome(s.name, "pass", 1.0, s.budget_s, "cmd", 0, "out") for s in steps]

    monkeypatch.setattr(gv, "run_plan", run_plan)
    res = CliRunner().invoke(main, ["validate-gpu", "--quick", "--date", "D", "--results-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert stopped == [1] and [s.name for s in seen["steps"]] == QUICK and seen["total_s"] <= gq.QUICK_BUDGET_S
    assert all(s.env["LD_PRELOAD"] == "/x/libnccl.so.2" for s in seen["steps"])
    record = json.loads((tmp_path / "gpu-nvidia-h200-D-quick.json").read_text())
    assert record["mode"] == "quick" and record["source"]["commit"] == "abc" and record["wall_s"] >= 0
    assert record["nccl"] == {"nccl_lib": "/x/libnccl.so.2", "nccl_version": "2.30.7", "multi_rank": True}
    assert [s["name"] for s in record["steps"]] == ["setup", *QUICK]
    text = (tmp_path / "gpu-nvidia-h200-D-quick.txt").read_text()
    assert "# source: " in text and '"commit": "abc"' in text and "# wall_s: " in text


def test_setup_loads_the_given_nccl_and_reads_its_version(monkeypatch, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build a stand-in libnccl")
    src = tmp_path / "fake.c"
    src.write_text("int ncclGetVersion(int *v) { *v = 23007; return 0; }\n")
    lib = tmp_path / "libnccl.so.2"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    assert gq.nccl_library_version(str(lib)) == (2, 30, 7)
    monkeypatch.setattr(gq, "start_mps", lambda: (False, "no MPS here"))
    out, info, started = gq.setup(str(lib))
    assert out.status == "pass" and not started and info["multi_rank"] and info["nccl_version"] == "2.30.7"
    assert info["nccl_lib"] == str(lib.resolve()) and "LD_PRELOAD" in out.output and "no MPS here" in out.output
    # a library that cannot be loaded fails the step and falls back to the default NCCL (none here)
    bad = tmp_path / "libbroken.so"
    bad.write_bytes(b"not an ELF")
    out, info, _ = gq.setup(str(bad))
    assert out.status == "fail" and info["nccl_lib"] is None and not info["multi_rank"]
    assert "cannot be used" in out.output and "refuses two ranks on one GPU" in out.output


def test_the_code_that_ran_comes_from_the_carried_file_else_from_git(tmp_path):
    none = tmp_path / "none.json"
    here = gpu_steps.source_identity(carried=none)
    assert here["from"] == "git" and len(here["commit"]) == 40
    carried = tmp_path / "commit.json"
    carried.write_text(json.dumps({"commit": "f" * 40, "dirty": False}))
    got = gpu_steps.source_identity(tmp_path, carried)  # a tree without .git
    assert got == {"commit": "f" * 40, "dirty": False, "from": str(carried)}
    # a checkout whose history is stale (the device's copy on 2026-11-27): the carried file wins
    got = gpu_steps.source_identity(ROOT, carried)
    assert got["commit"] == "f" * 40 and got["git_here"]["commit"] == here["commit"]
    assert gpu_steps.source_identity(tmp_path, none)["commit"] is None


def test_mps_is_started_and_stopped_with_the_control_command(monkeypatch):
    calls = []

    def runner(argv, **kw):
        calls.append((argv, kw.get("input")))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    assert gq.start_mps(runner) == (True, "MPS control daemon started (nvidia-cuda-mps-control -d)")
    gq.stop_mps(runner)
    assert calls == [(["nvidia-cuda-mps-control", "-d"], None), (["nvidia-cuda-mps-control"], "quit\n")]
    monkeypatch.setattr(shutil, "which", lambda name: None)
    started, said = gq.start_mps(runner)
    assert not started and "time-sliced" in said
