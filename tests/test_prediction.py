"""The performance model inside the library (collectives/prediction.py): the shm one-shot/two-shot
switch point comes from a calibrated model, comm.plan() shows the predicted time of the chosen plan
and of the runner-up, and ranks whose models differ raise instead of running different algorithms."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import collectives
from collectives import prediction
from collectives.model import System, predict_collective
from collectives.model.systems import Link
from tests.spmd import outcome


def _system(one_shot: tuple[float, float], two_shot: tuple[float, float], *, ranks: int = 2,
            extra: dict | None = None) -> System:
    """A calibrated host System with the given (alpha us, beta us/B) fits for shm's all_reduce algorithms."""
    def term(algorithm: str, alpha: float, beta: float, op: str = "all_reduce") -> dict:
        return {"algorithm": algorithm, "ranks": ranks, "alpha_us": alpha, "beta_us_per_byte": beta,
                "protocol": "fitted", "transport": algorithm.split("/")[0], "min_bytes": 8, "max_bytes": 1 << 26}
    calibration = {"all_reduce": [term("shm/one_shot", *one_shot), term("shm/two_shot", *two_shot)]}
    for op, (alg, alpha, beta) in (extra or {}).items():
        calibration.setdefault(op, []).append(term(alg, alpha, beta, op))
    return System(name="test-host", description="synthetic fits", gpus_per_node=ranks, arch="host",
                  intra=Link("shm", 5.0, 1.0), nic=None, nics_per_node=0, nvls=False, calibration=calibration)


def test_switch_point_is_where_the_fitted_lines_cross():
    # one-shot: 7 + 3e-4 s, two-shot: 19 + 1e-4 s -> equal at s = 12 / 2e-4 = 60000 B
    system = _system((7.0, 3e-4), (19.0, 1e-4))
    assert prediction.shm_one_shot_limit(system, 2) == pytest.approx(59_999, abs=1)  # float rounding
    # one rank: never two-shot; two-shot never slower / one-shot never slower
    assert prediction.shm_one_shot_limit(system, 1) == 1 << 62
    assert prediction.shm_one_shot_limit(_system((30.0, 3e-4), (19.0, 1e-4)), 2) == 0
    assert prediction.shm_one_shot_limit(_system((7.0, 1e-4), (19.0, 3e-4)), 2) == 1 << 62


def test_switch_point_for_an_unfitted_rank_count_rescales_by_traffic():
    # fitted at 2 ranks; at 4 ranks one-shot moves (4-1)/(2-1) = 3x the bytes, two-shot
    # 2*3/4 / (2*1/2) = 1.5x: 7 + 9e-4 s = 19 + 1.5e-4 s -> s = 12 / 7.5e-4 = 16000 B
    assert prediction.shm_one_shot_limit(_system((7.0, 3e-4), (19.0, 1e-4)), 4) == pytest.approx(15_999, abs=1)


def test_fits_that_favour_two_shot_at_small_sizes_give_two_shot_everywhere(caplog):
    # two-shot lower latency, one-shot better bandwidth: the lines cross, but shm cannot run
    # "one-shot above a size"; the model's verdict is logged and two-shot used throughout
    with caplog.at_level(logging.WARNING, logger="collectives"):
        assert prediction.shm_one_shot_limit(_system((19.0, 1e-4), (7.0, 3e-4)), 2) == 0
    assert "two-shot fits faster" in caplog.text


