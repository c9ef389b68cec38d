"""``moecomm validate-gpu``: everything the project's GPU code needs checked, in one run of about 25
minutes (issue 12). ``--quick`` runs the 8-minute plan of :mod:`benchmarks.gpu_quick` instead, which
fits one device call of a 15-minute lease (issue 38); both run through :mod:`benchmarks.gpu_steps`.

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
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Sequence

import click

from .gpu_checks import MULTI_RANK_ENV, check_abort, check_collectives, check_graphs
from .gpu_checks import LARGE_NUMEL
from .gpu_quick import QUICK_BUDGET_S, QUICK_TABLE, quick_paths, quick_plan, setup, stop_mps
# re-exported: the exit codes, Outcome and the runners are part of this command's interface
from .gpu_steps import (EXIT_FAILED, EXIT_INCOMPLETE, EXIT_NO_GPU, EXIT_OK, GPU_TEST_FILES,  # noqa: F401
                        RESULT_PREFIX, ROOT, Outcome, Step, cli_argv, exit_code, pytest_argv, run_command, run_plan,
                        source_identity, write_record)
from .options import FiniteFloat

RESULTS_DIR = ROOT / "benchmarks" / "results"

# The full run: about 25 minutes, for a lease longer than today's (15 minutes of device time a session,
# a machine start included); within that lease run `validate-gpu --quick` (benchmarks/gpu_quick.py).
TOTAL_BUDGET_S = 25 * 60
NO_GPU_MESSAGE = (f"moecomm validate-gpu needs a CUDA GPU (torch.cuda.is_available() is False here); "
                  f"nothing was run (exit code {EXIT_NO_GPU}). `moecomm validate-gpu --dry-run` prints the plan.")


def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"`` (for file names)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-gpu"


def output_paths(gpu_name: str, date: str, results_dir: str | Path = RESULTS_DIR) -> dict[str, Path]:
    """The record's files: ``gpu-<gpu>-<date>.txt/.json``, the sweep's ``.png`` and its rows' JSON."""
    stem = str(Path(results_dir) / f"gpu-{gpu_slug(gpu_name)}-{date}")  # a str: a dot in date is no suffix
    return {"txt": Path(f"{stem}.txt"), "json": Path(f"{stem}.json"),
            "png": Path(f"{stem}.png"), "bench_json": Path(f"{stem}-bench.json")}


def _has_option(command_name: str, option: str) -> bool:
    """Whether the bench command ``moecomm <command_name>`` has ``option``, read from the command object
    in its own module (the CLI registers the commands; a command does not import the CLI)."""
    from .bench_moe import bench_moe
    from .bench_tp import bench_tp

    cmd = {c.name: c for c in (bench_moe, bench_tp)}[command_name]
    return any(option in getattr(p, "opts", ()) for p in cmd.params)


