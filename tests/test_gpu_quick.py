"""`moecomm validate-gpu --quick` without a GPU: the plan fits 8 minutes and runs what issues 38 and 50
ask in order (GPU code never run first, sweeps last), every budget is 1.5x its step's measured time in
the records or marked a guess, every GPU test file runs in exactly one step, every command parses, no
captured CUDA-graph body copies from the host, the no-GPU exit, the setup step (MPS, the carried NCCL,
the code that ran) and the record's run facts. The run itself needs a GPU; tools/gpu/quick.sh makes it."""

from __future__ import annotations

import ast
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
QUICK = ["environment", "gpu-ipc", "gpu-ipc-spin", "gpu-ipc-lamport", "gpu-ipc-close", "moe-low-latency", "gpu-p2p",
         "gpu-moe-sync", "bench-paths", "bench-moe-ll", "gpu-core", "gpu-moe-tp", "collectives-ws2", "sweep-eager", "sweep-graph"]


def _forbid(*_a, **_k):
    raise AssertionError("validate-gpu --quick went on")


def _dry(tmp_path, *extra):
    res = CliRunner().invoke(main, ["validate-gpu", "--quick", "--dry-run", "--gpu-name", GPU, "--date", "D",
                                    "--results-dir", str(tmp_path), *extra])
    assert res.exit_code == 0, res.output
    return res.output


@pytest.mark.parametrize("with_lib", [False, True])
def test_the_quick_plan_fits_its_budget_and_runs_the_steps_in_order(monkeypatch, tmp_path, with_lib):
    monkeypatch.setattr(gv, "run_plan", _forbid)
    monkeypatch.setattr(gv, "setup", _forbid)
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"\0")
    out = _dry(tmp_path, *(["--nccl-lib", str(lib)] if with_lib else []))
    total, budget = map(int, re.search(r"plan: 16 steps, (\d+) s of (\d+) s budget", out).groups())
    assert total <= budget == gq.QUICK_BUDGET_S == 8 * 60 + 30
    assert total == sum(gq.QUICK_BUDGETS.values())
    positions = [out.index(f"{i}. {name} (") for i, name in enumerate(["setup", *QUICK])]
    assert positions == sorted(positions), out
    paths = gq.quick_paths("nvidia-h200", "D", tmp_path)
    steps = gq.quick_plan(paths, str(lib.resolve()) if with_lib else None, multi_rank=with_lib)
    assert [s.name for s in steps] == QUICK
    for s in steps:
        assert f"({s.budget_s} s)" in out and s.budget_s == gq.QUICK_BUDGETS[s.name]
        assert f"   budget: {gq.QUICK_TABLE[s.name].source}" in out  # where the number came from
        assert s.env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
        assert s.env.get("LD_PRELOAD") == (str(lib.resolve()) if with_lib else None), s.name
    for p in paths.values():
        assert str(p) in out
    assert not [p for p in tmp_path.iterdir() if p != lib], "a dry run writes nothing"
    by = {s.name: s.argv for s in steps}
    sweep, graph = by["sweep-eager"], by["sweep-graph"]
    assert sweep[sweep.index("-b") + 1] == "8" and sweep[sweep.index("-e") + 1] == "16M" and "-f" in sweep
    assert sweep[sweep.index("--ops") + 1] == "all_reduce"
    assert "--cuda-graph" not in sweep and graph[graph.index("--cuda-graph") + 1] == str(gq.GRAPH_CALLS)
    assert by["bench-moe-ll"][by["bench-moe-ll"].index("--mode") + 1] == "low_latency"
    assert {"--fp8", "--cuda-graph"} <= set(by["bench-moe-ll"])
    ws2 = by["collectives-ws2"]
    assert ws2[ws2.index("--large-mib") + 1] == str(gq.LARGE_MIB) and f"{gq.LARGE_MIB} MiB" in out
    for name in ("bench-paths", "bench-moe-ll", "sweep-eager", "sweep-graph"):
        assert by[name][by[name].index("--device") + 1] == "cuda", name
    paths_path = by["bench-paths"][by["bench-paths"].index("--path") + 1]
    assert paths_path == ("all" if with_lib else "cuda-ipc")  # NCCL's paths need two ranks on one GPU
    if with_lib:  # NCCL at 2 ranks: moecomm's nccl and ipc against torch.distributed NCCL
        assert {"--compare", "--peers"} <= set(sweep) and sweep[sweep.index("--transport") + 1] == "nccl,ipc"
        assert "--transport" not in by["bench-moe-ll"]
    else:  # the image's NCCL refuses two ranks on one GPU: ipc alone, and the titles say why
        assert "--compare" not in sweep and sweep[sweep.index("--transport") + 1] == "ipc"
        assert by["bench-moe-ll"][-3:] == ["--transport", "ipc", "--no-baseline"]
        assert all(s.env["MOECOMM_TRANSPORT"] == "ipc" for s in steps if s.name.startswith(("sweep", "bench")))
        assert "refuses two ranks on one GPU" in out


