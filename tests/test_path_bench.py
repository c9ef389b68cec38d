"""``--path`` of bench, bench-p2p and bench-moe (benchmarks/path_bench.py): forced, verified, refused.

On this machine (no GPU, no RDMA) the CPU paths shm and socket run end to end; the others must exit 2
with the reason ``moecomm paths`` gives; a path the library did not take fails naming both, checked with
a stand-in NCCL log and with a row that ran on another transport. The testbed's shaped-link check is in
tests/test_path_testbed.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import collectives
from benchmarks import path_bench as pb
from benchmarks.plot import series
from transports.paths import PathMismatchError

NCCL_LOGS = Path(__file__).parent / "fixtures" / "nccl_logs"


def _cli(*args: str) -> SimpleNamespace:
    """``moecomm ARGS`` in this process (its ranks are launched as usual): returncode, stdout, stderr."""
    from click.testing import CliRunner

    from benchmarks.cli import main

    res = CliRunner().invoke(main, list(args))
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    return SimpleNamespace(returncode=res.exit_code, stdout=res.stdout, stderr=res.stderr)


def test_bench_socket_and_shm_in_one_invocation(tmp_path):
    out = tmp_path / "run.json"
    p = _cli("bench", "--path", "socket,shm", "--ops", "all_reduce,all_gather", "-b", "1K", "-e", "64K", "-f", "64",
             "-n", "2", "-w", "1", "-q", "--no-save", "-J", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    run = json.loads(out.read_text())
    rows = run["rows"]
    assert {(r["transport"], r["path"]) for r in rows} == {("socket", "socket"), ("shm", "shm")}
    assert all(r["wrong"] == 0 for r in rows)
    # each path's rows ran on its transport: gloo (TCP) for socket, shm for shm
    assert {r["algorithm"].split(":")[0] for r in rows if r["path"] == "socket"} == {"gloo"}
    assert {r["algorithm"].split(":")[0] for r in rows if r["path"] == "shm"} == {"shm"}
    assert run["env"]["paths"]["socket"]["transport"] == "gloo"
    lines = {(op, peer) for op, peer, _, _ in series(rows)}  # the plot: one line per path and op
    assert lines == {(op, path) for op in ("all_reduce", "all_gather") for path in ("socket", "shm")}
    traffic = [n for n in run["notes"] if n.startswith("socket: rank 0 sent")]
    assert traffic and "over lo" in traffic[0], run["notes"]  # one node: TCP over loopback


def test_a_path_that_is_not_here_exits_2_with_one_line():
    from benchmarks.paths_cli import unavailable_message
    from collectives.topology.paths import path_info

    infos = pb.local_paths()
    missing = [p for p in ("nvlink", "pcie", "cuda-ipc", "ib", "roce") if not path_info(infos, p).available]
    if not missing:
        pytest.skip("this machine has every path")
    for path in missing:
        p = _cli("bench", "--path", path, "--no-save")
        assert p.returncode == 2, p.stdout + p.stderr
        err = [line for line in p.stderr.splitlines() if line.strip()]
        assert err == [f"Error: {unavailable_message(path_info(infos, path))}"], p.stderr
        assert path in err[0]


def test_bad_path_options():
    p = _cli("bench", "--path", "carrier-pigeon", "--no-save")
    assert p.returncode == 2 and "carrier-pigeon" in p.stderr
    p = _cli("bench", "--path", "shm", "--compare", "--no-save")
    assert p.returncode == 2 and "--compare" in p.stderr
    p = _cli("bench-p2p", "--path", "shm", "--transport", "gloo")
    assert p.returncode == 2 and "gloo cannot be forced onto path shm" in p.stderr


def test_transport_for_each_device():
    assert pb.transport_for("socket", "cpu") == "gloo" and pb.transport_for("shm", "cpu") == "shm"
    assert pb.transport_for("cuda-ipc", "cuda") == "ipc"
    assert pb.transport_for("cuda-ipc", "cuda", "nccl") == "nccl"  # NCCL's P2P/IPC
    assert {pb.transport_for(p, "cuda") for p in ("nvlink", "pcie", "shm", "ib", "roce", "socket")} == {"nccl"}
    with pytest.raises(pb.PathUnavailable, match="does not carry cpu tensors"):
        pb.transport_for("nvlink", "cpu")
    with pytest.raises(pb.PathUnavailable, match="cannot be forced"):
        pb.transport_for("socket", "cpu", "shm")


def test_each_nccl_path_gets_ranks_of_its_own(tmp_path):
    from collectives.topology.paths import PathInfo

    infos = [PathInfo("shm", True, "shm"), PathInfo("socket", True, "TCP over eth0", devices=("eth0",)),
             PathInfo("cuda-ipc", True, "ipc"), PathInfo("roce", True, "RoCE", devices=("mlx5_8:1",), gid_index=3)]
    launches = pb.plan_launches(["cuda-ipc", "shm", "socket", "roce"], "cuda", None, infos, external=False)
    try:
        assert [launch.paths for launch in launches] == [["cuda-ipc"], ["shm"], ["socket"], ["roce"]]
        assert launches[0].env == {}  # ours: no NCCL environment
        assert launches[2].env["NCCL_SOCKET_IFNAME"].endswith("eth0")
        assert launches[3].env["NCCL_IB_GID_INDEX"] == "3" and "mlx5_8:1" in launches[3].env["NCCL_IB_HCA"]
        assert all(launch.env["NCCL_DEBUG"] == "INFO" for launch in launches[1:])
        with pytest.raises(pb.PathUnavailable, match="one NCCL path per run"):
            pb.plan_launches(["shm", "socket"], "cuda", None, infos, external=True)
    finally:
        pb.cleanup(launches)
    assert not any(launch.log_dir and os.path.exists(launch.log_dir) for launch in launches)


class _OneRank:
    """The collectives agree_on_path needs, on one rank."""

    size, rank = 1, 0

    def all_gather(self, a):
        return a.copy()


def test_nccl_taking_another_path_fails_naming_both(tmp_path):
    (tmp_path / "nccl.host.1.log").write_text((NCCL_LOGS / "shm.log").read_text())
    taken = pb.taken_path("socket", "nccl", "nccl", str(tmp_path))
    assert taken[0] == "shm"
    with pytest.raises(PathMismatchError) as e:
        pb.agree_on_path(_OneRank(), "socket", taken, "all_reduce of 8 B")
    assert "'socket'" in str(e.value) and "'shm'" in str(e.value) and e.value.taken == "shm"
    assert pb.agree_on_path(_OneRank(), "shm", pb.taken_path("shm", "nccl", "nccl", str(tmp_path)), "x") == "shm"


def test_a_row_that_ran_elsewhere_fails_and_a_good_row_is_stamped():
    check = pb.Verifier(_OneRank(), "socket", "gloo")
    with pytest.raises(PathMismatchError, match="asked for path 'socket', but 'transport shm' was taken"):
        check(SimpleNamespace(algorithm="shm:one_shot", op="all_reduce", size=8, path=""))
    check = pb.Verifier(_OneRank(), "socket", "gloo")
    rows = [SimpleNamespace(algorithm="gloo:allreduce", op="all_reduce", size=s, path="") for s in (8, 64)]
    for row in rows:
        check(row)
    assert [r.path for r in rows] == ["socket", "socket"]


def _env_of_rank(comm, name):
    return os.environ.get(name)


def test_launch_sets_env_in_every_rank():
    # the fork server keeps the first launch's environment: env= is how later launches reach NCCL
    name = "MOECOMM_TEST_LAUNCH_ENV"
    assert collectives.launch(_env_of_rank, 2, name, env={name: "on"}, device="cpu") == ["on", "on"]
    with pytest.raises(TypeError, match="env must map"):
        collectives.launch(_env_of_rank, 1, name, env={name: 1})


def test_bench_p2p_and_bench_moe_take_the_path(tmp_path):
    p2p = tmp_path / "p2p.json"
    p = _cli("bench-p2p", "--path", "socket", "--sizes", "4K", "-n", "2", "--reps", "1", "-w", "1", "--json", str(p2p))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(p2p.read_text())["rows"]
    assert {r["path"] for r in rows if r["backend"] == "moecomm"} == {"socket"}
    assert "path socket (verified)" in p.stdout
    moe = tmp_path / "moe.json"
    p = _cli("bench-moe", "--path", "shm", "--tokens", "16", "--hidden", "32", "--experts", "4", "-k", "2",
             "-n", "1", "-w", "0", "--no-baseline", "-J", str(moe))
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(moe.read_text())["rows"]
    assert {r["path"] for r in rows if r["impl"] == "moecomm"} == {"shm"}
    p = _cli("bench-moe", "--path", "roce", "--tokens", "16", "--hidden", "32", "--experts", "4", "-k", "2")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_path_not_taken_fails_the_run_after_the_others_ran(monkeypatch, tmp_path):
    # two launches (as for two NCCL paths): the first's path is not taken, the second's rows are still
    # measured and written, and the run exits 1 naming what the first took
    import benchmarks.bench as bench_mod
    from benchmarks.common import Row

    first, second = pb.Launch(["shm"], {"NCCL_DEBUG": "INFO"}, str(tmp_path / "logs")), pb.Launch(["socket"])
    (tmp_path / "logs").mkdir()
    monkeypatch.setattr(pb, "plan_launches", lambda *a, **k: [first, second])
    row = Row(op="all_reduce", transport="socket", size=8, count=2, dtype="float32", redop="sum", time_us=1.0,
              algbw=0.008, busbw=0.008, wrong=0, path="socket").as_dict()

    def on_ranks(fn, nprocs, o, **kw):
        if o["paths"] == ["shm"]:
            assert kw["env"] == first.env
            raise PathMismatchError("shm", "p2p", "rank 1 (all_reduce of 8 B): via P2P/IPC")
        return True, {"rows": [row], "notes": [], "meta": {"nranks": 2, "paths": {"socket": {}}}}

    monkeypatch.setattr(bench_mod, "on_ranks", on_ranks)
    out = tmp_path / "run.json"
    p = _cli("bench", "--path", "shm,socket", "-b", "8", "-e", "8", "-J", str(out), "--no-save")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "asked for path 'shm', but 'p2p' was taken" in p.stderr and str(tmp_path / "logs") in p.stderr
    assert [r["path"] for r in json.loads(out.read_text())["rows"]] == ["socket"]
    assert (tmp_path / "logs").is_dir()  # the failed path's NCCL log is kept for the reader
