"""Run a test body on N ranks: spawned by collectives.launch, or the ranks of `mpiexec -n N python -m pytest`.

Bodies are module-level functions ``body(comm, *args)`` that assert on every rank. Under
mpiexec each pytest process is one rank: ``run`` calls the body on the world communicator
routed to the requested transport, and skips cases whose rank count differs from the job's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pytest
import torch

import collectives
from transports.base import Rendezvous

UNDER_MPI = collectives.detect_launch() == "mpi"
_world = None


def world() -> collectives.Communicator:
    """The world communicator of this mpiexec job (created on first use, timeout 60 s).

    Returns:
        The communicator from :func:`collectives.init`.
    """
    global _world
    if _world is None:
        _world = collectives.init(timeout=60.0)
    return _world


# The shm transport's paths, as settings (each a "transport" of the collective tests): the default
# (compiled small-message helper if built, single copy from the measured sizes), single copy at
# every size, and everything in Python and staged (the fallbacks where the helper is not built or
# process_vm_readv is refused).
SHM_PATHS: dict[str, dict[str, str]] = {
    "shm": {},
    "shm-single-copy": {"shm_single_copy": "always"},
    "shm-fallback": {"shm_single_copy": "off", "shm_native": "off"},
}


def transports_under_test(*, shm_paths: bool = False) -> list[str]:
    """The transports the collective tests cover here.

    Args:
        shm_paths: also every path of the shm transport (:data:`SHM_PATHS`; not under mpiexec).

    Returns:
        ["shm"] (+ the shm paths), and "mpi" too when pytest itself runs under mpiexec.
    """
    if UNDER_MPI:
        return ["mpi", "shm"]
    return list(SHM_PATHS) if shm_paths else ["shm"]


def run(body: Callable[..., Any], nprocs: int, *args: Any, transport: str = "shm", timeout: float = 60.0,
        **kwargs: Any) -> list[Any]:
    """``body(comm, *args, **kwargs)`` on ``nprocs`` ranks.

    Args:
        body: a module-level function that asserts on every rank.
        nprocs: ranks it needs; under mpiexec a job of another size skips the test.
        transport: the transport every call is routed to ("shm" or one of :data:`SHM_PATHS`, or
            "mpi" under mpiexec only).
        timeout: the communicators' timeout in seconds.

    Returns:
        The bodies' return values in rank order (under mpiexec: this rank's only).
    """
    if UNDER_MPI:
        comm = world()
        if comm.size != nprocs:
            pytest.skip(f"needs {nprocs} ranks; this mpiexec job has {comm.size}")
        return [body(comm.using(transport), *args, **kwargs)]
    if transport == "mpi":
        pytest.skip("the mpi transport is tested under mpiexec "
                    "(tests/test_launch_modes.py::test_collective_suite_under_mpiexec)")
    if transport in SHM_PATHS:
        return collectives.launch(body, nprocs, *args, transport="shm", timeout=timeout,
                                  options=SHM_PATHS[transport], **kwargs)
    return collectives.launch(body, nprocs, *args, transport=transport, timeout=timeout, **kwargs)


def shm_segments() -> set[str]:
    """Names of this user's moecomm segments in /dev/shm (to check that none is left behind)."""
    return {os.path.basename(p) for p in glob.glob(f"/dev/shm/moecomm-{os.getuid()}-*")}