def _record_seconds(record: str, step: str) -> float:
    """A step's seconds in a committed validate-gpu record (benchmarks/results/*.json)."""
    steps = json.loads((ROOT / "benchmarks" / "results" / record).read_text())["steps"]
    return next(s["seconds"] for s in steps if s["name"] == step)


def test_every_budget_is_one_and_a_half_its_measured_time_or_a_guess_and_the_plan_fits():
    table = gq.QUICK_TABLE
    assert sum(b.seconds for b in table.values()) <= gq.QUICK_BUDGET_S == 8 * 60 + 30
    assert set(table) == {"setup", *QUICK}
    for name, b in table.items():
        for record in re.findall(r"benchmarks/results/[\w.-]+\.(?:json|txt|md)", b.source):
            assert (ROOT / record).is_file(), (name, record)
        if b.measured_s is None:
            assert b.source.startswith("guess: "), name
        else:
            assert not b.source.startswith("guess") and "benchmarks/results/" in b.source, name
            assert b.seconds >= gq.MARGIN * b.measured_s and gq.MARGIN == 1.5, (name, b)
            assert f"{b.measured_s:.1f} s" in b.source or f"{b.measured_s:g} s" in b.source, (name, b.source)
    # the measured times are the records' (the last run of each step's command as planned now)
    h200 = "gpu-nvidia-h200-2026-11-27-"
    assert table["setup"].measured_s == round(_record_seconds(h200 + "eb7c865-quick.json", "setup"), 2)
    assert table["environment"].measured_s == round(_record_seconds(h200 + "eb7c865-quick.json", "environment"), 1)
    assert table["gpu-core"].measured_s == round(_record_seconds(h200 + "35a6dca.json", "gpu-tests"), 1)
    both = _record_seconds(h200 + "9478cb7-quick.json", "gpu-tests") - _record_seconds(h200 + "35a6dca.json", "gpu-tests")
    assert table["gpu-moe-tp"].measured_s == round(both, 1)
    ipc_alone = (ROOT / "benchmarks" / "results" / (h200 + "08aca58-test-ipc-gpu.txt")).read_text()
    assert table["gpu-ipc"].measured_s == round(float(re.search(r" in ([\d.]+)s", ipc_alone).group(1)), 1)


def test_gpu_code_never_run_goes_first_and_sweeps_last():
    kinds = [gq.QUICK_TABLE[name].checks for name in ["setup", *QUICK]]
    order = ["setup", "new", "rerun", "sweep"]
    assert [order.index(k) for k in kinds] == sorted(order.index(k) for k in kinds), kinds
    assert kinds.count("new") >= 7 and kinds[-1] == "sweep"
    for name in ("gpu-ipc", "gpu-ipc-lamport", "gpu-ipc-close", "moe-low-latency", "gpu-p2p"):
        assert gq.QUICK_TABLE[name].checks == "new", name


