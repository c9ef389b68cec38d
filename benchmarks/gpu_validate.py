"""``moecomm validate-gpu``: everything the project's GPU code needs checked, in one run that fits a
30-minute GPU lease (issue 12).

The steps run in order, each with its own time budget, each recording its outcome without
stopping the others:

1. environment: device, driver, CUDA, torch, cupy, NCCL (``transports.nccl``), triton versions and
   ``moecomm topo --json``;
2. GPU tests: pytest on the test files whose tests skip without a GPU, with
   ``NCCL_MULTI_RANK_GPU_ENABLE=1``; then every collective x dtype x op against a CPU reference,
   uneven all_to_all and ``split``, through nccl, ipc and auto at world size 1 and 2, both ranks
   on cuda:0 (:func:`check_collectives`);
3. CUDA graphs: an all_reduce captured once and replayed 100 times through nccl and ipc, every
   replay checked (:func:`check_graphs`); then the timeout path: a rank that never calls makes the
   other raise CollectiveTimeoutError naming it, through nccl and ipc (:func:`check_abort`);
4. the collective sweep ``moecomm bench --device cuda --compare`` from 8 B to 256 MiB;
5. ``moecomm bench-moe`` with DeepEP's conditions (4096 tokens, hidden 7168, top-8 of 256, bf16);
6. ``moecomm bench-tp``;
7. the record: ``benchmarks/results/gpu-<gpu>-<date>.{txt,json}`` (and the sweep's ``.png``).

Every step but the first runs as a subprocess in its own process group, killed at its budget.
Exit codes: 0 every step passed; 1 a step failed (a wrong result, an error or a timeout);
3 no CUDA GPU here (nothing was run); 4 nothing failed but a step could not run (e.g. a bench
without ``--device``); 2 a usage error (click's).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import click

from .gpu_checks import check_abort, check_collectives, check_graphs

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NO_GPU = 3
EXIT_INCOMPLETE = 4

TOTAL_BUDGET_S = 25 * 60  # the GPU lease is 30 minutes; leave room to start and to commit
NO_GPU_MESSAGE = (f"moecomm validate-gpu needs a CUDA GPU (torch.cuda.is_available() is False here); "
                  f"nothing was run (exit code {EXIT_NO_GPU}). `moecomm validate-gpu --dry-run` prints the plan.")

# The test files whose GPU tests skip without one (skipif on torch.cuda / HAS_NCCL / GPUS).
GPU_TEST_FILES = ("tests/test_nccl.py", "tests/test_device_binding.py", "tests/test_gpu_topology.py")
# pytest skip reasons that mean "a GPU test did not run on this GPU machine" (two GPUs are not expected).
_GPU_SKIP = re.compile(r"needs a CUDA GPU")
RESULT_PREFIX = "# validate-gpu result: "
MULTI_RANK_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}  # two ranks on one GPU (NCCL >= 2.30)


def _cli(*args: str) -> list[str]:
    """A ``moecomm`` command line as this interpreter runs it (no reliance on the entry point on PATH)."""
    return [sys.executable, "-m", "benchmarks.cli", *args]


def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (for file names)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def output_paths(gpu_name: str, date: str, results_dir: str | Path = RESULTS_DIR) -> dict[str, Path]:
    """The record's files: ``gpu-<gpu>-<date>.txt/.json``, the sweep's ``.png`` and its rows' JSON."""
    stem = str(Path(results_dir) / f"gpu-{gpu_slug(gpu_name)}-{date}")  # a str: a dot in date is no suffix
    return {"txt": Path(f"{stem}.txt"), "json": Path(f"{stem}.json"),
            "png": Path(f"{stem}.png"), "bench_json": Path(f"{stem}-bench.json")}


@dataclass
class Step:
    """One planned step: a command (argv, run as a subprocess) or, for ``environment``, in-process."""

    name: str
    title: str
    budget_s: int
    argv: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    skip: str | None = None  # why this step cannot run as planned (recorded, not run)


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


def _has_option(command_name: str, option: str) -> bool:
    from .cli import main

    cmd = main.commands[command_name]
    return any(option in getattr(p, "opts", ()) for p in cmd.params)


