"""tools/record_local_check.py: making the local check's runs again keeps the current recording
under local-check-history/<its commit>/ (the runs themselves are minutes of benchmarking, not a test),
and the report's gauge of the VM's state in each run (tools/local_check.py)."""

from __future__ import annotations

import json

import click
import pytest

from tools import record_local_check as rec


def _recording(results, commit: str) -> None:
    meta = {"runs": [{"file": f, "role": role, "commit": commit, "command": "x", "load_before": 0.1,
                      "load_after": 0.2} for f, role, _ in rec.RUNS]}
    (results / "local-runs-meta.json").write_text(json.dumps(meta))
    for f, _, _ in rec.RUNS:
        (results / f).write_text(f"{f} of {commit}")


def test_the_current_recording_moves_to_the_history_under_its_commit(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    for name, value in (("CALIBRATION_RUN", results / "local-calibration-run.json"),
                        ("PREDICTION_RUN", results / "local-prediction-run.json"),
                        ("LOCAL_RUNS_META", results / "local-runs-meta.json"),
                        ("RESULTS", results), ("HISTORY", results / "local-check-history")):
        monkeypatch.setattr(rec, name, value)
    assert rec._keep_current_recording() is None  # nothing recorded yet
    _recording(results, "abc1234")
    folder = rec._keep_current_recording()
    assert folder == results / "local-check-history" / "abc1234"
    assert sorted(p.name for p in folder.iterdir()) == sorted([*(f for f, _, _ in rec.RUNS), "local-runs-meta.json"])
    assert (folder / "local-repeat-run-2.json").read_text() == "local-repeat-run-2.json of abc1234"
    assert not any(results.glob("local-*.json"))
    # A recording of the same commit again would overwrite the kept one: refused.
    _recording(results, "abc1234")
    with pytest.raises(click.ClickException, match="exists already"):
        rec._keep_current_recording()
    assert (results / "local-runs-meta.json").exists()


def test_the_recorded_commands_are_the_check_s_sweeps():
    files = [f for f, _, _ in rec.RUNS]
    assert files[:2] == [rec.CALIBRATION_RUN.name, rec.PREDICTION_RUN.name]
    calibration, prediction = rec.RUNS[0][2], rec.RUNS[1][2]
    assert all(sweep == calibration for _, role, sweep in rec.RUNS if role == "repeat")
    assert calibration != prediction  # the prediction run is made at other sizes


def test_the_state_gauge_is_the_median_small_all_reduce_of_moecomm_rows():
    from tools.local_check import _small_all_reduce_us

    def row(op: str, size: int, p50: float, library: str = "moecomm") -> dict:
        return {"op": op, "size": size, "p50_us": p50, "time_us": p50, "library": library}

    run = {"rows": [row("all_reduce", 8, 1.9), row("all_reduce", 1024, 2.3), row("all_reduce", 1536, 2.1),
                    row("all_reduce", 2048, 9.0), row("all_gather", 8, 5.0), row("all_reduce", 8, 40.0, "torch")]}
    assert _small_all_reduce_us(run) == pytest.approx(2.1)
    assert _small_all_reduce_us({"rows": [row("all_gather", 8, 5.0)]}) is None