def left_behind(before: set[str], grace: float = 5.0) -> set[str]:
    """The segments created since ``before`` that nobody will remove: their creator has exited (as
    transports/_segment.py's stale-segment sweep judges it), or is this process. Segments of processes
    still running belong to another test (pytest-xdist runs two at once) and are not counted. Waits
    up to ``grace`` seconds for peers that are still unlinking."""
    from transports._host import pid_alive
    from transports._segment import _SEGMENT_RE

    def orphan(name: str) -> bool:
        m = _SEGMENT_RE.match(name)
        return m is None or int(m.group(2)) == os.getpid() or not pid_alive(int(m.group(2)))

    deadline = time.monotonic() + grace
    while True:
        left = {n for n in shm_segments() - before if orphan(n)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def rank_input(kind: str, rank: int, shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic random input any rank can regenerate for any other rank (never all-zeros/ones).

    Args:
        kind: what the input is for (part of the seed, so different uses differ).
        rank: the rank whose input this is.
        shape: its shape.
        dtype: its dtype (bool: random True/False; floats in [-2, 2); uint8 in [0, 256); other ints in [-1000, 1000) cast to the dtype).
        seed: the test's seed.

    Returns:
        ``shape`` tensor of ``dtype`` on the CPU.
    """
    # crc32, not hash(): str hashes differ between processes
    g = torch.Generator().manual_seed(zlib.crc32(repr((kind, rank, tuple(shape), str(dtype), seed)).encode()))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-1000, 1000)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def reference_reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """NumPy reference in rank order: float64 for floats, wrapping arithmetic of the dtype for ints.

    Args:
        xs: [size] every rank's input, all of one shape and dtype.
        op: "sum", "avg", "prod", "max" or "min".

    Returns:
        The reduction, float64 for float inputs, else the inputs' dtype.
    """
    dtype = xs[0].dtype
    if dtype.is_floating_point:
        arrs = [x.double().numpy() for x in xs]
    else:
        arrs = [x.numpy() for x in xs]
    ufunc = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    acc = arrs[0].copy()
    for a in arrs[1:]:
        acc = ufunc(acc, a)
    if op == "avg":
        acc = acc / len(xs)
    return torch.from_numpy(np.asarray(acc))


def assert_reduced(result: torch.Tensor, xs: list[torch.Tensor], op: str, what: str) -> None:
    """Assert ``result`` is ``op`` over ``xs``: exact for ints, bool, max and min; within the rounding
    of the dtype (and float32 accumulation of 16-bit types) otherwise.

    Args:
        result: one rank's all_reduce output.
        xs: [size] every rank's input.
        op: the reduction.
        what: the case, for the assertion message.
    """
    ref = reference_reduce(xs, op)
    dtype = xs[0].dtype
    assert result.dtype == dtype and tuple(result.shape) == tuple(xs[0].shape), what
    if not dtype.is_floating_point or op in ("max", "min"):
        assert torch.equal(result, ref.to(dtype)), f"{what}: mismatch"
        return
    # float32 accumulation (16-bit types) or the dtype's own (f32/f64), then one rounding to the dtype
    eps = {torch.float64: 2.2e-16, torch.float32: 1.2e-7, torch.float16: 9.8e-4, torch.bfloat16: 7.9e-3}[dtype]
    acc_eps = 2.2e-16 if dtype == torch.float64 else 1.2e-7
    mag = sum(x.double().abs() for x in xs) if op != "prod" else ref.abs() * len(xs)
    tol = eps * ref.abs() + acc_eps * len(xs) * mag + 1e-300
    err = (result.double() - ref).abs()
    assert (err <= tol * 1.01).all(), f"{what}: max error {err.max().item():.3g}"


class ThreadRendezvous(Rendezvous):
    """allgather_bytes between the threads of this process, one object per rank (rank = thread index).

    ``shared``: ``{"barrier": threading.Barrier(size), "slots": [b""] * size}``, one dict for all the
    ranks' objects; with an ``"exchanges"`` key, rank 0 counts the exchanges there.
    """

    def __init__(self, shared: dict, rank: int, size: int | None = None):
        self.shared, self.rank, self.timeout = shared, rank, 10.0
        self.size = len(shared["slots"]) if size is None else size

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        barrier, slots = self.shared["barrier"], self.shared["slots"]
        slots[self.rank] = data
        barrier.wait(timeout=10)
        out = list(slots)
        barrier.wait(timeout=10)  # nobody overwrites a slot before everyone has read it
        if self.rank == 0 and "exchanges" in self.shared:
            self.shared["exchanges"] += 1
        return out

    def split(self, *args):
        raise NotImplementedError


def on_threads(n: int, fn: Callable[[int], Any]) -> dict[int, Any]:
    """``fn(rank)`` on n threads of this process, joined within 30 s (a rank that hangs fails).

    Returns:
        {rank: fn's result, or the exception it raised}.
    """
    import threading

    res: dict[int, Any] = {}

    def run(r: int) -> None:
        try:
            res[r] = fn(r)
        except Exception as e:  # noqa: BLE001 - returned to the test
            res[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return res


def mpiexec_path() -> str | None:
    """The mpiexec of this environment (the `mpich` wheel of the test extra puts one next to python),
    else one on PATH, else None."""
    import shutil
    import sys
    from pathlib import Path

    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def run_checks(checks: dict[str, Callable[[Any], Any]], comm: Any) -> dict[str, tuple[str, Any]]:
    """Every check of ``checks`` (name -> body(comm)) in one launch, each result kept apart: name ->
    ("ok", what the body returned) or ("fail", its traceback). A check failing on some ranks only may
    make later ones fail too (the Communicator refuses mismatched calls): read the first failure."""
    out: dict[str, tuple[str, Any]] = {}
    for name, body in checks.items():
        try:
            out[name] = ("ok", body(comm))
        except Exception:  # noqa: BLE001 - reported by the test of this check
            out[name] = ("fail", traceback.format_exc())
    return out


def outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    """(exception type name, message) of what ``fn()`` raised here, or ("ok", "")."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the caller compares what every rank raised
        return type(e).__name__, str(e)
    return "ok", ""


def node_job_args(*, layout: bool = True) -> argparse.Namespace:
    """The command line of a tests/jobs/*_job.py rank on the testbed: ``--out DIR`` (where every rank
    writes its report) and, with ``layout``, ``--nodes N --ppn P --launcher torchrun|mpiexec``."""
    ap = argparse.ArgumentParser()
    if layout:
        ap.add_argument("--nodes", type=int, required=True)
        ap.add_argument("--ppn", type=int, required=True)
        ap.add_argument("--launcher", choices=("torchrun", "mpiexec"), required=True)
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def write_rank_report(out: Path, report: dict, fill: Callable[[dict], None]) -> dict:
    """``fill(report)``, then ``report["ok"]`` (or ``False`` and the traceback in ``report["error"]``),
    written as JSON to ``out``: what a job rank hands back to its test.

    Returns:
        ``report``.
    """
    try:
        fill(report)
        report["ok"] = True
    except Exception:  # noqa: BLE001 - the test reads it
        report["ok"] = False
        report["error"] = traceback.format_exc()
    out.write_text(json.dumps(report))
    return report


def mark_done(directory: str | os.PathLike, rank: int) -> None:
    """Tell :func:`wait_done` in another rank that ``rank`` got past its part (a file in ``directory``)."""
    Path(directory, f"done-{rank}").touch()


def wait_done(directory: str | os.PathLike, ranks: Sequence[int], limit: float = 30.0) -> bool:
    """Wait until every rank of ``ranks`` has called :func:`mark_done` on ``directory``, at most ``limit`` s.

    A rank that must stay away (or stay alive) until its peers have seen what the test is about waits
    here instead of sleeping a fixed time longer than their timeout: as long as needed, no longer.

    Returns:
        Whether they all did within ``limit``.
    """
    import time

    deadline = time.monotonic() + limit
    while not all(Path(directory, f"done-{r}").exists() for r in ranks):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run_side_by_side(commands: Sequence[Sequence[str]], *, timeout: float, envs: Sequence[dict] | None = None,
                     cwd: str | os.PathLike | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``commands`` at the same time (each mostly an interpreter importing torch on one core), text output
    captured; those still running at ``timeout`` s (or when waiting fails) are killed.

    Args:
        commands: the command lines.
        timeout: seconds for all of them together.
        envs: one environment per command (default: this process's).
        cwd: their working directory.

    Returns:
        Their completed processes, in the order of ``commands``.
    """
    import time

    envs = list(envs) if envs is not None else [None] * len(commands)
    procs = [subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
             for cmd, env in zip(commands, envs)]
    deadline = time.monotonic() + timeout
    try:
        outs = [p.communicate(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def plot_lines_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on in a test, benchmarks.plot draws no file: the lines plot_runs / plot_predictions
    return are decided before they save, and the saving (constrained layout, then a tight bounding
    box: ~5 CPU-s a figure) is what the --plot commands check with real files. For the calls after
    those that check only the lines."""
    from benchmarks import plot

    monkeypatch.setattr(plot, "_save", lambda fig, path: Path(path))