def plan(gpu_name: str, date: str, results_dir: str | Path = RESULTS_DIR) -> tuple[list[Step], dict[str, Path]]:
    """The validation run: its steps (in order, with budgets summing to at most 25 minutes) and
    its output files. Pure: looks at nothing but our CLI's options."""
    paths = output_paths(gpu_name, date, results_dir)
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    steps = [
        Step("environment", "device, driver, CUDA, torch, cupy, NCCL, triton versions; moecomm topo --json", 60,
             _cli("topo", "--json")),
        Step("gpu-tests", "pytest on the GPU tests (NCCL_MULTI_RANK_GPU_ENABLE=1)", 240, pytest_argv,
             dict(MULTI_RANK_ENV)),
        Step("collectives-ws1", "every collective x dtype x op vs a CPU reference, 1 rank on cuda:0", 90,
             _cli("validate-gpu", "--check", "collectives", "--nprocs", "1"), dict(MULTI_RANK_ENV)),
        Step("collectives-ws2", "every collective x dtype x op vs a CPU reference, uneven all_to_all, split: "
             "2 ranks on cuda:0", 180, _cli("validate-gpu", "--check", "collectives", "--nprocs", "2"),
             dict(MULTI_RANK_ENV)),
        Step("cuda-graphs", "all_reduce captured once, replayed 100x through nccl and ipc, 2 ranks on cuda:0", 120,
             _cli("validate-gpu", "--check", "graphs", "--nprocs", "2"), dict(MULTI_RANK_ENV)),
        Step("timeout-abort", "a rank that never calls: the other raises CollectiveTimeoutError naming it, "
             "through nccl and ipc, 2 ranks on cuda:0", 60,
             _cli("validate-gpu", "--check", "abort", "--nprocs", "2"), dict(MULTI_RANK_ENV)),
        Step("bench-sweep", "moecomm bench --device cuda --compare, 8 B to 256 MiB, 2 ranks, against "
             "torch.distributed NCCL", 390,
             _cli("bench", "--device", "cuda", "--compare", "--peers", "nccl", "-b", "8", "-e", "256M",
                  "--nprocs", "2", "-q", "-J", str(paths["bench_json"]), "--plot", str(paths["png"])),
             dict(MULTI_RANK_ENV)),
    ]
    moe_args = ["bench-moe", "--tokens", "4096", "--hidden", "7168", "-k", "8", "--experts", "256",
                "-d", "bfloat16", "--nprocs", "2"]
    steps.append(_device_step("bench-moe", "MoE dispatch/combine, DeepEP's conditions, 2 ranks", 240, moe_args))
    steps.append(_device_step("bench-tp", "tensor-parallel MLP block at TP 1 and 2", 120, ["bench-tp", "--sizes", "1,2"]))
    assert sum(s.budget_s for s in steps) <= TOTAL_BUDGET_S
    return steps, paths


def _device_step(name: str, title: str, budget_s: int, args: list[str]) -> Step:
    """A bench step on the GPU: with ``--device cuda`` where the command has that option, else
    recorded as skipped (it would measure CPU tensors and spend the lease on it)."""
    if _has_option(args[0], "--device"):
        return Step(name, title, budget_s, _cli(*args, "--device", "cuda"), dict(MULTI_RANK_ENV))
    return Step(name, title, budget_s, _cli(*args), dict(MULTI_RANK_ENV),
                skip=f"`moecomm {args[0]}` has no --device option yet: it would measure CPU tensors")


