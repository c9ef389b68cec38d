"""collectives.init / collectives.launch: argument checks up front, options=, retries under torchrun,
and launch refused inside an MPI job."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import collectives
from spmd import UNDER_MPI, mpiexec_path, run_side_by_side

HERE = Path(__file__).parent
ROOT = HERE.parent
pytestmark = pytest.mark.skipif(UNDER_MPI, reason="starts its own ranks and launchers")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOECOMM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def _rank_of(comm) -> int:
    return comm.rank


def _settings_of(comm) -> dict:
    return {k: comm.settings[k] for k in ("shm_slot_bytes", "shm_yield", "transport")}


def test_bad_timeouts_raise_before_anything_starts():
    """0, negative, inf and nan (ValueError) and non-numbers (TypeError) are refused by init and
    launch alike, at once, with no rank started (they used to hang or surface as torch C++ errors)."""
    failures = []
    cases = [(0, ValueError), (-1, ValueError), (0.0, ValueError), (float("inf"), ValueError),
             (float("-inf"), ValueError), (float("nan"), ValueError), ("5", TypeError), (None, TypeError),
             (True, TypeError)]
    for timeout, expected in cases:
        for name, call in (("init", lambda: collectives.init(timeout=timeout)),
                           ("launch", lambda: collectives.launch(_rank_of, 2, timeout=timeout))):
            t0 = time.monotonic()
            try:
                call()
            except expected as e:
                if "timeout" not in str(e):
                    failures.append(f"{name}(timeout={timeout!r}): message does not name the timeout: {e}")
            except BaseException as e:  # noqa: BLE001 - collect every wrong outcome
                failures.append(f"{name}(timeout={timeout!r}): {type(e).__name__} instead of {expected.__name__}: {e}")
            else:
                failures.append(f"{name}(timeout={timeout!r}) was accepted")
            if time.monotonic() - t0 > 5:
                failures.append(f"{name}(timeout={timeout!r}) took {time.monotonic() - t0:.1f}s to refuse")
    assert not multiprocessing.active_children(), "a bad timeout started ranks"
    assert not failures, "\n".join(failures)


def test_launch_options_reach_every_rank_and_bad_ones_raise_up_front():
    got = collectives.launch(_settings_of, 2, timeout=60.0,
                             options={"shm_slot_bytes": 1 << 16, "shm_yield": 7, "transport": "shm"})
    assert got == [{"shm_slot_bytes": 1 << 16, "shm_yield": 7, "transport": "shm"}] * 2
    for options, match in (({"no_such_option": 1}, "no_such_option"), ({"shm_slot_bytes": "big"}, "SHM_SLOT_BYTES"),
                           ({"transport": "carrier-pigeon"}, "carrier-pigeon")):
        with pytest.raises(ValueError, match=match):
            collectives.launch(_rank_of, 2, timeout=60.0, options=options)
    assert not multiprocessing.active_children()


def test_launch_ranks_see_the_callers_current_environment(monkeypatch):
    """Ranks fork from a server started at the first launch; a MOECOMM_* variable set after that
    must still reach them (it used to be silently ignored)."""
    collectives.launch(_rank_of, 1, timeout=60.0)  # the fork server exists from here on
    monkeypatch.setenv("MOECOMM_TRANSPORT", "mpi")  # not available under launch: every rank must say so
    with pytest.raises(ValueError, match="mpi"):
        collectives.launch(_rank_of, 2, timeout=60.0)
    monkeypatch.setenv("MOECOMM_TRANSPORT", "shm")
    monkeypatch.setenv("MOECOMM_SHM_YIELD", "3")
    assert [s["shm_yield"] for s in collectives.launch(_settings_of, 2, timeout=60.0)] == [3, 3]


def test_launch_preload_imports_modules_once_in_the_fork_server_and_only_before_the_first_launch(tmp_path):
    """Ranks fork holding the preloaded module (a module not preloaded is absent); a later call is refused,
    as are names that are not strings. In a fresh process: this one's fork server has started."""
    for bad in ("", 3, None):
        with pytest.raises(TypeError, match="launch_preload"):
            collectives.launch_preload(bad)
    script = tmp_path / "preload.py"
    script.write_text(textwrap.dedent("""
        import sys
        import collectives

        def held(comm):
            return ["xml.dom.minidom" in sys.modules, "wave" in sys.modules]

        if __name__ == "__main__":
            import transports.shm  # the server's own preload, so that the check below means something
            assert "xml.dom.minidom" not in sys.modules and "wave" not in sys.modules
            collectives.launch_preload("xml.dom.minidom")
            print(collectives.launch(held, 2, timeout=60.0, transport="shm"))
            try:
                collectives.launch_preload("wave")
            except RuntimeError as e:
                print("refused:", e)
        """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=_env(),
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[0] == "[[True, False], [True, False]]", p.stdout
    assert "refused: launch_preload: the fork server has started" in p.stdout, p.stdout


def test_init_options_override_launch_detection(monkeypatch):
    """options={"launch": "single"} wins over a torchrun environment (no store is contacted); bad
    launch settings and thread counts raise."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there: a store contact would fail
    assert collectives.detect_launch() == "torchrun"
    comm = collectives.init(timeout=5.0, options={"launch": "single", "shm_yield": 9})
    try:
        assert (comm.size, comm.topology.launch, comm.settings["shm_yield"]) == (1, "single", 9)
    finally:
        comm.close()
    with pytest.raises(ValueError, match="no_such_option"):
        collectives.init(timeout=5.0, options={"no_such_option": 1})
    monkeypatch.setenv("MOECOMM_LAUNCH", "slurm")  # a typo must not be ignored (it used to be)
    with pytest.raises(ValueError, match="MOECOMM_LAUNCH"):
        collectives.init(timeout=5.0)
    monkeypatch.delenv("MOECOMM_LAUNCH")
    for bad_threads in (0, -2, 1.5):
        with pytest.raises(ValueError, match="threads"):
            collectives.launch(_rank_of, 1, timeout=5.0, threads=bad_threads)


_RETRY_JOB = textwrap.dedent("""
    import gc, json, os, sys, time

    rank = int(os.environ["RANK"])
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        # 0: the first attempt of an elastic job fails: rank 0 has arrived at init when rank 1 exits;
        # torchrun then restarts both, and the restarted ranks must not be confused by rank 0's arrival
        arrived = os.path.join(os.environ["RETRY_JOB_DIR"], "attempt0-rank0-arrived")
        if rank == 1:  # needs no torch: it waits (bounded) for rank 0's word that the store counted it
            deadline = time.monotonic() + 60
            while not os.path.exists(arrived) and time.monotonic() < deadline:
                time.sleep(0.02)
            print("attempt 0: rank 1 exits", "after" if os.path.exists(arrived) else "WITHOUT",
                  "rank 0's arrival at init", flush=True)
            sys.exit(3)
        import threading
        import collectives
        from collectives import _torchrun_key_base
        from collectives.rendezvous import store_client

        def tell_arrival():  # once the agent's store has counted this rank's arrival at init
            store = store_client(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 60.0)
            while store.add(_torchrun_key_base() + "/arrivals", 0) < 1:
                time.sleep(0.02)
            open(arrived, "w").close()

        threading.Thread(target=tell_arrival, daemon=True).start()
        collectives.init(timeout=60.0)  # torchrun kills this rank when rank 1 exits
        sys.exit(4)
    import torch
    import collectives

    report = {"rank": rank, "local_errors": [], "phase2": None, "ok": []}

    def check(comm, seed):
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(5, dtype=torch.float64, generator=g) for _ in range(comm.size)]
        report["ok"].append(bool(torch.allclose(comm.all_reduce(xs[comm.rank]), sum(xs))))

    # 1: rank 1 fails twice on its own before the rendezvous, then retries; rank 0 calls init once
    if rank == 1:
        for bad in ("soon", float("nan")):
            try:
                collectives.init(timeout=bad)
                report["local_errors"].append("accepted")
            except (TypeError, ValueError) as e:
                report["local_errors"].append(type(e).__name__)
    comm = collectives.init(timeout=15.0)
    check(comm, 1)
    comm.close()
    # 2: every rank fails after the rendezvous (their settings differ), then every rank retries
    try:
        collectives.init(timeout=15.0, options={"shm_slot_bytes": 8192 * (rank + 1)})
        report["phase2"] = "accepted"
    except ValueError as e:
        report["phase2"] = "ValueError" if "shm_slot_bytes" in str(e).lower() else repr(e)
    comm = collectives.init(timeout=15.0)
    check(comm, 2)
    comm.close()
    print(json.dumps(report), flush=True)
    gc.freeze()  # everything is closed: no final garbage collection at exit (about 0.6 CPU-s with torch)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_retry_reports(out: str, err: str) -> None:
    # ranks share one pipe under torchrun, so their lines can interleave: pick out the JSON objects
    reports = sorted((json.loads(m) for m in re.findall(r'\{"rank"[^{}]*\}', out)), key=lambda d: d["rank"])
    assert [r["rank"] for r in reports] == [0, 1], out[-3000:] + err[-3000:]
    assert reports[1]["local_errors"] == ["TypeError", "ValueError"], reports
    assert all(r["phase2"] == "ValueError" and r["ok"] == [True, True] for r in reports), reports


def test_init_retry_meets_the_peers_under_torchrun(tmp_path):
    """A rank whose init() failed (locally, or on every rank) retries and meets its peers: under
    torchrun (agent's store, after an elastic restart of a first attempt that failed during init)
    and with RANK/WORLD_SIZE/MASTER_* set by hand (rank 0 hosts the store)."""
    job = tmp_path / "retry_job.py"
    job.write_text(_RETRY_JOB)
    # the torchrun job and the hand-set one run side by side
    common = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", "--monitor-interval", "0.1", str(job)]
    p, *procs = run_side_by_side([torchrun] + [[sys.executable, str(job)]] * 2, timeout=180,
                                 envs=[_env(RETRY_JOB_DIR=str(tmp_path))]
                                 + [_env(RANK=str(r), LOCAL_RANK=str(r), **common) for r in range(2)])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    # the first attempt failed as intended: rank 1 left once rank 0 had arrived at init
    assert "attempt 0: rank 1 exits after rank 0's arrival at init" in p.stdout, p.stdout[-3000:] + p.stderr[-5000:]
    _check_retry_reports(p.stdout, p.stderr)

    assert all(q.returncode == 0 for q in procs), "\n".join(q.stdout + q.stderr[-4000:] for q in procs)
    _check_retry_reports("".join(q.stdout for q in procs), "".join(q.stderr for q in procs))


_MPI_LAUNCH_JOB = textwrap.dedent("""
    import gc

    import collectives

    def touches_mpi(comm):
        from mpi4py import MPI  # what a rank of an MPI program would do; MPICH aborts here when launched inside mpiexec
        return MPI.COMM_WORLD.Get_size()

    if __name__ == "__main__":
        comm = collectives.init(timeout=30.0)
        try:
            print("RESULT", collectives.launch(touches_mpi, 2, timeout=30.0), flush=True)
        except collectives.RankFailedError as e:
            print("RANK FAILED", e, flush=True)
        except RuntimeError as e:
            print("REFUSED", e, flush=True)
        comm.close()
        gc.freeze()  # everything is closed: no final garbage collection at exit (about 0.6 CPU-s with torch)
""")


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec (install the test extra: pip install '.[test]')")
def test_launch_inside_an_mpi_job_is_refused_with_advice(tmp_path):
    job = tmp_path / "mpi_launch_job.py"
    job.write_text(_MPI_LAUNCH_JOB)
    p = subprocess.run([mpiexec_path(), "-n", "1", sys.executable, str(job)], capture_output=True, text=True,
                       timeout=120, env=_env())
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "REFUSED" in p.stdout, out[-4000:]
    assert "collectives.init()" in p.stdout and "without mpiexec" in p.stdout, p.stdout