def test_switch_point_on_piecewise_fits_and_rescaled_segments():
    # one-shot fitted in two size segments: 7 + 1e-4 s up to 64 KiB, 1 + 3e-4 s from 256 KiB;
    # two-shot 19 + 1e-4 s. Segment 0 alone never crosses two-shot; in the 64K..256K gap one-shot is
    # the chord from 13.5536 us at 65536 B to 79.6432 at 262144 (-8.4763 + 3.361491e-4 s), which meets
    # two-shot at 27.4763 / 2.361491e-4 = 116351.4 B: one-shot first loses at 116352.
    system = _system((7.0, 1e-4), (19.0, 1e-4))
    first = system.calibration["all_reduce"][0]
    system.calibration["all_reduce"][:1] = [{**first, "max_bytes": 64 << 10, "segment": 0},
                                            {**first, "alpha_us": 1.0, "beta_us_per_byte": 3e-4,
                                             "min_bytes": 256 << 10, "segment": 1}]
    assert prediction.shm_one_shot_limit(system, 2) == 116_351
    # at 4 ranks every segment is rescaled by traffic (one-shot x3, two-shot x1.5) and keeps its range:
    # at 64 KiB one-shot (7 + 3e-4 s: 26.66 us) still beats two-shot (19 + 1.5e-4 s: 28.83); in the gap the
    # chord to segment 1 at 256 KiB (1 + 9e-4 s: 236.93 us), -43.4288 + 1.0694824e-3 s, meets two-shot at
    # 62.4288 / 9.194824e-4 = 67895.6 B: one-shot first loses at 67896
    scaled = prediction.at_ranks(system, 4)
    one_shot = [t for t in scaled.calibration["all_reduce"] if t["algorithm"] == "shm/one_shot"]
    assert [(t["min_bytes"], t["max_bytes"], t["beta_us_per_byte"]) for t in one_shot] == [
        (8, 64 << 10, pytest.approx(3e-4)), (256 << 10, 1 << 26, pytest.approx(9e-4))]
    assert all(t["ranks"] == 4 and t["rescaled_from_ranks"] == 2 for t in scaled.calibration["all_reduce"])
    assert prediction.shm_one_shot_limit(system, 4) == 67_895
    # two-shot faster at small sizes (lower latency, parallel lines): 0
    assert prediction.shm_one_shot_limit(_system((7.0, 1e-4), (5.0, 1e-4)), 2) == 0


def test_a_model_without_shm_fits_leaves_the_transport_default():
    system = _system((7.0, 3e-4), (19.0, 1e-4))
    no_shm = System(**{**system.__dict__, "calibration": {"all_gather": system.calibration["all_reduce"][:1]}})
    assert prediction.shm_one_shot_limit(no_shm, 2) is None


def test_the_shipped_model_loads_and_gives_a_switch_point():
    system = prediction.host_model({})
    assert system.calibration, "collectives/model/calibrations/host-2vcpu.json has no fits"
    for n in (2, 3, 4):
        assert prediction.shm_one_shot_limit(system, n) is not None


def test_a_bad_model_file_raises_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        prediction.host_model({"model_file": str(bad)})
    uncalibrated = tmp_path / "preset.json"
    from collectives.model import get_system
    uncalibrated.write_text(json.dumps(get_system("dgx-h100").to_dict()))
    with pytest.raises(ValueError, match="not calibrated"):
        prediction.host_model({"model_file": str(uncalibrated)})


def _in_a_communicator(comm, model_file: str, other_file: str):
    """Every check that needs live ranks, in one launch (returned, compared by the test)."""
    out = {"limit": comm.transports["shm"]._one_shot_limit}
    small, large = torch.randn(1000), torch.randn(40_000)  # 4000 B one-shot, 160000 B two-shot at 59999
    out["plans"] = [comm.plan("all_reduce", small), comm.plan("all_reduce", large),
                    comm.plan("all_gather", small), comm.plan("barrier", small)]
    # the algorithm the plan names is the one that runs (and the result is right)
    xs = [torch.randn(40_000, generator=torch.Generator().manual_seed(r)) for r in range(comm.size)]
    out["sum_ok"] = torch.allclose(comm.all_reduce(xs[comm.rank]), sum(xs), atol=1e-4)
    # sizes that straddle the switch point on different ranks still raise the ValueError naming them
    x = small if comm.rank == 0 else large
    out["straddle"] = outcome(lambda: comm.all_reduce(x))
    # an explicit setting wins over the model
    sub = comm.split(0, options={"shm_one_shot_max": 123})
    out["explicit"] = sub.transports["shm"]._one_shot_limit
    sub.close()
    # ranks whose models differ: the derived switch points differ, and every rank raises at creation
    mine = model_file if comm.rank == 0 else other_file
    out["differ"] = outcome(lambda: comm.split(0, options={"model_file": mine}))
    return out


