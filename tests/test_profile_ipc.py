"""tools.profile_ipc without a GPU: it says so and exits 3; its host timers record one sample per
call, also when the timed call raises. The GPU run is in benchmarks/results (H100, 2026-11-23)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from tools import profile_ipc


def test_without_a_gpu_it_exits_3(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(profile_ipc.main, ["--bytes", "64"])
    assert res.exit_code == 3 and "needs a CUDA GPU" in res.output


def test_timed_records_every_call_and_passes_results_and_errors_through():
    samples: list[float] = []
    double = profile_ipc._timed(lambda x: 2 * x, samples)
    assert double(21) == 42 and len(samples) == 1 and samples[0] >= 0

    def fail():
        raise OSError("peer gone")

    with pytest.raises(OSError, match="peer gone"):
        profile_ipc._timed(fail, samples)()
    assert len(samples) == 2


def test_launch_timer_covers_the_bound_kernels_and_the_latency_closures():
    # both go through the launcher by their module's name for it: the timer must replace both, and undo both
    import transports._ipc_launch as launch_mod
    import transports.ipc as ipc_mod

    real = launch_mod.launch
    undo = profile_ipc._timed_launches({"launch": []}, [])
    try:
        assert launch_mod.launch is ipc_mod.launch is not real
    finally:
        undo()
    assert launch_mod.launch is ipc_mod.launch is real
