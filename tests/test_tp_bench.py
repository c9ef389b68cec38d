"""Smoke test of `moecomm bench-tp` at toy sizes (no timing asserts: timings belong to benchmarks)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from benchmarks.cli import main


@pytest.mark.parametrize("sp", ["--no-sequence-parallel", "--sequence-parallel"])
def test_bench_tp_smoke(sp):
    res = CliRunner().invoke(main, ["bench-tp", "--hidden", "16", "--ffn", "32", "--tokens", "8", "--sizes", "1,2",
                                    "-n", "2", "-w", "1", sp, "--device", "cpu"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = [ln.split() for ln in res.output.splitlines() if ln.split() and ln.split()[0] in ("1", "2")]
    assert [r[0] for r in rows] == ["1", "2"], res.output
    assert all(float(r[-1]) < 1e-5 for r in rows), res.output  # max_rel_err against the dense float64 block
    assert res.output.count("#      on cpu") == 2
    # at TP 2 the block's collectives are timed per phase (all_reduce, or all_gather/reduce_scatter with sp)
    assert ("fwd all_gather" in res.output) == (sp == "--sequence-parallel")
    assert "fwd all_reduce" in res.output or "fwd all_gather" in res.output


def test_bench_tp_device_cuda_without_a_gpu_is_a_usage_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = CliRunner().invoke(main, ["bench-tp", "--sizes", "1", "--device", "cuda"])
    assert res.exit_code == 2 and "needs a CUDA GPU" in res.output, res.output


def test_bench_tp_transport_reaches_the_communicator(monkeypatch):
    # forced onto ipc (emulated over host shared memory here), the block still equals the dense one
    monkeypatch.setenv("MOECOMM_IPC_EMULATE", "1")
    res = CliRunner().invoke(main, ["bench-tp", "--hidden", "16", "--ffn", "32", "--tokens", "8", "--sizes", "2",
                                    "-n", "1", "-w", "0", "--device", "cpu", "--transport", "ipc"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = [ln.split() for ln in res.output.splitlines() if ln.split() and ln.split()[0] == "2"]
    assert len(rows) == 1 and float(rows[0][-1]) < 1e-5, res.output
    # a transport this launch cannot have (mpi needs mpiexec) is refused by the communicator
    monkeypatch.delenv("MOECOMM_IPC_EMULATE")
    res = CliRunner().invoke(main, ["bench-tp", "--sizes", "2", "--device", "cpu", "--transport", "mpi"])
    assert res.exit_code != 0 and "'mpi'" in repr(res.exception) + res.output
