"""`moecomm doctor`: OK/WARN/FAIL lines with fixes, exit code 1 on FAIL, a broken MPI cannot crash it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from benchmarks import doctor as dr
from benchmarks.cli import main
from spmd import UNDER_MPI
from test_launch_modes import ROOT, _env

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own ranks")


def _quick(monkeypatch):
    """Skip the (real, launched) rank check and the MPI subprocess; tested on their own below."""
    monkeypatch.setattr(dr, "check_ranks", lambda nprocs, timeout, **kw: [dr.Check(dr.OK, "ranks", "stubbed")])
    monkeypatch.setattr(dr, "check_mpi", lambda: [dr.Check(dr.OK, "mpi", "stubbed")])
    for var in [v for v in os.environ if v.startswith(("NCCL_", "MOECOMM_"))] + ["CUDA_LAUNCH_BLOCKING"]:
        monkeypatch.delenv(var, raising=False)


def test_doctor_on_this_machine_is_ready(monkeypatch):
    """The real thing: two ranks launched, barrier + all_reduce, /dev/shm, MPI in a subprocess.

    In-process (CliRunner): the launching process prints every line, and its ranks come from the test
    session's warm fork server (a fresh `python -m benchmarks.cli` would import torch twice more)."""
    for var in [v for v in os.environ if v.startswith(("NCCL_", "MOECOMM_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])  # for doctor's MPI subprocess, as before
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(main, ["doctor", "--timeout", "60"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    lines = res.stdout.splitlines()
    for name in ("ranks", "shm", "mpi", "mpiexec", "gpu", "nccl", "env"):
        assert any(line.split()[:2] == ["OK", name] for line in lines), (name, res.output)
    assert "barrier + all_reduce correct" in res.stdout and "shm" in res.stdout
    assert lines[-1].startswith("doctor: 0 FAIL")


def test_env_variables_that_disable_fast_paths_warn(monkeypatch):
    _quick(monkeypatch)
    for var, val in (("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"), ("NCCL_IB_DISABLE", "1"),
                     ("NCCL_NVLS_ENABLE", "0"), ("MOECOMM_TRANSPORT", "mpi")):
        monkeypatch.setenv(var, val)
    res = CliRunner().invoke(main, ["doctor"])
    assert res.exit_code == 0, res.output  # warnings only
    warns = [line for line in res.output.splitlines() if line.startswith("WARN  env")]
    assert len(warns) == 5 and "fix: unset NCCL_P2P_DISABLE" in res.output
    assert "MOECOMM_TRANSPORT=mpi" in res.output and "doctor: 0 FAIL, 5 WARN" in res.output
    # values that do not disable anything are fine
    assert dr.check_env({"NCCL_P2P_DISABLE": "0", "NCCL_NVLS_ENABLE": "1", "MOECOMM_TRANSPORT": "auto",
                         "NCCL_DEBUG": "INFO"})[0].level == dr.OK
    assert dr.check_env({"MOECOMM_SHM_SLOT_BYTES": "lots"})[0].level == dr.FAIL
    assert dr.check_env({"MOECOMM_SHM_SLOT_BYTES": "4096"})[0].level == dr.WARN


def test_small_or_missing_dev_shm_fails(monkeypatch):
    _quick(monkeypatch)
    tiny = SimpleNamespace(f_blocks=16 << 10, f_frsize=4096, f_bavail=1 << 8)  # 64 MiB, 1 MiB free
    monkeypatch.setattr(dr.os, "statvfs", lambda path: tiny)
    res = CliRunner().invoke(main, ["doctor"])
    assert res.exit_code == 1, res.output
    assert any(line.startswith("FAIL  shm") for line in res.output.splitlines())
    assert "--shm-size" in res.output and res.output.splitlines()[-1].startswith("doctor: 1 FAIL")
    small = SimpleNamespace(f_blocks=16 << 10, f_frsize=4096, f_bavail=16 << 10)  # 64 MiB, all free
    monkeypatch.setattr(dr.os, "statvfs", lambda path: small)
    assert dr.check_shm(nprocs=2)[0].level == dr.WARN  # enough now, but Docker's default size

    def gone(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(dr.os, "statvfs", gone)
    assert dr.check_shm()[0].level == dr.FAIL


def test_broken_mpi_is_a_fail_not_a_crash(monkeypatch):
    monkeypatch.setattr(dr, "_MPI_PROBE", "raise OSError('libmpi.so.12: cannot open shared object file')")
    c = dr.check_mpi()[0]
    assert c.level == dr.FAIL and "libmpi.so.12" in c.message and 'pip install "moecomm[mpi]"' in c.fix
    monkeypatch.setattr(dr, "_MPI_PROBE", "import os; os.abort()")  # the library crashes the process
    assert dr.check_mpi()[0].level == dr.FAIL
    monkeypatch.setattr(dr, "_MPI_PROBE", "import time; time.sleep(30)")
    assert dr.check_mpi(timeout=1)[0].level == dr.FAIL
    monkeypatch.setattr(dr, "_MPI_PROBE", "raise ModuleNotFoundError(\"No module named 'mpi4py'\")")
    c = dr.check_mpi()[0]  # MPI is optional (the mpi extra): a plain install passes its doctor
    assert c.level == dr.WARN and 'pip install "moecomm[mpi]"' in c.fix


def test_rank_failures_are_reported(monkeypatch):
    import collectives

    def boom(*a, **k):
        raise TimeoutError("rank 1 did not arrive at barrier within 5 s")

    monkeypatch.setattr(collectives, "launch", boom)
    c = dr.check_ranks(2, 5)[0]
    assert c.level == dr.FAIL and "rank 1 did not arrive" in c.message

    def hang(*a, **k):
        import time

        time.sleep(5)

    monkeypatch.setattr(collectives, "launch", hang)
    c = dr.check_ranks(2, -14.5)[0]  # waits timeout * 2 + 30 = 1 s
    assert c.level == dr.FAIL and "did not finish" in c.message


def test_gpu_checks_without_and_with_gpus(monkeypatch):
    import torch

    n, checks = dr.gpu_count()
    assert n == torch.cuda.device_count() and checks[0].level in (dr.OK, dr.WARN)
    assert dr.check_p2p(0) == [] and dr.check_ipc(0) == []
    if n == 0:
        assert dr.check_nccl(0)[0].level == dr.OK
        import benchmarks.output

        monkeypatch.setattr(benchmarks.output, "nccl_version", lambda: None)
        assert dr.check_nccl(2)[0].level == dr.WARN  # GPUs but no NCCL
        monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) != (0, 1))
        p2p = dr.check_p2p(2)[0]
        assert p2p.level == dr.WARN and "0->1" in p2p.message


def test_moecomm_variables_are_checked_against_the_settings_table(monkeypatch):
    """Every MOECOMM_* value is parsed by its Setting (FAIL naming the variable), unknown names WARN,
    defaults quoted in fixes come from the table (the shm slot is 1 MiB, not 4), and doctor lists
    every setting with its value here."""
    from benchmarks.common import format_size
    from transports.settings import SETTINGS

    _quick(monkeypatch)
    failures = []
    for var, val in (("MOECOMM_SHM_YIELD", "-3"), ("MOECOMM_NCCL_CHECK", "sometimes"),
                     ("MOECOMM_SHM_ONE_SHOT_MAX", "big"), ("MOECOMM_TRANSPORT", "pigeon"),
                     ("MOECOMM_SHM_SLOT_BYTES", "100"), ("MOECOMM_LAUNCH", "slurm"), ("MOECOMM_SHM_SPIN", "1.5")):
        found = dr.check_env({var: val})
        if [c.level for c in found] != [dr.FAIL] or var not in found[0].message:
            failures.append((var, val, [(c.level, c.message) for c in found]))
    unknown = dr.check_env({"MOECOMM_SLOT_BYTES": "1048576"})
    if [c.level for c in unknown] != [dr.WARN] or "MOECOMM_SHM_SLOT_BYTES" not in unknown[0].message:
        failures.append(("unknown name", [(c.level, c.message) for c in unknown]))
    assert not failures, failures

    slot_default = format_size(SETTINGS["shm_slot_bytes"].default)
    small = dr.check_env({"MOECOMM_SHM_SLOT_BYTES": "4096"})
    assert [c.level for c in small] == [dr.WARN] and f"({slot_default})" in small[0].fix, small[0].fix
    gone = SimpleNamespace(f_blocks=16 << 10, f_frsize=4096, f_bavail=1 << 8)
    monkeypatch.setattr(dr.os, "statvfs", lambda path: gone)
    assert f"(default {slot_default})" in dr.check_shm(nprocs=2)[0].fix
    monkeypatch.undo()

    _quick(monkeypatch)
    monkeypatch.setenv("MOECOMM_SHM_YIELD", "7")
    res = CliRunner().invoke(main, ["doctor"])
    table = res.output[res.output.index("settings (MOECOMM_*"):]
    for setting in SETTINGS.values():
        assert f" {setting.env} " in table, setting.env
    assert next(line for line in table.splitlines() if "MOECOMM_SHM_YIELD" in line).split()[1] == "7"