def test_every_gpu_test_file_runs_in_exactly_one_quick_step(tmp_path):
    steps = gq.quick_plan(gq.quick_paths("gpu", "D", tmp_path), None, multi_rank=True)
    ran = [a for s in steps if gpu_steps.is_pytest(s.argv) for a in s.argv if a.startswith("tests/")]
    for s in steps:  # pytest keeps the last -r: each must still list skips, which fail a GPU step
        assert not gpu_steps.is_pytest(s.argv) or "s" in [a for a in s.argv if a.startswith("-r")][-1], s.argv
    assert sorted(ran) == sorted(gpu_steps.GPU_TEST_FILES) and len(set(ran)) == len(ran)
    missing = [f for f in gpu_steps.GPU_TEST_FILES if not (ROOT / f).is_file()]
    assert not missing, missing
    # every tests/ file with a GPU test is listed: its skip reason says so, which the run matches (_GPU_SKIP)
    gpu_marked = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                  if re.search(r"""reason=["']needs a CUDA GPU""", p.read_text())}
    assert gpu_marked == set(gpu_steps.GPU_TEST_FILES), gpu_marked ^ set(gpu_steps.GPU_TEST_FILES)


def test_a_test_file_not_in_the_tree_makes_its_step_not_run(tmp_path):
    (tmp_path / "tests").mkdir()
    for f in gpu_steps.GPU_TEST_FILES:
        if f != "tests/test_ipc_close_gpu.py":
            (tmp_path / f).write_text("")
    steps = {s.name: s for s in gq.quick_plan(gq.quick_paths("gpu", "D", tmp_path), None, False, root=tmp_path)}
    assert steps["gpu-ipc-close"].skip == "not in this tree: tests/test_ipc_close_gpu.py"
    assert all(s.skip is None for name, s in steps.items() if name != "gpu-ipc-close")
    out = gpu_steps.run_step(steps["gpu-ipc-close"], 1, _forbid)
    assert out.status == "skipped" and gpu_steps.exit_code([out]) == gpu_steps.EXIT_INCOMPLETE


def test_a_pytest_step_whose_gpu_test_skipped_fails():
    step = gq.quick_plan(gq.quick_paths("gpu", "D", "/tmp"), None, True)[1]
    assert step.name == "gpu-ipc" and gpu_steps.is_pytest(step.argv)
    said = "SKIPPED [1] tests/test_ipc_gpu.py:9: needs a CUDA GPU\n1 skipped in 0.1s"
    out = gpu_steps.run_step(step, 5, lambda argv, t, env: (0, said, 0.1))
    assert out.status == "fail" and out.details["gpu_tests_skipped"]


def test_every_quick_command_parses_with_the_cli(tmp_path):
    paths = gq.quick_paths("gpu", "D", tmp_path)
    for multi_rank in (False, True):
        for s in gq.quick_plan(paths, None, multi_rank):
            if s.argv[:3] != [sys.executable, "-m", "benchmarks.cli"]:
                assert s.argv[:3] == [sys.executable, "-m", "pytest"] and s.name in gq.GPU_TEST_STEPS
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


# ---- what a captured CUDA-graph body must not do (issue 50, point 1) ------------------------------
# A copy from pageable host memory (torch.tensor(list, device=...), x.to(device), .cuda()) or a host
# synchronization (.item(), .tolist(), .cpu(), synchronize()) inside `with torch.cuda.graph(...)` makes
# CUDA refuse the capture. The walk follows calls to functions of the same file and of the tests/
# modules it imports from; a library's own calls (comm.all_reduce, disp.dispatch) are the library's.
_HOST_DATA = {"tensor", "as_tensor", "asarray", "from_numpy"}  # torch.<name>(...)
_HOST_SYNC = {"item", "tolist", "cpu", "numpy", "synchronize", "cuda"}  # <anything>.<name>(...)
_DTYPES = {"float32", "float", "float64", "double", "float16", "half", "bfloat16", "int8", "uint8", "int16", "int32",
           "int64", "long", "int", "bool", "float8_e4m3fn", "float8_e5m2"}


def _is_graph_capture(node: ast.AST) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    return isinstance(f, ast.Attribute) and f.attr == "graph" and isinstance(f.value, ast.Attribute) \
        and f.value.attr == "cuda"