def test_communicator_uses_the_model_for_the_switch_point_and_plan(tmp_path):
    system = _system((7.0, 3e-4), (19.0, 1e-4),
                     extra={"all_gather": ("shm/pull", 5.0, 2e-4), "all_to_all": ("shm/pull", 9.0, 2e-4)})
    model = tmp_path / "model.json"
    model.write_text(json.dumps(system.to_dict()))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_system((7.0, 3e-4), (31.0, 1e-4)).to_dict()))
    results = collectives.launch(_in_a_communicator, 2, str(model), str(other), timeout=30.0,
                                 options={"model_file": str(model)})
    for rank, out in enumerate(results):
        assert out["limit"] == pytest.approx(59_999, abs=1), rank
        small, large, gather, barrier = out["plans"]
        assert (small.algorithm, large.algorithm) == ("one_shot", "two_shot")
        # predicted time of the plan and of the runner-up, from the model (sizes as nccl-tests counts them)
        assert small.predicted_us == pytest.approx(7.0 + 3e-4 * 4000)
        assert (small.runner_up, small.runner_up_us) == ("shm/two_shot", pytest.approx(19.0 + 1e-4 * 4000))
        assert large.predicted_us == pytest.approx(19.0 + 1e-4 * 160_000)
        assert (large.runner_up, large.runner_up_us) == ("shm/one_shot", pytest.approx(7.0 + 3e-4 * 160_000))
        assert gather.predicted_us == pytest.approx(5.0 + 2e-4 * 8000) and gather.runner_up is None
        assert barrier.predicted_us is None
        assert "predicted 8.2 us, runner-up shm/two_shot 19.4 us" in str(small)
        assert out["sum_ok"]
        assert out["straddle"][0] == "ValueError" and "rank" in out["straddle"][1], out["straddle"]
        assert out["explicit"] == 123
        kind, message = out["differ"]
        assert kind == "ValueError" and "MOECOMM_SHM_ONE_SHOT_MAX" in message, message


def test_plan_predictions_match_the_model_for_gpu_presets(monkeypatch):
    # The GPU branch without a GPU: the numbers predict_collective gives for the preset, the model's
    # one_shot/two_shot served by ipc and the others by nccl (which picks its own algorithm).
    from collectives.model import get_system

    system = get_system("dgx-h100")
    monkeypatch.setattr(prediction, "_gpu_model", lambda settings, device: system)
    for nbytes in (4096, 1 << 20, 1 << 28):
        p = predict_collective(system, "all_reduce", nbytes, nodes=1, gpus_per_node=8)
        best: dict[tuple[str, str], float] = {}
        for c in p.candidates:
            key = ("ipc" if c.algorithm in ("one_shot", "two_shot") else "nccl", c.algorithm)
            best[key] = min(c.time_us, best.get(key, c.time_us))
        nccl_best = min((k for k in best if k[0] == "nccl"), key=best.__getitem__)
        expected_runner = min((us, f"{t}/{a}") for (t, a), us in best.items() if (t, a) != nccl_best)
        got = prediction.predict_plan({}, op="all_reduce", transport="nccl", algorithm="nccl", nbytes=nbytes,
                                      ranks=8, nodes=1, device=torch.device("cuda", 0), available={"nccl", "ipc"})
        assert got.chosen_us == pytest.approx(best[nccl_best]), nbytes
        assert (got.runner_up, got.runner_up_us) == (expected_runner[1], pytest.approx(expected_runner[0])), nbytes
