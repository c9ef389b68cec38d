"""``moecomm doctor``: what a run needs, checked, with what to fix. Exit code 1 on any FAIL.

Checks: ranks reach each other (barrier + all_reduce through every transport, bounded by a
timeout), /dev/shm size and free space, the MPI library (loaded in a subprocess so a broken MPI
cannot crash the doctor) and mpiexec, GPUs, CUDA P2P and IPC (only with GPUs), NCCL, and
NCCL_*/MOECOMM_* environment variables that switch fast paths off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import click

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass
class Check:
    level: str  # OK, WARN or FAIL
    name: str
    message: str
    fix: str = ""

    def lines(self) -> list[str]:
        out = [f"{self.level:<5} {self.name:<9} {self.message}"]
        if self.fix and self.level != OK:
            out.append(f"{'':<5} {'':<9} fix: {self.fix}")
        return out


# ---- ranks ------------------------------------------------------------------------------------
def _ranks_body(comm) -> dict:
    """Barrier, then an all_reduce through auto and through every transport, checked against the sum."""
    import torch

    comm.barrier()
    n = comm.size
    inputs = [torch.randn(1000, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64)
              for r in range(n)]
    ref = sum(inputs)
    res = {"size": n, "topology": str(comm.topology).splitlines()[0], "transports": {}}
    for name in ["auto"] + sorted(comm.transports):
        c = comm if name == "auto" else comm.using(name)
        t0 = time.perf_counter()
        y = c.all_reduce(inputs[comm.rank])
        dt = time.perf_counter() - t0
        ok = bool(torch.allclose(y, ref, rtol=1e-12, atol=1e-12))
        label = f"auto->{comm.plan('all_reduce', y).transport}" if name == "auto" else name
        res["transports"][label] = (ok, dt * 1e6)
    comm.barrier()
    return res


def check_ranks(nprocs: int = 2, timeout: float = 30.0) -> list[Check]:
    """Ranks reach each other: this job's ranks under mpirun/torchrun, else ``nprocs`` self-launched."""
    import collectives

    mode = collectives.detect_launch()
    box: dict = {}

    def run() -> None:
        try:
            if mode in ("mpi", "torchrun"):
                with collectives.init(timeout=timeout) as comm:
                    box["res"] = _ranks_body(comm)
            else:
                box["res"] = collectives.launch(_ranks_body, nprocs, timeout=timeout)[0]
        except BaseException as e:  # noqa: BLE001 - reported as a FAIL line
            box["err"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout * 2 + 30)
    how = f"the {mode} job's ranks" if mode in ("mpi", "torchrun") else f"{nprocs} self-launched local ranks"
    if th.is_alive():
        return [Check(FAIL, "ranks", f"{how} did not finish a barrier + all_reduce within {timeout * 2 + 30:.0f} s",
                      "check that the ranks can open TCP connections to each other (127.0.0.1 for local "
                      "ranks, MASTER_ADDR/the MPI hosts across nodes) and that nothing is blocking them")]
    if "err" in box:
        e = box["err"]
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fix = "run `moecomm -vv doctor` for details; a TimeoutError names the rank that never arrived"
        if "MOECOMM_TRANSPORT" in os.environ and "not available" in first:
            fix = "unset MOECOMM_TRANSPORT, or launch so that transport is available (mpi: mpiexec -n N ...)"
        return [Check(FAIL, "ranks", f"{how} failed: {type(e).__name__}: {first}", fix)]
    res = box["res"]
    bad = [t for t, (ok, _) in res["transports"].items() if not ok]
    detail = ", ".join(f"{t} {us:.0f} us" for t, (_, us) in res["transports"].items())
    if bad:
        return [Check(FAIL, "ranks", f"{how}: all_reduce gave wrong results through {', '.join(bad)}",
                      "report this with `moecomm -vv doctor` output; force another transport with MOECOMM_TRANSPORT "
                      "meanwhile")]
    return [Check(OK, "ranks", f"{how} ({res['topology']}): barrier + all_reduce correct ({detail})")]


