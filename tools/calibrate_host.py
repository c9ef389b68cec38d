"""Fit the host model the library ships (its default shm switch point and plan() predictions).

    mpiexec -n 2 moecomm bench --quiet --transport shm,mpi -b 8 -e 128M -f 2 --json bench-2.json
    python -m tools.tune_shm --nprocs 2 --sizes 64,256,1K,4K,16K,64K,256K,1M,4M,16M,64M,128M --slots 1M \\
        --json tune-2.json                                                         # and 3, 4 ranks
    python -m tools.calibrate_host bench-2.json tune-2.json tune-3.json tune-4.json \\
        --out collectives/model/calibrations/host-2vcpu.json

The bench run goes to 128 MiB so that the sizes past the CI VM's 32 MiB L3 are three (16-32 MiB only, the
DRAM regime had two sizes, too few for a segment of its own, and a 32 MiB all_gather was predicted 2.8x
too fast). The runs' rows are pooled (one fit per op, transport, algorithm and rank count) and fitted by
:func:`collectives.model.calibrate`; the System's sources name every run (host, time, command). The shm
all_reduce algorithms come from the ``tune_shm`` runs alone where there are any: those measure one-shot
and two-shot at every size in the same repetitions, where ``bench`` measures each only on its own side
of the switch point, at another time. On the CI VM tune_shm measured a one-shot 256 KiB all_reduce
at 19.0 us in one run and at 28.4 us in the next, minutes later (2026-11-23): a crossing between a
one-shot fit that pools the bench's rows and a two-shot fit that has none compares different phases.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from benchmarks.output import load_run
from collectives.model.calibrate import calibrate


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="System JSON to write.")
@click.option("--name", default="host-2vcpu", show_default=True, help="The fitted system's name.")
def main(runs: tuple[str, ...], out: str, name: str) -> None:
    """Pool RUNS (moecomm bench / tune_shm --json files) and save the fitted System as JSON."""
    loaded = [load_run(r) for r in runs]
    tuned = any(_is_tune_run(run) for run in loaded)
    rows = []
    for run in loaded:
        ranks = run.get("env", {}).get("nranks")
        rows += [{**row, "nranks": row.get("nranks") or ranks} for row in run["rows"]
                 if not (tuned and not _is_tune_run(run) and _is_shm_all_reduce(row))]
    pooled = {**loaded[0], "rows": rows}
    system = calibrate(pooled, name=name)
    made = "; ".join(f"{Path(r).name}: {run['env'].get('hostname', '?')} {run['env'].get('time', '?')} "
                     f"`{run['env'].get('command', '?')}`" for r, run in zip(runs, loaded))
    env = loaded[0]["env"]
    system = dataclasses.replace(
        system, description=f"{env.get('cpu_model', '?')}, {env.get('cpus', '?')} CPUs: host transports fitted "
                            f"from {len(runs)} runs",
        sources={**system.sources, "calibration": f"least squares in relative error (collectives.model.calibrate) "
                                                  f"over the pooled rows of: {made}"})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(system.to_dict(), indent=1) + "\n")
    click.echo(f"saved {out}: {sum(len(t) for t in system.calibration.values())} fitted terms")


def _is_tune_run(run: dict) -> bool:
    """A ``tune_shm --json`` run (its options name the slot sizes it tried)."""
    return "slots" in run.get("options", {})


def _is_shm_all_reduce(row: dict) -> bool:
    return row.get("op") == "all_reduce" and str(row.get("transport", "")).startswith("shm")


if __name__ == "__main__":
    main()
