"""Running a GPU validation plan (``moecomm validate-gpu`` and its ``--quick`` mode): steps as
subprocesses in their own process groups, each killed at its budget, one step's failure never
stopping the next; the record (``.txt`` with every step's output, ``.json``) and the exit code.

The plans themselves live in :mod:`benchmarks.gpu_validate` (the full run) and
:mod:`benchmarks.gpu_quick` (the one-call run).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parent.parent

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_GPU = 3
EXIT_INCOMPLETE = 4

RESULT_PREFIX = "# validate-gpu result: "
# Every test file with GPU tests (they skip without one: skipif on torch.cuda / HAS_NCCL / GPUS), those of
# GPU code no GPU has run yet first; the quick check runs them in steps of their own (gpu_quick.GPU_TEST_STEPS).
GPU_TEST_FILES = ("tests/test_ipc_gpu.py", "tests/test_ipc_spin_gpu.py", "tests/test_ipc_lamport_gpu.py",
                  "tests/test_ipc_close_gpu.py", "tests/test_moe_low_latency_gpu.py", "tests/test_p2p_gpu.py",
                  "tests/test_moe_sync.py", "tests/test_nccl.py", "tests/test_device_binding.py",
                  "tests/test_gpu_topology.py", "tests/test_moe_gpu.py", "tests/test_tp_gpu.py")
# pytest skip reasons that mean "a GPU test did not run on this GPU machine" (two GPUs are not expected).
_GPU_SKIP = re.compile(r"needs a CUDA GPU")
# What a device call carries instead of git history: written here by tools/gpu/prepare.sh.
SOURCE_FILE = ROOT / ".gpu-run" / "commit.json"


def pytest_argv(*args: str) -> list[str]:
    """A quiet pytest run of ``args`` (files, options) that lists skip reasons (``-rs``: a GPU test that
    skips on the GPU machine fails its step) and leaves no cache behind."""
    return [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args]


def is_pytest(argv: Sequence[str] | None) -> bool:
    """Whether ``argv`` is a :func:`pytest_argv` command."""
    return bool(argv) and list(argv[1:3]) == ["-m", "pytest"]


def cli_argv(*args: str) -> list[str]:
    """A ``moecomm`` command line as this interpreter runs it (no reliance on the entry point on PATH)."""
    return [sys.executable, "-m", "benchmarks.cli", *args]


def source_identity(root: Path = ROOT, carried: Path | None = None) -> dict[str, Any]:
    """Which code runs: the commit and whether the tree differs from it.

    The file a device call carries (:data:`SOURCE_FILE`, written by tools/gpu/prepare.sh just before
    the call) wins over git: the device machine's copy of the tree can hold a stale ``.git`` (seen on
    2026-11-27: the session's first commit, while the tree was eight commits later), and git would
    then name the wrong commit. Git answers where no such file is; its own view is kept beside.

    Returns:
        {"commit": str | None, "dirty": bool | None, "from": path | "git" | "unknown", ...}.
    """
    carried = SOURCE_FILE if carried is None else carried
    here = _git_identity(root)
    try:
        info = {**json.loads(carried.read_text()), "from": str(carried)}
        if here is not None and here["commit"] != info.get("commit"):
            info["git_here"] = here  # a stale history in the copy; recorded, not believed
        return info
    except (OSError, ValueError):
        pass
    if here is not None:
        return here
    return {"commit": None, "dirty": None, "from": "unknown (no git history here and no "
            f"{carried.name}: run tools/gpu/prepare.sh before the device call)"}


def _git_identity(root: Path) -> dict[str, Any] | None:
    """{"commit", "dirty", "from": "git"} of the checkout at ``root``, or None without git history."""
    if not (root / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=20, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip()), "from": "git"}


@dataclass
class Step:
    """One planned step: a command (argv, run as a subprocess) or, for ``environment``, in-process."""

    name: str
    title: str
    budget_s: int
    argv: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    skip: str | None = None  # why this step cannot run as planned (recorded, not run)
    budget_source: str = ""  # where the budget's number came from (a record and its seconds, or a guess)


@dataclass
class Outcome:
    """What one step did. status: pass, fail (wrong result or non-zero exit), timeout, error
    (could not be started), skipped (could not run as planned)."""

    name: str
    status: str
    seconds: float = 0.0
    budget_s: int = 0
    command: str | None = None
    returncode: int | None = None
    output: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def run_command(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
    """Run argv from the repository root in its own process group; kill the group at the timeout.

    Returns:
        (returncode or None on timeout, stdout+stderr, seconds).
    """
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    t0 = time.monotonic()
    # a file, not a pipe: ranks the child started could hold a pipe open after it is killed
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks too, also when the leader already exited
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        out.seek(0)
        text = out.read()
    return rc, text, time.monotonic() - t0


Runner = Callable[[list[str], float, dict[str, str]], tuple[int | None, str, float]]


def _result_details(output: str) -> dict[str, Any]:
    """The JSON a ``--check`` subprocess printed after :data:`RESULT_PREFIX`, if any."""
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX):
            try:
                return json.loads(line[len(RESULT_PREFIX):])
            except ValueError:
                return {}
    return {}


def run_step(step: Step, timeout_s: float, runner: Runner = run_command) -> Outcome:
    """Run one step; never raises (an exception is the step's ``error`` outcome)."""
    command = shlex.join(step.argv) if step.argv else None
    if step.skip:
        return Outcome(step.name, "skipped", budget_s=step.budget_s, command=command, output=step.skip)
    try:
        if step.name == "environment":
            return _environment_step(step, timeout_s, runner)
        rc, text, seconds = runner(step.argv or [], timeout_s, step.env)
    except Exception as e:  # noqa: BLE001 - one step's failure must not stop the others
        return Outcome(step.name, "error", budget_s=step.budget_s, command=command, output=f"{type(e).__name__}: {e}")
    status = "timeout" if rc is None else "pass" if rc == 0 else "fail"
    details = _result_details(text)
    if is_pytest(step.argv):  # a GPU test that skipped on the GPU machine did not pass
        skipped = [ln for ln in text.splitlines() if ln.startswith("SKIPPED") and _GPU_SKIP.search(ln)]
        details["gpu_tests_skipped"] = skipped
        if status == "pass" and skipped:
            status = "fail"  # a GPU test that skips on the GPU machine validated nothing
    return Outcome(step.name, status, seconds, step.budget_s, command, rc, text, details)


def _versions() -> dict[str, Any]:
    """Versions of what the GPU code runs on; a missing package is recorded, not raised."""
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                            "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["device_count"] = torch.cuda.device_count()
        info["device_name"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    for mod in ("cupy", "triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            info[mod] = f"unavailable: {type(e).__name__}: {e}"
    try:
        from transports.nccl import nccl_version

        from .gpu_checks import MULTI_RANK_NCCL

        v = nccl_version()
        info["nccl"] = ".".join(map(str, v)) if v else "unavailable (no GPU, cupy or libnccl)"
        info["nccl_multi_rank_gpu_needs_env"] = bool(v and v >= MULTI_RANK_NCCL)
    except Exception as e:  # noqa: BLE001
        info["nccl"] = f"unavailable: {type(e).__name__}: {e}"
    return info


def _environment_step(step: Step, timeout_s: float, runner: Runner) -> Outcome:
    t0 = time.monotonic()
    details: dict[str, Any] = _versions()
    smi = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:
        rc, text, _ = runner(smi, min(30.0, timeout_s), {})
        details["nvidia_smi"] = text.strip() if rc == 0 else f"exit {rc}: {text.strip()[-500:]}"
    except OSError as e:
        details["nvidia_smi"] = f"unavailable: {e}"
    rc, text, _ = runner(step.argv or [], max(1.0, timeout_s - (time.monotonic() - t0)), {})
    try:
        details["topo"] = json.loads(text[text.index("{"):]) if rc == 0 else None
    except ValueError:
        details["topo"] = None
    status = "pass" if rc == 0 and details["topo"] is not None else "timeout" if rc is None else "fail"
    summary = "\n".join(f"{k}: {v}" for k, v in details.items() if k != "topo")
    return Outcome(step.name, status, time.monotonic() - t0, step.budget_s, shlex.join(step.argv or []), rc,
                   summary + "\n" + text, details)


def run_plan(steps: Sequence[Step], runner: Runner = run_command, total_s: float = float("inf"),
             echo: Callable[[str], None] = click.echo) -> list[Outcome]:
    """Every step in order, each killed at min(its budget, what is left of ``total_s``)."""
    start = time.monotonic()
    outcomes = []
    for i, s in enumerate(steps, 1):
        left = total_s - (time.monotonic() - start)
        echo(f"# [{i}/{len(steps)}] {s.name}: {s.title} (budget {s.budget_s} s)")
        if left < 5:
            o = Outcome(s.name, "timeout", budget_s=s.budget_s, command=shlex.join(s.argv or []),
                        output=f"not started: the run's {total_s:.0f} s were spent")
        else:
            o = run_step(s, min(s.budget_s, left), runner)
        echo(f"#   -> {o.status.upper()} in {o.seconds:.1f} s" + (f" ({o.output})" if o.status == "skipped" else ""))
        if o.status in ("fail", "timeout", "error"):
            for line in o.output.strip().splitlines()[-15:]:
                echo(f"#   | {line}")
        outcomes.append(o)
    return outcomes


def exit_code(outcomes: Sequence[Outcome]) -> int:
    """1 if any step failed, timed out or errored; else 4 if any was skipped; else 0."""
    if any(o.status in ("fail", "timeout", "error") for o in outcomes):
        return EXIT_FAILED
    if any(o.status == "skipped" for o in outcomes):
        return EXIT_INCOMPLETE
    return EXIT_OK


def write_record(outcomes: Sequence[Outcome], paths: dict[str, Path], gpu_name: str, date: str,
                 meta: dict[str, Any] | None = None) -> int:
    """Write the record's .txt (every step's status, command and full output) and .json.

    Args:
        meta: more of the run to keep at the top of both (the mode, the code that ran, the wall time).
    Returns:
        The run's exit code (:func:`exit_code`), also stored in the JSON.
    """
    code = exit_code(outcomes)
    paths["txt"].parent.mkdir(parents=True, exist_ok=True)
    env = next((o.details for o in outcomes if o.name == "environment"), {})
    record = {"gpu": gpu_name, "date": date, "exit_code": code, **(meta or {}), "environment": env,
              "files": {k: str(v) for k, v in paths.items() if k != "txt" and Path(v).exists()},
              "steps": [{**asdict(o), "output": o.output[-20000:]} for o in outcomes]}
    paths["json"].write_text(json.dumps(record, indent=1, default=str) + "\n")
    lines = [f"# moecomm validate-gpu on {gpu_name}, {date}: exit code {code}"]
    lines += [f"# {k}: {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}" for k, v in (meta or {}).items()]
    lines.append("")
    lines += [f"{o.name:<16} {o.status.upper():<8} {o.seconds:7.1f} s of {o.budget_s} s" for o in outcomes]
    for o in outcomes:
        lines += ["", f"== {o.name}: {o.status.upper()} (return code {o.returncode})"]
        if o.command:
            lines.append(f"$ {o.command}")
        lines.append(o.output.rstrip())
    paths["txt"].write_text("\n".join(lines) + "\n")
    return code