# ---- /dev/shm ---------------------------------------------------------------------------------
def check_shm(path: str = "/dev/shm", nprocs: int | None = None) -> list[Check]:
    """Size and free space of /dev/shm against what the shm transport maps for ``nprocs`` local ranks."""
    from transports.shm import DEFAULT_SLOT_BYTES

    fix = ("give the container more: `docker run --shm-size=8g` (or `--ipc=host`); or lower "
           "MOECOMM_SHM_SLOT_BYTES")
    try:
        st = os.statvfs(path)
    except OSError as e:
        return [Check(FAIL, "shm", f"{path} is not usable ({e}): the shm transport cannot map its segments", fix)]
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    try:
        slot = int(os.environ.get("MOECOMM_SHM_SLOT_BYTES") or DEFAULT_SLOT_BYTES)
    except ValueError:
        slot = DEFAULT_SLOT_BYTES
    ranks = nprocs or max(os.cpu_count() or 1, 2)
    need = ranks * 2 * slot + (1 << 20)  # two staging slots per rank, plus control blocks
    gib = 1 << 30
    where = f"{path}: {total / gib:.2f} GiB, {free / gib:.2f} GiB free"
    if free < need:
        return [Check(FAIL, "shm", f"{where}; {ranks} local ranks need {need / (1 << 20):.0f} MiB", fix)]
    if total < gib:
        return [Check(WARN, "shm", f"{where} (under 1 GiB, e.g. Docker's 64 MiB default): enough for {ranks} ranks "
                                   "now, but several communicators or other programs will run out", fix)]
    return [Check(OK, "shm", f"{where} (enough for {ranks} local ranks: {need / (1 << 20):.0f} MiB)")]


# ---- MPI --------------------------------------------------------------------------------------
_MPI_PROBE = (
    "import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI\n"
    "print(mpi4py.__version__)\n"
    "print(MPI.Get_library_version().strip().splitlines()[0])\n")


def mpiexec_path() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec") or shutil.which("mpirun")


