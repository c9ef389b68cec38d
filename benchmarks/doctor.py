"""``moecomm doctor``: what a run needs, checked, with what to fix. Exit code 1 on any FAIL.

Checks: ranks reach each other (barrier + all_reduce through every transport, bounded by a
timeout), /dev/shm size and free space, the MPI library (loaded in a subprocess so a broken MPI
cannot crash the doctor) and mpiexec, GPUs, CUDA P2P and IPC (only with GPUs), NCCL, and
NCCL_* variables that switch fast paths off. ``MOECOMM_*`` variables are checked against the one
table of settings (``transports/settings.py``): a bad value FAILs, an unknown name WARNs, and the
table is printed with the value each setting has here.
"""

from __future__ import annotations

import difflib
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

from transports.settings import SETTINGS, SETTINGS_BY_ENV, Setting

from .common import format_size
from .options import COUNT, SECONDS
from .ranks import on_ranks
from .table import Column, Table

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass
class Check:
    """One finding: ``level`` OK, WARN or FAIL; ``fix`` says what to do (printed unless OK)."""

    level: str
    name: str
    message: str
    fix: str = ""

    def lines(self) -> list[str]:
        """The finding as printed: one line, and a ``fix:`` line below unless it is OK."""
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
    shm = comm.transports.get("shm")
    if shm is not None:
        res["shm_single_copy"] = (shm.single_copy, shm.single_copy_status)
        res["shm_native"] = shm.native_status
    comm.barrier()
    return res


def check_ranks(nprocs: int = 2, timeout: float = 30.0, environ: Mapping[str, str] | None = None) -> list[Check]:
    """Ranks reach each other: this job's ranks under mpirun/torchrun, else ``nprocs`` self-launched.

    Args:
        nprocs: local ranks to start when self-launching.
        timeout: the communicators' timeout; the whole check gives up after ``2 * timeout + 30`` s.
        environ: the environment whose MOECOMM_TRANSPORT a fix may name (default ``os.environ``).

    Returns:
        One Check named "ranks".
    """
    import collectives

    mode = collectives.detect_launch()
    box: dict = {}

    def run() -> None:
        try:
            box["res"] = on_ranks(_ranks_body, nprocs, timeout=timeout)[1]
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
        if _setting_value(SETTINGS["transport"], environ) not in (None, "auto") and "not available" in first:
            fix = "unset MOECOMM_TRANSPORT, or launch so that transport is available (mpi: mpiexec -n N ...)"
        return [Check(FAIL, "ranks", f"{how} failed: {type(e).__name__}: {first}", fix)]
    res = box["res"]
    bad = [t for t, (ok, _) in res["transports"].items() if not ok]
    detail = ", ".join(f"{t} {us:.0f} us" for t, (_, us) in res["transports"].items())
    if bad:
        return [Check(FAIL, "ranks", f"{how}: all_reduce gave wrong results through {', '.join(bad)}",
                      "report this with `moecomm -vv doctor` output; force another transport with MOECOMM_TRANSPORT "
                      "meanwhile")]
    return [Check(OK, "ranks", f"{how} ({res['topology']}): barrier + all_reduce correct ({detail})"),
            *_single_copy_checks(res)]


def _single_copy_checks(res: dict) -> list[Check]:
    """The shm transport's single-copy path as the rank check's group found it (probed at start-up)."""
    if "shm_single_copy" not in res:
        return []
    on, status = res["shm_single_copy"]
    from transports._native import describe

    native_on = _setting_on("shm_native")
    helper = describe(enabled=native_on)
    if res["shm_native"] != "Python" or not native_on:
        checks = [Check(OK, "shm-fast", f"small shm messages: {res['shm_native']} ({helper})")]
    else:
        checks = [Check(WARN, "shm-fast", f"small shm messages run in Python (several us slower per call): the "
                                          f"compiled helper is {helper}", "pip install -e . with a C compiler (gcc)")]
    if on or status.startswith(("off", "not needed")):
        return checks + [Check(OK, "shm-copy", f"large shm messages: single copy {status}")]
    return checks + [Check(WARN, "shm-copy", f"large shm messages are staged (two copies): single copy {status}",
                           "allow the ranks to read each other's memory (same user; kernel.yama.ptrace_scope <= 1; "
                           "in Docker --cap-add SYS_PTRACE or a seccomp profile that allows process_vm_readv)")]