def _host_use(call: ast.Call) -> str | None:
    """What ``call`` does on the host that a capture refuses, or None."""
    f = call.func
    if not isinstance(f, ast.Attribute):
        return None
    if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in _HOST_DATA:
        return f"torch.{f.attr}(...): a tensor from host data"
    if f.attr in _HOST_SYNC:
        return f".{f.attr}(): a host synchronization or copy"
    if f.attr == "to":
        first = call.args[0] if call.args else None
        dtype_only = (first is None or (isinstance(first, ast.Attribute) and first.attr in _DTYPES)) and \
            all(k.arg in ("dtype", "non_blocking", "copy", "memory_format") for k in call.keywords)
        if not dtype_only:
            return ".to(<not a dtype>): a copy between devices"
    return None


class _Module:
    def __init__(self, path: Path):
        self.path = path
        self.tree = ast.parse(path.read_text())
        self.defs: dict[str, list[ast.FunctionDef]] = {}
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        for n in ast.walk(self.tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.defs.setdefault(n.name, []).append(n)
            elif isinstance(n, ast.ImportFrom) and n.module:
                for a in n.names:
                    self.imports[a.asname or a.name] = (n.module, a.name)


def captured_host_uses(paths: list[Path], search: list[Path]) -> tuple[list[str], int]:
    """(every host use inside a captured body of ``paths`` as "file:line via f: what", captured blocks)."""
    modules: dict[Path, _Module] = {}

    def module(path: Path) -> _Module:
        if path not in modules:
            modules[path] = _Module(path)
        return modules[path]

    def resolve(mod: _Module, name: str) -> list[tuple[_Module, ast.AST]]:
        if name in mod.defs:
            return [(mod, d) for d in mod.defs[name]]
        if name in mod.imports:
            modname, orig = mod.imports[name]
            for d in [mod.path.parent, *search]:
                p = d / (modname.split(".")[-1] + ".py")
                if p.is_file() and orig in module(p).defs:
                    return [(module(p), fn) for fn in module(p).defs[orig]]
        return []

    found: list[str] = []
    seen: set[int] = set()

    def walk(mod: _Module, nodes: list[ast.AST], via: str) -> None:
        for top in nodes:
            for n in ast.walk(top):
                if not isinstance(n, ast.Call):
                    continue
                what = _host_use(n)
                if what:
                    found.append(f"{mod.path.name}:{n.lineno} via {via}: {what}")
                if isinstance(n.func, ast.Name):
                    for m2, fn in resolve(mod, n.func.id):
                        if id(fn) not in seen:
                            seen.add(id(fn))
                            walk(m2, fn.body, f"{via} -> {fn.name}")

    blocks = 0
    for path in paths:
        mod = module(path)
        for n in ast.walk(mod.tree):
            if isinstance(n, ast.With) and any(_is_graph_capture(i.context_expr) for i in n.items):
                blocks += 1
                seen.clear()
                walk(mod, n.body, f"capture at {path.name}:{n.lineno}")
    return found, blocks


def test_no_captured_body_copies_from_the_host_or_synchronizes():
    files = [p for d in ("tests", "benchmarks") for p in sorted((ROOT / d).glob("*.py"))
             if "torch.cuda.graph(" in p.read_text() and p.name != Path(__file__).name]
    names = {p.name for p in files}
    # the GPU tests' and the quick check's captures: low-latency MoE, ipc, graphs check, sweep, bench-moe-ll
    assert {"test_moe_low_latency_gpu.py", "test_ipc_gpu.py", "gpu_checks.py", "sweep.py", "bench_moe_ll.py"} <= names
    found, blocks = captured_host_uses(files, [ROOT / "tests"])
    assert blocks >= 6 and not found, found


def test_the_capture_walk_finds_a_host_copy_in_a_helper_of_another_module(tmp_path):
    """The mistake of issue 50: the captured step calls a helper imported from the CPU test module,
    which builds a tensor from a list on the device."""
    (tmp_path / "helper.py").write_text(
        "import torch\n\ndef _experts(recv, rank):\n"
        "    scale = torch.tensor([rank + 1.0], device=recv.device)\n    return recv * scale\n")
    (tmp_path / "test_x.py").write_text(
        "import torch\n\ndef body(x, device):\n    from helper import _experts\n\n"
        "    def step(x):\n        return _experts(x, 0) + x.sum().item() * 0\n\n"
        "    g = torch.cuda.CUDAGraph()\n    with torch.cuda.graph(g):\n        y = step(x)\n"
        "    with torch.cuda.graph(g):\n        y = x.to(device) + x.to(torch.bfloat16).float()\n")
    found, blocks = captured_host_uses([tmp_path / "test_x.py"], [])
    assert blocks == 2
    assert sorted(f.split(": ", 1)[1] for f in found) == [
        ".item(): a host synchronization or copy", ".to(<not a dtype>): a copy between devices",
        "torch.tensor(...): a tensor from host data"], found
    assert "helper.py:4 via capture at test_x.py:10 -> step -> _experts: torch.tensor" in "\n".join(found)


# ---- tools/gpu/prepare.sh takes the shared prebuilt NCCL (issue 50, point 9) ------------------------
def _prepare_tree(tmp_path: Path) -> Path:
    """A repository with tools/gpu/prepare.sh and one commit, as prepare.sh needs."""
    repo = tmp_path / "repo"
    (repo / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "gpu" / "prepare.sh", repo / "tools" / "gpu" / "prepare.sh")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    return repo


def _prepare(repo: Path, **env: str) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("MOECOMM_SHARED_NCCL")}
    return subprocess.run(["bash", "tools/gpu/prepare.sh"], cwd=repo, env={**full, **env}, capture_output=True,
                          text=True, timeout=60)