def plan(gpu_name: str, date: str, results_dir: str | Path = RESULTS_DIR) -> tuple[list[Step], dict[str, Path]]:
    """The validation run: its steps (in order, with budgets summing to at most 25 minutes) and
    its output files. Pure: looks at nothing but our CLI's options."""
    paths = output_paths(gpu_name, date, results_dir)
    tests = [f for f in GPU_TEST_FILES if (ROOT / f).is_file()]  # one not in this tree would stop pytest
    steps = [
        Step("environment", "device, driver, CUDA, torch, cupy, NCCL, triton versions; moecomm topo --json", 60,
             cli_argv("topo", "--json")),
        # the quick check's GPU test steps add up to 296 s, each file with its own process and start
        Step("gpu-tests", "pytest on the GPU tests (NCCL_MULTI_RANK_GPU_ENABLE=1)", 300, pytest_argv(*tests),
             dict(MULTI_RANK_ENV)),
        Step("collectives-ws1", "every collective x dtype x op vs a CPU reference, 1 rank on cuda:0", 90,
             cli_argv("validate-gpu", "--check", "collectives", "--nprocs", "1"), dict(MULTI_RANK_ENV)),
        Step("collectives-ws2", "every collective x dtype x op vs a CPU reference, uneven all_to_all, split: "
             "2 ranks on cuda:0", 180, cli_argv("validate-gpu", "--check", "collectives", "--nprocs", "2"),
             dict(MULTI_RANK_ENV)),
        Step("cuda-graphs", "all_reduce captured once, replayed 100x through nccl and ipc, 2 ranks on cuda:0", 120,
             cli_argv("validate-gpu", "--check", "graphs", "--nprocs", "2"), dict(MULTI_RANK_ENV)),
        Step("timeout-abort", "a rank that never calls: the other raises CollectiveTimeoutError naming it, "
             "through nccl and ipc, 2 ranks on cuda:0", 60,
             cli_argv("validate-gpu", "--check", "abort", "--nprocs", "2"), dict(MULTI_RANK_ENV)),
        Step("bench-sweep", "moecomm bench --device cuda --compare, 8 B to 256 MiB, 2 ranks, against "
             "torch.distributed NCCL", 330,
             cli_argv("bench", "--device", "cuda", "--compare", "--peers", "nccl", "-b", "8", "-e", "256M",
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
        return Step(name, title, budget_s, cli_argv(*args, "--device", "cuda"), dict(MULTI_RANK_ENV))
    return Step(name, title, budget_s, cli_argv(*args), dict(MULTI_RANK_ENV),
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


def format_plan(steps: Sequence[Step], paths: dict[str, Path], *, budget: float = TOTAL_BUDGET_S,
                setup: tuple[int, str] | None = None, setup_source: str = "") -> list[str]:
    """The plan as printed by ``--dry-run``: every step, its budget and where that came from, the exact
    command, the outputs.

    Args:
        budget: the run's budget; setup: (budget, what it does) of an in-process step 0 before the steps;
        setup_source: where setup's budget came from.
    """
    total = sum(s.budget_s for s in steps) + (setup[0] if setup else 0)
    lines = [f"# moecomm validate-gpu plan: {len(steps) + bool(setup)} steps, {total} s of {budget:.0f} s budget"]
    if total > budget:
        lines.append("# the steps' budgets add up to more than the run's: a step is killed at min(its budget, what "
                     "is left), and one is not started with under 5 s left")
    if setup:
        lines.append(f"0. setup ({setup[0]} s): {setup[1]}")
        if setup_source:
            lines.append(f"   budget: {setup_source}")
    before = setup[0] if setup else 0  # seconds the steps before may take (their whole budgets)
    for i, s in enumerate(steps, 1):
        left = budget - before
        cut = ("" if left >= s.budget_s else f"; {left:.0f} s if the steps before use all of theirs" if left >= 5
               else "; not started if the steps before use all of theirs")
        lines.append(f"{i}. {s.name} ({s.budget_s} s{cut}): {s.title}")
        if s.budget_source:
            lines.append(f"   budget: {s.budget_source}")
        before += s.budget_s
        env = " ".join(f"{k}={v}" for k, v in s.env.items())
        if s.name == "environment":
            lines.append("   in-process: torch/cupy/triton versions, transports.nccl.nccl_version(), "
                         "nvidia-smi --query-gpu=name,driver_version --format=csv,noheader")
        lines.append(f"   $ {env + ' ' if env else ''}{shlex.join(s.argv or [])}")
        if s.skip:
            lines.append(f"   not run: {s.skip}")
    lines.append(f"{len(steps) + 1}. record: {paths['txt']}")
    for key in [k for k in paths if k != "txt"]:
        lines.append(f"   {' ' * len(str(len(steps) + 1))}     {paths[key]}")
    lines.append(f"# exit codes: {EXIT_OK} all passed, {EXIT_FAILED} a step failed (wrong result, error, timeout), "
                 f"2 usage error, {EXIT_NO_GPU} no CUDA GPU, {EXIT_INCOMPLETE} nothing failed but a step could not run")
    return lines


# ---- the command -----------------------------------------------------------------------------

def _gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


@click.command("validate-gpu")
@click.option("--quick", is_flag=True,
              help="The 8-minute check that fits one device call of a 15-minute lease (setup with MPS and "
                   "--nccl-lib, GPU tests with MoE and TP, 2-rank collectives, graphs, eager and CUDA-graph "
                   "sweeps, bench-moe, bench-tp): benchmarks/gpu_quick.py.")
@click.option("--nccl-lib", envvar="MOECOMM_NCCL_LIBRARY", default=None, metavar="PATH",
              help="An NCCL library (>= 2.30 takes two ranks on one GPU; tools/gpu/build_nccl.sh builds one) "
                   "that every step, its ranks and the torch baseline preload (LD_PRELOAD) "
                   "[env: MOECOMM_NCCL_LIBRARY; default: the one torch and cupy load].")
@click.option("--dry-run", is_flag=True, help="Print the plan (steps, budgets, exact commands, output files) and exit 0.")
@click.option("--results-dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR), show_default=True,
              help="Where the record goes.")
@click.option("--gpu-name", default=None, help="GPU name in the record's file names [default: device 0's name].")
@click.option("--date", default=None, help="Date in the record's file names [default: today, YYYY-MM-DD].")
@click.option("--check", type=click.Choice(["collectives", "graphs", "abort"]), default=None, hidden=True,
              help="Run one GPU check (a step of the run) and print its result.")
@click.option("--nprocs", type=click.IntRange(min=1), default=2, hidden=True, help="Ranks of --check.")
@click.option("--large-mib", type=click.IntRange(min=0), default=LARGE_NUMEL >> 18, show_default=True, hidden=True,
              help="MiB of float32 of --check collectives' largest case (0: none).")
@click.option("--steps", "only", default=None, metavar="NAMES",
              help="Comma-separated step names to run, in plan order (to split the run over several GPU "
                   "calls, each under 10 minutes) [default: every step].")
@click.option("--budget", type=FiniteFloat(10, min_open=False), default=None,
              help=f"Seconds for the whole run; a step is killed at min(its budget, what is left) "
                   f"[default: {TOTAL_BUDGET_S}, with --quick {QUICK_BUDGET_S}].")
def validate_gpu(quick: bool, nccl_lib: str | None, dry_run: bool, results_dir: str, gpu_name: str | None,
                 date: str | None, check: str | None, nprocs: int, large_mib: int, only: str | None,
                 budget: float | None) -> None:
    """Validate the GPU code: environment, GPU tests, 2-rank collectives, CUDA graphs, the collective
    sweep against torch.distributed NCCL, MoE and TP benchmarks. The full run takes about 25 minutes;
    --quick fits 8. The record goes to benchmarks/results/gpu-<gpu>-<date>[-quick].{txt,json,png}.

    Exit status: 0 all passed; 1 a step failed (wrong result, error or timeout); 2 usage error;
    3 no CUDA GPU (nothing run); 4 nothing failed but a step could not run.
    """
    if check:
        if check == "collectives":
            result = check_collectives(nprocs, large_numel=large_mib << 18)  # float32 elements
        else:
            result = {"graphs": check_graphs, "abort": check_abort}[check](nprocs)
        for f in result["failures"]:
            click.echo(f"WRONG: {f}")
        click.echo(RESULT_PREFIX + json.dumps(result))
        sys.exit(EXIT_FAILED if result["failures"] else EXIT_OK)
    if nccl_lib and not Path(nccl_lib).is_file():
        raise click.BadParameter(f"{nccl_lib} is not a file", param_hint="--nccl-lib")
    if not dry_run:
        import torch

        if not torch.cuda.is_available():
            click.echo(NO_GPU_MESSAGE, err=True)
            sys.exit(EXIT_NO_GPU)
    day = date or _dt.date.today().isoformat()
    if quick:
        if date is None:  # two quick runs of a day, at different code, keep both records
            day = f"{day}-{_source_tag(source_identity())}"
        _run_quick(nccl_lib, dry_run, results_dir, gpu_name, day, only, QUICK_BUDGET_S if budget is None else budget)
        return
    name = gpu_name or _gpu_name() or "unknown-gpu"
    steps, paths = plan(name, day, results_dir)
    if nccl_lib:
        for s in steps:
            s.env["LD_PRELOAD"] = str(Path(nccl_lib).resolve())
    if only:
        steps = select_steps(steps, only)
    budget = TOTAL_BUDGET_S if budget is None else budget
    for line in format_plan(steps, paths, budget=budget):
        click.echo(line)
    if dry_run:
        return
    outcomes = run_plan(steps, total_s=budget)
    code = write_record(outcomes, paths, name, day, {"mode": "full"})
    click.echo(f"# wrote {paths['txt']} and {paths['json']}; exit code {code}")
    sys.exit(code)


def _source_tag(source: dict) -> str:
    """``35a6dca``, ``35a6dca-dirty`` or ``unknown-code``: the code in the record's file names."""
    commit = source.get("commit")
    return f"{commit[:7]}{'-dirty' if source.get('dirty') else ''}" if commit else "unknown-code"


def _run_quick(nccl_lib: str | None, dry_run: bool, results_dir: str, gpu_name: str | None, day: str,
               only: str | None, budget: float) -> None:
    """``validate-gpu --quick``: setup (MPS, the NCCL, the code), then :func:`gpu_quick.quick_plan`."""
    t0 = time.monotonic()
    if dry_run:
        lib = str(Path(nccl_lib).resolve()) if nccl_lib else None
        paths = quick_paths(gpu_slug(gpu_name or "unknown-gpu"), day, results_dir)
        steps = quick_plan(paths, lib, multi_rank=lib is not None)
        if only:
            steps = select_steps(steps, only)
        what = (f"in-process: start MPS (nvidia-cuda-mps-control -d, stopped at exit); load "
                f"{lib or 'the NCCL torch and cupy load'} and read its version (this plan assumes that a given "
                "--nccl-lib takes two ranks on one GPU and that the default NCCL does not); read the code's commit")
        for line in format_plan(steps, paths, budget=budget, setup=(QUICK_TABLE["setup"].seconds, what),
                                setup_source=QUICK_TABLE["setup"].source):
            click.echo(line)
        return
    first, info, started = setup(nccl_lib)
    try:
        click.echo(f"# [setup] {first.status.upper()} in {first.seconds:.1f} s")
        for line in first.output.splitlines():
            click.echo(f"#   | {line}")
        name = gpu_name or _gpu_name() or "unknown-gpu"
        paths = quick_paths(gpu_slug(name), day, results_dir)
        steps = quick_plan(paths, info["nccl_lib"], info["multi_rank"])
        if only:
            steps = select_steps(steps, only)
        for line in format_plan(steps, paths, budget=budget, setup=(QUICK_TABLE["setup"].seconds, "done above")):
            click.echo(line)
        outcomes = [first, *run_plan(steps, total_s=budget - (time.monotonic() - t0))]
    finally:
        if started:
            stop_mps()
    wall = time.monotonic() - t0
    meta = {"mode": "quick", "wall_s": round(wall, 1), "budget_s": budget, "source": info["source"],
            "nccl": {k: info[k] for k in ("nccl_lib", "nccl_version", "multi_rank")}, "mps": info["mps"]}
    code = write_record(outcomes, paths, name, day, meta)
    click.echo(f"# quick check: {wall:.0f} s of {budget:.0f} s; wrote {paths['txt']} and {paths['json']}; "
               f"exit code {code}")
    sys.exit(code)