def select_steps(steps: Sequence[Step], names: str) -> list[Step]:
    """The steps named in ``names`` (comma-separated), in plan order; an unknown name is a usage error
    listing the known ones."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [s.name for s in steps]
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise click.BadParameter(f"unknown step(s) {unknown or names!r}; the steps are {', '.join(known)}",
                                 param_hint="--steps")
    return [s for s in steps if s.name in wanted]


def format_plan(steps: Sequence[Step], paths: dict[str, Path]) -> list[str]:
    """The plan as printed by ``--dry-run``: every step, its budget, the exact command, the outputs."""
    lines = [f"# moecomm validate-gpu plan: {len(steps)} steps, {sum(s.budget_s for s in steps)} s of "
             f"{TOTAL_BUDGET_S} s budget"]
    for i, s in enumerate(steps, 1):
        lines.append(f"{i}. {s.name} ({s.budget_s} s): {s.title}")
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        if s.name == "environment":
            lines.append("   in-process: torch/cupy/triton versions, transports.nccl.nccl_version(), "
                         "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader")
        lines.append(f"   $ {env + ' ' if env else ''}{shlex.join(s.argv or [])}")
        if s.skip:
            lines.append(f"   not run: {s.skip}")
    lines.append(f"{len(steps) + 1}. record: {paths['txt']}")
    for key in ("json", "png", "bench_json"):
        lines.append(f"   {' ' * len(str(len(steps) + 1))}     {paths[key]}")
    lines.append(f"# exit codes: {EXIT_OK} all passed, {EXIT_FAILED} a step failed (wrong result, error, timeout), "
                 f"2 usage error, {EXIT_NO_GPU} no CUDA GPU, {EXIT_INCOMPLETE} nothing failed but a step could not run")
    return lines


# ---- running the steps ---------------------------------------------------------------------------

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
    if step.name == "gpu-tests":
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

        v = nccl_version()
        info["nccl"] = ".".join(map(str, v)) if v else "unavailable (no GPU, cupy or libnccl)"
        info["nccl_multi_rank_gpu_needs_env"] = bool(v and v >= (2, 30, 0))
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


def run_plan(steps: Sequence[Step], runner: Runner = run_command, total_s: float = TOTAL_BUDGET_S,
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


def write_record(outcomes: Sequence[Outcome], paths: dict[str, Path], gpu_name: str, date: str) -> int:
    """Write the record's .txt (every step's status, command and full output) and .json.

    Returns:
        The run's exit code (:func:`exit_code`), also stored in the JSON.
    """
    code = exit_code(outcomes)
    paths["txt"].parent.mkdir(parents=True, exist_ok=True)
    env = next((o.details for o in outcomes if o.name == "environment"), {})
    record = {"gpu": gpu_name, "date": date, "exit_code": code, "environment": env,
              "files": {k: str(v) for k, v in paths.items() if k != "txt" and Path(v).exists()},
              "steps": [{**asdict(o), "output": o.output[-20000:]} for o in outcomes]}
    paths["json"].write_text(json.dumps(record, indent=1, default=str) + "\n")
    lines = [f"# moecomm validate-gpu on {gpu_name}, {date}: exit code {code}", ""]
    lines += [f"{o.name:<16} {o.status.upper():<8} {o.seconds:7.1f} s of {o.budget_s} s" for o in outcomes]
    for o in outcomes:
        lines += ["", f"== {o.name}: {o.status.upper()} (return code {o.returncode})"]
        if o.command:
            lines.append(f"$ {o.command}")
        lines.append(o.output.rstrip())
    paths["txt"].write_text("\n".join(lines) + "\n")
    return code


# ---- the command -----------------------------------------------------------------------------

def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


@click.command("validate-gpu")
@click.option("--dry-run", is_flag=True, help="Print the plan (steps, budgets, exact commands, output files) and exit 0.")
@click.option("--results-dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR), show_default=True,
              help="Where the record goes.")
@click.option("--gpu-name", default=None, help="GPU name in the record's file names [default: device 0's name].")
@click.option("--date", default=None, help="Date in the record's file names [default: today, YYYY-MM-DD].")
@click.option("--check", type=click.Choice(["collectives", "graphs", "abort"]), default=None, hidden=True,
              help="Run one GPU check (a step of the run) and print its result.")
@click.option("--nprocs", type=click.IntRange(min=1), default=2, hidden=True, help="Ranks of --check.")
@click.option("--steps", "only", default=None, metavar="NAMES",
              help="Comma-separated step names to run, in plan order (to split the run over several GPU "
                   "calls, each under 10 minutes) [default: every step].")
@click.option("--budget", type=click.FloatRange(min=10), default=TOTAL_BUDGET_S, show_default=True,
              help="Seconds for the whole run; a step is killed at min(its budget, what is left).")
def validate_gpu(dry_run: bool, results_dir: str, gpu_name: str | None, date: str | None, check: str | None,
                 nprocs: int, only: str | None, budget: float) -> None:
    """Validate the GPU code in one run of at most ~25 minutes: environment, GPU tests, CUDA graphs, the
    collective sweep against torch.distributed NCCL, MoE and TP benchmarks; the record goes to
    benchmarks/results/gpu-<gpu>-<date>.{txt,json,png}.

    Exit status: 0 all passed; 1 a step failed (wrong result, error or timeout); 2 usage error;
    3 no CUDA GPU (nothing run); 4 nothing failed but a step could not run.
    """
    if check:
        result = {"collectives": check_collectives, "graphs": check_graphs, "abort": check_abort}[check](nprocs)
        for f in result["failures"]:
            click.echo(f"WRONG: {f}")
        click.echo(RESULT_PREFIX + json.dumps(result))
        sys.exit(EXIT_FAILED if result["failures"] else EXIT_OK)
    if not dry_run:
        import torch

        if not torch.cuda.is_available():
            click.echo(NO_GPU_MESSAGE, err=True)
            sys.exit(EXIT_NO_GPU)
    name = gpu_name or _gpu_name() or "unknown-gpu"
    day = date or _dt.date.today().isoformat()
    steps, paths = plan(name, day, results_dir)
    if only:
        steps = select_steps(steps, only)
    for line in format_plan(steps, paths):
        click.echo(line)
    if dry_run:
        return
    outcomes = run_plan(steps, total_s=budget)
    code = write_record(outcomes, paths, name, day)
    click.echo(f"# wrote {paths['txt']} and {paths['json']}; exit code {code}")
    sys.exit(code)