def test_prepare_carries_the_shared_nccl_after_checking_it_and_records_its_version(tmp_path):
    import hashlib

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("git") is None or shutil.which("sha256sum") is None:
        pytest.skip("needs a C compiler, git and sha256sum")
    repo = _prepare_tree(tmp_path)
    shared = tmp_path / "shared" / "gpu"
    shared.mkdir(parents=True)
    (tmp_path / "fake.c").write_text("int ncclGetVersion(int *v) { *v = 23007; return 0; }\n")
    lib = shared / "libnccl.so.2"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "fake.c")], check=True)
    digest = hashlib.sha256(lib.read_bytes()).hexdigest()
    (shared / "README.md").write_text(f"NCCL 2.30.7 for sm_90.\n16 MB; sha256 `{digest}`.\n")
    lib.chmod(0o555)  # read-only, as the shared folder's is: a second prepare must still replace the copy
    for _ in range(2):
        p = _prepare(repo, MOECOMM_SHARED_NCCL=str(lib))
        assert p.returncode == 0, p.stderr
    carried = repo / ".gpu-run" / "lib" / "libnccl.so.2"
    assert carried.read_bytes() == lib.read_bytes()
    info = json.loads((repo / ".gpu-run" / "commit.json").read_text())
    assert info["nccl"]["version"] == "2.30.7" and info["nccl"]["sha256"] == digest and len(info["commit"]) == 40
    assert "NCCL 2.30.7" in p.stdout and digest in p.stdout and "sha256 checked" in info["nccl"]["from"]
    # the default is ../shared/gpu/libnccl.so.2 beside the repository, as /work/shared is to /work/main
    shutil.rmtree(repo / ".gpu-run")
    p = _prepare(repo)
    assert p.returncode == 0 and carried.is_file() and "NCCL 2.30.7" in p.stdout, p.stderr
    # a library whose sha256 is not the README's is refused, and none is carried
    shutil.rmtree(repo / ".gpu-run")
    p = _prepare(repo, MOECOMM_SHARED_NCCL=str(lib), MOECOMM_SHARED_NCCL_SHA256="0" * 64)
    assert p.returncode == 1 and "not used" in p.stderr and not carried.exists()


def test_prepare_without_a_shared_nccl_carries_none(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("needs git")
    repo = _prepare_tree(tmp_path)
    p = _prepare(repo, MOECOMM_SHARED_NCCL=str(tmp_path / "absent" / "libnccl.so.2"))
    assert p.returncode == 0, p.stderr
    assert not (repo / ".gpu-run" / "lib").exists() and "no NCCL carried" in p.stdout
    info = json.loads((repo / ".gpu-run" / "commit.json").read_text())
    assert "nccl" not in info and info["dirty"] is False