def _setting_on(option: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether an auto/off setting is not "off" in ``environ`` (default ``os.environ``)."""
    return _setting_value(SETTINGS[option], environ) != "off"


# ---- /dev/shm ---------------------------------------------------------------------------------
def check_shm(path: str = "/dev/shm", nprocs: int | None = None,
              environ: Mapping[str, str] | None = None) -> list[Check]:
    """Size and free space of /dev/shm against what the shm transport maps.

    Args:
        path: the shared-memory file system.
        nprocs: local ranks (default: one per CPU, at least 2).
        environ: where MOECOMM_SHM_SLOT_BYTES is read (default ``os.environ``; a bad value counts
            as the default here, :func:`check_env` reports it).

    Returns:
        One Check named "shm".
    """
    setting = SETTINGS["shm_slot_bytes"]
    fix = ("give the container more: `docker run --shm-size=8g` (or `--ipc=host`); or lower "
           f"{setting.env} (default {format_size(setting.default)})")
    try:
        st = os.statvfs(path)
    except OSError as e:
        return [Check(FAIL, "shm", f"{path} is not usable ({e}): the shm transport cannot map its segments", fix)]
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    slot = _setting_value(setting, environ)
    slot = setting.default if slot is None else slot
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
    """The mpiexec next to this Python (the mpich wheel's), else one on PATH, else None."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec") or shutil.which("mpirun")


def check_mpi(timeout: float = 30.0) -> list[Check]:
    """mpi4py and its MPI library, probed in a subprocess; and an mpiexec to launch with."""
    out = []
    try:
        p = subprocess.run([sys.executable, "-c", _MPI_PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [Check(FAIL, "mpi", f"loading the MPI library hung for {timeout:.0f} s",
                      "check the MPI installation (`python -c 'from mpi4py import MPI'`); pip install "
                      "\"moecomm[mpi]\" for a self-contained one (mpich)")]
    if p.returncode == 0 and len(p.stdout.split("\n")) >= 2:
        ver, lib = p.stdout.strip().split("\n")[:2]
        out.append(Check(OK, "mpi", f"mpi4py {ver}, {' '.join(lib.split())}"))
    elif "ModuleNotFoundError" in p.stderr and "mpi4py" in p.stderr:
        out.append(Check(WARN, "mpi", "mpi4py is not installed (MPI is optional): no mpi transport, no mpirun "
                         "launches; across nodes, torchrun and gloo still work",
                         "pip install \"moecomm[mpi]\" (mpi4py and mpich), or pip install mpi4py built against "
                         "your system MPI"))
    else:
        last = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
        out.append(Check(FAIL, "mpi", f"mpi4py cannot load its MPI library: {last}",
                         "pip install \"moecomm[mpi]\" (mpich: a self-contained MPI), or reinstall mpi4py against "
                         "the MPI you launch with (pip install --no-binary mpi4py --force-reinstall mpi4py)"))
    exe = mpiexec_path()
    if exe:
        out.append(Check(OK, "mpiexec", exe))
    else:
        out.append(Check(WARN, "mpiexec", "no mpiexec/mpirun found: `mpiexec -n N moecomm bench` is unavailable",
                         "pip install \"moecomm[mpi]\", or put your MPI's bin directory on PATH"))
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
    """NCCL's version where a library can be loaded; a WARN if ``n`` > 0 GPUs but no NCCL."""
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
]


def _setting_value(setting: Setting, environ: Mapping[str, str] | None) -> object | None:
    """The setting's value from the environment, its default if unset, None if the value is bad."""
    env = os.environ if environ is None else environ
    raw = env.get(setting.env)
    try:
        return setting.parse(raw if raw not in (None, "") else None, source="environment")
    except ValueError:
        return None


def _accepted(setting: Setting) -> str:
    """What a setting accepts, in words."""
    if setting.choices:
        return f"one of {', '.join(setting.choices)}"
    if setting.type is int:
        return "an integer" + (f" >= {setting.minimum}" if setting.minimum is not None else "")
    return "a string"


def _shown(setting: Setting, value: object) -> str:
    """A setting's value for the table (byte counts also in KiB/MiB)."""
    if value is None:
        return "(detected)" if setting.env == "MOECOMM_LAUNCH" else "(built in)"
    if isinstance(value, int) and setting.env.endswith(("_BYTES", "_MAX")) and value >= 1024:
        return f"{value} ({format_size(value)})"
    return str(value)


def check_moecomm_env(environ: Mapping[str, str] | None = None) -> list[Check]:
    """MOECOMM_* variables checked against ``transports.settings``.

    Args:
        environ: the environment to check (default ``os.environ``).

    Returns:
        FAIL per variable whose value its setting refuses, WARN per unknown MOECOMM_* name and per
        setting that switches a fast path off (a forced transport, a small shm slot).
    """
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(k for k in env if k.startswith("MOECOMM_")):
        setting = SETTINGS_BY_ENV.get(name)
        if setting is None:
            close = difflib.get_close_matches(name, SETTINGS_BY_ENV, n=1)
            out.append(Check(WARN, "env", f"{name} is not a moecomm setting: nothing reads it"
                             + (f" (did you mean {close[0]}?)" if close else ""),
                             "unset it; the settings table below lists every MOECOMM_* variable"))
            continue
        raw = env[name]
        if raw == "":
            continue
        try:
            value = setting.parse(raw, source="environment")
        except ValueError as e:
            out.append(Check(FAIL, "env", f"{e} (every rank refuses to start with it)",
                             f"set {name} to {_accepted(setting)}, or unset it (default "
                             f"{_shown(setting, setting.default)})"))
            continue
        if setting.option == "transport" and value != "auto":
            out.append(Check(WARN, "env", f"{name}={raw} forces every moecomm call onto one transport: the "
                                          "automatic choice (shm on one node) is off",
                             f"unset {name} (or use transport= / comm.using() for one communicator)"))
        if setting.option in ("shm_single_copy", "shm_native") and value == "off":
            what = ("large shm messages are always staged (two copies)" if setting.option == "shm_single_copy"
                    else "small shm collectives run in Python, several us slower per call")
            out.append(Check(WARN, "env", f"{name}=off: {what}", f"unset {name} (default auto)"))
        if setting.option == "shm_sleep" and value == "backoff":
            out.append(Check(WARN, "env", f"{name}=backoff: shm waits sleep on timers, so ranks that lose their "
                                          "CPU to other work fall behind", f"unset {name} (default futex)"))
        if setting.option == "shm_slot_bytes" and value < (1 << 20):
            out.append(Check(WARN, "env", f"{name}={value} (< 1 MiB): large messages take many rounds through "
                                          "the shm transport",
                             f"unset it (default {_shown(setting, setting.default)})"))
    return out


def settings_table(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every MOECOMM_* setting with its value here, its default and what it does.

    Args:
        environ: where the values come from (default ``os.environ``).

    Returns:
        The table's lines (a bad value shows as ``(invalid)``).
    """
    env = os.environ if environ is None else environ
    rows = []
    for s in SETTINGS.values():
        raw = env.get(s.env)
        if raw in (None, ""):
            value = "(default)"
        else:
            parsed = _setting_value(s, env)
            value = "(invalid)" if parsed is None else _shown(s, parsed)
        rows.append((s.env, value, _shown(s, s.default), s.meaning))
    table = Table([Column("variable", max(len(r[0]) for r in rows), align="<", gap=2),
                   Column("value", max(len(r[1]) for r in rows), align="<"),
                   Column("default", max(len(r[2]) for r in rows), align="<"), Column("meaning", align="<")])
    return table.header() + [table.line(*r) for r in rows]


def check_env(environ: Mapping[str, str] | None = None) -> list[Check]:
    """Environment variables: NCCL_* (and CUDA_LAUNCH_BLOCKING) that switch fast paths off, and
    MOECOMM_* checked by :func:`check_moecomm_env`.

    Args:
        environ: the environment to check (default ``os.environ``).

    Returns:
        The WARN/FAIL findings, or one OK Check named "env".
    """
    env = os.environ if environ is None else environ
    out = []
    for var, harmful, what, fix in _ENV_RULES:
        v = env.get(var)
        if v is not None and harmful(v):
            out.append(Check(WARN, "env", f"{var}={v} {what}", fix))
    out += check_moecomm_env(env)
    if not out:
        seen = sorted(k for k in env if k.startswith(("NCCL_", "MOECOMM_")))
        extra = f" (set: {', '.join(seen)})" if seen else ""
        out.append(Check(OK, "env", f"no NCCL_*/MOECOMM_* variable switches a fast path off{extra}"))
    return out


def run_checks(*, nprocs: int = 2, timeout: float = 30.0, environ: Mapping[str, str] | None = None) -> list[Check]:
    """Every check, in the order printed (module-level functions, so tests can replace one).

    Args:
        nprocs: local ranks of the rank check; timeout: its communicators' timeout in seconds.
        environ: the environment checked (default ``os.environ``).

    Returns:
        The checks, OK/WARN/FAIL.
    """
    mod = sys.modules[__name__]
    checks = list(mod.check_ranks(nprocs, timeout, environ=environ))
    checks += mod.check_shm(nprocs=None, environ=environ)
    checks += mod.check_mpi()
    n, gpu_checks = mod.gpu_count()
    checks += gpu_checks
    checks += mod.check_p2p(n)
    checks += mod.check_ipc(n)
    checks += mod.check_nccl(n)
    checks += mod.check_env(environ)
    return checks


@click.command()
@click.option("--nprocs", type=COUNT, default=2, show_default=True, help="Local ranks to launch for the rank check.")
@click.option("--timeout", type=SECONDS, default=30.0, show_default=True, help="Seconds the rank check may wait.")
def doctor(nprocs: int, timeout: float) -> None:
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
    click.echo("\nsettings (MOECOMM_* environment variables, or options= of collectives.init/launch):")
    for line in settings_table():
        click.echo(line)
    fails, warns = sum(c.level == FAIL for c in checks), sum(c.level == WARN for c in checks)
    click.echo("")
    verdict = "problems found" if fails else "ready" if not warns else "ready, with warnings"
    click.echo(f"doctor: {fails} FAIL, {warns} WARN: {verdict}")
    sys.exit(1 if fails else 0)