def check_mpi(timeout: float = 30.0) -> list[Check]:
    """mpi4py and its MPI library, probed in a subprocess; and an mpiexec to launch with."""
    out = []
    try:
        p = subprocess.run([sys.executable, "-c", _MPI_PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [Check(FAIL, "mpi", f"loading the MPI library hung for {timeout:.0f} s",
                      "check the MPI installation (`python -c 'from mpi4py import MPI'`); pip install mpich for a "
                      "self-contained one")]
    if p.returncode == 0 and len(p.stdout.split("\n")) >= 2:
        ver, lib = p.stdout.strip().split("\n")[:2]
        out.append(Check(OK, "mpi", f"mpi4py {ver}, {' '.join(lib.split())}"))
    elif "ModuleNotFoundError" in p.stderr and "mpi4py" in p.stderr:
        out.append(Check(WARN, "mpi", "mpi4py is not installed: no mpi transport, no mpirun launches, no multi-node",
                         "pip install mpi4py mpich (or mpi4py built against your system MPI)"))
    else:
        last = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
        out.append(Check(FAIL, "mpi", f"mpi4py cannot load its MPI library: {last}",
                         "pip install mpich (a self-contained MPI), or reinstall mpi4py against the MPI you launch "
                         "with (pip install --no-binary mpi4py --force-reinstall mpi4py)"))
    exe = mpiexec_path()
    if exe:
        out.append(Check(OK, "mpiexec", exe))
    else:
        out.append(Check(WARN, "mpiexec", "no mpiexec/mpirun found: `mpiexec -n N moecomm bench` is unavailable",
                         "pip install mpich, or put your MPI's bin directory on PATH"))
    return out


# ---- GPUs -------------------------------------------------------------------------------------
def gpu_count() -> tuple[int, list[Check]]:
    """(number of GPUs torch sees, checks)."""
    import torch

    try:
        avail = torch.cuda.is_available()
        n = torch.cuda.device_count() if avail else 0
    except Exception as e:  # noqa: BLE001 - a broken driver
        return 0, [Check(FAIL, "gpu", f"the CUDA driver failed: {e}", "check `nvidia-smi`; reinstall the driver")]
    if n == 0:
        if torch.version.cuda:
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
            return 0, [Check(WARN, "gpu", f"torch {torch.__version__} is a CUDA build but sees no GPU{hint}",
                             "check `nvidia-smi`, the driver, and CUDA_VISIBLE_DEVICES; CPU transports still work")]
        return 0, [Check(OK, "gpu", f"no GPU (torch {torch.__version__} is a CPU build); moecomm uses its CPU "
                                    "transports")]
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    return n, [Check(OK, "gpu", f"{n} GPU(s): {', '.join(dict.fromkeys(names))} (CUDA {torch.version.cuda})")]


def check_p2p(n: int) -> list[Check]:
    """Peer access between every pair of GPUs (only with 2 or more)."""
    import torch

    if n < 2:
        return []
    missing = [(i, j) for i in range(n) for j in range(n) if i != j and not torch.cuda.can_device_access_peer(i, j)]
    if missing:
        pairs = ", ".join(f"{i}->{j}" for i, j in missing[:8]) + (" ..." if len(missing) > 8 else "")
        return [Check(WARN, "p2p", f"no CUDA peer access for GPU pairs {pairs}: copies between them go through "
                                   "host memory",
                      "on PCIe machines disable ACS / set the IOMMU to passthrough; check `nvidia-smi topo -m`")]
    return [Check(OK, "p2p", f"CUDA peer access between all {n} GPUs")]


_IPC_PROBE = '''
import sys, torch, torch.multiprocessing as mp
def child(q, r):
    t = q.get()
    r.put(float(t.sum()))
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, r))
    p.start()
    t = torch.arange(4096, dtype=torch.float32, device="cuda")
    q.put(t)
    v = r.get(timeout=60)
    p.join(60)
    print("ok" if v == float(t.sum()) else f"mismatch {v}")
'''


def check_ipc(n: int, timeout: float = 120.0) -> list[Check]:
    """A CUDA tensor shared with another process through CUDA IPC (only with GPUs)."""
    if n < 1:
        return []
    fix = ("containers need `--ipc=host` (or a shared PID namespace) for CUDA IPC; check that the driver "
           "allows it (`nvidia-smi -q | grep -i mig`: MIG instances do not support IPC)")
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "ipc_probe.py"
        script.write_text(_IPC_PROBE)
        try:
            p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [Check(FAIL, "ipc", f"sharing a CUDA tensor with another process hung for {timeout:.0f} s", fix)]
    if p.returncode == 0 and p.stdout.strip() == "ok":
        return [Check(OK, "ipc", "CUDA IPC between processes works")]
    last = (p.stderr.strip().splitlines() or [p.stdout.strip() or f"exit code {p.returncode}"])[-1]
    return [Check(FAIL, "ipc", f"CUDA IPC between processes failed: {last}", fix)]


def check_nccl(n: int) -> list[Check]:
    from .output import nccl_version

    ver = nccl_version()
    if ver:
        return [Check(OK, "nccl", f"NCCL {ver}")]
    if n == 0:
        return [Check(OK, "nccl", "no NCCL (not needed without GPUs)")]
    return [Check(WARN, "nccl", f"{n} GPU(s) but no NCCL library could be loaded",
                  "pip install 'moecomm[cuda12]' (nvidia-nccl-cu12, cupy-cuda12x), or a CUDA build of torch")]


# ---- environment ------------------------------------------------------------------------------
def _flag(v: str) -> int | None:
    try:
        return int(v.strip())
    except ValueError:
        return None


# (variable, is it harmful given its value, what it does, fix)
_ENV_RULES = [
    ("NCCL_P2P_DISABLE", lambda v: _flag(v) not in (None, 0), "disables NCCL's NVLink/PCIe peer-to-peer transport",
     "unset NCCL_P2P_DISABLE"),
    ("NCCL_SHM_DISABLE", lambda v: _flag(v) not in (None, 0), "disables NCCL's shared-memory transport",
     "unset NCCL_SHM_DISABLE"),
    ("NCCL_IB_DISABLE", lambda v: _flag(v) not in (None, 0),
     "disables InfiniBand/RoCE: traffic between nodes falls back to TCP sockets", "unset NCCL_IB_DISABLE"),
    ("NCCL_NVLS_ENABLE", lambda v: _flag(v) == 0, "disables NVLink SHARP (NVLS) collectives on NVSwitch systems",
     "unset NCCL_NVLS_ENABLE"),
    ("NCCL_P2P_LEVEL", lambda v: v.strip().upper() in ("LOC", "0"), "restricts peer-to-peer to no GPU pair",
     "unset NCCL_P2P_LEVEL"),
    ("NCCL_NET_GDR_LEVEL", lambda v: v.strip().upper() in ("LOC", "0"), "disables GPUDirect RDMA",
     "unset NCCL_NET_GDR_LEVEL"),
    ("NCCL_ALGO", lambda v: bool(v.strip()), "forces NCCL's algorithm choice (its tuner usually picks better)",
     "unset NCCL_ALGO unless you are experimenting"),
    ("NCCL_PROTO", lambda v: bool(v.strip()), "forces NCCL's protocol choice (its tuner usually picks better)",
     "unset NCCL_PROTO unless you are experimenting"),
    ("CUDA_LAUNCH_BLOCKING", lambda v: _flag(v) not in (None, 0), "makes every CUDA launch synchronous",
     "unset CUDA_LAUNCH_BLOCKING (a debugging setting)"),
    ("MOECOMM_TRANSPORT", lambda v: v.strip() not in ("", "auto"),
     "forces every moecomm call onto one transport: the automatic choice (shm on one node) is off",
     "unset MOECOMM_TRANSPORT (or use transport= / comm.using() for one communicator)"),
]


def check_env(environ: Mapping[str, str] | None = None) -> list[Check]:
    """NCCL_*/MOECOMM_* (and CUDA_LAUNCH_BLOCKING) settings that switch fast paths off."""
    env = os.environ if environ is None else environ
    out = []
    for var, harmful, what, fix in _ENV_RULES:
        v = env.get(var)
        if v is not None and harmful(v):
            out.append(Check(WARN, "env", f"{var}={v} {what}", fix))
    slot = env.get("MOECOMM_SHM_SLOT_BYTES")
    if slot is not None:
        n = _flag(slot)
        if n is None or n <= 0:
            out.append(Check(FAIL, "env", f"MOECOMM_SHM_SLOT_BYTES={slot!r} is not a positive number of bytes",
                             "unset it (default 4 MiB) or give bytes, e.g. 8388608"))
        elif n < (1 << 20):
            out.append(Check(WARN, "env", f"MOECOMM_SHM_SLOT_BYTES={n} (< 1 MiB): large messages take many rounds "
                                          "through the shm transport", "unset it (default 4 MiB)"))
    if not out:
        seen = sorted(k for k in env if k.startswith(("NCCL_", "MOECOMM_")))
        extra = f" (set: {', '.join(seen)})" if seen else ""
        out.append(Check(OK, "env", f"no NCCL_*/MOECOMM_* variable switches a fast path off{extra}"))
    return out


def run_checks(*, nprocs: int = 2, timeout: float = 30.0, environ: Mapping[str, str] | None = None) -> list[Check]:
    """Every check, in the order printed (module-level functions, so tests can replace one)."""
    mod = sys.modules[__name__]
    checks = list(mod.check_ranks(nprocs, timeout))
    checks += mod.check_shm(nprocs=None)
    checks += mod.check_mpi()
    n, gpu_checks = mod.gpu_count()
    checks += gpu_checks
    checks += mod.check_p2p(n)
    checks += mod.check_ipc(n)
    checks += mod.check_nccl(n)
    checks += mod.check_env(environ)
    return checks


@click.command()
@click.option("--nprocs", default=2, show_default=True, help="Local ranks to launch for the rank check.")
@click.option("--timeout", default=30.0, show_default=True, help="Seconds the rank check may wait.")
def doctor(nprocs, timeout):
    """Check this machine for a run: ranks, /dev/shm, MPI, GPUs, P2P/IPC, NCCL, environment.

    Prints OK/WARN/FAIL lines with what to fix; exits 1 if anything FAILs. Under mpirun/torchrun
    it checks the job's ranks; rank 0 prints.
    """
    import collectives

    checks = run_checks(nprocs=nprocs, timeout=timeout)
    if collectives.detect_launch() in ("mpi", "torchrun") and int(os.environ.get("RANK", os.environ.get(
            "PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))) != 0:
        sys.exit(1 if any(c.level == FAIL for c in checks) else 0)
    for c in checks:
        for line in c.lines():
            click.echo(line)
    fails, warns = sum(c.level == FAIL for c in checks), sum(c.level == WARN for c in checks)
    verdict = "problems found" if fails else "ready" if not warns else "ready, with warnings"
    click.echo(f"doctor: {fails} FAIL, {warns} WARN: {verdict}")
    sys.exit(1 if fails else 0)
