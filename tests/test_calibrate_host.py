"""tools/calibrate_host.py: the shipped host model is the fit of the pooled runs, and says where it came from."""

from __future__ import annotations

import json

from click.testing import CliRunner

from benchmarks.output import load_run
from collectives.model import load_system_file
from collectives.model.calibrate import calibrate
from tools.calibrate_host import main

RESULTS = "benchmarks/results"
RUNS = [f"{RESULTS}/host-calibration-bench-2.json", f"{RESULTS}/host-calibration-tune-3.json"]


def test_pooled_runs_fit_as_one_and_name_their_sources(tmp_path):
    out = tmp_path / "host.json"
    result = CliRunner().invoke(main, [*RUNS, "--out", str(out), "--name", "test-host"])
    assert result.exit_code == 0, result.output
    system = load_system_file(out)
    # the same terms as calibrating one run holding both runs' rows (each row keeps its run's rank count),
    # but for the bench run's shm all_reduce rows: with a tune_shm run given, those come from it alone
    runs = [load_run(r) for r in RUNS]
    rows = [{**row, "nranks": row.get("nranks") or run["env"]["nranks"]} for run in runs for row in run["rows"]
            if "slots" in run["options"] or not (row["op"] == "all_reduce" and row["transport"] == "shm")]
    expected = calibrate({**runs[0], "rows": rows}, name="test-host")
    assert json.loads(json.dumps(system.calibration)) == json.loads(json.dumps(expected.calibration))
    fitted = {(op, t["algorithm"], t["ranks"]) for op, terms in system.calibration.items() for t in terms}
    assert ("all_reduce", "shm/one_shot", 3) in fitted and ("all_reduce", "shm/two_shot", 3) in fitted
    assert not any(op == "all_reduce" and name.startswith("shm/") and ranks == 2 for op, name, ranks in fitted)
    assert ("all_reduce", "mpi/Iallreduce", 2) in fitted  # the bench run's other rows stay
    assert any(op == "all_gather" and ranks == 2 for op, _, ranks in fitted)  # from the bench run
    assert all(name.rsplit("/", 1)[-1] in system.sources["calibration"] for name in RUNS)


def test_without_a_tune_run_the_bench_run_fits_shm_all_reduce(tmp_path):
    out = tmp_path / "host.json"
    result = CliRunner().invoke(main, [RUNS[0], "--out", str(out)])
    assert result.exit_code == 0, result.output
    fitted = {(op, t["algorithm"], t["ranks"]) for op, terms in load_system_file(out).calibration.items() for t in terms}
    assert ("all_reduce", "shm/one_shot", 2) in fitted
