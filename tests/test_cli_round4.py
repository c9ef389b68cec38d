"""Command-line mistakes that must be one-line usage errors (exit code 2 naming the option, no traceback)
before any rank starts, issue #51 point 16: bench-p2p's --transport and --json, bench-moe --mode
low_latency's --hidden and --tokens, bench-hf's --nprocs; and bench-moe's low-latency emulation passed
as a setting (transports/settings.py), not written into the environment. In-process (CliRunner), with
the launch replaced by one that fails the test, so a regression cannot start ranks or hang.
"""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

import collectives
from benchmarks import bench_hf, bench_tp, ranks
from benchmarks.cli import main


class Launched(Exception):
    """What the stand-in launch raises after recording its arguments."""


@pytest.fixture
def launches(monkeypatch):
    """The calls that reached the launch: [(transport, options)]; each raises Launched."""
    calls = []

    def launch_logged(fn, nprocs, *args, timeout, options=None, transport="auto"):
        calls.append((transport, options))
        raise Launched()

    def launch(*args, **kwargs):
        calls.append(("launch", kwargs.get("options")))
        raise Launched()

    monkeypatch.setattr(ranks, "launch_logged", launch_logged)
    monkeypatch.setattr(collectives, "launch", launch)  # the commands that launch by themselves
    for mod in (bench_hf, bench_tp):
        monkeypatch.setattr(mod, "launch_logged", launch_logged)
    return calls


def usage_error(*args, says: tuple[str, ...] = ()) -> str:
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 2, (res.exit_code, res.output, repr(res.exception))
    assert "Traceback" not in res.output
    for text in says:
        assert text in res.output, (text, res.output)
    return res.output


@pytest.mark.parametrize("transport", ["bogus", "ipc", "nccl"])
def test_bench_p2p_transport_without_a_channel_is_a_usage_error(transport, launches):
    usage_error("bench-p2p", "--transport", transport, says=("--transport", transport))
    assert not launches


def test_bench_p2p_mpi_without_mpirun_and_gloo_reaches_the_communicator(launches, monkeypatch):
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE",
                "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD", "RANK", "WORLD_SIZE", "MOECOMM_LAUNCH"):
        monkeypatch.delenv(var, raising=False)
    usage_error("bench-p2p", "--transport", "mpi", says=("--transport", "mpirun"))
    assert not launches
    # gloo, named in the help, exists only where the communicator is created with it
    res = CliRunner().invoke(main, ["bench-p2p", "--transport", "gloo"])
    assert isinstance(res.exception, Launched) and launches == [("gloo", None)], (res.output, launches)


def test_output_file_checked_before_the_run(tmp_path, launches):
    (tmp_path / "a-file").write_text("")
    usage_error("bench-p2p", "--json", tmp_path / "a-file" / "run.json", says=("--json", "not a directory"))
    usage_error("bench-p2p", "--json", tmp_path, says=("--json", "is a directory"))
    usage_error("bench-moe", "--json", tmp_path, says=("--json", "is a directory"))
    assert not launches


def test_bench_moe_low_latency_checks_hidden_and_buffers_up_front(launches, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    usage_error("bench-moe", "--mode", "low_latency", "--hidden", "100", says=("--hidden", "multiple of 128"))
    usage_error("bench-moe", "--mode", "low_latency", "--cpu-scale", "--hidden", "1000",
                says=("--hidden", "--cpu-scale"))
    # [L=128, P*M=200000, H=7168] bf16 per rank: hundreds of GB, refused instead of a silent run
    usage_error("bench-moe", "--mode", "low_latency", "--tokens", "100000",
                says=("--tokens", "P*M=200000", "lower --tokens"))
    assert not launches


def test_bench_moe_low_latency_emulation_is_a_setting_not_the_environment(launches, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.delenv("MOECOMM_IPC_EMULATE", raising=False)
    res = CliRunner().invoke(main, ["bench-moe", "--mode", "low_latency", "--tokens", "8", "--hidden", "128",
                                    "--experts", "4", "-k", "2"])
    assert isinstance(res.exception, Launched), (res.output, repr(res.exception))
    assert launches == [("auto", {"ipc_emulate": 1})], launches
    assert "MOECOMM_IPC_EMULATE" not in os.environ


@pytest.mark.parametrize("cmd,option", [("bench-hf", "--nprocs"), ("bench-tp", "--sizes")])
@pytest.mark.parametrize("value", ["2,,4", "2,4,"])
def test_int_lists_refuse_empty_items(cmd, option, value, launches):
    usage_error(cmd, option, value, says=(option, "empty item"))
    assert not launches
