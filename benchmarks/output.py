"""Saved runs: the environment of a run, and its rows as JSON or CSV (both read back by ``load_run``).

A run is ``{"schema", "env", "options", "notes", "rows"}``; ``rows`` are :class:`common.Row` dicts.
CSV keeps the same information: ``# key: <json>`` comment lines for everything but the rows, then a
header and one line per row (``pandas.read_csv(path, comment="#")`` reads the rows).
"""

from __future__ import annotations

import csv
import datetime as _dt
import importlib.metadata as md
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from .common import ROW_FIELDS, Row

SCHEMA = "moecomm-bench/1"
_MPI_VERSION_SNIPPET = (
    "import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
    "from mpi4py import MPI\n"
    "print(MPI.Get_library_version().strip().splitlines()[0])\n")


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor/machine name."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def mpi_library_version(timeout: float = 30.0) -> str | None:
    """The MPI library's version string, without initializing MPI in this process.

    Where mpi4py's MPI is already loaded (an mpiexec launch) it is asked directly; otherwise a
    subprocess asks, so a broken MPI installation cannot crash or hang the caller.
    """
    if "mpi4py.MPI" in sys.modules:
        try:
            return sys.modules["mpi4py.MPI"].Get_library_version().strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            return None
    try:
        p = subprocess.run([sys.executable, "-c", _MPI_VERSION_SNIPPET], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (p.stdout.strip() or None) if p.returncode == 0 else None


def gpu_info() -> dict[str, Any]:
    """GPU model, count, CUDA and NCCL versions where torch sees GPUs (empty dict otherwise)."""
    import torch

    try:
        if not torch.cuda.is_available():
            return {}
        info = {"gpu_model": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
                "cuda": torch.version.cuda}
    except Exception:  # noqa: BLE001 - a broken driver: report no GPU rather than fail the run
        return {}
    v = nccl_version()
    if v:
        info["nccl"] = v
    return info


def nccl_version() -> str | None:
    """The version of the libnccl this process loads, if it can load one.

    cupy's ``get_version`` asks the loaded library (ncclGetVersion), so an LD_PRELOADed NCCL shows
    as itself; ``torch.cuda.nccl.version()`` is the version torch was built against (on the H100
    record it said 2.28.9 while NCCL 2.30.7 was loaded and ran two ranks on one GPU, which 2.28
    refuses), so it is only the fallback, for torch builds without cupy.
    """
    from transports.nccl import nccl_version as loaded

    try:
        v = loaded()
    except Exception:  # noqa: BLE001 - a broken driver or libnccl
        v = None
    if v:
        return ".".join(map(str, v))
    import torch

    try:
        if torch.version.cuda:
            return ".".join(map(str, torch.cuda.nccl.version())) + " (torch's build)"
    except Exception:  # noqa: BLE001 - no libnccl
        pass
    return None


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent.parent
    if not (here / ".git").exists():
        return None
    try:
        p = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        return p.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def environment(meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Where and with what a run was made; ``meta`` (launch, nranks, peers, ...) is merged in."""
    import numpy
    import torch

    env = {
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "mpi4py": _version("mpi4py"),
        "mpi_library": mpi_library_version(),
        "moecomm": _version("moecomm"),
        "moecomm_commit": _git_commit(),
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["moecomm"] + sys.argv[1:]) if sys.argv and sys.argv[0].endswith("moecomm")
        else " ".join(sys.argv),
    }
    env.update(gpu_info())
    if "nccl" not in env:
        v = nccl_version()
        if v:
            env["nccl"] = v
    env.update(meta or {})
    return env


def make_run(rows: Sequence[Row | Mapping[str, Any]], env: Mapping[str, Any], options: Mapping[str, Any],
             notes: Sequence[str] | None = None) -> dict[str, Any]:
    """A run as saved: ``{"schema", "env", "options", "notes", "rows"}``.

    Args:
        rows: the measured rows (:class:`common.Row` or their dicts).
        env: where and with what it ran (:func:`environment`).
        options: the command's options; notes: what the peers skipped and why.

    Returns:
        The run, ready for :func:`save_json` / :func:`save_csv`.
    """
    return {"schema": SCHEMA, "env": dict(env), "options": dict(options), "notes": list(notes or []),
            "rows": [r.as_dict() if isinstance(r, Row) else dict(r) for r in rows]}


def save_json(path: str | os.PathLike, run: Mapping[str, Any]) -> Path:
    """Write ``run`` as indented JSON to ``path`` (its folder is created); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(run, indent=1) + "\n")
    return p


def save_csv(path: str | os.PathLike, run: Mapping[str, Any]) -> Path:
    """Write ``run`` as CSV: ``# key: <json>`` lines for all but the rows, then a header and the rows.

    Returns:
        The path written (its folder is created).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", newline="") as f:
        for key in ("schema", "env", "options", "notes"):
            f.write(f"# {key}: {json.dumps(run.get(key))}\n")
        w = csv.DictWriter(f, fieldnames=list(ROW_FIELDS), extrasaction="ignore")
        w.writeheader()
        for r in run["rows"]:
            w.writerow(r)
    return p


def load_csv(path: str | os.PathLike) -> dict[str, Any]:
    """A run written by :func:`save_csv`, rows normalized through :class:`common.Row`."""
    run: dict = {}
    lines = Path(path).read_text().splitlines()
    body = []
    for line in lines:
        if line.startswith("# ") and ":" in line and not body:
            key, val = line[2:].split(":", 1)
            run[key.strip()] = json.loads(val)
        else:
            body.append(line)
    run["rows"] = [Row.from_dict(d).as_dict() for d in csv.DictReader(body)]
    return run


def load_run(path: str | os.PathLike) -> dict[str, Any]:
    """A saved run (.json or .csv), rows normalized through :class:`common.Row`.

    Raises ValueError, naming the file, for anything that is not a run of this schema.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not a moecomm bench run (a binary file); pass the .json or .csv that "
                         "`moecomm bench --json/--csv` wrote") from None
    if p.suffix.lower() == ".csv":
        run = load_csv(p)
    else:
        try:
            run = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a moecomm bench JSON file ({e})") from None
        if not isinstance(run, dict) or "rows" not in run:
            raise ValueError(f"{p}: not a moecomm bench run (no 'rows'); write one with `moecomm bench --json`")
        run["rows"] = [Row.from_dict(d).as_dict() for d in run["rows"]]
    if run.get("schema") != SCHEMA:
        raise ValueError(f"{p}: schema {run.get('schema')!r}, expected {SCHEMA!r}")
    return run
