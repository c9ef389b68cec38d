"""Make the runs of the model's local check again (:mod:`tools.local_check`).

    python -m tools.record_local_check          # from the repository root, nothing else running

Moves the current recording (its calibration and prediction runs, repeats and meta file) into
``benchmarks/results/local-check-history/<its commit>/``, so that the report keeps scoring it beside
the new one, then makes the four runs one after another, each with the 1-minute load average before
and after, and writes ``local-runs-meta.json``. Run ``python -m tools.validate_model --write``
afterwards to regenerate the reports.

The commands are fixed here so that every recording is of the same commands: a calibration sweep of
powers of two, a prediction sweep of other sizes (3 x 4^k), and the calibration command twice more.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

from .local_check import CALIBRATION_RUN, HISTORY, LOCAL_RUNS_META, PREDICTION_RUN, REPEAT_RUNS, RESULTS

ROOT = RESULTS.parent.parent
CALIBRATION_SWEEP = ["-b", "8", "-e", "128M", "-f", "2", "--cycles", "3"]
PREDICTION_SWEEP = ["-b", "24", "-e", "96M", "-f", "4", "--cycles", "3"]
# (file, role, sweep): the order they are made in.
RUNS = [(CALIBRATION_RUN.name, "calibration", CALIBRATION_SWEEP),
        (PREDICTION_RUN.name, "prediction", PREDICTION_SWEEP),
        ("local-repeat-run-1.json", "repeat", CALIBRATION_SWEEP),
        ("local-repeat-run-2.json", "repeat", CALIBRATION_SWEEP)]
RANKS = 2


def _load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def _changed_outside_results() -> list[str]:
    """Tracked files changed outside benchmarks/results: the runs would not be of the commit named."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    results = RESULTS.relative_to(ROOT).as_posix() + "/"
    return [line[3:] for line in out.splitlines() if not line[3:].startswith(results)]


def _tool(name: str) -> str:
    """``name`` beside this Python (the venv's mpiexec and moecomm), as a path relative to the root."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise click.ClickException(f"{path} not found: install the package (pip install -e .) and the mpich wheel "
                                   "in this Python's environment")
    try:
        return os.path.relpath(path, ROOT) if path.resolve().is_relative_to(ROOT.resolve()) else str(path)
    except ValueError:
        return str(path)


def _keep_current_recording() -> Path | None:
    """Move the current recording into HISTORY/<its calibration commit>/; None when there is none."""
    if not LOCAL_RUNS_META.exists():
        return None
    meta = json.loads(LOCAL_RUNS_META.read_text())
    commit = next(r["commit"] for r in meta["runs"] if r["role"] == "calibration")
    folder = HISTORY / commit
    if folder.exists():
        raise click.ClickException(f"{folder} exists already: the current recording was kept before")
    folder.mkdir(parents=True)
    for path in [CALIBRATION_RUN, PREDICTION_RUN, LOCAL_RUNS_META, *sorted(RESULTS.glob(REPEAT_RUNS))]:
        if path.exists():
            shutil.move(str(path), folder / path.name)
    return folder


@click.command()
@click.option("--force", is_flag=True, help="Record even with changes outside benchmarks/results.")
def main(force: bool) -> None:
    """Make the local check's four runs again, keeping the current ones under local-check-history/."""
    changed = _changed_outside_results()
    if changed and not force:
        raise click.ClickException(f"uncommitted changes ({', '.join(changed[:5])}): the runs would not be of "
                                   "the commit they name; commit first (or --force)")
    mpiexec, moecomm = _tool("mpiexec"), _tool("moecomm")
    commit = _commit()
    kept = _keep_current_recording()
    if kept:
        click.echo(f"kept the current recording in {kept.relative_to(ROOT)}")
    runs = []
    for file, role, sweep in RUNS:
        out = (RESULTS / file).relative_to(ROOT).as_posix()
        command = [mpiexec, "-n", str(RANKS), moecomm, "bench", "--quiet", "--json", out, "--no-save", *sweep]
        before = _load_average()
        click.echo(f"{role}: {' '.join(command)} (1-min load {before})")
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        runs.append({"file": file, "role": role, "commit": commit, "command": " ".join(command),
                     "load_before": before, "load_after": _load_average()})
    LOCAL_RUNS_META.write_text(json.dumps({
        "description": "How the two local runs of the model's local check were made (tools/local_check.py, "
                       "by tools/record_local_check.py). Load: the 1-minute load average from /proc/loadavg "
                       "just before and just after each run, on this 2-core machine with nothing else running.",
        "runs": runs}, indent=1) + "\n")
    click.echo(f"wrote {LOCAL_RUNS_META.relative_to(ROOT)}; now: python -m tools.validate_model --write")


if __name__ == "__main__":
    main()
